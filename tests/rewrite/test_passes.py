"""Rewrite passes: SQL text in, SQL text out."""

from __future__ import annotations

from dpsql.analyze import analyze
from dpsql.policy import Policy
from dpsql.release.apply import centre_rows
from dpsql.rewrite import to_sql


def test_count_with_where(health_policy: Policy) -> None:
    plan = analyze("SELECT COUNT(*) FROM patients WHERE problem = 'Obesity' AND age >= '30'", health_policy)
    assert to_sql(plan, "postgres") == (
        'SELECT COUNT(*) AS m0 FROM "patients" AS "patients" '
        'WHERE "patients"."problem" = \'Obesity\' AND "patients"."age" >= 30'
    )


def test_sum_is_clamped_and_avg_centred(health_policy: Policy) -> None:
    plan = analyze("SELECT sex, SUM(age), AVG(age) FROM patients GROUP BY sex", health_policy)
    age = '"patients"."age"'
    clamp = f"CASE WHEN {age} < 0 THEN 0 WHEN {age} > 110 THEN 110 ELSE {age} END"
    assert to_sql(plan, "postgres") == (
        f'SELECT "patients"."sex" AS k0, COALESCE(SUM({clamp}), 0) AS m0, COALESCE(SUM({clamp}), 0) AS m1, '
        'COUNT(*) AS m2, COUNT(*) AS z1 FROM "patients" AS "patients" GROUP BY "patients"."sex"'
    )
    # AVG's centred sum is folded in after the query: Σx − 55·z1, exactly Σ(x − 55)
    rows = centre_rows(plan, [("F", 700, 700, 10, 10)])
    assert rows == [("F", 700, 700 - 550, 10)]


def test_variance_centres_inside_the_square(health_policy: Policy) -> None:
    sql = to_sql(analyze("SELECT var_pop(age) FROM patients", health_policy), "postgres")
    assert "END - 55 AS BIGINT) * CAST(" in sql and "COUNT(*) AS z" in sql


def test_real_sums_cast_before_clamping(health_policy: Policy) -> None:
    plan = analyze("SELECT SUM(bmi) FROM patients", health_policy)
    sql = to_sql(plan, "duckdb")
    assert 'CAST("patients"."bmi" AS DOUBLE)' in sql and "THEN 12 WHEN" in sql


def test_dates_become_typed_literals(health_policy: Policy) -> None:
    plan = analyze("SELECT COUNT(*) FROM patients WHERE dob BETWEEN '1990-01-01' AND DATE '1999-12-31'", health_policy)
    assert "BETWEEN CAST('1990-01-01' AS DATE) AND CAST('1999-12-31' AS DATE)" in to_sql(plan, "postgres")


def test_clamping_keeps_null_null(health_policy: Policy, health_duckdb) -> None:
    """NULL bmi must not be counted as the lower bound (GREATEST would do that in PostgreSQL)."""
    plan = analyze("SELECT SUM(bmi) FROM patients WHERE bmi IS NULL", health_policy)
    _, rows = health_duckdb.execute(to_sql(plan, "duckdb"))
    assert rows == [(0,)] or rows == [(0.0,)]
