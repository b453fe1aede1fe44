"""The post-processing sandbox: an in-process DuckDB kept per admitted place, holding released rows only
for the statement that released them.

The privacy argument and design notes: docs/internals.md, section dpsql/outer/sandbox.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import hashlib
import heapq
import logging
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
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
#: A row of a sandbox table or result.
Row = tuple[Any, ...]
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


class Database:
    """One locked-down in-memory DuckDB kept between statements (issue #37: starting one cost 56-61 % of a
    small outer statement). Each statement works in a connection of its own (:class:`Sandbox`, a DuckDB
    cursor) whose released rows are *temporary* tables: DuckDB keeps temporary objects per connection, so
    another connection never sees them, and closing the connection drops them. What stays in the database
    is public: copies of public tables (loaded once per key, i.e. per backend and data stamp, see
    :meth:`public_table`), least recently used ones dropped past :data:`RETAINED_PUBLIC_ROWS`.
    :meth:`reset` checks after every statement that nothing else is left; a database that fails the
    check, or that DuckDB reported broken, is closed instead of reused (:attr:`broken`).

    One statement at a time uses a pooled database (:mod:`dpsql.outer.admission`); the shapes database
    (:func:`shape_database`) serves concurrent describes, each in its own connection with empty tables only."""

    def __init__(self) -> None:
        self.con = duckdb.connect(":memory:", config=dict(CONFIG))
        for setting in _SESSION:
            self.con.execute(setting)
        self._lock = threading.Lock()
        #: public copies: key -> (table name in ``main``, rows), least recently used first
        self._public: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.broken = False

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to this database (its own temporary schema, interrupt and random state)."""
        with self._lock:
            return self.con.cursor()

    def public_table(
        self, box: Sandbox, key: str, columns: Sequence[tuple[str, PgType]], read: Callable[[], Sequence[Row]]
    ) -> str:
        """The ``main`` table holding the public table of ``key`` (its rows read with ``read`` and loaded
        in bulk through ``box`` when this database does not hold it yet)."""
        found = self._public.get(key)
        if found is not None:
            self._public.move_to_end(key)
            return found[0]
        rows = read()
        table = _PUBLIC_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:24]
        try:
            box.load(table, columns, rows, temporary=False)
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                self.con.execute(f"DROP TABLE IF EXISTS main.{_quote(table)}")
            raise
        self._public[key] = (table, len(rows))
        return table

    def reset(self) -> None:
        """After a statement (its connection closed): drop public copies past the retained rows, then check
        that the tables left are exactly the public copies (no released rows kept for the next statement);
        otherwise the database is :attr:`broken`."""
        if self.broken:
            return
        try:
            while len(self._public) > 1 and (
                len(self._public) > RETAINED_PUBLIC_TABLES
                or sum(n for _, n in self._public.values()) > RETAINED_PUBLIC_ROWS
            ):
                _, (table, _) = self._public.popitem(last=False)
                self.con.execute(f"DROP TABLE main.{_quote(table)}")
            left = self.con.execute(_LEFT_OVER).fetchall()
        except duckdb.Error as exc:
            log.warning("post-processing database failed its reset (%s): replaced", type(exc).__name__)
            self.broken = True
            return
        expected = sorted(("table", t) for t, _ in self._public.values())
        if sorted((str(kind), str(name)) for kind, name in left) != expected:
            log.warning("post-processing database held unexpected objects after a statement: replaced")
            self.broken = True

    def close(self) -> None:
        with contextlib.suppress(duckdb.Error):
            self.con.close()


#: The tables of the database (temporary ones are per connection: a closed connection's are gone). An
#: outer statement is one SELECT and cannot create anything; this catches a slip of dpsql's own that
#: would keep released rows in a table (views, sequences and macros hold no rows; listing them too would
#: double the check's cost, listing functions multiply it by ~100).
_LEFT_OVER = "SELECT 'table', table_name FROM duckdb_tables() WHERE NOT internal"
_PUBLIC_PREFIX = "__dpsql_public_"
#: Rows of public copies a database keeps between statements (a statement may load more; the least
#: recently used copies are dropped after it), and how many copies.
RETAINED_PUBLIC_ROWS = MAX_PUBLIC_ROWS
RETAINED_PUBLIC_TABLES = 8


