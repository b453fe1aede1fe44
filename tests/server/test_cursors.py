"""DECLARE / FETCH / MOVE / CLOSE over answerable queries, with real psycopg named cursors.

A cursor runs its query once at DECLARE (the same analysis, refusals and single charge as the
query sent alone) and keeps the released rows; FETCH and MOVE page through them for free.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from .conftest import Running, open_engine, serving

#: ``problem`` has a public domain of 7 values: the released row count is fixed. Each test asks with
#: its own WHERE, so the result cache (repeats are free) never hides a charge.
BY_PROBLEM = "SELECT problem, COUNT(*) AS n FROM patients WHERE age >= {} GROUP BY problem ORDER BY problem"
PROBLEMS = sorted(["Hypertension", "Obesity", "Chest pain", "Shortness of breath", "Diabetes", "Asthma", "None"])


def _spent(server: Running, analyst: str) -> float:
    return server.engine.ledger.spent(server.engine.policy.dataset, analyst).epsilon


def _charges(server: Running, analyst: str) -> int:
    return len(server.engine.ledger.charges(server.engine.policy.dataset, analyst))


def connect(server: Running, user: str, **kw: object) -> psycopg.Connection:
    conn = psycopg.connect(server.dsn(user), **kw)  # type: ignore[arg-type]
    conn.execute("SET dpsql.epsilon = 0.25")
    conn.commit()
    return conn


def test_named_cursor_fetchmany_fetchall_charges_once(dp_server: Running) -> None:
    notices: list[str] = []
    with connect(dp_server, "carol") as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        before = _charges(dp_server, "carol")
        with conn.cursor(name="by_problem") as cur:
            cur.execute(BY_PROBLEM.format(1))
            assert [d.name for d in cur.description or ()] == ["problem", "n"]
            first = cur.fetchmany(3)
            assert [r[0] for r in first] == PROBLEMS[:3]
            assert cur.fetchone()[0] == PROBLEMS[3]  # type: ignore[index]
            rest = cur.fetchall()
            assert [r[0] for r in rest] == PROBLEMS[4:]
            assert cur.fetchall() == []
            assert all(isinstance(r[1], int) for r in first + rest)
        conn.commit()
    assert _charges(dp_server, "carol") == before + 1
    assert any("charged ε=0.25" in n for n in notices)


def test_named_cursor_iteration_with_itersize_and_binary(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn:
        before = _spent(dp_server, "carol")
        with conn.cursor(name="it") as cur:
            cur.itersize = 2
            cur.execute(BY_PROBLEM.format(2))
            assert [r[0] for r in cur] == PROBLEMS
        with conn.cursor(name="bin") as cur:
            cur.execute("SELECT sex, AVG(age) AS a FROM patients WHERE age >= 2 GROUP BY sex ORDER BY sex", binary=True)
            rows = cur.fetchall()
            assert [r[0] for r in rows] == ["Female", "Male"] and all(isinstance(r[1], float) for r in rows)
        conn.commit()
    assert _spent(dp_server, "carol") - before == pytest.approx(0.5)


def test_named_cursor_with_parameters(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn, conn.cursor(name="p") as cur:
        before = _charges(dp_server, "carol")
        cur.execute("SELECT COUNT(*) AS n, AVG(age) AS a FROM patients WHERE age >= %s AND sex = %s", (41, "Female"))
        n, avg = cur.fetchone()  # type: ignore[misc]
        assert isinstance(n, int) and 30 <= avg <= 110
        assert _charges(dp_server, "carol") == before + 1


def test_refused_query_same_error_nothing_charged(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn:
        with pytest.raises(psycopg.Error) as plain:
            conn.execute("SELECT ssn FROM patients")
        conn.rollback()
        before = _charges(dp_server, "carol")
        with pytest.raises(psycopg.Error) as declared, conn.cursor(name="bad") as cur:
            cur.execute("SELECT ssn FROM patients")
        assert declared.value.sqlstate == plain.value.sqlstate == "42501"
        assert declared.value.diag.message_primary == plain.value.diag.message_primary
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        assert _charges(dp_server, "carol") == before


def test_composite_query_under_declare(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn, conn.cursor(name="outer") as cur:
        before = _charges(dp_server, "carol")
        # a filter no other test's release has (else its cells could answer the inner query, free)
        cur.execute(
            "SELECT COUNT(*) AS k FROM (SELECT problem, COUNT(*) AS c FROM patients WHERE age > 17 GROUP BY problem) s"
        )
        assert cur.fetchall() == [(7,)]
        assert _charges(dp_server, "carol") == before + 1


def test_catalog_and_tableless_cursors(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn:
        with conn.cursor(name="one") as cur:
            cur.execute("SELECT 1 AS x")
            assert cur.fetchall() == [(1,)]
        with conn.cursor(name="cat") as cur:
            cur.execute("SELECT relname FROM pg_class WHERE relname = 'patients'")
            assert cur.fetchall() == [("patients",)]
        conn.commit()


def _simple(conn: psycopg.Connection, sql: str) -> psycopg.Cursor:
    """One statement over the simple query protocol (as psql sends it)."""
    cur = conn.cursor()
    cur.execute(sql.encode(), prepare=False)
    return cur


def test_simple_protocol_fetch_move_close(dp_server: Running) -> None:
    with psycopg.connect(dp_server.dsn("carol"), autocommit=True) as conn:
        before = _charges(dp_server, "carol")
        _simple(conn, "BEGIN")
        assert _simple(conn, f"DECLARE c CURSOR FOR {BY_PROBLEM.format(3)}").statusmessage == "DECLARE CURSOR"
        cur = _simple(conn, "FETCH 2 FROM c")
        assert cur.statusmessage == "FETCH 2" and [r[0] for r in cur.fetchall()] == PROBLEMS[:2]
        assert _simple(conn, "MOVE FORWARD 2 IN c").statusmessage == "MOVE 2"
        assert [r[0] for r in _simple(conn, "FETCH NEXT FROM c").fetchall()] == [PROBLEMS[4]]
        assert [r[0] for r in _simple(conn, "FETCH PRIOR FROM c").fetchall()] == [PROBLEMS[3]]
        assert [r[0] for r in _simple(conn, "FETCH BACKWARD 2 c").fetchall()] == [PROBLEMS[2], PROBLEMS[1]]
        assert [r[0] for r in _simple(conn, "FETCH ABSOLUTE -1 FROM c").fetchall()] == [PROBLEMS[-1]]
        assert [r[0] for r in _simple(conn, "FETCH FIRST FROM c").fetchall()] == [PROBLEMS[0]]
        cur = _simple(conn, "FETCH ALL FROM c")
        assert cur.statusmessage == "FETCH 6" and [r[0] for r in cur.fetchall()] == PROBLEMS[1:]
        cur = _simple(conn, "FETCH FORWARD 3 FROM c")
        assert cur.statusmessage == "FETCH 0" and cur.fetchall() == []
        assert [d.name for d in cur.description or ()] == ["problem", "n"]
        assert _simple(conn, "CLOSE c").statusmessage == "CLOSE CURSOR"
        _simple(conn, "COMMIT")
        assert _charges(dp_server, "carol") == before + 1


def _error(conn: psycopg.Connection, sql: str) -> tuple[str | None, str | None]:
    with pytest.raises(psycopg.Error) as info:
        _simple(conn, sql)
    return info.value.sqlstate, info.value.diag.message_primary


def test_cursor_errors(dp_server: Running) -> None:
    with psycopg.connect(dp_server.dsn("carol"), autocommit=True) as conn:
        before = _charges(dp_server, "carol")
        assert _error(conn, f"DECLARE c CURSOR FOR {BY_PROBLEM.format(4)}") == (
            "25P01",
            "DECLARE CURSOR can only be used in transaction blocks",
        )
        assert _error(conn, "FETCH 1 FROM nope") == ("34000", 'cursor "nope" does not exist')
        assert _error(conn, "CLOSE nope") == ("34000", 'cursor "nope" does not exist')
        assert _error(conn, "DECLARE c CURSOR FOR SHOW ALL") == ("42601", 'syntax error at or near "SHOW"')
        assert _error(conn, "DECLARE c FOO CURSOR FOR SELECT 1") == ("42601", 'syntax error at or near "foo"')
        _simple(conn, "BEGIN")
        _simple(conn, "DECLARE c NO SCROLL CURSOR FOR SELECT 1")
        assert _error(conn, "FETCH PRIOR FROM c") == ("55000", "cursor can only scan forward")
        _simple(conn, "ROLLBACK")
        _simple(conn, "BEGIN")
        _simple(conn, 'DECLARE "C" CURSOR FOR SELECT 1')
        assert _error(conn, 'DECLARE "C" CURSOR FOR SELECT 2') == ("42P03", 'cursor "C" already exists')
        _simple(conn, "ROLLBACK")
        _simple(conn, "BEGIN")
        _simple(conn, "DECLARE c CURSOR FOR SELECT 1")
        assert _simple(conn, "FETCH 1 FROM C").fetchall() == [(1,)]  # bare names fold to lower case
        assert _error(conn, 'FETCH 1 FROM "C"') == ("34000", 'cursor "C" does not exist')
        _simple(conn, "ROLLBACK")
        assert _charges(dp_server, "carol") == before


def test_transaction_end_and_savepoints_close_cursors(dp_server: Running) -> None:
    with psycopg.connect(dp_server.dsn("carol"), autocommit=True) as conn:
        _simple(conn, "BEGIN")
        _simple(conn, "DECLARE a CURSOR FOR SELECT 1")
        _simple(conn, "SAVEPOINT s")
        _simple(conn, "DECLARE b CURSOR FOR SELECT 2")
        _simple(conn, "ROLLBACK TO SAVEPOINT s")
        assert _simple(conn, "FETCH a").fetchall() == [(1,)]
        assert _error(conn, "FETCH b") == ("34000", 'cursor "b" does not exist')
        _simple(conn, "ROLLBACK")
        _simple(conn, "BEGIN")
        _simple(conn, "DECLARE a CURSOR FOR SELECT 1")
        _simple(conn, "DECLARE h CURSOR WITH HOLD FOR SELECT 3")
        _simple(conn, "COMMIT")
        assert _error(conn, "FETCH a") == ("34000", 'cursor "a" does not exist')
        assert _simple(conn, "FETCH h").fetchall() == [(3,)]
        _simple(conn, "CLOSE ALL")
        assert _error(conn, "FETCH h") == ("34000", 'cursor "h" does not exist')


def test_withhold_named_cursor(dp_server: Running) -> None:
    with connect(dp_server, "carol") as conn:
        with conn.cursor(name="held", withhold=True) as cur:
            cur.execute(BY_PROBLEM.format(5))
            conn.commit()
            assert [r[0] for r in cur.fetchall()] == PROBLEMS
        conn.commit()


@pytest.fixture(scope="module")
def small_server() -> Iterator[Running]:
    with serving(open_engine(trust=True), catalog_dsn="", max_cursors=2, max_cursor_rows=10) as (running, _):
        yield running


def test_cursor_limits(small_server: Running) -> None:
    with psycopg.connect(small_server.dsn("carol"), autocommit=True) as conn:
        _simple(conn, "BEGIN")
        _simple(conn, "DECLARE a CURSOR FOR SELECT 1")
        _simple(conn, "DECLARE b CURSOR FOR SELECT 2")
        before = _charges(small_server, "carol")
        assert _error(conn, f"DECLARE c CURSOR FOR {BY_PROBLEM.format(6)}") == (
            "53400",
            "too many open cursors in this session (at most 2)",
        )
        assert _charges(small_server, "carol") == before  # refused before the query ran
        _simple(conn, "ROLLBACK")
        _simple(conn, "BEGIN")
        _simple(conn, f"DECLARE a CURSOR FOR {BY_PROBLEM.format(7)}")
        assert _error(conn, f"DECLARE b CURSOR FOR {BY_PROBLEM.format(8)}") == (
            "53400",
            "cursors would hold too many rows (14; at most 10 in all open cursors of a session)",
        )
        _simple(conn, "ROLLBACK")


def test_asyncpg_cursor(dp_server: Running) -> None:
    import asyncio

    import asyncpg

    async def run() -> list[str]:
        conn = await asyncpg.connect(host=dp_server.host, port=dp_server.port, user="carol", database="health")
        try:
            async with conn.transaction():
                cur = await conn.cursor(BY_PROBLEM.format(9))
                rows = await cur.fetch(3)
                rows += await cur.fetch(10)
                return [r[0] for r in rows]
        finally:
            await conn.close()

    assert asyncio.run(run()) == PROBLEMS


def test_protocol_close_and_describe_of_a_cursor(dp_server: Running) -> None:
    """Cursors share the portal namespace: Describe and Close (portal) messages reach them by name."""
    from psycopg.generators import execute

    with psycopg.connect(dp_server.dsn("carol")) as conn:
        _simple(conn, "DECLARE pc CURSOR FOR SELECT 1 AS x")
        stolen = conn.cursor(name="pc")  # psycopg Describes the portal "pc", then FETCHes
        assert stolen.fetchall() == [(1,)] and [d.name for d in stolen.description or ()] == ["x"]
        if not hasattr(conn.pgconn, "send_close_portal"):
            pytest.skip("libpq without PQsendClosePortal")
        conn.pgconn.send_close_portal(b"pc")
        conn.wait(execute(conn.pgconn))
        assert _error(conn, "FETCH pc") == ("34000", 'cursor "pc" does not exist')
        conn.rollback()


def test_psql_cursor_script_and_fetch_count(dp_server: Running) -> None:
    """The real psql: an explicit cursor script, and FETCH_COUNT (psql < 17 pages a SELECT through a cursor)."""
    psql = shutil.which("psql")
    assert psql is not None, "psql must be installed (scripts/setup.sh installs postgresql-client)"
    base = [psql, "-X", "-At", "-v", "ON_ERROR_STOP=1", "-h", dp_server.host, "-p", str(dp_server.port), "-U", "carol"]
    env = {"PGCONNECT_TIMEOUT": "10", "PATH": "/usr/bin:/bin"}
    declare = f"DECLARE c CURSOR FOR {BY_PROBLEM.format(10)}"
    script = f"BEGIN; {declare}; FETCH 3 FROM c; MOVE 1 IN c; FETCH ALL FROM c; COMMIT"
    done = subprocess.run([*base, "health", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("|")[0] for line in lines if "|" in line] == PROBLEMS[:3] + PROBLEMS[4:]
    assert [line for line in lines if "|" not in line] == ["BEGIN", "DECLARE CURSOR", "MOVE 1", "COMMIT"]
    paged = [*base, "-v", "FETCH_COUNT=2", "health", "-c", BY_PROBLEM.format(11)]
    done = subprocess.run(paged, capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert [line.split("|")[0] for line in done.stdout.splitlines()] == PROBLEMS
