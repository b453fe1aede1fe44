"""Synopses on neighbouring databases (the heaviest patient's visits removed), on DuckDB and PostgreSQL:
whether a query is answered from the synopsis, charged, or refused — and every notice's wording apart
from the released numbers — is the same on both. The answer path reads released values only."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.curator.synopsis_cli import build
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session

CLINIC = demo_policy_path("clinic")
CUBE = """
  visits_cube:
    table: visits
    keys: [department, "DATE_TRUNC('month', visit_date)"]
    measures: ["COUNT(*)", "SUM(cost)"]
    epsilon: 3.0
"""
QUERIES = [
    "SELECT department, COUNT(*) FROM visits GROUP BY department",
    "SELECT DATE_TRUNC('year', visit_date), COUNT(*), AVG(cost) FROM visits GROUP BY 1",
    "SELECT COUNT(*) FROM visits WHERE visit_date >= '2022-01-15'",
    "SELECT DATE_TRUNC('quarter', visit_date), COUNT(*) FROM visits WHERE department = 'Oncology' GROUP BY 1",
    "SELECT department, SUM(cost) FROM visits WHERE visit_date BETWEEN '2022-01-01' AND '2022-06-30' GROUP BY 1",
    "SELECT department, COUNT(*) FROM visits WHERE department LIKE 'O%' OR department = 'Cardiology' GROUP BY 1",
    "SELECT urgent, COUNT(*) FROM visits GROUP BY urgent",
    "SELECT department, COUNT(*) FROM visits WHERE cost / 0 > 1 GROUP BY 1",
    "SELECT DATE_TRUNC('week', visit_date), COUNT(*) FROM visits GROUP BY 1",
]

#: Coarsening an earlier release (dpsql.synopsis.reuse): (query, ε); the second is answered from the first.
COARSE = [
    ("SELECT department, urgent, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1, 2", 8.0),
    ("SELECT urgent, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1", 1.0),
    ("SELECT COUNT(*) FROM visits WHERE cost > 100 AND department = 'Oncology'", 1.0),
    ("SELECT urgent, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1", 8.0),
]


def _neighbours(kind: str, new_database: Callable[[], str] | None) -> list[Backend]:
    backends = []
    for _ in range(2):
        backend = open_backend("duckdb://") if new_database is None else open_backend(new_database())
        load_demo(backend, ["clinic"])
        backends.append(backend)
    heavy = backends[1].execute("SELECT patient_id FROM visits GROUP BY 1 ORDER BY COUNT(*) DESC LIMIT 1")[1][0][0]
    backends[1].execute_script(f"DELETE FROM visits WHERE patient_id = {int(heavy)}")
    return backends


def _outcome(engine: Engine, sql: str, epsilon: float | None = None) -> tuple[str, ...]:
    try:
        result = engine.execute(sql, Session("alice", epsilon=epsilon))
    except Error as exc:
        return ("refused", exc.sqlstate, exc.message)
    words = tuple(re.sub(r"[-+]?\d[\d.,:e+-]*", "#", n) for n in result.notices)
    return ("answered", f"{result.epsilon_spent:g}", *words)


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
def test_outcomes_match_on_neighbouring_databases(kind: str, request: pytest.FixtureRequest) -> None:
    new_database = request.getfixturevalue("pg_new_database") if kind == "postgres" else None
    outcomes = []
    for backend in _neighbours(kind, new_database):
        policy = parse_policy(CLINIC.read_text() + CUBE, str(CLINIC))
        engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache())
        build(engine, "visits_dashboard")
        build(engine, "visits_cube")
        outcomes.append([_outcome(engine, sql) for sql in QUERIES] + [_outcome(engine, *q) for q in COARSE])
        engine.close()
    assert outcomes[0] == outcomes[1]
    answered_free = [o[0] == "answered" and o[1] == "0" for o in outcomes[0]]
    assert answered_free == [True, True, False, True, True, True, False, False, False, False, True, True, False]
