"""What every backend declares, and the helpers the three implementations share.

:class:`Backend` is what the rest of dpsql may ask of a database; :class:`BackendBase` is the base
class of the implementations. Every difference between DuckDB, PostgreSQL and Spark lives on the
backend's class (no caller compares dialect names): which database it is (:meth:`Backend.identity`),
whether its data changed (:meth:`Backend.data_stamp`, with :attr:`Backend.sees_outside_writes`
saying whether that stamp also sees writes made outside dpsql), its tables and stored column types,
the catalog a write is checked against (:meth:`Backend.write_catalog`), how it is opened read-only
(:meth:`BackendBase.from_url`) and the SQL text generated for it (:meth:`Backend.render`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, Protocol, Self, runtime_checkable

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect

from dpsql.errors import BackendError, QueryCanceled

#: A salted order of a unit's rows or cells: ``md5`` of their text (the same on every backend),
#: ``duckdb`` (DuckDB's HASH) or ``postgres`` (PostgreSQL's 64-bit ``hashtextextended`` of md5's text).
RowHash = Literal["md5", "duckdb", "postgres"]
#: Keeping a unit's first rows in one step: DuckDB's ``MIN_BY(x, order, n)`` or ``ROW_NUMBER()``.
TopRows = Literal["min_by", "row_number"] | None

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


SQL_TYPE = re.compile(r"^[A-Za-z][A-Za-z0-9_ ]*(\(\s*\d+\s*(,\s*\d+\s*)?\))?(\[\])?$")


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


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def column_defs(columns: list[tuple[str, str]]) -> str:
    """``"a" BIGINT, "b" TEXT`` — types are checked against a simple shape, not interpolated blindly."""
    if not columns:
        raise BackendError("a table needs at least one column")
    defs = []
    for name, sql_type in columns:
        if not SQL_TYPE.match(sql_type.strip()):
            raise BackendError(f"invalid column type {sql_type!r}")
        defs.append(f"{quote_ident(name)} {sql_type.strip()}")
    return ", ".join(defs)


@functools.cache
def sql_dialect(name: str) -> Dialect:
    """One shared sqlglot dialect instance per name (resolving a name builds a new one each time)."""
    return Dialect.get_or_raise(name)


@dataclass(frozen=True, slots=True)
class WriteCatalog:
    """What an INSERT into a table is checked against (schema only, see :mod:`dpsql.writes`)."""

    #: (constraint, its columns; None when it is over an expression) of keys relating rows to each other.
    keys: list[tuple[str, list[str] | None]] = field(default_factory=list)
    #: Column → its default expression's text (None: no default).
    defaults: dict[str, str | None] = field(default_factory=dict)
    #: Descriptions of triggers or rules, which may do anything with stored rows.
    triggers: list[str] = field(default_factory=list)


@runtime_checkable
class Backend(Protocol):
    """What the engine, the cache, the curator and the write checks may ask of a database."""

    url: str
    dialect: str  # sqlglot dialect name: "duckdb", "postgres" or "spark"
    #: A counter bumped before every write through this backend; the statistics proofs and the
    #: stored-type memo are keyed by it.
    data_version: int
    #: The salted order that picks a heavy unit's rows (``Physical.hash``).
    row_hash: RowHash
    #: How counts over many groups keep each unit's first rows (``Physical.top_rows``), None: not at all.
    top_rows: TopRows
    #: Whether :meth:`data_stamp` moves with every write to the data, including writes made outside
    #: dpsql. When False the result cache serves this backend's answers only within a short window.
    sees_outside_writes: bool
    #: Whether the database answers ``information_schema`` (constraints, NOT NULL): the curator's checks.
    information_schema: bool
    #: Whether the database has PostgreSQL's roles and privileges (``dpsql serve`` warns about a
    #: superuser or table-owner login on the data database).
    pg_roles: bool

    @property
    def in_memory(self) -> bool:
        """Whether the data lives only in this process (DuckDB ``:memory:``, the demo): nothing outlives it."""
        ...

    def identity(self) -> str:
        """Which database this is, for the result cache and the ledger marker."""
        ...

    def pin_identity(self, name: str) -> None:
        """Name a private (in-memory) database whose rows are the same wherever ``name`` is used."""
        ...

    def data_stamp(self) -> str:
        """A text that changes whenever the data may have (see :attr:`sees_outside_writes`)."""
        ...

    def render(self, tree: exp.Expression, *, copy: bool = True) -> str:
        """The SQL text to :meth:`execute` for a query dpsql built: generated once, in this dialect."""
        ...

    def tables(self) -> list[str]:
        """Tables and views of the current schema (or database), sorted."""
        ...

    def columns(self, table: str) -> dict[str, str] | None:
        """Column → stored type of ``table`` (a policy ``source``), in table order; None if absent."""
        ...

    def catalog_where(self, table: str) -> str:
        """The ``information_schema`` condition naming ``table`` (backends with :attr:`information_schema`)."""
        ...

    def write_catalog(self, table: str) -> WriteCatalog | None:
        """The keys, defaults and triggers an INSERT into ``table`` meets; None: unknown (no write allowed)."""
        ...

    def proven_ranges(self, table: str, columns: list[str]) -> dict[str, tuple[Any, Any]]:
        """(min, max) the database's exact statistics guarantee per column; {} when none are known."""
        ...

    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement; return (column names, rows)."""
        ...

    def execute_script(self, sql: str) -> None:
        """Run DDL / loading statements (demo data, tests, randomized-response INSERTs; not read-only)."""
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


class BackendBase(ABC):
    """Base class of the backends. What differs between databases is abstract or a class attribute
    each subclass sets itself; the defaults here are only what is the same everywhere."""

    # Declared (set) by every subclass on its class, checked by __init_subclass__:
    #: URL schemes :func:`dpsql.backends.open_backend` opens with this class.
    schemes: tuple[str, ...]
    dialect: str
    sees_outside_writes: bool
    information_schema: bool
    pg_roles: bool
    url: str
    data_version: int = 0
    row_hash: RowHash = "md5"
    top_rows: TopRows = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [
            name
            for name in ("schemes", "dialect", "sees_outside_writes", "information_schema", "pg_roles")
            if not hasattr(cls, name)
        ]
        if missing:  # a new backend must say what it can and cannot see, not inherit a silent answer
            raise TypeError(f"{cls.__name__} must declare {', '.join(missing)}")

    @property
    def in_memory(self) -> bool:
        return False

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, *, statement_timeout_ms: int | None, pool_size: int, read_only: bool) -> Self:
        """Open ``url``. ``read_only`` asks for an opening that takes no write lock (DuckDB files);
        each backend says in its own docstring how its statements are kept read-only otherwise."""

    @abstractmethod
    def identity(self) -> str: ...

    @abstractmethod
    def data_stamp(self) -> str: ...

    @abstractmethod
    def tables(self) -> list[str]: ...

    @abstractmethod
    def columns(self, table: str) -> dict[str, str] | None: ...

    @abstractmethod
    def write_catalog(self, table: str) -> WriteCatalog | None: ...

    @abstractmethod
    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]: ...

    @abstractmethod
    def execute_script(self, sql: str) -> None: ...

    @abstractmethod
    def load_rows(
        self,
        table: str,
        columns: list[tuple[str, str]],
        rows: Iterable[tuple[Any, ...]],
        *,
        replace: bool = False,
    ) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def pin_identity(self, name: str) -> None:
        """Name a private (in-memory) database for the result cache across processes. Only for data that
        is the same wherever the name is used — the seeded demo, named by its generator's digest — so a
        release made by one ``dpsql query`` process is post-processing, not a new measurement, for the next."""
        self._pinned_identity = name

    def object_identity(self) -> str:
        """A token drawn once per backend object: answers are then never shared with another process
        (unless :meth:`pin_identity` named the data)."""
        pinned: str | None = getattr(self, "_pinned_identity", None)
        if pinned is not None:
            return pinned
        token: str | None = getattr(self, "_identity_token", None)
        if token is None:
            token = secrets.token_hex(16)
            self._identity_token = token
        return f"{self.dialect}:{redact_url(self.url)}:{token}"

    def render(self, tree: exp.Expression, *, copy: bool = True) -> str:
        return tree.sql(dialect=sql_dialect(self.dialect), copy=copy)

    def catalog_where(self, table: str) -> str:
        """Exact names, in the current schema unless qualified (PostgreSQL's rule)."""
        *schema, name = table.split(".")
        schema_sql = quote_literal(schema[-1]) if schema else "current_schema()"
        return f"table_name = {quote_literal(name)} AND table_schema = {schema_sql}"

    def proven_ranges(self, table: str, columns: list[str]) -> dict[str, tuple[Any, Any]]:
        return {}


def information_schema_tables(backend: Backend) -> list[str]:
    """Tables and views of the current schema, from ``information_schema`` (DuckDB and PostgreSQL)."""
    _, rows = backend.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() ORDER BY 1"
    )
    return [str(r[0]) for r in rows]


