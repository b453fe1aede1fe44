"""COUNT(DISTINCT col), FILTER (WHERE …) and the bivariate family (corr, covar_*, regr_*), on DuckDB
and PostgreSQL: answered close to the truth at a large ε, named and typed as PostgreSQL names them,
and charged like any other measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.session import Session

BIG = "budget:\n  dataset: {epsilon: 1.0e9, delta: 0.5}\n  analyst: {epsilon: 1.0e9, delta: 0.5}\n"


@pytest.fixture(scope="module")
def roomy_policy() -> Policy:
    text = demo_policy_path("health").read_text(encoding="utf-8")
    start = text.index("budget:\n")
    end = text.index("\n\n", start)
    return parse_policy(text[:start] + BIG + text[end + 1 :])


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest, pg_new_database: Callable[[], str]) -> Any:
    backend = open_backend("duckdb://" if request.param == "duckdb" else pg_new_database())
    load_demo(backend, ["health"])
    yield backend
    backend.close()


def _engine(policy: Policy, backend: Backend) -> Engine:
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"))


def _truth(backend: Backend, sql: str) -> tuple[Any, ...]:
    return backend.execute(sql)[1][0]


def test_filter_matches_where(roomy_policy: Policy, backend: Backend) -> None:
    engine = _engine(roomy_policy, backend)
    result = engine.execute(
        "SELECT COUNT(*) FILTER (WHERE sex = 'Female') AS f, SUM(age) FILTER (WHERE age > 50), "
        "AVG(age) FILTER (WHERE sex = 'Male'), COUNT(*) FROM patients",
        Session("alice", epsilon=1e5),
    )
    assert [c.name for c in result.columns] == ["f", "sum", "avg", "count"]
    assert [c.type for c in result.columns] == ["bigint", "bigint", "double precision", "bigint"]
    female, older, male_age, total = _truth(
        backend,
        "SELECT COUNT(*) FILTER (WHERE sex = 'Female'), SUM(age) FILTER (WHERE age > 50), "
        "AVG(age) FILTER (WHERE sex = 'Male'), COUNT(*) FROM patients",
    )
    f, s, a, n = result.rows[0]
    assert abs(f - female) <= 2 and abs(n - total) <= 2
    assert abs(s - older) <= 500 and abs(a - float(male_age)) < 0.1


def test_count_distinct_columns(roomy_policy: Policy, backend: Backend) -> None:
    engine = _engine(roomy_policy, backend)
    result = engine.execute(
        "SELECT COUNT(DISTINCT problem), COUNT(DISTINCT age) FROM patients", Session("alice", epsilon=1e5)
    )
    truth = _truth(backend, "SELECT COUNT(DISTINCT problem), COUNT(DISTINCT age) FROM patients")
    assert all(abs(got - want) <= 1 for got, want in zip(result.rows[0], truth, strict=True))
    grouped = engine.execute(
        "SELECT sex, COUNT(DISTINCT problem) FROM patients GROUP BY sex ORDER BY sex", Session("alice", epsilon=1e5)
    )
    assert [r[0] for r in grouped.rows] == ["Female", "Male"]
    assert all(abs(r[1] - 7) <= 1 for r in grouped.rows)


def test_count_distinct_sensitivity_is_max_rows(roomy_policy: Policy, backend: Backend) -> None:
    """A person keeps at most max_rows rows after bounding, so adds at most that many distinct values."""
    explanation = _engine(roomy_policy, backend).explain(
        "SELECT COUNT(DISTINCT problem) FROM patients", Session("alice", epsilon=1.0)
    )
    assert explanation.columns[0]["sensitivity"] == 1


def test_bivariate_family_close_to_postgres(roomy_policy: Policy, backend: Backend) -> None:
    functions = "corr(bmi, age), covar_pop(bmi, age), covar_samp(age, bmi), regr_slope(bmi, age), " + (
        "regr_intercept(bmi, age), regr_r2(bmi, age)"
    )
    engine = _engine(roomy_policy, backend)
    result = engine.execute(f"SELECT {functions} FROM patients", Session("alice", epsilon=1e6))
    assert [c.name for c in result.columns] == [
        "corr",
        "covar_pop",
        "covar_samp",
        "regr_slope",
        "regr_intercept",
        "regr_r2",
    ]
    assert {c.type for c in result.columns} == {"double precision"}
    truth = _truth(backend, f"SELECT {functions} FROM patients")
    for got, want in zip(result.rows[0], truth, strict=True):
        assert got == pytest.approx(float(want), rel=0.05, abs=0.01)


def test_bivariate_shares_moments_and_is_charged_once(roomy_policy: Policy, backend: Backend) -> None:
    """AVG(age) reads the same centred Σage as corr: one measurement, one share of ε."""
    engine = _engine(roomy_policy, backend)
    plan = engine.prepare("SELECT corr(bmi, age), AVG(age) FROM patients", Session("alice")).plan
    assert plan is not None
    labels = [m.label for m in plan.measures]
    assert len(labels) == len(set(labels))
    engine.execute("SELECT corr(bmi, age), AVG(age) FROM patients", Session("alice", epsilon=0.5))
    assert sum(c.cost.epsilon for c in engine.ledger.charges("health", "alice")) == pytest.approx(0.5)
