"""``dpsql serve``'s start checks and live reload, through real servers and real psycopg sessions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dpsql.cli import main
from dpsql.dev.demo import demo_policy_path

from .serving import Served

HEALTH = demo_policy_path("health").read_text()
COUNT = "SELECT COUNT(*) FROM patients"


@pytest.fixture
def servers() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for server in started:
        server.stop()


def _connect(server: Served, user: str) -> psycopg.Connection:
    return psycopg.connect(f"postgresql://{user}@127.0.0.1:{server.port}/health", connect_timeout=10, autocommit=True)


def test_missing_duckdb_file_refused(tmp_path: Path, servers: list[Served]) -> None:
    """A duckdb:/// path that does not exist is never created empty and served."""
    missing = tmp_path / "typo.duckdb"
    server = Served("--database", f"duckdb://{missing}", home=tmp_path)
    servers.append(server)
    assert server.exit_code() == 1
    assert f'ERROR:  database file "{missing}" does not exist' in server.lines
    assert not missing.exists()


def test_missing_table_refused(tmp_path: Path, servers: list[Served]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH + "  ghosts:\n    columns:\n      x: {type: int}\n")
    line = len(HEALTH.splitlines()) + 1
    server = Served("--policy", str(policy), home=tmp_path)
    servers.append(server)
    assert server.exit_code() == 1
    assert f'ERROR:  {policy}:{line}: tables.ghosts: table "ghosts" does not exist in the database' in server.lines
    assert not any("dpsql serving" in line for line in server.lines)


def test_start_line_names_policy_ledger_and_pid_file(tmp_path: Path, servers: list[Served]) -> None:
    server = Served(home=tmp_path)
    servers.append(server)
    line = server.wait_for("dpsql serving")
    pid_file = tmp_path / f"serve-{server.port}.pid"
    assert "policy " in line and f"ledger sqlite:///{tmp_path}" in line and f"pid file {pid_file}" in line
    assert pid_file.read_text() == f"{server.proc.pid}\n"  # the pid alone: kill $(cat FILE) works
    server.stop()
    assert not pid_file.exists()


