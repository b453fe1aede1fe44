"""Cursors (DECLARE / FETCH / MOVE / CLOSE) on neighbouring databases, DuckDB and PostgreSQL.

A cursor must be no new oracle: what DECLARE answers or refuses (SQLSTATE, message), what it
charges, and what FETCH/MOVE/CLOSE then say (tags, row counts, errors, including the cursor
limits) must be the same whether one patient is there, is absent, or holds out-of-bounds values.
The queries group by ``problem``, a public domain, so the released row count is fixed; the noisy
values themselves are not compared. Runs through a real ``dpsql`` wire server and psycopg.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from dpsql.backends import open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Auth, load_policy
from dpsql.server import ThreadedServer

BY_PROBLEM = "SELECT problem, COUNT(*) AS n, AVG(age) AS a FROM patients GROUP BY problem"
ONE = "(SELECT ssn FROM patients ORDER BY ssn LIMIT 1)"
NEIGHBOURS = {
    "as-loaded": None,
    "one-patient-odd-values": f"UPDATE patients SET age = 100000, bmi = 1e300 WHERE ssn = {ONE}",
    "one-patient-absent": f"DELETE FROM patients WHERE ssn = {ONE}",
}
#: The session each neighbour runs: statements over the simple protocol, then a psycopg named cursor.
SCRIPT = [
    f"DECLARE c CURSOR FOR {BY_PROBLEM}",  # outside a transaction block: 25P01
    "BEGIN",
    "DECLARE bad CURSOR FOR SELECT ssn FROM patients",  # refused, nothing charged
    "ROLLBACK",
    "BEGIN",
    f"DECLARE c NO SCROLL CURSOR FOR {BY_PROBLEM} WHERE age > 30",
    "FETCH 3 FROM c",
    "MOVE ALL IN c",
    "FETCH PRIOR FROM c",  # NO SCROLL: 55000
    "ROLLBACK",
    "BEGIN",
    f"DECLARE c CURSOR FOR {BY_PROBLEM} WHERE age > 40",
    "FETCH 3 FROM c",
    "MOVE ALL IN c",
    "FETCH BACKWARD 2 FROM c",
    f"DECLARE d CURSOR FOR {BY_PROBLEM} WHERE age > 50",  # 14 rows > max_cursor_rows: 53400 (after the charge)
    "ROLLBACK",
    "BEGIN",
    "DECLARE a CURSOR FOR SELECT 1",
    "DECLARE a CURSOR FOR SELECT 1",  # 42P03
    "ROLLBACK",
    "FETCH 1 FROM a",  # closed at ROLLBACK: 34000
]


def _session(port: int) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []
    with psycopg.connect(f"host=127.0.0.1 port={port} user=alice dbname=health", autocommit=True) as conn:
        for sql in SCRIPT:
            cur = conn.cursor()
            try:
                cur.execute(sql.encode(), prepare=False)
                rows = cur.fetchall() if cur.description else []
                seen.append((sql, cur.statusmessage, len(rows)))
            except psycopg.Error as exc:
                seen.append((sql, exc.sqlstate, exc.diag.message_primary))
        conn.autocommit = False
        with conn.cursor(name="named") as named:
            try:
                named.execute(f"{BY_PROBLEM} WHERE age >= %s AND sex = %s", (25, "Male"))
                seen.append(("named", len(named.fetchmany(4)), len(named.fetchall())))
            except psycopg.Error as exc:
                seen.append(("named", exc.sqlstate, exc.diag.message_primary))
        conn.rollback()
    return seen


@pytest.fixture(scope="module")
def cursor_outcomes(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str], Any]]:
    policy = load_policy(demo_policy_path("health"))
    policy = policy.model_copy(update={"auth": Auth(trust=True)})
    found: dict[tuple[str, str], Any] = {}
    for name, url in (("duckdb", "duckdb://"), ("postgres", pg_new_database())):
        backend = open_backend(url)
        try:
            load_demo(backend, ["health"])
            for neighbour, change in NEIGHBOURS.items():
                if change:
                    backend.execute_script(change)
                engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
                server = ThreadedServer(engine, catalog_dsn="", max_cursors=4, max_cursor_rows=10)
                try:
                    session = _session(server.port)
                finally:
                    server.stop()
                charges = len(engine.ledger.charges(policy.dataset, "alice"))
                spent = round(engine.ledger.spent(policy.dataset, "alice").epsilon, 9)
                found[name, neighbour] = (session, charges, spent)
        finally:
            backend.close()
    yield found


def test_cursor_outcomes_do_not_depend_on_one_person(cursor_outcomes: dict[tuple[str, str], Any]) -> None:
    distinct = {repr(v) for v in cursor_outcomes.values()}
    assert len(distinct) == 1, f"cursor outcomes depend on the data or backend: {cursor_outcomes}"
    session, charges, _ = cursor_outcomes["duckdb", "as-loaded"]
    outcome = {sql: rest for sql, *rest in session}
    assert outcome[SCRIPT[0]] == ["25P01", "DECLARE CURSOR can only be used in transaction blocks"]
    assert outcome[SCRIPT[2]][0] == "42501"
    assert outcome["FETCH PRIOR FROM c"] == ["55000", "cursor can only scan forward"]
    assert outcome["FETCH BACKWARD 2 FROM c"] == ["FETCH 2", 2]
    assert outcome[SCRIPT[15]][0] == "53400"
    assert outcome["DECLARE a CURSOR FOR SELECT 1"] == ["42P03", 'cursor "a" already exists']
    assert outcome["FETCH 1 FROM a"] == ["34000", 'cursor "a" does not exist']
    assert outcome["named"] == [4, 3]
    assert charges == 4  # each answered DECLARE once (the 53400 one too: it ran); the refusals never
