"""Malformed frames and hostile input close only the offending connection; the server keeps serving."""

from __future__ import annotations

import asyncio
import socket
import struct

import asyncpg
import psycopg
import pytest

from .conftest import Running


def _startup_packet(user: str = "analyst", version: int = 196608) -> bytes:
    body = struct.pack("!i", version) + b"user\0" + user.encode() + b"\0database\0health\0\0"
    return struct.pack("!i", len(body) + 4) + body


def _recv_all(sock: socket.socket) -> bytes:
    chunks = []
    sock.settimeout(5)
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _read_until_ready(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(5)
    while not (len(data) >= 6 and data[-6:-1] == b"Z\0\0\0\x05"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _connected(server: Running) -> socket.socket:
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(_startup_packet())
    _read_until_ready(sock)
    return sock


def _assert_fatal_08p01(reply: bytes) -> None:
    assert reply[:1] == b"E", reply
    assert b"SFATAL\0" in reply and b"C08P01\0" in reply, reply


def _still_serving(server: Running) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_garbage_before_startup(dp_server: Running) -> None:
    with socket.create_connection((dp_server.host, dp_server.port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _assert_fatal_08p01(_recv_all(sock))
    _still_serving(dp_server)


@pytest.mark.parametrize(
    "frame",
    [
        b"Q" + struct.pack("!i", -5),  # negative length
        b"Q" + struct.pack("!i", 2),  # length smaller than itself
        b"Q" + struct.pack("!i", 2 << 20) + b"x" * 100,  # over the 1 MiB limit
        b"\x01" + struct.pack("!i", 4),  # unknown message type
        b"Q" + struct.pack("!i", 8) + b"abcd",  # query string without terminator
        b"B" + struct.pack("!i", 10) + b"\0\0\xff\xff\0\0",  # Bind with a negative count
    ],
)
def test_malformed_messages_close_only_that_connection(dp_server: Running, frame: bytes) -> None:
    bystander = _connected(dp_server)
    with _connected(dp_server) as sock:
        sock.sendall(frame)
        _assert_fatal_08p01(_recv_all(sock))
    bystander.sendall(b"Q" + struct.pack("!i", 13) + b"SELECT 1\0")
    assert b"SELECT 1\0" in _read_until_ready(bystander)
    bystander.close()


def test_truncated_frame_then_hangup(dp_server: Running) -> None:
    with _connected(dp_server) as sock:
        sock.sendall(b"Q" + struct.pack("!i", 100) + b"SELE")
    _still_serving(dp_server)


def test_ssl_and_gss_refused_without_certificate(dp_server: Running) -> None:
    with socket.create_connection((dp_server.host, dp_server.port)) as sock:
        sock.sendall(struct.pack("!ii", 8, 80877104))
        assert sock.recv(1) == b"N"
        sock.sendall(struct.pack("!ii", 8, 80877103))
        assert sock.recv(1) == b"N"
        sock.sendall(_startup_packet())
        assert _read_until_ready(sock)[:1] == b"R"


def test_unsupported_protocol_and_replication(dp_server: Running) -> None:
    with socket.create_connection((dp_server.host, dp_server.port)) as sock:
        sock.sendall(_startup_packet(version=2 << 16))
        reply = _recv_all(sock)
        assert b"C0A000\0" in reply
    with pytest.raises(psycopg.OperationalError, match="replication"):
        psycopg.connect(dp_server.dsn(replication="database"))


def test_error_in_extended_batch_skips_until_sync(dp_server: Running) -> None:
    with _connected(dp_server) as sock:
        bad = b"P" + struct.pack("!i", 4 + 1 + 22 + 2) + b"\0SELECT * FROM nowhere\0" + b"\0\0"
        sync = b"S" + struct.pack("!i", 4)
        execute = b"E" + struct.pack("!i", 9) + b"\0" + struct.pack("!i", 0)
        sock.sendall(bad + execute + sync)
        reply = _read_until_ready(sock)
        assert reply.count(b"E") >= 1 and reply.endswith(b"Z\0\0\0\x05I")


def test_many_concurrent_clients(dp_server: Running) -> None:
    async def one(i: int) -> int:
        conn = await asyncpg.connect(dp_server.url("grace"))
        try:
            return int(await conn.fetchval("SELECT COUNT(*) FROM patients WHERE visits > $1", i % 5))
        finally:
            await conn.close()

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(25)))

    assert len(asyncio.run(main())) == 25
    _still_serving(dp_server)


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def test_text_that_is_not_utf8_is_an_error_the_session_survives(dp_server: Running) -> None:
    """Not UTF-8 inside a well-framed message dropped the connection (FATAL 08P01); PostgreSQL
    answers ERROR 22021 and goes on: in a Query, ready again; in Parse, everything up to Sync is
    skipped. The same session then answers."""
    with _connected(dp_server) as sock:
        sock.sendall(_message(b"Q", b"SELECT '\xff\xfe'\0"))
        reply = _read_until_ready(sock)
        assert b"SERROR\0" in reply and b"C22021\0" in reply and b"invalid byte sequence" in reply, reply
        bad_parse = _message(b"P", b"\0SELECT '\xc3\x28'\0\0\0")
        bind = _message(b"B", b"\0\0\0\0\0\0\0\0")
        sock.sendall(bad_parse + bind + _message(b"E", b"\0\0\0\0\0") + _message(b"S", b""))
        reply = _read_until_ready(sock)
        assert reply.count(b"SERROR\0") == 1 and b"C22021\0" in reply, reply  # Bind/Execute skipped
        sock.sendall(_message(b"Q", b"SELECT 1\0"))
        reply = _read_until_ready(sock)
        assert b"SERROR\0" not in reply and b"D\0\0\0\x0b\0\x01\0\0\0\x011" in reply, reply


@pytest.mark.parametrize(
    ("messages", "sqlstate", "text"),
    [
        (_message(b"D", b"Z\0"), b"08P01", b"invalid DESCRIBE/CLOSE message subtype 90"),
        (
            _message(b"P", b"\0SELECT 1\0\0\0") + _message(b"B", b"\0\0\0\0\0\0\0\x01\0\x07"),
            b"22023",
            b"unsupported format code: 7",
        ),
    ],
    ids=["describe-kind", "bind-result-format"],
)
def test_bad_content_in_a_well_framed_message_is_an_error(
    dp_server: Running, messages: bytes, sqlstate: bytes, text: bytes
) -> None:
    """An unknown Describe kind and a Bind result format other than text/binary closed the connection
    (FATAL 08P01); PostgreSQL answers ERROR (08P01, 22023) and skips to Sync: the session goes on."""
    with _connected(dp_server) as sock:
        sock.sendall(messages + _message(b"E", b"\0\0\0\0\0") + _message(b"S", b""))
        reply = _read_until_ready(sock)
        assert reply.count(b"SERROR\0") == 1 and b"C" + sqlstate + b"\0" in reply and text in reply, reply
        sock.sendall(_message(b"Q", b"SELECT 1\0"))
        assert b"SERROR\0" not in _read_until_ready(sock)


def test_an_unknown_time_zone_is_refused_as_postgresql_does(dp_server: Running) -> None:
    """``SET TIME ZONE 'Mars/Olympus'`` was accepted (and reported back); PostgreSQL says 22023.
    Known zones, offsets and abbreviations still pass."""
    with psycopg.connect(dp_server.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("SET TIME ZONE 'Mars/Olympus'")
        assert refused.value.sqlstate == "22023"
        assert refused.value.diag.message_primary == 'invalid value for parameter "TimeZone": "Mars/Olympus"'
        for zone in ("Europe/Paris", "America/Argentina/Buenos_Aires", "UTC", "+02:00", "EST5EDT"):
            conn.execute(f"SET TIME ZONE '{zone}'")
        assert conn.execute("SHOW TimeZone").fetchone() is not None
