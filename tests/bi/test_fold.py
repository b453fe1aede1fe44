"""Constant folding (dpsql/analyze/fold.py): PostgreSQL's results, and its errors before anything runs."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlglot import exp

from dpsql.analyze.fold import Interval, add_interval, fold_constants, parse_interval
from dpsql.analyze.parse import parse_statement
from dpsql.errors import Error

pytestmark = pytest.mark.unit

NOW = dt.datetime(2024, 3, 31, 12, 30, 15, 250000)

CASES = [
    ("TO_DATE('2022-01-05', 'YYYY-MM-DD')", "CAST('2022-01-05' AS DATE)"),
    ("TO_TIMESTAMP('2022-01-05 10:20', 'YYYY-MM-DD HH24:MI')", "CAST('2022-01-05 10:20:00' AS TIMESTAMP)"),
    ("TO_TIMESTAMP(0)", "CAST('1970-01-01 00:00:00' AS TIMESTAMP)"),
    ("MAKE_DATE(2024, 2, 29)", "CAST('2024-02-29' AS DATE)"),
    ("make_timestamp(2024, 2, 29, 23, 59, 30.5)", "CAST('2024-02-29 23:59:30.500000' AS TIMESTAMP)"),
    ("NOW()", "CAST('2024-03-31 12:30:15.250000' AS TIMESTAMP)"),
    ("CURRENT_TIMESTAMP - INTERVAL '7 days'", "CAST('2024-03-24 12:30:15.250000' AS TIMESTAMP)"),
    ("LOCALTIMESTAMP + INTERVAL '1 hour'", "CAST('2024-03-31 13:30:15.250000' AS TIMESTAMP)"),
    ("CURRENT_DATE", "CAST('2024-03-31' AS DATE)"),
    ("CURRENT_DATE - INTERVAL '1 month'", "CAST('2024-02-29 00:00:00' AS TIMESTAMP)"),  # day clamped
    ("DATE '2022-01-31' + INTERVAL '1 month'", "CAST('2022-02-28 00:00:00' AS TIMESTAMP)"),
    ("DATE '2022-01-01' + INTERVAL '1 year 2 months 3 days'", "CAST('2023-03-04 00:00:00' AS TIMESTAMP)"),
    ("DATE '2022-01-01' + 31", "CAST('2022-02-01' AS DATE)"),
    ("'2022-01-01'::date", "CAST('2022-01-01' AS DATE)"),
    ("CAST(TIMESTAMP '2022-01-01 10:00' AS DATE)", "CAST('2022-01-01' AS DATE)"),
    ("CAST(DATE '2022-01-01' AS TIMESTAMP)", "CAST('2022-01-01 00:00:00' AS TIMESTAMP)"),
    ("INTERVAL '1 day' + DATE '2022-01-01'", "CAST('2022-01-02 00:00:00' AS TIMESTAMP)"),
]


@pytest.mark.parametrize(("sql", "expected"), CASES, ids=[c[0] for c in CASES])
def test_folds_to_a_literal(sql: str, expected: str) -> None:
    tree = parse_statement(f"SELECT COUNT(*) FROM t WHERE d > {sql}")
    folded = fold_constants(tree, NOW)
    assert folded.args["where"].this.expression.sql(dialect="postgres") == expected


def test_columns_are_left_alone() -> None:
    tree = parse_statement("SELECT COUNT(*) FROM t WHERE d + INTERVAL '1 day' > NOW()")
    assert fold_constants(tree, NOW).sql(dialect="postgres") == (
        "SELECT COUNT(*) FROM t WHERE d + INTERVAL '1 DAY' > CAST('2024-03-31 12:30:15.250000' AS TIMESTAMP)"
    )


ERRORS = [
    ("MAKE_DATE(2022, 13, 1)", "22008", "date field value out of range: 2022-13-01"),
    ("TO_DATE('2022-13-45', 'YYYY-MM-DD')", "22007", 'invalid input syntax for type date: "2022-13-45"'),
    ("TO_TIMESTAMP('yesterday', 'YYYY-MM-DD')", "22007", 'invalid input syntax for type timestamp: "yesterday"'),
    ("DATE '9999-12-01' + INTERVAL '1 month'", "22008", "timestamp out of range"),
    ("DATE '2022-01-01' + INTERVAL '1 fortnight'", "22007", 'invalid input syntax for type interval: "1 fortnight"'),
]


@pytest.mark.parametrize(("sql", "sqlstate", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_invalid_constants_raise_postgres_errors(sql: str, sqlstate: str, message: str) -> None:
    tree = parse_statement(f"SELECT COUNT(*) FROM t WHERE d > {sql}")
    with pytest.raises(Error) as info:
        fold_constants(tree, NOW)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)


def test_interval_arithmetic_is_postgres() -> None:
    assert parse_interval("1 mon 2 days 03:00:00") == Interval(1, 2, 3 * 3_600_000_000)
    assert add_interval(dt.datetime(2024, 1, 31), Interval(months=1)) == dt.datetime(2024, 2, 29)
    assert add_interval(dt.datetime(2024, 3, 31), -Interval(months=1, days=1)) == dt.datetime(2024, 2, 28)


# --- DATE_TRUNC of a constant (issue #29 item 6: Metabase's relative date filters) ----------------------

TRUNCS = [
    # Metabase's "previous 30 years" filter: the start of the year 30 years ago
    ("DATE_TRUNC('year', NOW() + INTERVAL '-30 year')", "CAST('1994-01-01 00:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('month', NOW() + INTERVAL '-3 month')", "CAST('2023-12-01 00:00:00' AS TIMESTAMP)"),
    ("date_trunc('quarter', CAST(now() AS timestamp))", "CAST('2024-01-01 00:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('week', CURRENT_DATE)", "CAST('2024-03-25 00:00:00' AS TIMESTAMP)"),  # ISO week: Monday
    ("DATE_TRUNC('day', NOW())", "CAST('2024-03-31 00:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('hour', NOW())", "CAST('2024-03-31 12:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('minute', NOW())", "CAST('2024-03-31 12:30:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('second', NOW())", "CAST('2024-03-31 12:30:15' AS TIMESTAMP)"),
    ("DATE_TRUNC('milliseconds', NOW())", "CAST('2024-03-31 12:30:15.250000' AS TIMESTAMP)"),
    ("DATE_TRUNC('mon', NOW())", "CAST('2024-03-01 00:00:00' AS TIMESTAMP)"),  # PostgreSQL's abbreviations
    ("DATE_TRUNC('decade', NOW())", "CAST('2020-01-01 00:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('century', DATE '2000-05-01')", "CAST('1901-01-01 00:00:00' AS TIMESTAMP)"),
    ("DATE_TRUNC('millennium', NOW())", "CAST('2001-01-01 00:00:00' AS TIMESTAMP)"),
    # a truncated constant cast to date (Metabase on a date column)
    ("CAST(DATE_TRUNC('year', NOW() + INTERVAL '-30 year') AS date)", "CAST('1994-01-01' AS DATE)"),
    (
        "DATE_TRUNC('month', TO_DATE('2022-05-17', 'YYYY-MM-DD')) + INTERVAL '1 month'",
        "CAST('2022-06-01 00:00:00' AS TIMESTAMP)",
    ),
]


@pytest.mark.parametrize(("sql", "expected"), TRUNCS, ids=[t[0] for t in TRUNCS])
def test_date_trunc_of_a_constant_folds(sql: str, expected: str) -> None:
    tree = parse_statement(f"SELECT COUNT(*) FROM t WHERE d >= {sql}")
    assert fold_constants(tree, NOW).args["where"].this.expression.sql(dialect="postgres") == expected


LEFT_ALONE = [
    "DATE_TRUNC('year', d)",  # a column: a key or a filter for the analyzer, not a constant
    "DATE_TRUNC(u, NOW())",  # a bare name (sqlglot reads it as a unit word): not PostgreSQL's unit
    "DATE_TRUNC('fortnight', NOW())",  # no such unit: the analyzer's error, as before
    "DATE_TRUNC('timezone', NOW())",  # a unit date_trunc does not support
    "DATE_TRUNC('year', NOW(), 'Europe/Paris')",  # a time zone: not folded
]


@pytest.mark.parametrize("sql", LEFT_ALONE)
def test_date_trunc_that_is_not_a_constant_is_left_alone(sql: str) -> None:
    tree = parse_statement(f"SELECT COUNT(*) FROM t WHERE d >= {sql}")
    folded = fold_constants(tree, NOW).args["where"].this.expression
    assert isinstance(folded, exp.TimestampTrunc | exp.DateTrunc), folded.sql(dialect="postgres")
