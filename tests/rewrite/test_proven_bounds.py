"""Clamps the database's statistics prove redundant are left out, and only those."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import open_backend
from dpsql.backends.duckdb import DuckDBBackend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.policies import DEFAULTS, policy_yaml, table_yaml

X = "x: {type: int, lower: 0, upper: 100, nullable: false}\n"
POLICY = policy_yaml(
    "bounds",
    table_yaml("t", X + "y: {type: float, lower: 0.0, upper: 10.0}") + table_yaml("v", X),
    defaults=DEFAULTS,
    budget="{dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}",
)


@pytest.fixture
def engine() -> Iterator[Engine]:
    backend = open_backend("duckdb://")
    backend.execute_script(
        "CREATE TABLE t AS SELECT i % 101 AS x, CAST(i % 11 AS DOUBLE) AS y FROM range(1000) r(i);"
        "CREATE VIEW v AS SELECT x FROM t"
    )
    engine = Engine(parse_policy(POLICY), backend, Ledger.open("sqlite:///:memory:"))
    yield engine
    engine.close()


def test_in_bounds_columns_are_not_clamped(engine: Engine) -> None:
    prepared = engine.prepare("SELECT SUM(x), AVG(y) FROM t", Session("alice"))
    assert prepared.plan.physical.proven == frozenset({0, 1})
    assert "CASE" not in prepared.sql


def test_views_and_out_of_bounds_values_keep_the_clamp(engine: Engine) -> None:
    assert "CASE" in engine.prepare("SELECT SUM(x) FROM v", Session("alice")).sql  # views are not trusted
    engine.backend.execute_script("INSERT INTO t VALUES (50, 11.5)")
    prepared = engine.prepare("SELECT SUM(x), AVG(y) FROM t", Session("alice"))
    assert prepared.plan.physical.proven == frozenset({0})  # y now has a value above 10; the plan cache was refreshed
    assert prepared.sql.count("CASE") == 1


def test_deleting_the_outlier_does_not_narrow_statistics(engine: Engine) -> None:
    engine.backend.execute_script("INSERT INTO t VALUES (500, 1); DELETE FROM t WHERE x = 500")
    assert engine.prepare("SELECT SUM(x) FROM t", Session("alice")).plan.physical.proven == frozenset()


def test_a_write_after_planning_runs_the_clamped_query(engine: Engine) -> None:
    session = Session("alice", epsilon=1e7, bias=False)  # (the measurement's statements only)
    sql = "SELECT SUM(x) FROM t WHERE x >= 100"
    prepared = engine.prepare(sql, session)
    assert "CASE" not in prepared.sql
    backend = engine.backend
    assert isinstance(backend, DuckDBBackend)
    run = engine.step.query
    seen: list[str] = []

    def write_then_run(statement: str) -> list[tuple[object, ...]]:
        if not seen:  # the write lands between planning and execution
            backend.execute_script("INSERT INTO t VALUES (1000000, 1)")
        seen.append(statement)
        return run(statement)

    engine.step.query = write_then_run  # type: ignore[method-assign,assignment]
    engine._plans.clear()
    engine._plans.put((sql, None, (session.epsilon, session.delta, session.mechanism), backend.data_version), prepared)
    result = engine.execute(sql, session)
    assert seen[0] == prepared.sql and len(seen) == 2 and "CASE" in seen[1]
    # 9 rows of x = 100 (i % 101 = 100 for i = 100, 201, …, 908) and the new 1,000,000 clamped to 100
    assert result.rows[0][0] == pytest.approx(1000, abs=1)


def test_explain_shows_every_clamp(engine: Engine) -> None:
    """Which clamps the statistics prove redundant depends on the data; EXPLAIN is free, so it must not tell."""
    explanation = engine.explain("SELECT SUM(x) FROM t", Session("alice"))
    assert "CASE WHEN" in explanation.sql
