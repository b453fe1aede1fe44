"""psycopg 3 against the server: simple and extended protocol, binary results, prepared statements."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .conftest import Running


def connect(server: Running, user: str = "analyst", **kw: object) -> psycopg.Connection:
    return psycopg.connect(server.dsn(user), autocommit=True, **kw)  # type: ignore[arg-type]


def test_ping_and_session_functions(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        version = conn.execute("select version()").fetchone()[0]  # type: ignore[index]
        assert version.startswith("PostgreSQL ") and "dpsql" in version
        assert conn.execute("select current_user, current_database()").fetchone() == ("analyst", "health")
        assert conn.execute("select current_setting('server_encoding')").fetchone() == ("UTF8",)
        assert conn.execute("SHOW transaction isolation level").fetchone() == ("read committed",)
        assert conn.info.parameter_status("default_transaction_read_only") == "on"
        assert conn.info.server_version >= 150000


def test_empty_and_comment_only_query(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        cur = conn.execute("-- ping")
        assert cur.pgresult is not None and cur.pgresult.status == psycopg.pq.ExecStatus.EMPTY_QUERY


def test_dp_query_simple_protocol_with_notices(dp_server: Running) -> None:
    notices: list[str] = []
    with connect(dp_server, "alice") as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET dpsql.epsilon = 7.5")  # more than any earlier release of sex: a fresh, charged answer
        rows = conn.execute("SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex ORDER BY sex").fetchall()
    assert [r[0] for r in rows] == ["Female", "Male"]
    assert all(isinstance(r[1], int) for r in rows)
    assert any("ε=7.5" in n and "remaining" in n for n in notices)
    assert any("95% CI" in n for n in notices)


def test_server_side_parameters_and_binary(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        cur = conn.execute("SELECT COUNT(*) AS n, AVG(age) AS a FROM patients WHERE age >= %s", (40,))
        n, avg = cur.fetchone()  # type: ignore[misc]
        assert isinstance(n, int) and 30 <= avg <= 110
        cur = conn.execute("SELECT sex, SUM(visits) FROM patients GROUP BY sex", binary=True)
        assert {r[0] for r in cur.fetchall()} == {"Female", "Male"}
        cur = conn.execute("SELECT COUNT(*) FROM patients WHERE sex = %s AND bmi < %s", ("Female", 30.5), prepare=True)
        assert isinstance(cur.fetchone()[0], int)  # type: ignore[index]
        # second run of the same text uses the server-side prepared statement
        cur = conn.execute("SELECT COUNT(*) FROM patients WHERE sex = %s AND bmi < %s", ("Male", 30.5), prepare=True)
        assert isinstance(cur.fetchone()[0], int)  # type: ignore[index]


def test_show_intervals_adds_ci_columns(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        conn.execute("SET dpsql.show_intervals = on")
        for binary in (False, True):
            cur = conn.execute("SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex", binary=binary)
            assert [d.name for d in cur.description] == ["sex", "n", "n_ci95"]
            assert all(r[2] > 0 for r in cur.fetchall())
        conn.execute("RESET dpsql.show_intervals")
        cur = conn.execute("SELECT COUNT(*) AS n FROM patients")
        assert [d.name for d in cur.description] == ["n"]


def test_refusals_carry_sqlstate(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT ssn FROM patients")
        assert info.value.sqlstate is not None and info.value.sqlstate != "XX000"
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute("SELECT COUNT(*) FROM patients JOIN pg_class ON true")
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute("COPY patients TO STDOUT")
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute("SET dpsql.epsilon = -1")
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection is still usable


def test_multi_statement_error_aborts_rest(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        with pytest.raises(psycopg.Error):
            conn.execute("SET application_name = 'a'; SELECT nope FROM nowhere; SET application_name = 'b'")
        assert conn.execute("SHOW application_name").fetchone() == ("a",)
        assert conn.info.parameter_status("application_name") == "a"


def _status(conn: psycopg.Connection[Any]) -> psycopg.pq.TransactionStatus:
    """Read afresh each time (mypy would keep the first assertion's narrowing of the attribute)."""
    return conn.info.transaction_status


def test_transactions_status(dp_server: Running) -> None:
    with psycopg.connect(dp_server.dsn()) as conn:  # not autocommit: psycopg sends BEGIN
        conn.execute("SELECT COUNT(*) FROM patients")
        assert _status(conn) == psycopg.pq.TransactionStatus.INTRANS
        with pytest.raises(psycopg.Error):
            conn.execute("SELECT * FROM patients")
        assert _status(conn) == psycopg.pq.TransactionStatus.INERROR
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("SELECT 1")
        conn.rollback()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with conn.transaction():
            conn.execute("SAVEPOINT s1")
            conn.execute("RELEASE SAVEPOINT s1")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_catalog_queries_hit_the_empty_shadow(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
        assert sorted(tables) == [("dpsql_budget",), ("patients",)]  # the analyst's own budget view
        cols = {
            r[0]: r[1]
            for r in conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s",
                ("patients",),
            )
        }
        assert cols["age"] == "bigint" and "ssn" not in cols and "name" not in cols
        assert conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'patients'").fetchone()[0] <= 0  # type: ignore[index]
        assert conn.execute("SELECT current_user").fetchone() == ("analyst",)


def test_statement_timeout(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        conn.execute("SET statement_timeout = '200ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(3)")
        conn.execute("SET statement_timeout = 0")
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_explain_show_all_and_discard(dp_server: Running) -> None:
    with connect(dp_server) as conn:
        plan = [r[0] for r in conn.execute("EXPLAIN SELECT COUNT(*) FROM patients")]
        assert plan and "epsilon" in plan[0]
        cur = conn.execute("EXPLAIN SELECT COUNT(*) FROM patients WHERE age > %s", (3,))
        assert [d.name for d in cur.description] == ["QUERY PLAN"]
        settings = dict((r[0], r[1]) for r in conn.execute("SHOW ALL"))
        assert settings["dpsql.epsilon"] and settings["TimeZone"] == "UTC"
        conn.execute("SET dpsql.epsilon = 0.25")
        conn.execute("DISCARD ALL")
        assert conn.execute("SHOW dpsql.epsilon").fetchone() == ("1.0",)


def test_idle_timeout() -> None:
    from dpsql.server import ThreadedServer

    from .conftest import open_engine

    engine = open_engine(trust=True)
    server = ThreadedServer(engine, catalog_dsn="", idle_timeout=0.3)
    try:
        with psycopg.connect(f"host={server.host} port={server.port} user=analyst", autocommit=True) as conn:
            import time

            time.sleep(0.8)
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
    finally:
        server.stop()
        engine.close()
