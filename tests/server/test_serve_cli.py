"""`dpsql serve` as a user starts it: the "serving" line comes only once the port accepts connections."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (shadow catalog or cluster)

ROOT = Path(__file__).resolve().parents[2]


def test_serving_line_means_listening(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        assert server.stderr is not None
        line = ""
        while "dpsql serving" not in line:
            line = server.stderr.readline()
            assert line or server.poll() is None, "dpsql serve exited before serving"
            assert time.monotonic() < deadline
        assert f"127.0.0.1:{port}" in line and "ledger sqlite:///" in line
        # no retry: the line is printed only once the socket is up
        with psycopg.connect(f"postgresql://analyst@127.0.0.1:{port}/health", connect_timeout=5) as conn:
            assert conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0] > 9000  # type: ignore[index]
            # the shadow catalog starts in the background (issue #37): a catalog query waits for it, and
            # gets 57P03 (the database system is starting up) only past 15 s of waiting, as from PostgreSQL
            while True:
                try:
                    tables = conn.execute("SELECT relname FROM pg_catalog.pg_class WHERE relname = 'patients'")
                    assert tables.fetchall() == [("patients",)]
                    break
                except psycopg.errors.CannotConnectNow:
                    assert time.monotonic() < deadline
    finally:
        server.terminate()
        server.wait(30)