class _Alarms:
    """One daemon thread calling functions at their :func:`time.monotonic` deadlines: a sandbox's timeout
    without starting a thread per statement (a :class:`threading.Timer` each cost ~0.1-10 ms on a busy
    host). Cancelled entries are skipped when due, and dropped in bulk once they are most of the heap."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list[Callable[[], object] | None]]] = []
        self._count = 0
        self._cancelled = 0
        self._thread: threading.Thread | None = None

    def add(self, when: float, call: Callable[[], object]) -> list[Callable[[], object] | None]:
        """Call ``call`` at ``when``; returns the handle :meth:`cancel` takes."""
        handle: list[Callable[[], object] | None] = [call]
        with self._cond:
            self._count += 1
            heapq.heappush(self._heap, (when, self._count, handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpsql-sandbox-alarms", daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def cancel(self, handle: list[Callable[[], object] | None]) -> None:
        with self._cond:
            if handle[0] is not None:
                handle[0] = None
                self._cancelled += 1
                if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
                    self._heap = [entry for entry in self._heap if entry[2][0] is not None]
                    heapq.heapify(self._heap)
                    self._cancelled = 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, handle = heapq.heappop(self._heap)
                call, handle[0] = handle[0], None
                if call is None:
                    self._cancelled = max(0, self._cancelled - 1)
            if call is not None:
                try:
                    call()
                except Exception:  # an alarm must not end the thread that serves every sandbox
                    log.exception("post-processing sandbox alarm failed")


_ALARMS = _Alarms()
_shapes_lock = threading.Lock()
_shapes: Database | None = None


def shape_database() -> Database:
    """The process's database for describing outer statements over empty tables (concurrent
    connections, nothing kept): replaced when DuckDB reported it broken."""
    global _shapes
    with _shapes_lock:
        if _shapes is None or _shapes.broken:
            if _shapes is not None:
                _shapes.close()
            _shapes = Database()
        return _shapes


class Sandbox:
    """One statement's connection to a locked-down in-memory DuckDB (``database``; None: a fresh one,
    closed with the sandbox); closing it drops the statement's temporary tables and views.

    ``deadline`` (:func:`time.monotonic` seconds; None: none) is the statement's: :meth:`run` and
    :meth:`describe` are interrupted there (57014). ``max_bytes`` caps the fetched result (54000;
    default :data:`MAX_RESULT_BYTES`)."""

    def __init__(
        self, deadline: float | None = None, max_bytes: int | None = None, database: Database | None = None
    ) -> None:
        self._owned = database is None
        self.database = Database() if database is None else database
        self.con = self.database.cursor()
        self.deadline = deadline
        self.max_bytes = MAX_RESULT_BYTES if max_bytes is None else max_bytes
        self._expired = False
        self._stopped = False
        self._alarm: list[Callable[[], object] | None] | None = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._alarm is not None:
            _ALARMS.cancel(self._alarm)
        try:
            self.con.close()
        except duckdb.Error:
            self.database.broken = True
        if self._owned:
            self.database.close()

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
        """Run a sandbox statement until the deadline (:data:`_ALARMS` interrupts it), cancellable by the
        server's job like a backend statement; DuckDB's errors as PostgreSQL's."""
        if self.deadline is not None and self._alarm is None:
            if self.deadline <= time.monotonic():
                raise timed_out()
            self._alarm = _ALARMS.add(self.deadline, self._expire)
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
            if isinstance(exc, duckdb.FatalException | duckdb.InternalException):
                self.database.broken = True  # DuckDB invalidates a database after these
            raise translate(exc) from None

    def load(
        self,
        table: str,
        columns: Sequence[tuple[str, PgType]],
        rows: Sequence[Row],
        *,
        temporary: bool = True,
    ) -> None:
        """Create ``table`` with PostgreSQL-typed columns and insert ``rows`` (none for a dry run), in
        bulk (:func:`_columns`: every mix of value kinds); interruptible like a statement (a public table may
        bring many rows). Temporary (the default): this connection's only, dropped with it."""
        cols = ", ".join(f"{_quote(n)} {_TO_DUCKDB.get(t, 'VARCHAR')}" for n, t in columns)
        where = "TEMPORARY TABLE" if temporary else f"TABLE main.{_quote(table)}"
        name = _quote(table) if temporary else ""
        self.con.execute(f"CREATE {where} {name} ({cols})")
        if not rows:
            return
        target = _quote(table) if temporary else f"main.{_quote(table)}"
        types = [_TO_DUCKDB.get(t, "VARCHAR") for _, t in columns]
        with self._bounded():
            parts = _columns(rows, len(types))
            if parts is not None:
                try:
                    self.con.execute(_bulk_insert(target, types, [len(p) for p in parts]), _flat(parts))
                    return
                except duckdb.InterruptException:
                    raise
                except duckdb.Error as exc:  # a value no list of its kind takes: row by row, as before
                    log.debug("bulk load of a sandbox table fell back to rows: %s", type(exc).__name__)
            marks = ", ".join("?" for _ in columns)
            self.con.executemany(f"INSERT INTO {target} VALUES ({marks})", [list(r) for r in rows])

    def alias(self, name: str, table: str) -> None:
        """``name`` (a temporary view of this connection) reads the ``main`` table ``table``."""
        self.con.execute(f"CREATE TEMPORARY VIEW {_quote(name)} AS SELECT * FROM main.{_quote(table)}")

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


