"""SCRAM-SHA-256 (RFC 5802 / RFC 7677), server side, against PostgreSQL-format verifiers.

Unknown roles, and roles without a verifier, go through a *mock* exchange (as PostgreSQL does):
the same SASL offer, a server-first-message with a salt derived by HMAC from the installation's
secret and the user name (so repeated attempts see the same salt, as for a real role) and the
iteration count of the policy's own verifiers (so the client's PBKDF2 work is the same), then the
same 28P01 at the same point. Nothing on the wire tells whether the name exists.

A verifier is ``SCRAM-SHA-256$<iterations>:<b64 salt>$<b64 StoredKey>:<b64 ServerKey>``, exactly
what ``pg_authid.rolpassword`` holds, so the policy never contains a password: only what is needed
to check a proof. Channel binding is not offered (no ``-PLUS`` mechanism), matching a PostgreSQL
server without TLS; a client that insists on it is refused.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any

from dpsql.errors import AuthFailed, ScramProtocolError

MECHANISM = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096


__all__ = ["AuthFailed", "ScramProtocolError"]  # defined in dpsql.errors, re-exported here


@dataclass(frozen=True, slots=True)
class Verifier:
    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes

    @classmethod
    def parse(cls, text: str) -> Verifier:
        try:
            mech, rest = text.split("$", 1)
            iter_salt, keys = rest.split("$", 1)
            iterations, salt = iter_salt.split(":", 1)
            stored, server = keys.split(":", 1)
            if mech != MECHANISM:
                raise ValueError(mech)
            return cls(int(iterations), _b64d(salt), _b64d(stored), _b64d(server))
        except (ValueError, TypeError) as exc:
            raise ValueError("not a SCRAM-SHA-256 verifier") from exc

    def __str__(self) -> str:
        return f"{MECHANISM}${self.iterations}:{_b64e(self.salt)}${_b64e(self.stored_key)}:{_b64e(self.server_key)}"


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def make_verifier(password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """A PostgreSQL-compatible SCRAM-SHA-256 verifier for ``password`` (used by ``dpsql passwd``).

    The password is used as given (PostgreSQL applies SASLprep, which is the identity on ASCII).
    """
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    stored_key = hashlib.sha256(client_key).digest()
    server_key = _hmac(salted, b"Server Key")
    return str(Verifier(iterations, salt, stored_key, server_key))


def mock_verifier(secret: bytes, user: str, iterations: int) -> Verifier:
    """A verifier no password matches, for a user that has none: deterministic per (secret, user),
    so repeated attempts for one unknown name look exactly like those for a real role."""

    def derive(label: bytes, size: int) -> bytes:
        return _hmac(secret, b"dpsql scram mock " + label + b"\0" + user.encode("utf-8"))[:size]

    return Verifier(iterations, derive(b"salt", 16), derive(b"stored key", 32), derive(b"server key", 32))


def mock_exchange(engine: Any, user: str) -> ScramExchange:
    """The doomed exchange for ``user`` (unknown, or without a verifier) on ``engine``'s server."""
    verifiers = tuple(a.password for a in engine.policy.analysts if a.password is not None)
    return ScramExchange(mock_verifier(mock_secret(engine.ledger), user, mock_iterations(verifiers)), doomed=True)


#: Used only when the ledger cannot give the installation key (it then fails every query anyway).
_FALLBACK_SECRET = secrets.token_bytes(32)


def mock_secret(ledger: Any) -> bytes:
    """The mock-salt secret: derived from the installation key, so it survives restarts."""
    try:
        key = ledger.installation_key()
    except Exception:
        return _FALLBACK_SECRET
    return _hmac(key, b"dpsql scram mock secret v1")


@functools.lru_cache(maxsize=16)
def mock_iterations(verifiers: tuple[str, ...]) -> int:
    """The iteration count the policy's verifiers use most (ties: the largest), else the default."""
    counts: Counter[int] = Counter()
    for text in verifiers:
        try:
            counts[Verifier.parse(text).iterations] += 1
        except ValueError:
            continue
    if not counts:
        return DEFAULT_ITERATIONS
    return max(counts.items(), key=lambda item: (item[1], item[0]))[0]


