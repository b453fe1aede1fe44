"""Every class of refused SQL, with its exact SQLSTATE and message; and what is accepted."""

from __future__ import annotations

import pytest

from dpsql.analyze import analyze, infer_parameter_types, parse_statement
from dpsql.errors import Error
from dpsql.policy import Policy

REFUSALS = [
    # (sql, sqlstate, message)
    ("SELECT * FROM patients", "42803", "SELECT * would release individual rows"),
    ("SELECT p.* FROM patients p", "42803", "SELECT * would release individual rows"),
    (
        "SELECT age FROM patients",
        "42803",
        'column "patients.age" must appear in the GROUP BY clause or be used in an aggregate function',
    ),
    (
        "SELECT sex, age, COUNT(*) FROM patients GROUP BY sex",
        "42803",
        'column "patients.age" must appear in the GROUP BY clause or be used in an aggregate function',
    ),
    ("SELECT SUM(name) FROM patients", "42501", 'permission denied for column "name"'),
    (
        "SELECT COUNT(*) FROM patients WHERE ssn = '000-00-0009'",
        "42501",
        'permission denied for column "ssn"',
    ),
    ("SELECT name, COUNT(*) FROM patients GROUP BY name", "42501", 'permission denied for column "name"'),
    ("SELECT COUNT(height) FROM patients", "42703", 'column "height" does not exist'),
    ("SELECT COUNT(*) FROM doctors", "42P01", 'relation "doctors" does not exist'),
    ("SELECT COUNT(*) FROM secret.patients", "42P01", 'relation "secret.patients" does not exist'),
    ("SELECT COUNT(*) FROM patients WHERE q.age > 3", "42P01", 'missing FROM-clause entry for table "q"'),
    ("INSERT INTO patients (age) VALUES (1)", "25006", "cannot execute INSERT in a read-only transaction"),
    ("UPDATE patients SET age = 1", "25006", "cannot execute UPDATE in a read-only transaction"),
    ("DELETE FROM patients", "25006", "cannot execute DELETE in a read-only transaction"),
    ("DROP TABLE patients", "25006", "cannot execute DROP in a read-only transaction"),
    ("CREATE TABLE x (a int)", "25006", "cannot execute CREATE in a read-only transaction"),
    (
        "SELECT COUNT(*) INTO t2 FROM patients",
        "25006",
        "cannot execute SELECT INTO in a read-only transaction",
    ),
    (
        "SELECT COUNT(*) FROM patients; SELECT 1",
        "42601",
        "cannot insert multiple commands into a prepared statement",
    ),
    ("SELEC COUNT(*) FROM patients", "42601", 'syntax error at or near "SELEC"'),
    ("SELECT COUNT(* FROM patients", "42601", None),
    ("SELECT COUNT(*) FROM patients UNION SELECT COUNT(*) FROM patients", "0A000", "UNION is not supported"),
    (
        "SELECT COUNT(*) FROM patients EXCEPT SELECT COUNT(*) FROM patients",
        "0A000",
        "EXCEPT is not supported",
    ),
    ("SELECT COUNT(*) OVER () FROM patients", "0A000", "window functions are not supported"),
    (
        "SELECT sex, ROW_NUMBER() OVER (ORDER BY sex) FROM patients GROUP BY sex",
        "0A000",
        "window functions are not supported",
    ),
    (
        # analysed alone: the engine answers it as two DP queries (dpsql.outer.scalar)
        "SELECT COUNT(*) FROM patients WHERE age > (SELECT AVG(age) FROM patients)",
        "0A000",
        "a subquery in WHERE that aggregates protected rows is not supported",
    ),
    (
        "WITH x AS (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) SELECT SUM(n) FROM x",
        "0A000",
        'GROUP BY inside the subquery or CTE "x" is only supported on the privacy unit',
    ),
    (
        "SELECT COUNT(*) FROM patients a JOIN patients b ON a.zip = b.zip",
        "0A000",
        'self-joins of private table "patients" are not supported',
    ),
    ("SELECT foo(age) FROM patients GROUP BY age", "42883", "function foo() does not exist"),
    ("SELECT SUM(problem) FROM patients", "42883", "function sum(text) does not exist"),
    ("SELECT ARRAY_AGG(age) FROM patients", "0A000", "aggregate function array_agg is not supported yet"),
    ("SELECT COUNT(DISTINCT (zip, age)) FROM patients", "0A000", "COUNT(DISTINCT ...) is supported on one column only"),
    ("SELECT SUM(SUM(age)) FROM patients", "42803", "aggregate function calls cannot be nested"),
    (
        "SELECT COUNT(*) FROM patients WHERE COUNT(*) > 1",
        "42803",
        "aggregate functions are not allowed in WHERE",
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE age > 'abc'",
        "42804",
        'invalid input syntax for type bigint: "abc"',
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE dob > 'yesterday'",
        "42804",
        'invalid input syntax for type date: "yesterday"',
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE sex = 3",
        "42804",
        "operator does not exist: text compared with number",
    ),
    ("SELECT COUNT(*) FROM patients WHERE age = sex", "42804", "operator does not exist: bigint eq text"),
    ("SELECT COUNT(*) FROM patients WHERE age / 0 > 1", "22012", "division by zero"),
    ("SELECT COUNT(*) FROM patients WHERE 1 + 1 > 1", "0A000", "comparisons in WHERE must involve a column"),
    (
        "SELECT COUNT(*) FROM patients WHERE age / (bmi - 20) > 1",
        "0A000",
        "division by an expression that can be zero",
    ),
    ("SELECT COUNT(*) FROM patients WHERE LN(age) > 1", "0A000", "comparisons in WHERE must involve a column"),
    (
        "SELECT COUNT(*) FROM patients WHERE age LIKE '1%'",
        "42883",
        "operator does not exist: bigint ~~ unknown",
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE CAST(sex AS int) = 1",
        "0A000",
        'CAST of text column "sex" to int is not supported in WHERE',
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE age IN (SELECT age FROM patients)",
        "0A000",
        "a subquery over protected rows may only filter rows of the same person",
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE age",
        "42804",
        "argument of WHERE must be type boolean, not type bigint",
    ),
    ("SELECT COUNT(*) FROM patients FOR UPDATE", "0A000", "SELECT ... FOR UPDATE/SHARE is not supported"),
    ("SELECT 1", "0A000", "a query without FROM is not answered by the privacy engine"),
    ("SELECT COUNT(*) FROM patients GROUP BY lower(sex)", "0A000", "LOWER is not supported in GROUP BY"),
    ("SELECT COUNT(*) FROM patients GROUP BY 5", "42P10", "GROUP BY position 5 is not in select list"),
    ("SELECT COUNT(*) FROM patients ORDER BY 3", "42P10", "ORDER BY position 3 is not in select list"),
    (
        "SELECT COUNT(*) FROM patients GROUP BY ROLLUP (sex)",
        "0A000",
        "ROLLUP, CUBE and GROUPING SETS are not supported",
    ),
    (
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY age) FILTER (WHERE age > 3) FROM patients",
        "0A000",
        "FILTER is supported on COUNT, SUM, AVG and variance aggregates",
    ),
    ("SELECT SUM(age / (bmi - 20)) FROM patients", "0A000", "division by an expression that can be zero"),
    ("SELECT COUNT(*) FROM patients WHERE age IN ()", "42601", 'syntax error at or near ")"'),
    ("SELECT COUNT(*) FROM patients WHERE bmi < -1e400", "22003", 'value out of range: "1e400"'),
    (
        "SELECT COUNT(*) FROM patients WHERE bmi > 'NaN'",
        "42804",
        'invalid input syntax for type double precision: "NaN"',
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE dob < CAST('2020-13-45' AS date)",
        "42804",
        'invalid input syntax for type date: "2020-13-45"',
    ),
    ("SELECT COUNT(*) FROM patients TABLESAMPLE SYSTEM (10)", "0A000", "TABLESAMPLE is not supported"),
    ("SELECT COUNT(*) FROM patients LIMIT age", "0A000", "LIMIT must be a non-negative integer constant"),
    ("COPY patients TO STDOUT", "0A000", "COPY is not supported"),
    ("SET search_path = x", "0A000", "SET statements are not supported"),
    ("SELECT COUNT(*) FROM patients WHERE age > $1", "42P02", "there is no parameter $1"),
]


