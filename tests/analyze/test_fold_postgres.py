"""Constant folding checked against PostgreSQL itself: each expression and its folded literal are
evaluated on the real server the tests start, and must agree in value and type (or both fail with
the same SQLSTATE). Then the same folded literals on DuckDB give PostgreSQL's values too."""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterator

import duckdb
import psycopg
import pytest
import sqlglot

from dpsql.analyze.fold import fold_constants
from dpsql.analyze.parse import parse_statement
from dpsql.errors import Error

NOW = dt.datetime(2024, 3, 31, 12, 30, 15)

#: (expression as written, the same in PostgreSQL's spelling when it differs, or None)
CASES: list[tuple[str, str | None]] = [
    ("0.06 - 0.01", None),
    ("0.06 + 0.01", None),
    ("1 + 10", None),
    ("24 - 1", None),
    ("7 / 2", None),
    ("-7 / 2", None),
    ("-7 % 3", None),
    ("7 % -3", None),
    ("7.0 / 2", None),
    ("1.0 / 3", None),
    ("1 / 3.0", None),
    ("2 / 3.000", None),
    ("1 / 7.00", None),
    ("0.0001 / 3", None),
    ("123456789.123 / 0.007", None),
    ("10.5 % 3", None),
    ("-10.25 % 3", None),
    ("1.5 * 2", None),
    ("0.1 * 0.25", None),
    ("100 * 1000", None),
    ("1e3 + 1", None),
    ("1.5e2 * 2", None),
    ("2.5e-3 - 1", None),
    ("3000000000 - 2999999999", None),
    ("(3000000000 - 2999999999) * 2147483647", None),
    ("12345678901234567890 / 7", None),
    ("-2147483648 / -1", None),
    ("'1.5'::numeric * 2", None),
    ("'12'::int + 1", None),
    ("2::float8 * 3", None),
    ("0.1::float8 + 0.2", None),
    ("1::float8 / 3", None),
    ("CAST(2.5 AS INT)", None),
    ("CAST(-2.5 AS INT)", None),
    ("CAST(2.5::float8 AS INT)", None),
    ("CAST(3.5::float8 AS BIGINT)", None),
    ("CAST(1 / 3::float8 AS NUMERIC)", None),
    ("CAST(123.456 AS NUMERIC(5,2))", None),
    ("CAST(7 AS SMALLINT) + CAST(8 AS SMALLINT)", None),
    ("-(1 + 2)", None),
    ("-(0.5 * 3)", None),
    ("- - 4", None),
    ("2147483647 + 1", None),  # 22003
    ("9223372036854775807 + 1", None),  # 22003
    ("CAST(-2147483648 AS INT) / -1", None),  # 22003
    ("100000 * 100000", None),  # 22003
    ("CAST(32767 AS SMALLINT) + CAST(1 AS SMALLINT)", None),  # 22003
    ("1 / 0", None),  # 22012
    ("1.0 / 0", None),
    ("1::float8 / 0", None),
    ("5 % 0", None),
    ("1e308::float8 * 10", None),  # overflow
    ("1e-300::float8 * 1e-300::float8", None),  # underflow
    ("CAST(1234.5 AS NUMERIC(5,2))", None),  # numeric field overflow
    ("CAST(3000000000 AS INT)", None),
    ("5::float8 % 2", None),  # 42883
    ("DATE '1994-01-01' + INTERVAL '1' YEAR", None),
    ("date '1998-12-01' - interval '90' day (3)", "date '1998-12-01' - interval '90' day"),
    ("DATE '1995-09-01' + INTERVAL '1' MONTH", None),
    ("DATE '1994-01-31' + INTERVAL '1 month'", None),
    ("DATE '1995-01-01' - DATE '1994-01-01'", None),
    ("DATE '1994-01-01' + INTERVAL '1 day' * 7", None),
    ("DATE '1994-01-01' + 3 * INTERVAL '2 hours'", None),
    ("DATE '1994-01-01' + (1 + 1)", None),
    ("DATE '1994-01-01' + 365 * 2", None),
]


def _folded(expression: str) -> str:
    tree = parse_statement(f"SELECT COUNT(*) FROM t WHERE d > {expression}")
    return fold_constants(tree, NOW).args["where"].this.expression.sql(dialect="postgres")


def _pg(conn: psycopg.Connection[tuple[object, ...]], expression: str) -> tuple[object, ...] | str:
    """(text value, type) of ``expression`` on PostgreSQL, or the SQLSTATE of its error."""
    try:
        row = conn.execute(f"SELECT ({expression})::text, pg_typeof({expression})::text").fetchone()
    except psycopg.Error as exc:
        conn.rollback()
        return str(exc.sqlstate)
    assert row is not None
    conn.rollback()
    return tuple(row)


@pytest.fixture(scope="module")
def pg(pg_dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(pg_dsn) as conn:
        yield conn


@pytest.mark.parametrize(("expression", "spelled"), CASES, ids=[c[0] for c in CASES])
def test_folded_constant_is_postgres_own(
    pg: psycopg.Connection[tuple[object, ...]], expression: str, spelled: str | None
) -> None:
    expected = _pg(pg, spelled or expression)
    try:
        folded = _folded(expression)
    except Error as exc:
        assert exc.sqlstate == expected, f"{expression}: dpsql {exc.sqlstate} {exc}, PostgreSQL {expected}"
        return
    assert isinstance(expected, tuple), f"{expression}: PostgreSQL fails with {expected}, dpsql folds to {folded}"
    got = _pg(pg, folded)
    if expected[1] in ("timestamp without time zone", "date"):  # what the analyzer compares: the instant
        assert got[0] == expected[0] and got[1] in ("timestamp without time zone", "date"), (expression, folded)
    else:
        assert got == expected, f"{expression} -> {folded}: PostgreSQL {expected}, folded {got}"
    # DuckDB reads the folded literal as PostgreSQL's value (its own 7 / 2 is 3.5, its 1e3 a double)
    with duckdb.connect() as duck:
        row = duck.execute(f"SELECT {sqlglot.transpile(folded, read='postgres', write='duckdb')[0]}").fetchone()
    assert row is not None
    assert _same(row[0], str(expected[0])), f"{expression} -> {folded}: DuckDB {row[0]!r}, PostgreSQL {expected[0]}"


def _same(duck: object, text: str) -> bool:
    if isinstance(duck, dt.date):
        return str(duck) == text.removesuffix(" 00:00:00") or str(duck) == text
    return decimal.Decimal(str(duck)) == decimal.Decimal(text)
