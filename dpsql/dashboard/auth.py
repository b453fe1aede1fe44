"""The curator's login for ``dpsql dashboard``: one password, sessions, CSRF tokens, a failure limit.

The dashboard shows every analyst's spending and the whole audit trail, and can grant budget:
it is the curator's, so everything but the login page needs a session. Design choices:

* The password is checked against a SCRAM-SHA-256 verifier (``dpsql passwd``'s format), from
  ``--password-file`` or ``$DPSQL_CURATOR_VERIFIER``; ``$DPSQL_CURATOR_PASSWORD`` (plaintext, for
  tests and quick local use) is turned into a verifier with a fresh salt at start. The check is
  PBKDF2 then :func:`hmac.compare_digest`, so its time does not depend on how much of a guess is right.
* Failed logins are limited per client address (:data:`MAX_FAILURES` per :data:`FAILURE_WINDOW_S`);
  beyond that every attempt gets 429 without even checking the password.
* A session is 32 random bytes (``secrets``) in an ``HttpOnly; SameSite=Strict`` cookie (``Secure``
  under TLS), valid :data:`SESSION_TTL_S` at most; its CSRF token (another 32 bytes) must come back
  with every POST. The login form has its own double-submit token. No secret is ever put in a URL
  or a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from dpsql.errors import PolicyError
from dpsql.server.auth import Verifier, make_verifier

#: Failed logins one client address may make per window before it is refused (429) outright.
MAX_FAILURES = 5
FAILURE_WINDOW_S = 300.0
#: A session's whole life (the curator logs in again after it).
SESSION_TTL_S = 8 * 3600.0
#: Sessions kept at most (oldest dropped first): a flood of logins cannot fill memory.
MAX_SESSIONS = 64

ENV_VERIFIER = "DPSQL_CURATOR_VERIFIER"
ENV_PASSWORD = "DPSQL_CURATOR_PASSWORD"


def load_verifier(password_file: str | None) -> Verifier:
    """The curator's verifier: ``--password-file``, else ``$DPSQL_CURATOR_VERIFIER``, else a verifier
    made now from ``$DPSQL_CURATOR_PASSWORD``; none of them is F0000 (the dashboard will not start open)."""
    text: str | None = None
    where = ""
    if password_file:
        try:
            text, where = Path(password_file).read_text(encoding="utf-8").strip(), password_file
        except OSError as exc:
            raise PolicyError(f"cannot read the curator password file: {exc.strerror}") from None
    elif os.environ.get(ENV_VERIFIER):
        text, where = os.environ[ENV_VERIFIER].strip(), ENV_VERIFIER
    elif os.environ.get(ENV_PASSWORD):
        text, where = make_verifier(os.environ[ENV_PASSWORD]), ENV_PASSWORD
    if text is None:
        raise PolicyError(
            "no curator password for the dashboard",
            hint=f"Give --password-file with a verifier from `dpsql passwd`, or set {ENV_VERIFIER} or {ENV_PASSWORD}.",
        )
    try:
        return Verifier.parse(text)
    except ValueError:
        raise PolicyError(f"{where}: not a SCRAM-SHA-256 verifier", hint="Generate one with `dpsql passwd`.") from None


def password_matches(verifier: Verifier, password: str) -> bool:
    """SCRAM's own check: the StoredKey the password gives, compared in constant time."""
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), verifier.salt, verifier.iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    return hmac.compare_digest(hashlib.sha256(client_key).digest(), verifier.stored_key)


@dataclass
class Session:
    csrf: str
    expires: float


class Curator:
    """Sessions and the failed-login limiter of one dashboard process (in memory: a restart logs out)."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self._sessions: dict[str, Session] = {}
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def throttled(self, client: str) -> bool:
        """True when ``client`` has used up its failed logins for the window."""
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get(client)
            while failures and failures[0] < now - FAILURE_WINDOW_S:
                failures.popleft()
            return failures is not None and len(failures) >= MAX_FAILURES

    def login(self, client: str, password: str) -> str | None:
        """A new session token if the password is right, else None (and the failure is counted)."""
        if password_matches(self.verifier, password):
            token = secrets.token_urlsafe(32)
            with self._lock:
                while len(self._sessions) >= MAX_SESSIONS:
                    self._sessions.pop(next(iter(self._sessions)))
                self._sessions[token] = Session(secrets.token_urlsafe(32), time.monotonic() + SESSION_TTL_S)
            return token
        with self._lock:
            if len(self._failures) > 10_000:  # many addresses: forget the oldest entries
                self._failures.pop(next(iter(self._failures)))
            self._failures.setdefault(client, deque()).append(time.monotonic())
        return None

    def session(self, token: str | None) -> Session | None:
        if not token:
            return None
        with self._lock:
            session = self._sessions.get(token)
            if session is not None and session.expires < time.monotonic():
                del self._sessions[token]
                return None
            return session

    def logout(self, token: str | None) -> None:
        with self._lock:
            if token:
                self._sessions.pop(token, None)


def tokens_equal(a: str | None, b: str | None) -> bool:
    """Constant-time comparison of two tokens (False if either is missing)."""
    if not a or not b:
        return False
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))
