"""Aggregates over expressions: bounds by interval arithmetic, no data-dependent failure, same on both backends."""

from __future__ import annotations

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.policy import Policy
from dpsql.rewrite import to_sql
from dpsql.session import Session

ACCEPTED = [
    "SELECT SUM(age * visits), AVG(CASE WHEN problem = 'Obesity' THEN bmi ELSE 0 END) FROM patients",
    "SELECT sex, AVG(EXTRACT(YEAR FROM dob)), SUM(bmi / 2.0), COUNT(bmi + 1) FROM patients GROUP BY sex",
    "SELECT SUM(ABS(age - 50)), SUM(COALESCE(bmi, 25.0) * 2), SUM(-age) FROM patients",
    "SELECT problem, SUM(CASE WHEN age >= 65 THEN 1 ELSE 0 END) AS seniors FROM patients GROUP BY problem",
    # division and casts (#36): PostgreSQL's integer division truncates; a divisor that can be 0 is NULLIF'd
    "SELECT SUM(age / visits), SUM(age / (visits + 1)), SUM(-age / 7), SUM(age % 7), SUM(age / 2.0) FROM patients",
    "SELECT SUM(CAST(age AS DOUBLE PRECISION)), AVG(bmi::float), SUM(CAST(bmi AS INTEGER)), AVG(age::numeric) "
    "FROM patients",
    "SELECT COUNT(*), SUM(bmi) FROM patients WHERE age + 1 > 40 AND bmi * (1 - 0.1) BETWEEN 20 AND 30",
    "SELECT COUNT(*) FROM patients WHERE age / visits > 3 OR (age - 40) / 7 = 2 OR age % 5 IN (1, 3)",
]


@pytest.mark.parametrize("sql", ACCEPTED)
def test_expression_aggregates_match_on_duckdb_and_postgres(
    sql: str, health_policy: Policy, health_duckdb: Backend, health_pg: Backend
) -> None:
    plan = analyze(sql, health_policy)
    duck = sorted(health_duckdb.execute(to_sql(plan, "duckdb"))[1])
    pg = sorted(health_pg.execute(to_sql(plan, "postgres"))[1])
    assert len(duck) == len(pg)
    for d, p in zip(duck, pg, strict=True):
        keys = [v for v in d if isinstance(v, str)]
        assert keys == [v for v in p if isinstance(v, str)]
        assert [v for v in d if not isinstance(v, str)] == pytest.approx(
            [v for v in p if not isinstance(v, str)], rel=1e-12
        )


def test_derived_bounds_and_sensitivity(health_policy: Policy) -> None:
    plan = analyze(
        "SELECT SUM(age * visits), SUM(CASE WHEN age >= 65 THEN bmi ELSE 0 END), SUM(age - 200) FROM patients",
        health_policy,
    )
    product, case, shifted = plan.measures
    assert (product.lower, product.upper, product.integer, product.sensitivity) == (0, 5500, True, 5500)
    assert (case.lower, case.upper, case.integer) == (0, 60, False)
    assert (shifted.lower, shifted.upper, shifted.sensitivity) == (-200, -90, 200)


def test_seniors_count_through_the_engine(engine: Engine) -> None:
    result = engine.execute(
        "SELECT SUM(CASE WHEN age >= 65 THEN 1 ELSE 0 END) AS seniors, COUNT(*) FROM patients", Session("alice")
    )
    truth = engine.backend.execute("SELECT COUNT(*) FROM patients WHERE age >= 65")[1][0][0]
    width = result.accuracy[0][0]
    assert width is not None and abs(result.rows[0][0] - truth) < 5 * width
    assert [c.name for c in result.columns] == ["seniors", "count"]


REFUSED = [
    ("SELECT SUM(age / (bmi - 20)) FROM patients", "division by an expression that can be zero"),
    ("SELECT SUM(age / 0) FROM patients", "division by zero"),
    ("SELECT SUM(bmi % 2) FROM patients", "operator does not exist: double precision % double precision"),
    ("SELECT SUM(CAST(problem AS INTEGER)) FROM patients",
     'CAST of text column "problem" to int is not supported inside an aggregate'),
    ("SELECT SUM(CAST(age AS TEXT)) FROM patients", "CAST to text is not supported inside an aggregate"),
    ("SELECT SUM(CAST(age * 1000000 AS SMALLINT)) FROM patients",
     "CAST to smallint inside an aggregate could overflow"),
    ("SELECT SUM(age * 1e300) FROM patients", "an expression inside an aggregate can exceed 2^53 in magnitude"),
    ("SELECT SUM(age * age * age * age * age * age * age * age * age) FROM patients",
     "an expression inside an aggregate can exceed 2^53 in magnitude"),
    ("SELECT SUM(LN(age)) FROM patients", "LN is not supported inside an aggregate"),
    ("SELECT SUM(CASE WHEN age / 0 > 1 THEN 1 ELSE 0 END) FROM patients", "division by zero"),
    ("SELECT SUM(CASE WHEN LN(age) > 1 THEN 1 ELSE 0 END) FROM patients",
     "comparisons in WHERE must involve a column"),
    ("SELECT SUM(CASE age WHEN 1 THEN 1 END) FROM patients",
     "CASE <value> WHEN ... is not supported inside an aggregate"),
    ("SELECT SUM(EXTRACT(EPOCH FROM dob)) FROM patients", 'EXTRACT("epoch") is not supported inside an aggregate'),
    ("SELECT SUM(age + ssn) FROM patients", 'permission denied for column "ssn"'),
]  # fmt: skip


@pytest.mark.parametrize(("sql", "message"), REFUSED, ids=[r[0][:50] for r in REFUSED])
def test_expression_refusals(sql: str, message: str, health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze(sql, health_policy)
    assert info.value.message == message
