"""After ``dpsql reload`` says "policy reloaded", every surface shows the new policy (#28 item 5, audit):
the shadow catalog's comments (``\\d+``, ``col_description``/``obj_description``) as well as the
answers; the pid file holds the pid alone (``kill $(cat FILE)`` works) with ``--processes N`` too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg
import pytest

from dpsql.cli import main
from dpsql.dev.demo import demo_policy_path

from .serving import Served

CLINIC = demo_policy_path("clinic").read_text()
HEALTH = demo_policy_path("health").read_text()
COST = "      cost: {type: float, lower: 0.0, upper: 2000.0, nullable: false}\n"
CAP = "    max_rows_per_unit: 20"
DESCRIBE = (
    "SELECT pg_catalog.col_description('public.visits'::regclass, a.attnum), "
    "pg_catalog.obj_description('public.visits'::regclass, 'pg_class') "
    "FROM pg_catalog.pg_attribute a WHERE a.attrelid = 'public.visits'::regclass AND a.attname = 'cost'"
)


@pytest.mark.postgres  # the server's shadow catalog is a local PostgreSQL
def test_comments_are_new_as_soon_as_reload_returns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert COST in CLINIC and CAP in CLINIC
    policy, pid_file = tmp_path / "clinic.yaml", tmp_path / "dpsql.pid"
    policy.write_text(CLINIC)
    server = Served("--policy", str(policy), "--pid-file", str(pid_file), home=tmp_path, catalog=True)
    try:
        server.wait_for("dpsql serving")
        dsn = f"host=127.0.0.1 port={server.port} user=analyst dbname=clinic connect_timeout=10"
        with psycopg.connect(dsn, autocommit=True) as before:
            column, table = before.execute(DESCRIBE).fetchone()  # type: ignore[misc]
            assert "bounds [0, 2000]" in column and "max_rows_per_unit 20" in table
            policy.write_text(
                CLINIC.replace(COST, COST.replace("2000.0", "3000.0")).replace(CAP, "    max_rows_per_unit: 30")
            )
            assert main(["reload", "--pid-file", str(pid_file)]) == 0
            assert capsys.readouterr().out.startswith("policy reloaded: ")
            # no waiting: the reload was reported only once the new catalog served
            with psycopg.connect(dsn, autocommit=True) as after:
                column, table = after.execute(DESCRIBE).fetchone()  # type: ignore[misc]
                assert "bounds [0, 3000]" in column and "max_rows_per_unit 30" in table
            # a session opened before the reload reaches the new catalog too (possibly after one 08006)
            try:
                column, table = before.execute(DESCRIBE).fetchone()  # type: ignore[misc]
                assert "bounds [0, 3000]" in column and "max_rows_per_unit 30" in table
            except psycopg.OperationalError:
                pass
        assert "catalog refreshed for the reloaded policy" in server.log
    finally:
        server.stop()


def test_pid_file_holds_the_pid_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--processes 2``: ``kill -0 $(cat FILE)`` reaches the supervisor; the count ``dpsql reload`` waits
    for lives beside it, and everything is removed at stop."""
    policy, pid_file = tmp_path / "health.yaml", tmp_path / "dpsql.pid"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), "--processes", "2", "--pid-file", str(pid_file), home=tmp_path)
    try:
        server.wait_for("dpsql serving", count=2)
        assert pid_file.read_text() == f"{server.proc.pid}\n"
        assert (tmp_path / "dpsql.pid.processes").read_text() == "2\n"
        assert subprocess.run(["sh", "-c", f"kill -0 $(cat '{pid_file}')"], check=False).returncode == 0
        policy.write_text(HEALTH.replace("  - name: alice\n", "  - name: alice\n  - name: carol\n"))
        assert main(["reload", "--pid-file", str(pid_file)]) == 0  # waited for both workers' verdicts
        assert capsys.readouterr().out.endswith(f" by 2 processes (pid {server.proc.pid})\n")
    finally:
        server.stop()
    assert sorted(p.name for p in tmp_path.glob("dpsql.pid*")) == []
