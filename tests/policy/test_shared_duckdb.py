"""A DuckDB file is opened read-only, so serving, the curator's tools and the CLI share it (issue #28 item 5).

Before, ``dpsql serve --processes 2`` on a DuckDB file crashed worker 0 with a lock-conflict traceback
and stopped the server, and ``dpsql policy check`` could not open a file that was being served.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from dpsql.cli import main
from dpsql.dev.demo import demo_policy_path

from .serving import Served


def test_two_workers_and_the_curator_share_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"duckdb://{tmp_path / 'health.duckdb'}"
    policy = str(demo_policy_path("health"))
    assert main(["demo-data", "--database", url, "--dataset", "health"]) == 0
    server = Served("--database", url, "--policy", policy, "--processes", "2", home=tmp_path)
    try:
        server.wait_for("dpsql serving", count=2)
        for _ in range(12):  # the kernel spreads new connections over both workers
            dsn = f"postgresql://alice@127.0.0.1:{server.port}/health"
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                assert conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0] > 9000  # type: ignore[index]
        server.wait_for("query analyst=alice", count=12)
        answered = {m.group(1) for line in server.lines if (m := re.search(r"\[worker (\d)", line)) and "query" in line}
        assert answered == {"0", "1"}, server.log
        capsys.readouterr()
        assert main(["policy", "check", "--database", url, "--policy", policy]) == 0  # while serving
        ledger = f"sqlite:///{tmp_path / 'cli-ledger.sqlite'}"
        query = ["query", "SELECT COUNT(*) FROM patients", "--database", url, "--policy", policy, "--ledger", ledger]
        assert main(query) == 0
        assert server.proc.poll() is None  # still serving
    finally:
        server.stop()
