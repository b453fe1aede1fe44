"""PostgreSQL backend: a small thread-safe pool of autocommit connections (psycopg 3, no extra deps).

Queries run through the extended protocol (one unnamed statement: no second statement can be
smuggled in) on autocommit connections whose session default is read-only, so each query is its
own read-only transaction in a single round trip. Loading (demo/tests) uses a separate
short-lived read-write connection.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
from psycopg.types.datetime import DateBinaryLoader, TimestampBinaryLoader

from dpsql.backends import (
    QUERY_FAILED,
    BackendDefaults,
    RowHash,
    TopRows,
    cancellable,
    column_defs,
    log_database_error,
    normalize_rows,
    quote_ident,
    redact_url,
    timed_out,
)
from dpsql.errors import BackendError

log = logging.getLogger(__name__)

CONNECT_FAILED = "could not connect to the database"


class ConnectionPool:
    """At most ``size`` connections, created lazily, reused LIFO, dropped when broken."""

    def __init__(self, connect: Callable[[], psycopg.Connection], size: int, acquire_timeout: float = 60) -> None:
        if size < 1:
            raise ValueError("pool size must be at least 1")
        self._connect = connect
        self._slots = threading.BoundedSemaphore(size)
        self._idle: queue.LifoQueue[psycopg.Connection] = queue.LifoQueue()
        self._acquire_timeout = acquire_timeout
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if self._closed:
            raise BackendError("the database backend is closed")
        if not self._slots.acquire(timeout=self._acquire_timeout):
            raise BackendError("timed out waiting for a database connection")
        conn: psycopg.Connection | None = None
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self._connect()
            yield conn
        finally:
            if conn is not None:
                if conn.broken or conn.closed or self._closed:
                    conn.close()
                else:
                    self._idle.put(conn)
            self._slots.release()

    def close(self) -> None:
        """Close idle connections now; connections in use are closed when handed back."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


class _SaturatingDateLoader(DateBinaryLoader):
    """Dates beyond Python's range (±infinity, years past 9999 or BC) saturate to ``date.min``/``date.max``
    as DuckDB's client returns ±infinity, instead of failing the fetch: a failing fetch of a group key
    would reveal that someone holds such a value."""

    def load(self, data: Any) -> dt.date:
        try:
            return super().load(data)
        except psycopg.DataError:
            return dt.date.min if int.from_bytes(data, "big", signed=True) < 0 else dt.date.max


class _SaturatingTimestampLoader(TimestampBinaryLoader):
    """Timestamps beyond Python's range saturate to ``datetime.min``/``datetime.max`` (see dates)."""

    def load(self, data: Any) -> dt.datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            return dt.datetime.min if int.from_bytes(data, "big", signed=True) < 0 else dt.datetime.max


class PostgresBackend(BackendDefaults):
    dialect = "postgres"
    #: ``hashtextextended`` gives a bigint order: sorting cells by it instead of md5's text, and keeping a
    #: unit's first rows with ROW_NUMBER, brought grouped person-level queries near their floor
    #: (bench/person.py, bench/README.md).
    row_hash: RowHash = "postgres"
    top_rows: TopRows = "row_number"

    def __init__(self, url: str, *, statement_timeout_ms: int | None = None, pool_size: int = 8) -> None:
        self.url = url
        self.statement_timeout_ms = statement_timeout_ms
        self._pool = ConnectionPool(self._connect_read_only, pool_size)

    def __repr__(self) -> str:
        return f"PostgresBackend({redact_url(self.url)!r})"

    def _connect(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            log.warning("cannot connect to %s: %s", redact_url(self.url), exc)
            raise BackendError(CONNECT_FAILED) from None

    def _connect_read_only(self) -> psycopg.Connection:
        conn = self._connect()
        try:
            conn.adapters.register_loader("date", _SaturatingDateLoader)
            conn.adapters.register_loader("timestamp", _SaturatingTimestampLoader)
            conn.execute("SET default_transaction_read_only = on")
            conn.execute("SET application_name = 'dpsql'")
            if self.statement_timeout_ms:
                conn.execute(f"SET statement_timeout = {int(self.statement_timeout_ms)}")
        except psycopg.Error as exc:
            conn.close()
            log.warning("cannot configure connection to %s: %s", redact_url(self.url), exc)
            raise BackendError(CONNECT_FAILED) from None
        return conn

    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        with self._pool.connection() as conn:
            try:
                with conn.cursor() as cur, cancellable(conn.cancel):
                    # binary=True forces the extended protocol (exactly one statement) without the extra
                    # round trip of a named prepared statement; default_transaction_read_only makes the
                    # implicit transaction read-only.
                    cur.execute(sql, binary=True)
                    names = [col.name for col in cur.description or ()]
                    rows = normalize_rows(cur.fetchall()) if cur.description else []
                return names, rows
            except psycopg.errors.QueryCanceled as exc:
                log_database_error("PostgreSQL query canceled", exc)
                raise timed_out() from None
            except psycopg.Error as exc:
                log_database_error(f"PostgreSQL query failed ({exc.sqlstate})", exc)
                raise BackendError(QUERY_FAILED) from None

    def execute_script(self, sql: str) -> None:
        with self._connect() as conn:
            try:
                conn.execute(sql)  # no params: simple protocol, many statements
            except psycopg.Error as exc:
                log_database_error(f"PostgreSQL script failed ({exc.sqlstate})", exc)
                raise BackendError(QUERY_FAILED) from None

    def load_rows(
        self,
        table: str,
        columns: list[tuple[str, str]],
        rows: Iterable[tuple[Any, ...]],
        *,
        replace: bool = False,
    ) -> None:
        """Create the table and stream the rows with COPY, in one transaction."""
        target = quote_ident(table)
        names = ", ".join(quote_ident(name) for name, _ in columns)
        defs = column_defs(columns)
        with self._connect() as conn:
            try:
                with conn.transaction(), conn.cursor() as cur:
                    if replace:
                        cur.execute(f"DROP TABLE IF EXISTS {target}")
                    cur.execute(f"CREATE TABLE {target} ({defs})")
                    with cur.copy(f"COPY {target} ({names}) FROM STDIN") as copy:
                        for row in rows:
                            copy.write_row(row)
                    cur.execute(f"ANALYZE {target}")
            except psycopg.Error as exc:
                log_database_error(f"PostgreSQL load into {table} failed ({exc.sqlstate})", exc)
                raise BackendError(QUERY_FAILED) from None

    def close(self) -> None:
        self._pool.close()
