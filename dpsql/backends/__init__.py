"""The narrow interface dpsql uses to run (already rewritten) SQL on a real database.

Three implementations: DuckDB (embedded default), PostgreSQL and Apache Spark SQL (optional
``spark`` extra). All are safe to call from many threads at once, run ``execute`` read-only
with a single statement (a read-only transaction; Spark, which has none, accepts only a parsed
SELECT), and turn every database error into a generic :class:`dpsql.errors.BackendError` (the
database's own message may depend on private data: it goes only to :data:`database_log`).
Every backend applies a statement timeout (``DEFAULT_STATEMENT_TIMEOUT_MS`` unless told
otherwise) and reports it as 57014, as PostgreSQL does.

Result values are plain Python: ``Decimal`` is normalised to ``int`` (integral values) or
``float`` so that both databases return the same types for ``SUM``/``AVG``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal
from typing import Any, Literal, Protocol, runtime_checkable

from dpsql.errors import BackendError, QueryCanceled

#: A salted order of a unit's rows or cells: ``md5`` of their text (the same on every backend),
#: ``duckdb`` (DuckDB's HASH) or ``postgres`` (PostgreSQL's 64-bit ``hashtextextended`` of md5's text).
RowHash = Literal["md5", "duckdb", "postgres"]
#: Keeping a unit's first rows in one step: DuckDB's ``MIN_BY(x, order, n)`` or ``ROW_NUMBER()``.
TopRows = Literal["min_by", "row_number"] | None

__all__ = ["Backend", "BackendDefaults", "BackendError", "database_log", "open_backend", "redact_url"]

QUERY_FAILED = "the database failed to run the query"
#: Every statement dpsql sends is cancelled after this long unless the caller sets another timeout
#: (a hostile query must not hold a connection or a core forever; 0 would mean none).
DEFAULT_STATEMENT_TIMEOUT_MS = 60_000

#: The database's own text (an overflow message quotes the stored operands, a LIKE error says which
#: pattern met which row) is data-dependent. It goes only to this logger, which propagates nowhere and
#: has no handler until ``dpsql serve`` attaches it to the operator's log (INFO, never WARNING). In the
#: DB-API and the CLI, i.e. the analyst's own process, it is dropped: Python's last-resort handler never
#: sees it, and neither does a root handler the analyst configures.
database_log = logging.getLogger("dpsql.database")
database_log.propagate = False
database_log.addHandler(logging.NullHandler())


_statement_hook = threading.local()


@contextlib.contextmanager
def cancellable(cancel: Callable[[], object]) -> Iterator[None]:
    """Backends run each statement inside this: while it runs, ``cancel`` (DuckDB's interrupt,
    PostgreSQL's cancel request) is offered to the hook the calling thread installed with
    :func:`statement_hook`, which may call it from another thread (a client that gave up)."""
    hook = getattr(_statement_hook, "hook", None)
    if hook is None:
        yield
        return
    with hook(cancel):
        yield


@contextlib.contextmanager
def statement_hook(hook: Callable[[Callable[[], object]], contextlib.AbstractContextManager[object]]) -> Iterator[None]:
    """Install ``hook`` for the statements this thread runs (the server's per-statement job)."""
    previous = getattr(_statement_hook, "hook", None)
    _statement_hook.hook = hook
    try:
        yield
    finally:
        _statement_hook.hook = previous


def log_database_error(what: str, exc: BaseException) -> None:
    """Record a database failure's own text for the operator only (see :data:`database_log`)."""
    database_log.info("%s (%s): %s", what, type(exc).__name__, str(exc)[:4000])


def timed_out() -> QueryCanceled:
    """57014, as PostgreSQL reports a statement_timeout (the database's own text stays in the log)."""
    return QueryCanceled(
        "canceling statement due to statement timeout",
        hint="Narrow the query, or raise the timeout (SET statement_timeout / --statement-timeout).",
    )


_SQL_TYPE = re.compile(r"^[A-Za-z][A-Za-z0-9_ ]*(\(\s*\d+\s*(,\s*\d+\s*)?\))?(\[\])?$")


@runtime_checkable
class Backend(Protocol):
    """What the engine may ask of a database. The last three members are optional capabilities:
    a backend that lacks one inherits :class:`BackendDefaults`' answer ("not offered")."""

    url: str
    dialect: str  # sqlglot dialect name: "duckdb", "postgres" or "spark"
    #: A counter bumped before every write through this backend; 0 if it does not count writes
    #: (then nothing is proven from statistics, so nothing depends on it).
    data_version: int
    #: The salted order that picks a heavy unit's rows (``Physical.hash``).
    row_hash: RowHash
    #: How counts over many groups keep each unit's first rows (``Physical.top_rows``), None: not at all.
    top_rows: TopRows

    def proven_ranges(self, table: str, columns: list[str]) -> dict[str, tuple[Any, Any]]:
        """(min, max) the database's exact statistics guarantee per column; {} when none are known."""
        ...

    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement; return (column names, rows)."""
        ...

    def execute_script(self, sql: str) -> None:
        """Run DDL / loading statements (demo data and tests only; not read-only)."""
        ...

    def load_rows(
        self,
        table: str,
        columns: list[tuple[str, str]],
        rows: Iterable[tuple[Any, ...]],
        *,
        replace: bool = False,
    ) -> None:
        """Create ``table`` with ``columns`` (name, SQL type) and bulk-insert ``rows``."""
        ...

    def close(self) -> None: ...


class BackendDefaults:
    """Base class of the backends: the optional capabilities of :class:`Backend`, not offered."""

    data_version: int = 0
    row_hash: RowHash = "md5"
    top_rows: TopRows = None

    def proven_ranges(self, table: str, columns: list[str]) -> dict[str, tuple[Any, Any]]:
        return {}


def open_backend(
    url: str,
    *,
    statement_timeout_ms: int | None = DEFAULT_STATEMENT_TIMEOUT_MS,
    pool_size: int = 8,
    read_only: bool = False,
) -> Backend:
    """Open a backend from a URL.

    ``read_only``: open a DuckDB file without its write lock, so several processes (``serve --processes
    N``, the curator's ``policy check``, ``dpsql query``) read it at once; dpsql only ever writes to it
    for randomized-response INSERTs. Other backends take their read-only guarantee per statement.

    ``duckdb://`` or ``duckdb:///:memory:`` (in-memory), ``duckdb:///abs/path.duckdb``,
    ``postgresql://user:pw@host:port/db`` (or ``postgres://``), ``spark://local[N][/database]``
    (in-process Spark) and ``sc://host:port`` (Spark Connect); see :mod:`dpsql.backends.spark`.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "duckdb":
        from dpsql.backends.duckdb import DuckDBBackend

        return DuckDBBackend(url, statement_timeout_ms=statement_timeout_ms, read_only=read_only)
    if scheme in ("postgresql", "postgres"):
        from dpsql.backends.postgres import PostgresBackend

        return PostgresBackend(url, statement_timeout_ms=statement_timeout_ms, pool_size=pool_size)
    if scheme in ("spark", "sc"):
        from dpsql.backends.spark import SparkBackend  # imports pyspark only when Spark is asked for

        return SparkBackend(url, statement_timeout_ms=statement_timeout_ms)
    raise BackendError(
        f"unsupported database URL scheme {scheme!r}",
        hint="use duckdb:///path.duckdb, duckdb:// (in memory), postgresql://user@host:port/db, "
        "spark://local[N] or sc://host:15002",
    )


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and reprs."""
    return re.sub(r"(://[^/:@]*:)[^/@]*@", r"\1***@", url)


def normalize_value(value: Any) -> Any:
    """Decimal → int/float so DuckDB and PostgreSQL aggregates compare equal and feed noise code directly."""
    if isinstance(value, Decimal):
        if value.is_finite() and value == value.to_integral_value():
            return int(value)
        return float(value)
    return value


def normalize_rows(rows: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [tuple(normalize_value(v) for v in row) for row in rows]


def quote_ident(name: str) -> str:
    """Double-quote a possibly schema-qualified identifier (``schema.table``)."""
    parts = name.split(".")
    if not all(parts):
        raise BackendError(f"invalid identifier {name!r}")
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)


def column_defs(columns: list[tuple[str, str]]) -> str:
    """``"a" BIGINT, "b" TEXT`` — types are checked against a simple shape, not interpolated blindly."""
    if not columns:
        raise BackendError("a table needs at least one column")
    defs = []
    for name, sql_type in columns:
        if not _SQL_TYPE.match(sql_type.strip()):
            raise BackendError(f"invalid column type {sql_type!r}")
        defs.append(f"{quote_ident(name)} {sql_type.strip()}")
    return ", ".join(defs)


#: Stored types a cast to a non-text policy type can fail on for *some* values only: text-like columns.
_TEXTUAL = re.compile(r"char|text|string|json|enum|user-defined", re.IGNORECASE)


def stored_type_mismatches(backend: Backend, table: str, declared: Mapping[str, str]) -> list[tuple[str, str]]:
    """(column, stored type) of declared non-text columns that the database stores as text.

    Generated SQL casts each column to its declared type. A cast from text fails only on rows whose
    text does not parse ('Igor-77.5x' stored in a float column): an error that depends on one person's
    value. The stored schema is the same on neighbouring databases, so refusing the column on its type
    alone, before any row is read, is data-independent. Backends without ``information_schema``
    (Spark) are not checked.
    """
    if backend.dialect not in ("duckdb", "postgres"):
        return []
    *schema, name = table.split(".")  # a policy source may be schema-qualified

    def quoted(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    _, rows = backend.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        f"WHERE table_name = {quoted(name)} AND table_schema = "
        + (quoted(schema[-1]) if schema else "current_schema()")
    )
    stored = {str(c): str(t) for c, t in rows}
    return [
        (column, stored[column])
        for column, declared_type in declared.items()
        if declared_type != "text" and column in stored and _TEXTUAL.search(stored[column])
    ]
