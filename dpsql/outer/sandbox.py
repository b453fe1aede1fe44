"""The post-processing sandbox: a fresh in-process DuckDB per statement, holding released rows only.

Every scalar and window function of the outer statement runs here, over the noisy rows the inner
queries released and the public tables of the policy, never over the data. The instance has no
file system or network access, loads no extension, uses one thread and a bounded amount of memory,
and its configuration is locked, so the outer SQL cannot reach anything but what it was given.

Resources (the outer statement is free once its inner queries are released, or cached, so it must
not be a way to take the server's memory or a core): the statement's deadline interrupts the sandbox
(57014, as a database statement); the result is fetched in batches and refused once the Python objects
it holds pass :data:`MAX_RESULT_BYTES` (54000) or :data:`MAX_OUTPUT_ROWS`; recursive CTEs and functions
that make rows or sized values are refused before anything is charged
(:func:`dpsql.outer.shapes.refuse_sized`). Sandboxes that hold released rows are admitted process-wide
and run on low-priority threads (:mod:`dpsql.outer.admission`): a bounded number at once (their memory
capped in total), at most one per analyst, their CPU time charged to the analyst; the statement's worker
thread waits for its sandbox while holding the analyst's worker slot
(:class:`dpsql.server.limits.WorkSlots`), and the server's cancel or timeout reaches the sandbox through
:func:`dpsql.backends.cancellable`, like a backend statement. None of this reads un-noised data: whether
a limit is hit depends on the released rows and the SQL only (post-processing).

Not bounded here: DuckDB does not count string values against ``memory_limit``, so concatenation
doubling a released value through many nested sub-queries can still allocate before the byte cap
sees a row; only a separate process with an address-space limit would bound that.
Ordinary DP results get no byte cap: the backend has materialised their rows before one could act,
and their row count is bounded by partition selection and the domain caps.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import duckdb
from sqlglot import exp

from dpsql.analyze.parse import dialect
from dpsql.backends import cancellable, timed_out
from dpsql.errors import (
    DatatypeMismatch,
    DivisionByZero,
    Error,
    FeatureNotSupported,
    GroupingError,
    InvalidTextRepresentation,
    NumericValueOutOfRange,
    ProgramLimitExceeded,
    QueryCanceled,
    SyntaxError_,
    UndefinedColumn,
    UndefinedFunction,
    UndefinedTable,
)
from dpsql.pgtypes import PgType

log = logging.getLogger(__name__)

#: Sandbox settings: no file system, no extensions, one thread, bounded memory; locked afterwards
#: (:data:`_SESSION`).
CONFIG: dict[str, str | bool | int] = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "threads": 1,
    "memory_limit": "128MB",
    "max_temp_directory_size": "0KB",
}
#: Run once before the outer SQL can: no progress bar on the server's stdout, then the lock.
_SESSION = ("SET enable_progress_bar = false", "SET lock_configuration = true")
#: Most rows a public table may bring into the sandbox.
MAX_PUBLIC_ROWS = 100_000
#: Most rows the outer statement may return.
MAX_OUTPUT_ROWS = 1_000_000
#: Most bytes of Python objects the outer statement's result may hold in the server (counted while
#: fetching: see :func:`value_bytes`).
MAX_RESULT_BYTES = 64 * 1024 * 1024
#: Rows fetched at a time, at most (fewer once rows are seen to be large).
FETCH_ROWS = 1024

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


def value_bytes(value: Any) -> int:
    """Memory a released value (or row) holds in the server: the size of its Python object, summed over
    the items of a row, list or struct. Shared objects (None, small integers) are counted each time, so
    this errs high: a text of two characters costs 51 bytes, not 2 (counting text lengths only let a
    1,000,000-row result of short texts pass the cap while it held 1.3 GB)."""
    if isinstance(value, list | tuple):
        return sys.getsizeof(value) + sum(value_bytes(v) for v in value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(value_bytes(k) + value_bytes(v) for k, v in value.items())
    return sys.getsizeof(value)


class Sandbox:
    """One fresh, locked-down in-memory DuckDB; closed after the statement.

    ``deadline`` (:func:`time.monotonic` seconds; None: none) is the statement's: :meth:`run` and
    :meth:`describe` are interrupted there (57014). ``max_bytes`` caps the fetched result (54000;
    default :data:`MAX_RESULT_BYTES`)."""

    def __init__(self, deadline: float | None = None, max_bytes: int | None = None) -> None:
        self.con = duckdb.connect(":memory:", config=dict(CONFIG))
        for setting in _SESSION:
            self.con.execute(setting)
        self.deadline = deadline
        self.max_bytes = MAX_RESULT_BYTES if max_bytes is None else max_bytes
        self._expired = False
        self._stopped = False

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.con.close()

    def _expire(self) -> None:
        self._expired = True
        with contextlib.suppress(duckdb.Error):  # the statement ended (and the sandbox closed) meanwhile
            self.con.interrupt()

    def stop(self) -> None:
        """Cancel (any thread): interrupt the running statement; the fetch loop stops at its next batch."""
        self._stopped = True
        with contextlib.suppress(duckdb.Error):
            self.con.interrupt()

    def _check(self) -> None:
        """Between batches: DuckDB's interrupt reaches a running statement, not Python fetching its rows."""
        if self._expired:
            raise timed_out()
        if self._stopped:
            raise QueryCanceled("canceling statement due to user request")

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[None]:
        """Run a sandbox statement until the deadline (a timer thread interrupts it), cancellable by
        the server's job like a backend statement; DuckDB's errors as PostgreSQL's."""
        timer = None
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise timed_out()
            timer = threading.Timer(left, self._expire)
            timer.daemon = True
            timer.start()
        try:
            with cancellable(self.stop):
                self._check()
                yield
        except duckdb.InterruptException as exc:
            log.debug("post-processing sandbox interrupted: %s", exc)
            if self._expired:
                raise timed_out() from None
            raise QueryCanceled("canceling statement due to user request") from None
        except duckdb.Error as exc:
            raise translate(exc) from None
        finally:
            if timer is not None:
                timer.cancel()

    def load(self, table: str, columns: Sequence[tuple[str, PgType]], rows: Sequence[tuple[Any, ...]]) -> None:
        """Create ``table`` with PostgreSQL-typed columns and insert ``rows`` (none for a dry run);
        interruptible like a statement (a public table may bring many rows)."""
        cols = ", ".join(f"{_quote(n)} {_TO_DUCKDB.get(t, 'VARCHAR')}" for n, t in columns)
        self.con.execute(f"CREATE TABLE {_quote(table)} ({cols})")
        if rows:
            marks = ", ".join("?" for _ in columns)
            with self._bounded():
                self.con.executemany(f"INSERT INTO {_quote(table)} VALUES ({marks})", [list(r) for r in rows])

    def describe(self, sql: str) -> list[tuple[str, str]]:
        """(name, DuckDB type) of each output column, without running the statement."""
        with self._bounded():
            return [(str(r[0]), str(r[1])) for r in self.con.execute(f"DESCRIBE {sql}").fetchall()]

    def run(self, sql: str, kinds: Sequence[PgType | None] | None = None) -> list[tuple[Any, ...]]:
        """The statement's rows (as released values of ``kinds``, see :func:`release_value`, if given),
        fetched in batches until :data:`MAX_OUTPUT_ROWS` rows or ``max_bytes`` (counted by
        :func:`value_bytes`) are exceeded (54000): DuckDB streams the result, so neither a long result
        nor large values are held beyond the cap and one batch."""
        rows: list[tuple[Any, ...]] = []
        size = widest = 0
        batch = 16
        with self._bounded():
            cursor = self.con.execute(sql)
            while chunk := cursor.fetchmany(batch):
                self._check()
                if kinds is not None:
                    chunk = [tuple(release_value(v, k) for v, k in zip(row, kinds, strict=True)) for row in chunk]
                for row in chunk:
                    n = value_bytes(row) + 8  # and its place in the list
                    size += n
                    widest = max(widest, n)
                rows.extend(chunk)
                if size > self.max_bytes:
                    raise ProgramLimitExceeded(
                        f"the result exceeds {self.max_bytes} bytes",
                        hint="Aggregate or filter the released rows further, or select fewer or shorter columns.",
                    )
                if len(rows) > MAX_OUTPUT_ROWS:
                    raise ProgramLimitExceeded(f"the result has more than {MAX_OUTPUT_ROWS} rows")
                batch = max(1, min(FETCH_ROWS, (self.max_bytes - size) // (2 * widest + 1)))
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