def information_schema_columns(backend: Backend, table: str) -> dict[str, str] | None:
    """Column → stored type of ``table`` in table order, from ``information_schema``; None if absent."""
    _, rows = backend.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        f"WHERE {backend.catalog_where(table)} ORDER BY ordinal_position"
    )
    return {str(name): str(type_name) for name, type_name in rows} or None


#: Stored types a cast to a non-text policy type can fail on for *some* values only: text-like columns.
_TEXTUAL = re.compile(r"char|text|string|json|enum|user-defined", re.IGNORECASE)


def stored_type_mismatches(backend: Backend, table: str, declared: Mapping[str, str]) -> list[tuple[str, str]]:
    """(column, stored type) of declared non-text columns that the database stores as text.

    Generated SQL casts each column to its declared type. A cast from text fails only on rows whose
    text does not parse ('Igor-77.5x' stored in a float column): an error that depends on one person's
    value. The stored schema is the same on neighbouring databases, so refusing the column on its type
    alone, before any row is read, is data-independent. Every backend reads its stored types
    (:meth:`Backend.columns`); none is skipped.
    """
    stored = backend.columns(table) or {}
    return [
        (column, stored[column])
        for column, declared_type in declared.items()
        if declared_type != "text" and column in stored and _TEXTUAL.search(stored[column])
    ]
