"""Other real clients: pg8000, psql, SQLAlchemy 2 (inspector + pandas.read_sql)."""

from __future__ import annotations

import shutil
import subprocess

import pg8000.native
import pytest

from .conftest import Running

PSQL = shutil.which("psql")


def test_pg8000(dp_server: Running) -> None:
    conn = pg8000.native.Connection("erin", host=dp_server.host, port=dp_server.port, database="health")
    try:
        assert conn.run("SELECT 1") == [[1]]
        rows = conn.run("SELECT problem, COUNT(*) FROM patients WHERE age > :a GROUP BY problem", a=20)
        assert len(rows) == 7
        assert conn.run("SHOW server_encoding") == [["UTF8"]]
        assert any("charged" in str(n.get("M", n.get(b"M", ""))) for n in conn.notices), conn.notices
    finally:
        conn.close()


def _psql(server: Running, *args: str) -> str:
    assert PSQL is not None
    out = subprocess.run(
        [PSQL, "-X", "-h", server.host, "-p", str(server.port), "-U", "analyst", "-d", "health", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PGCONNECT_TIMEOUT": "10", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


@pytest.mark.skipif(PSQL is None, reason="psql not installed")
def test_psql_query_and_meta_commands(dp_server: Running) -> None:
    out = _psql(dp_server, "-c", "SELECT sex, COUNT(*) FROM patients GROUP BY sex")
    assert "Female" in out and "NOTICE" in out and "charged" in out
    assert "patients" in _psql(dp_server, "-c", r"\dt")
    described = _psql(dp_server, "-c", r"\d patients")
    assert "age" in described and "bigint" in described and "ssn" not in described
    assert "health" in _psql(dp_server, "-c", r"\l")


def test_sqlalchemy_inspector_and_pandas(dp_server: Running) -> None:
    import pandas as pd
    import sqlalchemy as sa

    engine = sa.create_engine(dp_server.url("frank", "postgresql+psycopg"))
    try:
        inspector = sa.inspect(engine)
        assert inspector.get_table_names() == ["patients"]
        columns = {c["name"]: c for c in inspector.get_columns("patients")}
        assert str(columns["age"]["type"]) == "BIGINT" and "ssn" not in columns
        with engine.connect() as conn:
            df = pd.read_sql(sa.text("SELECT sex, AVG(age) AS mean_age FROM patients GROUP BY sex"), conn)
            assert list(df.columns) == ["sex", "mean_age"] and len(df) == 2
            n = conn.execute(sa.text("SELECT COUNT(*) FROM patients WHERE age > :a"), {"a": 18}).scalar()
            assert isinstance(n, int)
    finally:
        engine.dispose()


def test_pgcli_completion_metadata(dp_server: Running) -> None:
    """pgcli's completer loads schemata, tables, columns, functions and types through PGExecute."""
    pgexecute = pytest.importorskip("pgcli.pgexecute")
    ex = pgexecute.PGExecute("health", "analyst", None, dp_server.host, dp_server.port, None)
    try:
        assert ("public", "patients") in list(ex.tables())
        columns = {c[2] for c in ex.table_columns() if c[1] == "patients"}
        assert "age" in columns and "ssn" not in columns
        assert list(ex.schemata()) and list(ex.datatypes()) is not None and list(ex.functions())
        results = list(ex.run("SELECT COUNT(*) FROM patients"))
        assert results and results[0][1] is not None
    finally:
        ex.conn.close()
