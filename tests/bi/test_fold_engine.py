"""Constant DATE_TRUNC folding (dpsql/analyze/fold.py) against the real thing, on DuckDB and PostgreSQL.

Metabase writes relative date filters as ``DATE_TRUNC('year', NOW() + INTERVAL '-30 year')``: folded at
analysis to a timestamp literal, so the WHERE compares a column with a constant (answered) and the
backend never reads the clock. The folded value is PostgreSQL's own ``date_trunc`` for every unit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

import pytest

from dpsql.analyze.fold import truncate
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session

STAMPS = [
    dt.datetime(2024, 3, 31, 12, 30, 15, 250123),
    dt.datetime(2000, 1, 1),
    dt.datetime(2001, 1, 1),
    dt.datetime(1999, 12, 31, 23, 59, 59, 999999),
    dt.datetime(2021, 1, 3, 5),  # a Sunday: ISO week of the previous year
    dt.datetime(1900, 2, 28, 1, 2, 3),
    dt.datetime(1, 6, 1),
]
UNITS = [
    "microseconds", "milliseconds", "second", "minute", "hour", "day", "week", "month", "quarter", "year",
    "decade", "century", "millennium",
]  # fmt: skip


@pytest.fixture(scope="module")
def postgres_trunc(pg_new_database: Callable[[], str]) -> Iterator[Backend]:
    backend = open_backend(pg_new_database())
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize("unit", UNITS)
def test_truncate_is_postgres_date_trunc(postgres_trunc: Backend, unit: str) -> None:
    """The folded value is what PostgreSQL's own date_trunc returns, for every unit it has."""
    values = ", ".join(f"date_trunc('{unit}', TIMESTAMP '{s.isoformat(sep=' ')}')" for s in STAMPS)
    _, rows = postgres_trunc.execute(f"SELECT {values}")
    expected = [truncate(unit, s) for s in STAMPS[:-1]]
    assert list(rows[0][:-1]) == expected
    if unit == "decade":  # PostgreSQL's decade of year 1 begins in 1 BC: beyond Python's dates, 22008 here
        with pytest.raises(Error) as info:
            truncate(unit, STAMPS[-1])
        assert info.value.sqlstate == "22008"
    else:
        assert rows[0][-1] == truncate(unit, STAMPS[-1])


# Metabase's relative filters on the demos, through the whole engine on DuckDB and PostgreSQL: answered
# (the bound is a constant), charged once, the same rows as the same filter written with literals.
METABASE = [
    (
        "clinic",
        "SELECT department, COUNT(*) AS count FROM visits"
        " WHERE visit_date >= DATE_TRUNC('year', NOW() + INTERVAL '-30 year')"
        " AND visit_date < DATE_TRUNC('year', NOW() + INTERVAL '1 year') GROUP BY department",
    ),
    (
        "health",
        "SELECT sex, COUNT(*) AS count FROM patients"
        " WHERE dob >= CAST(DATE_TRUNC('year', NOW() + INTERVAL '-30 year') AS date) GROUP BY sex",
    ),
]


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def demo_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    url = "duckdb://" if request.param == "duckdb" else request.getfixturevalue("pg_new_database")()
    backend = open_backend(url)
    try:
        load_demo(backend, ["clinic", "health"])
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize(("demo", "sql"), METABASE, ids=[m[0] for m in METABASE])
def test_metabase_relative_date_filter_is_answered(demo_backend: Backend, demo: str, sql: str) -> None:
    engine = Engine(load_policy(demo_policy_path(demo)), demo_backend, Ledger.open("sqlite:///:memory:"))
    result = engine.execute(sql, Session("alice", epsilon=1.0))
    assert result.epsilon_spent == pytest.approx(1.0)
    assert len(result.rows) == 2 if demo == "health" else 6
    ledger = engine.ledger.spent(engine.policy.dataset, "alice")
    assert ledger.epsilon == pytest.approx(1.0)
    # the backend ran the folded literal, never the clock
    plan = engine.explain(sql, Session("alice", epsilon=1.0))
    assert plan is not None and "NOW" not in plan.sql.upper() and "INTERVAL" not in plan.sql.upper()
