"""The post-processing sandbox: a fresh in-process DuckDB per statement, holding released rows only.

Every scalar and window function of the outer statement runs here, over the noisy rows the inner
queries released and the public tables of the policy, never over the data. The instance has no
file system or network access, loads no extension, uses one thread and a bounded amount of memory,
and its configuration is locked, so the outer SQL cannot reach anything but what it was given.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import re
from collections.abc import Sequence
from typing import Any

import duckdb
from sqlglot import exp

from dpsql.analyze.parse import dialect
from dpsql.backends import cancellable
from dpsql.errors import (
    DatatypeMismatch,
    DivisionByZero,
    Error,
    FeatureNotSupported,
    GroupingError,
    InvalidTextRepresentation,
    NumericValueOutOfRange,
    ProgramLimitExceeded,
    SyntaxError_,
    UndefinedColumn,
    UndefinedFunction,
    UndefinedTable,
)
from dpsql.pgtypes import PgType

log = logging.getLogger(__name__)

#: Sandbox settings: no file system, no extensions, one thread, bounded memory; locked afterwards.
CONFIG: dict[str, str | bool | int] = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "threads": 1,
    "memory_limit": "256MB",
    "max_temp_directory_size": "0KB",
    "lock_configuration": True,
}
#: Most rows a public table may bring into the sandbox.
MAX_PUBLIC_ROWS = 100_000
#: Most rows the outer statement may return.
MAX_OUTPUT_ROWS = 1_000_000

_TO_DUCKDB: dict[str, str] = {
    "bigint": "BIGINT",
    "integer": "INTEGER",
    "smallint": "SMALLINT",
    "timestamp with time zone": "TIMESTAMP",  # UTC instants, released again as timestamp
    "double precision": "DOUBLE",
    "numeric": "DECIMAL(38,10)",
    "text": "VARCHAR",
    "date": "DATE",
    "timestamp": "TIMESTAMP",
    "boolean": "BOOLEAN",
}
_INTEGERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER"}


def pg_type(duck: str) -> PgType | None:
    """The PostgreSQL type a sandbox result type is released as (None: released as text)."""
    name = duck.upper()
    if name in _INTEGERS:
        return "bigint"
    if name in ("HUGEINT", "UBIGINT", "UHUGEINT") or name.startswith("DECIMAL"):
        return "numeric"  # PostgreSQL's sum(bigint) is numeric too
    if name in ("DOUBLE", "FLOAT"):
        return "double precision"
    if name == "VARCHAR":
        return "text"
    if name == "DATE":
        return "date"
    if name in ("TIMESTAMP", "TIMESTAMP_NS", "TIMESTAMP_MS", "TIMESTAMP_S"):
        return "timestamp"
    if name == "BOOLEAN":
        return "boolean"
    return None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Sandbox:
    """One fresh, locked-down in-memory DuckDB; closed after the statement."""

    def __init__(self) -> None:
        self.con = duckdb.connect(":memory:", config=dict(CONFIG))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.con.close()

    def load(self, table: str, columns: Sequence[tuple[str, PgType]], rows: Sequence[tuple[Any, ...]]) -> None:
        """Create ``table`` with PostgreSQL-typed columns and insert ``rows`` (none for a dry run)."""
        cols = ", ".join(f"{_quote(n)} {_TO_DUCKDB.get(t, 'VARCHAR')}" for n, t in columns)
        self.con.execute(f"CREATE TABLE {_quote(table)} ({cols})")
        if rows:
            marks = ", ".join("?" for _ in columns)
            try:
                self.con.executemany(f"INSERT INTO {_quote(table)} VALUES ({marks})", [list(r) for r in rows])
            except duckdb.Error as exc:
                raise translate(exc) from None

    def describe(self, sql: str) -> list[tuple[str, str]]:
        """(name, DuckDB type) of each output column, without running the statement."""
        try:
            return [(str(r[0]), str(r[1])) for r in self.con.execute(f"DESCRIBE {sql}").fetchall()]
        except duckdb.Error as exc:
            raise translate(exc) from None

    def run(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            with cancellable(self.con.interrupt):
                cursor = self.con.execute(sql)
                rows = cursor.fetchmany(MAX_OUTPUT_ROWS + 1)
        except duckdb.Error as exc:
            raise translate(exc) from None
        if len(rows) > MAX_OUTPUT_ROWS:
            raise ProgramLimitExceeded(f"the result has more than {MAX_OUTPUT_ROWS} rows")
        return rows


def outer_sql(tree: exp.Expr) -> str:
    """The outer statement in DuckDB's dialect (PostgreSQL semantics kept by sqlglot's transpiler)."""
    return tree.sql(dialect=dialect("duckdb"))


_NOT_FOUND = re.compile(r'Referenced column "([^"]*)" not found')
_TABLE = re.compile(r"Table with name (\S+) does not exist")
_FUNCTION = re.compile(r"(?:Scalar|Aggregate|Table)? ?Function with name (\S+) does not exist")


def translate(exc: duckdb.Error) -> Error:
    """A sandbox error as a PostgreSQL error. The sandbox holds released rows and public tables only,
    so its messages can reveal nothing else; they are still reduced to PostgreSQL's wording."""
    text = str(exc).split("\n", 1)[0]
    log.debug("post-processing sandbox: %s", text)
    if isinstance(exc, duckdb.ParserException):
        return SyntaxError_("syntax error in the post-processing query")
    if isinstance(exc, duckdb.CatalogException):
        if match := _TABLE.search(text):
            return UndefinedTable(f'relation "{match.group(1)}" does not exist')
        if match := _FUNCTION.search(text):
            return UndefinedFunction(f"function {match.group(1)} does not exist")
        return FeatureNotSupported("the post-processing query uses an unsupported object")
    if isinstance(exc, duckdb.BinderException):
        if match := _NOT_FOUND.search(text):
            return UndefinedColumn(f'column "{match.group(1)}" does not exist')
        if "GROUP BY" in text or "aggregate" in text:
            return GroupingError("the post-processing query mixes aggregates and plain columns")
        if "No function matches" in text:
            return UndefinedFunction("function does not exist for the given argument types")
        return DatatypeMismatch("the post-processing query cannot be bound to the released columns")
    if isinstance(exc, duckdb.ConversionException):
        return InvalidTextRepresentation("invalid input syntax in the post-processing query")
    if isinstance(exc, duckdb.OutOfRangeException):
        return NumericValueOutOfRange("value out of range in the post-processing query")
    if "Division by zero" in text:
        return DivisionByZero("division by zero")
    if isinstance(exc, duckdb.InterruptException):
        from dpsql.errors import QueryCanceled

        return QueryCanceled("canceling statement due to user request")
    if isinstance(exc, duckdb.OutOfMemoryException):
        return ProgramLimitExceeded("the post-processing query needs too much memory")
    if isinstance(exc, duckdb.PermissionException):
        return FeatureNotSupported("the post-processing query may not read files")
    return FeatureNotSupported("the post-processing query is not supported")


def release_value(value: Any, type_name: PgType | None) -> Any:
    """A sandbox value as the released Python value of its PostgreSQL type."""
    if value is None:
        return None
    if type_name is None:
        return str(value)
    if type_name == "numeric" and isinstance(value, int):
        return decimal.Decimal(value)
    if type_name == "timestamp" and isinstance(value, dt.datetime):
        return value.replace(tzinfo=None)
    return value
