"""Issue #41 item 8: TLS on the wire, attacked.

A server with ``--tls-cert`` (and ``--require-tls``, a hostssl-only pg_hba.conf) against: a client that
never finishes the handshake (held until the startup deadline, nothing else held up), one that speaks
plaintext after ``S`` or garbage instead of a ClientHello, one that offers only TLS 1.1, plaintext pipelined
behind the SSLRequest (CVE-2021-23214), a second SSLRequest inside TLS, and a plaintext session when TLS is
required (28000, before any password). Another analyst's TLS session keeps working throughout.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.server import ThreadedServer
from tests.server.conftest import Running, open_engine, self_signed_cert, serving

SSL_REQUEST = struct.pack("!II", 8, 80877103)


def _startup(user: str) -> bytes:
    body = struct.pack("!I", 196608) + f"user\0{user}\0database\0health\0\0".encode()
    return struct.pack("!I", len(body) + 4) + body


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    made = self_signed_cert(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.fail("openssl is needed for the TLS tests")
    return made


@pytest.fixture(scope="module")
def required(cert: tuple[Path, Path]) -> Iterator[tuple[Running, ThreadedServer]]:
    tls: dict[str, Any] = {"tls_cert": str(cert[0]), "tls_key": str(cert[1]), "require_tls": True}
    with serving(open_engine(trust=True), catalog_dsn="", startup_timeout=2.0, **tls) as pair:
        yield pair


def _count(running: Running) -> int:
    with psycopg.connect(running.dsn("alice", sslmode="require", connect_timeout="20"), autocommit=True) as conn:
        conn.execute("SET dpsql.epsilon = 0.01")
        return int(conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0])  # type: ignore[index]


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, OSError):
        pass
    return data


def test_plaintext_sessions_are_refused_when_tls_is_required(required: tuple[Running, ThreadedServer]) -> None:
    running, _ = required
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(running.dsn("alice", sslmode="disable", connect_timeout="20"))
    assert "no pg_hba.conf entry" in str(refused.value) and "no encryption" in str(refused.value)
    assert _count(running) > 0


def test_a_handshake_that_never_finishes_is_cut_at_the_startup_deadline(
    required: tuple[Running, ThreadedServer],
) -> None:
    running, server = required
    stalled = []
    for _ in range(20):
        sock = socket.create_connection((running.host, running.port), timeout=10)
        sock.sendall(SSL_REQUEST)
        assert sock.recv(1) == b"S"
        stalled.append(sock)  # and never sends a ClientHello
    assert _count(running) > 0  # meanwhile another analyst is served
    started = time.monotonic()
    for sock in stalled:
        _closed_within(sock, 10)
        sock.close()
    assert time.monotonic() - started < 8
    assert server.server.ctx.preauth.count == 0 or _count(running) > 0


@pytest.mark.parametrize(
    "after_s",
    [b"\x00\x00\x00\x08\x04\xd2\x16\x2f", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x05hello"],
    ids=["plaintext-startup", "http", "truncated-hello"],
)
def test_garbage_instead_of_a_client_hello_closes_that_socket_only(
    required: tuple[Running, ThreadedServer], after_s: bytes
) -> None:
    running, _ = required
    sock = socket.create_connection((running.host, running.port), timeout=10)
    sock.sendall(SSL_REQUEST)
    assert sock.recv(1) == b"S"
    sock.sendall(after_s)
    _closed_within(sock, 8)
    sock.close()
    assert _count(running) > 0


def test_tls_below_1_2_is_refused(required: tuple[Running, ThreadedServer]) -> None:
    running, _ = required
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_1
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot even offer TLS 1.1")
    sock = socket.create_connection((running.host, running.port), timeout=10)
    sock.sendall(SSL_REQUEST)
    assert sock.recv(1) == b"S"
    with pytest.raises((ssl.SSLError, OSError)):
        context.wrap_socket(sock, server_hostname="localhost")
    sock.close()
    assert _count(running) > 0


def test_plaintext_pipelined_behind_the_ssl_request_is_refused(required: tuple[Running, ThreadedServer]) -> None:
    """CVE-2021-23214: bytes after the SSLRequest would otherwise be read as if they came over TLS."""
    running, _ = required
    sock = socket.create_connection((running.host, running.port), timeout=10)
    sock.sendall(SSL_REQUEST + _startup("alice"))
    reply = _closed_within(sock, 8)
    sock.close()
    # refused in plaintext (08P01), or, when the bytes came a moment later, taken for a bad ClientHello: never
    # an authentication request answered from them
    assert (reply[:1] != b"S" and b"08P01" in reply) or reply == b"S"
    assert _count(running) > 0


def test_a_second_ssl_request_inside_tls_is_declined(required: tuple[Running, ThreadedServer]) -> None:
    running, _ = required
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    raw = socket.create_connection((running.host, running.port), timeout=10)
    raw.sendall(SSL_REQUEST)
    assert raw.recv(1) == b"S"
    tls = context.wrap_socket(raw, server_hostname="localhost")
    assert tls.version() in ("TLSv1.2", "TLSv1.3")
    tls.sendall(SSL_REQUEST)
    assert tls.recv(1) == b"N"  # no TLS in TLS
    tls.sendall(_startup("alice"))
    reply = tls.recv(65536)
    assert reply[:1] == b"R"  # authentication goes on, over the one TLS layer
    tls.close()
