"""The narrow interface dpsql uses to run (already rewritten) SQL on a real database.

Three implementations: DuckDB (embedded default), PostgreSQL and Apache Spark SQL (optional
``spark`` extra: pyspark is imported only when a Spark URL is opened). All are safe to call from
many threads at once, run ``execute`` read-only with a single statement (a read-only transaction;
Spark, which has none, accepts only a SELECT it generated or parsed itself), and turn every database
error into a generic :class:`dpsql.errors.BackendError` (the database's own message may depend on
private data: it goes only to :data:`database_log`). Every backend applies a statement timeout
(``DEFAULT_STATEMENT_TIMEOUT_MS`` unless told otherwise) and reports it as 57014, as PostgreSQL does.
Everything that differs between them is declared on the backend's class (:mod:`dpsql.backends.base`).

Result values are plain Python: ``Decimal`` is normalised to ``int`` (integral values) or
``float`` so that both databases return the same types for ``SUM``/``AVG``.
"""

from __future__ import annotations

from dpsql.backends.base import (
    DEFAULT_STATEMENT_TIMEOUT_MS,
    QUERY_FAILED,
    Backend,
    BackendBase,
    RowHash,
    TopRows,
    WriteCatalog,
    cancellable,
    column_defs,
    database_log,
    log_database_error,
    normalize_rows,
    normalize_value,
    quote_ident,
    redact_url,
    statement_hook,
    stored_type_mismatches,
    timed_out,
)
from dpsql.backends.duckdb import DuckDBBackend
from dpsql.backends.postgres import PostgresBackend
from dpsql.backends.spark import SparkBackend
from dpsql.errors import BackendError

__all__ = [
    "BACKENDS",
    "DEFAULT_STATEMENT_TIMEOUT_MS",
    "QUERY_FAILED",
    "Backend",
    "BackendBase",
    "BackendError",
    "RowHash",
    "TopRows",
    "WriteCatalog",
    "cancellable",
    "column_defs",
    "database_log",
    "log_database_error",
    "normalize_rows",
    "normalize_value",
    "open_backend",
    "quote_ident",
    "redact_url",
    "statement_hook",
    "stored_type_mismatches",
    "timed_out",
]

#: The backend classes, each opening the URL schemes it lists in ``schemes``.
BACKENDS: tuple[type[BackendBase], ...] = (DuckDBBackend, PostgresBackend, SparkBackend)


def open_backend(
    url: str,
    *,
    statement_timeout_ms: int | None = DEFAULT_STATEMENT_TIMEOUT_MS,
    pool_size: int = 8,
    read_only: bool = False,
) -> Backend:
    """Open a backend from a URL.

    ``read_only``: open without taking a write lock, so several processes (``serve --processes N``,
    the curator's ``policy check``, ``dpsql query``) read one DuckDB file at once; dpsql only ever
    writes for randomized-response INSERTs. Each class's ``from_url`` says what it means there.

    ``duckdb://`` or ``duckdb:///:memory:`` (in-memory), ``duckdb:///abs/path.duckdb``,
    ``postgresql://user:pw@host:port/db`` (or ``postgres://``), ``spark://local[N][/database]``
    (in-process Spark) and ``sc://host:port`` (Spark Connect); see :mod:`dpsql.backends.spark`.
    """
    scheme = url.split(":", 1)[0].lower()
    for backend in BACKENDS:
        if scheme in backend.schemes:
            return backend.from_url(
                url, statement_timeout_ms=statement_timeout_ms, pool_size=pool_size, read_only=read_only
            )
    raise BackendError(
        f"unsupported database URL scheme {scheme!r}",
        hint="use duckdb:///path.duckdb, duckdb:// (in memory), postgresql://user@host:port/db, "
        "spark://local[N] or sc://host:15002",
    )