def _columns(rows: Sequence[Row], width: int) -> list[list[list[Any]]] | None:
    """``rows`` column-wise for a bulk insert (:func:`_bulk_insert`): per column, one list per kind of value
    it holds (:func:`_kind`), the other kinds' places None; None when a row has another width (row by row,
    which refuses it). DuckDB gives a list one element type, so ``[1, 2.5]`` in one list would become
    doubles before the column's cast (an integer above 2^53 changed); one list per kind casts each value
    from its own type, as a row-by-row insert does (a backend may hand ``12.0`` back as ``12``, a
    driver mix naive and aware instants)."""
    if rows and set(map(len, rows)) != {width}:
        return None
    columns = zip(*rows, strict=True) if rows else iter([() for _ in range(width)])
    out: list[list[list[Any]]] = []
    for column in columns:
        kinds = list(dict.fromkeys(_kind(v) for v in column if v is not None))
        if len(kinds) <= 1:
            out.append([list(column)])
        else:
            out.append([[v if v is not None and _kind(v) == k else None for v in column] for k in kinds])
    return out


def _kind(value: Any) -> tuple[type, bool]:
    """A value's kind for a bulk list: its Python type (and, for an instant, whether it is aware: naive and
    aware ones convert differently)."""
    return type(value), isinstance(value, dt.datetime | dt.time) and value.tzinfo is not None


def _bulk_insert(target: str, types: Sequence[str], parts: Sequence[int]) -> str:
    """``INSERT … SELECT`` of one list parameter per (column, kind) (``UNNEST`` zips them), each cast to the
    column's type element by element; a column of several kinds takes the one value of its row that is set."""
    inner: list[str] = []
    outer: list[str] = []
    for c, (kind, n) in enumerate(zip(types, parts, strict=True)):
        names = [f"c{c}_{p}" for p in range(n)]
        inner += [f"UNNEST(?::{kind}[]) AS {name}" for name in names]
        outer.append(names[0] if n == 1 else f"COALESCE({', '.join(names)})")
    return f"INSERT INTO {target} SELECT {', '.join(outer)} FROM (SELECT {', '.join(inner)})"


def _flat(parts: Sequence[Sequence[list[Any]]]) -> list[list[Any]]:
    return [values for column in parts for values in column]


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
