"""A catalog query cannot fill the server's memory: its result is read row by row and cut at a cap."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from dpsql.server.shadow_session import MAX_CATALOG_RESULT_ROWS
from tests.listening import port_from_log

from .conftest import Running

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.exclusive
def test_huge_catalog_result_is_refused_not_buffered(dp_server: Running) -> None:
    """A cross join of catalog tables (hundreds of millions of rows within the shadow's timeout)
    is cancelled once it passes the cap: 54000, and the session stays usable."""
    with psycopg.connect(dp_server.url(), autocommit=True) as conn:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as info:
            conn.execute("SELECT a.oid, b.oid, c.oid FROM pg_catalog.pg_class a, pg_catalog.pg_class b, pg_class c")
        assert f"exceeds {MAX_CATALOG_RESULT_ROWS} rows" in str(info.value)
        assert time.monotonic() - started < 5
        assert conn.execute("SELECT count(*) FROM pg_catalog.pg_namespace").fetchone()[0] > 0  # type: ignore[index]


@pytest.mark.exclusive
def test_cancel_reaches_a_streaming_catalog_query(dp_server: Running) -> None:
    """Reading rows one at a time must not block the thread that sends the cancel (psycopg's
    get_result holds the GIL while libpq waits): a pg_sleep is cut by the client's timeout."""
    with psycopg.connect(dp_server.url(), autocommit=True) as conn:
        conn.execute("SET statement_timeout = 300")
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(4)")
        assert time.monotonic() - started < 3


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def _startup(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = struct.pack("!I", 196608) + b"user\0analyst\0database\0health\0\0"
    sock.sendall(struct.pack("!I", len(body) + 4) + body)
    buffered = b""
    while b"Z\0\0\0\5" not in buffered:
        buffered += sock.recv(65536)
    return sock


def test_unread_huge_catalog_results_keep_rss_bounded(tmp_path: Path) -> None:
    """Issue #15's bar: 4 clients that send a catalog query with a huge result and never read the
    answer leave `dpsql serve` under 500 MB RSS (the results are cut at the cap, not buffered)."""
    env = {**os.environ, "DPSQL_HOME": str(tmp_path)}
    server = subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", "serve", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.log").open("w"),
    )
    try:
        port = port_from_log(tmp_path / "serve.log", server)  # printed once the socket listens
        _startup(port).close()
        query = b"SELECT a.*, b.relname, c.relname FROM pg_class a, pg_class b, pg_class c\0"
        clients = []
        for _ in range(4):
            sock = _startup(port)
            sock.sendall(b"Q" + struct.pack("!I", len(query) + 4) + query)
            clients.append(sock)  # never read
        peak = 0
        for _ in range(24):
            time.sleep(0.25)
            peak = max(peak, _rss_mb(server.pid))
        assert peak < 500, f"server RSS peaked at {peak} MB"
        assert b"C54000" in clients[0].recv(4096)
        for sock in clients:
            sock.close()
    finally:
        server.terminate()
        server.wait(30)
