"""CTEs and FROM-subqueries that filter and rename rows are inlined; others are refused."""

from __future__ import annotations

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend
from dpsql.errors import Error
from dpsql.policy import Policy
from dpsql.rewrite import to_sql

EQUIVALENT = [
    (
        "WITH adults AS (SELECT age, sex AS s FROM patients WHERE age >= 18) "
        "SELECT s, COUNT(*) AS n, AVG(age) FROM adults WHERE s = 'Male' GROUP BY s ORDER BY n",
        "SELECT sex AS s, COUNT(*) AS n, AVG(age) FROM patients WHERE sex = 'Male' AND age >= 18 GROUP BY sex",
    ),
    (
        "SELECT COUNT(*) FROM (SELECT * FROM patients WHERE bmi > 30) AS obese WHERE obese.age > 40",
        "SELECT COUNT(*) FROM patients WHERE age > 40 AND bmi > 30",
    ),
    (
        "WITH a AS (SELECT age, problem FROM patients WHERE age > 10), "
        "b AS (SELECT age FROM a WHERE problem = 'Obesity') SELECT SUM(age) FROM b",
        "SELECT SUM(age) FROM patients WHERE problem = 'Obesity' AND age > 10",
    ),
]


CLINIC_EQUIVALENT = [
    (  # ibis: a filter in a FROM-subquery whose WHERE is one bare boolean column of the inner alias
        'SELECT "t1"."department", COUNT(*) FROM (SELECT * FROM "visits" AS "t0" WHERE "t0"."urgent") AS "t1" '
        "GROUP BY 1",
        "SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department",
    ),
    (  # ibis / Looker: a join with a public table inside a FROM-subquery is the flat join
        'SELECT "t4"."building", COUNT(*), SUM("t4"."c") FROM (SELECT "t2"."cost" AS "c", "t3"."building" '
        'FROM "visits" AS "t2" INNER JOIN "departments" AS "t3" ON "t2"."department" = "t3"."name" '
        'WHERE "t2"."urgent") AS "t4" GROUP BY 1',
        "SELECT t3.building, COUNT(*), SUM(t2.cost) FROM visits t2 JOIN departments t3 ON t2.department = t3.name "
        "WHERE t2.urgent GROUP BY t3.building",
    ),
]


@pytest.mark.parametrize(("view_sql", "flat_sql"), CLINIC_EQUIVALENT)
def test_ibis_views_measure_what_the_flat_query_measures(view_sql: str, flat_sql: str) -> None:
    from dpsql.backends import open_backend
    from dpsql.dev.demo import demo_policy_path, load_demo
    from dpsql.policy import load_policy

    policy = load_policy(demo_policy_path("clinic"))
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    via_view = backend.execute(to_sql(analyze(view_sql, policy), "duckdb"))[1]
    flat = backend.execute(to_sql(analyze(flat_sql, policy), "duckdb"))[1]
    backend.close()
    via, expected = dict((r[0], r[1:]) for r in via_view), dict((r[0], r[1:]) for r in flat)
    assert via.keys() == expected.keys()
    for key, values in via.items():  # float sums: summation order differs in the last bits
        assert values == pytest.approx(expected[key], rel=1e-9), key


@pytest.mark.parametrize(("view_sql", "flat_sql"), EQUIVALENT)
def test_views_measure_what_the_inlined_query_measures(
    view_sql: str, flat_sql: str, health_policy: Policy, health_duckdb: Backend
) -> None:
    via_view = health_duckdb.execute(to_sql(analyze(view_sql, health_policy), "duckdb"))[1]
    flat = health_duckdb.execute(to_sql(analyze(flat_sql, health_policy), "duckdb"))[1]
    assert via_view == flat


REFUSED = [
    ("WITH x AS (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) SELECT SUM(n) FROM x", "0A000",
     'GROUP BY inside the subquery or CTE "x" is only supported on the privacy unit'),
    ("SELECT COUNT(*) FROM (SELECT DISTINCT zip FROM patients) t", "0A000",
     'DISTINCT inside the subquery or CTE "t" is not supported'),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients LIMIT 5) t", "0A000",
     'LIMIT inside the subquery or CTE "t" is not supported'),
    ("SELECT COUNT(*) FROM (SELECT age, COUNT(*) OVER () AS a FROM patients) t", "0A000",
     'the subquery or CTE "t" may only select columns and row-level expressions'),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients) t WHERE t.bmi > 3", "42703", "column t.bmi does not exist"),
    ("WITH x AS (SELECT ssn FROM patients) SELECT SUM(ssn) FROM x", "42501", 'permission denied for column "ssn"'),
    ("WITH RECURSIVE x AS (SELECT 1) SELECT COUNT(*) FROM x", "0A000", "WITH RECURSIVE is not supported"),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients UNION ALL SELECT age FROM patients) t", "0A000",
     'the subquery "t" must be a plain SELECT'),
    ("SELECT COUNT(*) FROM (SELECT a.age FROM patients a JOIN patients b ON a.zip = b.zip) t", "0A000",
     'self-joins of private table "patients" are not supported'),
    ("SELECT COUNT(*) FROM (SELECT * FROM patients a JOIN patients b ON a.zip = b.zip) t", "0A000",
     'the subquery or CTE "t" with a JOIN may only select columns and named row-level expressions'),
    ("SELECT COUNT(*) FROM (SELECT a.age FROM patients a JOIN patients b ON a.zip = b.zip GROUP BY a.age) t",
     "0A000", 'GROUP BY inside the subquery or CTE "t" is only supported on the privacy unit'),
]  # fmt: skip


@pytest.mark.parametrize(("sql", "sqlstate", "message"), REFUSED, ids=[r[0][:60] for r in REFUSED])
def test_view_refusals(sql: str, sqlstate: str, message: str, health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze(sql, health_policy)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)
