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


@pytest.mark.parametrize(("view_sql", "flat_sql"), EQUIVALENT)
def test_views_measure_what_the_inlined_query_measures(
    view_sql: str, flat_sql: str, health_policy: Policy, health_duckdb: Backend
) -> None:
    via_view = health_duckdb.execute(to_sql(analyze(view_sql, health_policy), "duckdb"))[1]
    flat = health_duckdb.execute(to_sql(analyze(flat_sql, health_policy), "duckdb"))[1]
    assert via_view == flat


REFUSED = [
    ("WITH x AS (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) SELECT SUM(n) FROM x", "0A000",
     'GROUP BY inside the subquery or CTE "x" is not supported'),
    ("SELECT COUNT(*) FROM (SELECT DISTINCT zip FROM patients) t", "0A000",
     'DISTINCT inside the subquery or CTE "t" is not supported'),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients LIMIT 5) t", "0A000",
     'LIMIT inside the subquery or CTE "t" is not supported'),
    ("SELECT COUNT(*) FROM (SELECT age * 2 AS a FROM patients) t", "0A000",
     'the subquery or CTE "t" may only select columns'),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients) t WHERE t.bmi > 3", "42703", "column t.bmi does not exist"),
    ("WITH x AS (SELECT ssn FROM patients) SELECT COUNT(ssn) FROM x", "42501", 'permission denied for column "ssn"'),
    ("WITH RECURSIVE x AS (SELECT 1) SELECT COUNT(*) FROM x", "0A000", "WITH RECURSIVE is not supported"),
    ("SELECT COUNT(*) FROM (SELECT age FROM patients UNION ALL SELECT age FROM patients) t", "0A000",
     'the subquery "t" must be a plain SELECT'),
    ("SELECT COUNT(*) FROM (SELECT a.age FROM patients a JOIN patients b ON a.zip = b.zip) t", "0A000",
     'JOIN inside the subquery or CTE "t" is not supported'),
]  # fmt: skip


@pytest.mark.parametrize(("sql", "sqlstate", "message"), REFUSED, ids=[r[0][:60] for r in REFUSED])
def test_view_refusals(sql: str, sqlstate: str, message: str, health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze(sql, health_policy)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)