def _attributes(text: str) -> list[tuple[str, str]]:
    pairs = []
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramProtocolError("malformed SCRAM message", detail=f"Attribute expected, got {part[:1]!r}.")
        pairs.append((part[0], part[2:]))
    return pairs


@dataclass(slots=True)
class ScramExchange:
    """One server-side SCRAM conversation: ``first()`` then ``final()``."""

    verifier: Verifier
    #: A mock exchange (unknown role, or no verifier): runs every step, then always fails.
    doomed: bool = False
    server_nonce: str = ""
    gs2_header: str = ""
    client_first_bare: str = ""
    server_first: str = ""
    nonce: str = ""

    def first(self, client_first: bytes) -> bytes:
        """Consume client-first-message, return server-first-message."""
        text = _decode(client_first)
        if text.startswith("p="):
            raise ScramProtocolError(
                "channel binding is not supported by this server",
                hint="Connect with channel_binding=disable or prefer.",
            )
        if not (text.startswith("n,") or text.startswith("y,")):
            raise ScramProtocolError("malformed SCRAM message", detail="Unexpected channel-binding flag.")
        head, sep, rest = text[2:].partition(",")
        if not sep or (head and not head.startswith("a=")):
            raise ScramProtocolError("malformed SCRAM message", detail="Invalid GS2 header.")
        self.gs2_header = text[: 2 + len(head) + 1]
        self.client_first_bare = rest
        attrs = _attributes(rest)
        if len(attrs) < 2 or attrs[0][0] != "n" or attrs[1][0] != "r" or not attrs[1][1]:
            raise ScramProtocolError("malformed SCRAM message", detail="Expected n= and r= attributes.")
        client_nonce = attrs[1][1]
        self.nonce = client_nonce + _b64e(secrets.token_bytes(18))
        v = self.verifier
        self.server_first = f"r={self.nonce},s={_b64e(v.salt)},i={v.iterations}"
        return self.server_first.encode("ascii")

    def final(self, client_final: bytes) -> bytes:
        """Check client-final-message's proof; return server-final-message or raise :class:`AuthFailed`."""
        text = _decode(client_final)
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise ScramProtocolError("malformed SCRAM message", detail="Proof missing.")
        attrs = dict(_attributes(without_proof))
        expected_cb = _b64e(self.gs2_header.encode("utf-8"))
        if attrs.get("c") != expected_cb:
            raise ScramProtocolError("SCRAM channel binding check failed")
        if attrs.get("r") != self.nonce:
            raise ScramProtocolError("malformed SCRAM message", detail="Nonce does not match.")
        try:
            proof = _b64d(proof_part)
        except ValueError:
            raise ScramProtocolError("malformed SCRAM message", detail="Malformed proof.") from None
        auth_message = f"{self.client_first_bare},{self.server_first},{without_proof}".encode()
        v = self.verifier
        signature = _hmac(v.stored_key, auth_message)
        if len(proof) != len(signature):
            raise AuthFailed("password authentication failed")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        matches = hmac.compare_digest(hashlib.sha256(client_key).digest(), v.stored_key)
        if self.doomed or not matches:
            raise AuthFailed("password authentication failed")
        return f"v={_b64e(_hmac(v.server_key, auth_message))}".encode("ascii")


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ScramProtocolError("malformed SCRAM message", detail="Invalid UTF-8.") from None


def parse_sasl_initial(data: bytes) -> tuple[str, bytes]:
    """Split a SASLInitialResponse payload into (mechanism, client-first-message)."""
    end = data.find(b"\0")
    if end < 0 or len(data) < end + 5:
        raise ScramProtocolError("malformed SASLInitialResponse")
    mechanism = data[:end].decode("ascii", "replace")
    length = int.from_bytes(data[end + 1 : end + 5], "big", signed=True)
    body = data[end + 5 :]
    if length != len(body):
        raise ScramProtocolError("malformed SASLInitialResponse")
    return mechanism, body