def test_sighup_reload(tmp_path: Path, servers: list[Served], capsys: pytest.CaptureFixture[str]) -> None:
    """A new analyst logs in after SIGHUP while an open session keeps working; a broken policy is refused
    (its file:line error logged) and the previous one keeps serving; the ledger carries on."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving")
    with pytest.raises(psycopg.OperationalError, match='role "carol" does not exist'):
        _connect(server, "carol")
    with _connect(server, "alice") as alice:
        assert alice.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
        policy.write_text(HEALTH.replace("  - name: alice\n", "  - name: alice\n  - name: carol\n"))
        server.hup()
        server.wait_for("policy reloaded")
        with _connect(server, "carol") as carol:
            assert carol.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
        assert alice.execute("SELECT AVG(age) FROM patients").fetchone()[0] is not None  # type: ignore[index]

        policy.write_text(HEALTH.replace("dataset: health", "dataset: health\nbogus_key: 1"))
        server.hup()
        refused = server.wait_for("policy reload refused")
        line = HEALTH.splitlines().index("dataset: health") + 2
        assert f'{policy}:{line}: <top>: unknown setting "bogus_key"' in refused
        with _connect(server, "carol") as carol:  # the previous (reloaded) policy still serves
            assert carol.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
        assert alice.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]  # cache hit, same session
    policy.write_text(HEALTH)
    ledger = f"sqlite:///{tmp_path / 'ledger-health.sqlite'}"
    assert main(["budget", "--policy", str(policy), "--ledger", ledger, "--analyst", "alice", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["queries"] == 2  # one ledger across reloads


def test_dpsql_reload_command(tmp_path: Path, servers: list[Served], capsys: pytest.CaptureFixture[str]) -> None:
    """`dpsql reload --pid-file`: checks the policy first (nothing signalled on errors), then SIGHUP."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), "--pid-file", str(tmp_path / "dpsql.pid"), home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving")
    policy.write_text(HEALTH.replace("epsilon: 50", "epsilon: -50"))
    assert main(["reload", "--pid-file", str(tmp_path / "dpsql.pid"), "--policy", str(policy)]) == 1
    assert "nothing was signalled" in capsys.readouterr().err
    policy.write_text(HEALTH.replace("  - name: alice\n", "  - name: alice\n  - name: dave\n"))
    assert main(["reload", "--pid-file", str(tmp_path / "dpsql.pid"), "--policy", str(policy)]) == 0
    assert capsys.readouterr().out == f"policy reloaded: 1 table, 6 analysts (pid {server.proc.pid})\n"
    with _connect(server, "dave") as dave:
        assert dave.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
    assert main(["reload", "--pid-file", str(tmp_path / "dpsql.pid")]) == 0
    assert capsys.readouterr().out == f"policy unchanged: 1 table, 6 analysts (pid {server.proc.pid})\n"
    # valid as a file, refused by the server (the table is not in its database): exit 1 with its reason
    policy.write_text(HEALTH + "  ghosts:\n    columns:\n      x: {type: int}\n")
    assert main(["reload", "--pid-file", str(tmp_path / "dpsql.pid"), "--policy", str(policy)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ERROR:  policy reload refused; still serving the previous policy:\n")
    assert 'tables.ghosts: table "ghosts" does not exist in the database' in err
    with _connect(server, "dave") as dave:  # the previous policy still serves
        assert dave.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
    assert main(["reload", "--pid-file", str(tmp_path / "dpsql.pid"), "--no-wait"]) == 0
    assert f"sent SIGHUP to dpsql serve (pid {server.proc.pid})" in capsys.readouterr().out
    assert main(["reload", "--pid-file", str(tmp_path / "nothing.pid")]) == 1
    assert "no running dpsql serve found" in capsys.readouterr().err
    server.stop()
    assert sorted(p.name for p in tmp_path.glob("dpsql.pid*")) == []  # pid file, request, verdict removed


def test_reload_reaches_every_worker(tmp_path: Path, servers: list[Served]) -> None:
    """`--processes 2`: SIGHUP to the supervisor reaches both workers."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), "--processes", "2", home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving", count=2)
    pid_file = tmp_path / f"serve-{server.port}.pid"
    policy.write_text(HEALTH + "  ghosts:\n    columns:\n      x: {type: int}\n")
    assert main(["reload", "--pid-file", str(pid_file)]) == 1  # both workers refuse: exit 1
    policy.write_text(HEALTH.replace("  - name: alice\n", "  - name: alice\n  - name: carol\n"))
    assert main(["reload", "--pid-file", str(pid_file)]) == 0  # waits for both verdicts
    server.wait_for("policy reloaded", count=2)
    reloaded = [line for line in server.lines if "policy reloaded" in line]
    assert "[worker 0" in " ".join(reloaded) and "[worker 1" in " ".join(reloaded)
    for _ in range(6):  # whichever worker the kernel picks knows carol
        with _connect(server, "carol") as carol:
            assert carol.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]


@pytest.mark.postgres  # the server's shadow catalog is a local PostgreSQL
def test_reload_refreshes_the_shadow_catalog(tmp_path: Path, servers: list[Served]) -> None:
    """After a reload adding an analyst and removing a column, that analyst's catalog queries (\\d, BI schema sync)
    work and see the new schema; an open session's catalog queries keep working."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), home=tmp_path, catalog=True)
    servers.append(server)
    server.wait_for("dpsql serving")
    columns = "SELECT count(*) FROM information_schema.columns WHERE table_name = 'patients'"
    with _connect(server, "alice") as alice:
        before = alice.execute(columns).fetchone()[0]  # type: ignore[index]
        policy.write_text(
            HEALTH.replace("  - name: alice\n", "  - name: alice\n  - name: carol\n").replace(
                "      sex: {type: text, domain: [Female, Male], nullable: false}\n", ""
            )
        )
        server.hup()
        server.wait_for("policy reloaded")
        server.wait_for("catalog refreshed")
        with _connect(server, "carol") as carol:
            assert carol.execute(columns).fetchone()[0] == before - 1  # type: ignore[index]
        assert alice.execute(columns).fetchone()[0] == before - 1  # type: ignore[index]


def test_reload_revokes_a_removed_analyst(tmp_path: Path, servers: list[Served]) -> None:
    """An analyst removed by a reload cannot go on querying through a session opened before it (28000),
    nor log in again; the others are unaffected."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving")
    with _connect(server, "bob") as bob, _connect(server, "alice") as alice:
        assert bob.execute(COUNT).fetchone()[0] > 9000  # type: ignore[index]
        start = HEALTH.index("  - name: bob")
        end = HEALTH.index("  - name:", start + 1)
        policy.write_text(HEALTH[:start] + HEALTH[end:])
        server.hup()
        server.wait_for("policy reloaded")
        with pytest.raises(psycopg.errors.InvalidAuthorizationSpecification, match='role "bob" does not exist'):
            bob.execute("SELECT AVG(age) FROM patients")
        assert alice.execute("SELECT AVG(age) FROM patients").fetchone()[0] is not None  # type: ignore[index]
    with pytest.raises(psycopg.OperationalError, match='role "bob" does not exist'):
        _connect(server, "bob")
