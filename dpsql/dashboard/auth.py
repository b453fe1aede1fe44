"""The curator's login for ``dpsql dashboard``: one password, sessions, CSRF tokens, a failure limit.

The privacy argument and design notes: docs/internals.md, section dpsql/dashboard/auth.py.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from dpsql.errors import PolicyError
from dpsql.server.auth import Verifier, make_verifier

#: Failed logins one client address (or one device) may make per window before it is refused (429) outright.
MAX_FAILURES = 5
FAILURE_WINDOW_S = 300.0
#: Failed logins of the account, from every address without a device cookie, before checks are spaced out.
ACCOUNT_FREE_FAILURES = 5
ACCOUNT_WINDOW_S = 900.0
#: Spacing between password checks under the slow-down: the step, doubled per further failure, up to the
#: max (1, 2, 4 … 32, then 60 s: about 60 guesses an hour sustained, however many addresses guess).
SLOWDOWN_STEP_S = 1.0
SLOWDOWN_MAX_S = 60.0
#: A device cookie's life: a browser that logged in keeps its own allowance this long.
DEVICE_TTL_S = 30 * 86400
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


class SlowedDown(Exception):
    """A login without a device cookie while the account's password checks are booked up (429)."""


@dataclass
class Session:
    csrf: str
    expires: float


def client_key(address: str) -> str:
    """What the per-address limit counts by: the IPv4 address (also when IPv4-mapped), an IPv6 /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Curator:
    """Sessions and the failed-login limiters of one dashboard process (in memory: a restart logs out)."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self._sessions: dict[str, Session] = {}
        self._failures: dict[str, deque[float]] = {}  # per address key, and per "device:<id>"
        self._account: deque[float] = deque(maxlen=100_000)  # failures without a device cookie
        self._next_check = 0.0  # when the next slowed-down password check may run
        self._device_key = hmac.new(verifier.server_key, b"dpsql dashboard device cookie", hashlib.sha256).digest()
        self._lock = threading.Lock()

    # -- devices ------------------------------------------------------------------------------------

    def new_device(self) -> str:
        """A device cookie's value for a browser that just logged in: ``<id>.<expiry>.<mac>``."""
        body = f"{secrets.token_urlsafe(16)}.{int(time.time() + DEVICE_TTL_S)}"
        return f"{body}.{self._mac(body)}"

    def device(self, cookie: str | None) -> str | None:
        """The device id of a valid, unexpired device cookie, else None."""
        if not cookie or cookie.count(".") != 2:
            return None
        body, _, mac = cookie.rpartition(".")
        device, _, expiry = body.partition(".")
        if not tokens_equal(mac, self._mac(body)) or not expiry.isdigit() or int(expiry) < time.time():
            return None
        return device

    def _mac(self, body: str) -> str:
        return hmac.new(self._device_key, body.encode("ascii", "replace"), hashlib.sha256).hexdigest()

    # -- the limiters -------------------------------------------------------------------------------

    def throttled(self, client: str, device: str | None = None) -> bool:
        """True when this device (with a device cookie) or else this address has used up its failed
        logins for the window."""
        key = f"device:{device}" if device else client_key(client)
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get(key)
            while failures and failures[0] < now - FAILURE_WINDOW_S:
                failures.popleft()
            return failures is not None and len(failures) >= MAX_FAILURES

    def slowdown(self) -> float | None:
        """Seconds the next password check without a device cookie waits (0 while the account has had
        few failures), reserving that check's turn in arrival order; None (no turn taken) when the free
        turn is more than :data:`SLOWDOWN_MAX_S` away: the caller refuses (429) without a check."""
        now = time.monotonic()
        with self._lock:
            while self._account and self._account[0] < now - ACCOUNT_WINDOW_S:
                self._account.popleft()
            excess = len(self._account) - ACCOUNT_FREE_FAILURES
            if excess < 0:
                return 0.0
            start = max(now, self._next_check)
            if start - now > SLOWDOWN_MAX_S:
                return None
            self._next_check = start + min(SLOWDOWN_MAX_S, SLOWDOWN_STEP_S * 2.0 ** min(excess, 64))
            return start - now

    def login(self, client: str, password: str, device: str | None = None) -> str | None:
        """A new session token if the password is right, else None (and the failure is counted).

        Without a device cookie the check waits its turn under the account's slow-down first;
        :class:`SlowedDown` when no turn is free soon enough (nothing checked, nothing counted)."""
        if device is None:
            wait = self.slowdown()
            if wait is None:
                raise SlowedDown()
            if wait > 0:
                time.sleep(wait)
        if password_matches(self.verifier, password):
            token = secrets.token_urlsafe(32)
            with self._lock:
                while len(self._sessions) >= MAX_SESSIONS:
                    self._sessions.pop(next(iter(self._sessions)))
                self._sessions[token] = Session(secrets.token_urlsafe(32), time.monotonic() + SESSION_TTL_S)
            return token
        key = f"device:{device}" if device else client_key(client)
        now = time.monotonic()
        with self._lock:
            if len(self._failures) > 10_000:  # many addresses: forget the oldest entries
                self._failures.pop(next(iter(self._failures)))
            self._failures.setdefault(key, deque()).append(now)
            if device is None:
                self._account.append(now)
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