@pytest.mark.parametrize(("sql", "sqlstate", "message"), REFUSALS, ids=[r[0][:60] for r in REFUSALS])
def test_refusal(sql: str, sqlstate: str, message: str | None, health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze(sql, health_policy)
    assert info.value.sqlstate == sqlstate
    if message is not None:
        assert info.value.message == message


def test_refusal_has_hint_naming_the_fix(health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze("SELECT COUNT(height) FROM patients", health_policy)
    assert "age" in (info.value.hint or "") and "ssn" not in (info.value.hint or "")


def test_unbounded_sum_refused_with_policy_hint() -> None:
    from dpsql.dev.demo import demo_policy_path
    from dpsql.policy import load_policy

    adult = load_policy(demo_policy_path("adult"))
    with pytest.raises(Error) as info:
        analyze("SELECT SUM(native_country) FROM adult", adult)
    assert info.value.sqlstate == "42883"


ACCEPTED = [
    ("SELECT COUNT(*) FROM patients", ["count"]),
    ('SELECT count(*) AS "N", SUM(age) total FROM "patients"', ["N", "total"]),
    ("SELECT sex, COUNT(*), AVG(bmi) FROM patients GROUP BY sex", ["sex", "count", "avg"]),
    (
        "SELECT p.sex AS s, count(p.age) FROM public.patients AS p WHERE p.age BETWEEN 20 AND 30 GROUP BY s",
        ["s", "count"],
    ),
    (
        "SELECT COUNT(*) FROM patients WHERE problem IN ('Obesity', 'Asthma') AND NOT (sex = 'Male') "
        "OR bmi IS NULL OR ethnicity LIKE 'W%' OR dob >= '1990-01-01'",
        ["count"],
    ),
    (
        "SELECT problem, COUNT(*) FROM patients GROUP BY 1 HAVING COUNT(*) > 100 ORDER BY 2 DESC LIMIT 3 OFFSET 1",
        ["problem", "count"],
    ),
    ("SELECT SUM(age) / COUNT(*) AS mean, ROUND(AVG(age), 1) FROM patients", ["mean", "round"]),
    ("SELECT sex FROM patients GROUP BY sex", ["sex"]),
]


@pytest.mark.parametrize(("sql", "names"), ACCEPTED)
def test_accepted_and_named_like_postgres(sql: str, names: list[str], health_policy: Policy) -> None:
    plan = analyze(sql, health_policy)
    assert [o.column.name for o in plan.outputs] == names


def test_shared_count_is_measured_once(health_policy: Policy) -> None:
    plan = analyze("SELECT COUNT(bmi), AVG(bmi), SUM(bmi) FROM patients", health_policy)
    kinds = [(m.kind, m.column, m.centre) for m in plan.measures]
    assert kinds == [("count", "bmi", 0.0), ("sum", "bmi", 36.0), ("sum", "bmi", 0.0)]


def test_parameters_bind_as_literals(health_policy: Policy) -> None:
    with pytest.raises(Error, match="more placeholders than parameters"):
        analyze("SELECT COUNT(*) FROM patients WHERE age > %s", health_policy, None)
    with pytest.raises(Error, match="more placeholders than parameters"):
        analyze("SELECT COUNT(*) FROM patients WHERE age > %s", health_policy, ())
    plan = analyze("SELECT COUNT(*) FROM patients WHERE age > $1 AND sex = $2", health_policy, (30, "x'; DROP"))
    assert "x''; DROP" in plan.where.sql()


def test_parameter_types_inferred(health_policy: Policy) -> None:
    tree = parse_statement("SELECT COUNT(*) FROM patients WHERE age > $1 AND dob < $2 AND sex = $3 LIMIT $4")
    assert infer_parameter_types(tree, health_policy) == ["bigint", "date", "text", "bigint"]
