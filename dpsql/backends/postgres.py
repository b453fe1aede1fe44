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
from typing import Any, Self

import psycopg
from psycopg.types.datetime import DateBinaryLoader, TimestampBinaryLoader

from dpsql.backends.base import (
    QUERY_FAILED,
    BackendBase,
    RowHash,
    TopRows,
    WriteCatalog,
    cancellable,
    column_defs,
    information_schema_columns,
    information_schema_tables,
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


#: pg_constraint.contype → what a write check calls it.
_CONSTRAINTS = {"p": "PRIMARY KEY", "u": "UNIQUE", "f": "FOREIGN KEY", "x": "EXCLUDE constraint"}


class PostgresBackend(BackendBase):
    schemes = ("postgresql", "postgres")
    dialect = "postgres"
    #: The stamp is the cluster's next transaction id, which every writing transaction moves.
    sees_outside_writes = True
    information_schema = True
    pg_roles = True
    #: ``hashtextextended`` gives a bigint order: sorting cells by it instead of md5's text, and keeping a
    #: unit's first rows with ROW_NUMBER, brought grouped person-level queries near their floor
    #: (bench/person.py, bench/README.md).
    row_hash: RowHash = "postgres"
    top_rows: TopRows = "row_number"

    def __init__(self, url: str, *, statement_timeout_ms: int | None = None, pool_size: int = 8) -> None:
        self.url = url
        self.statement_timeout_ms = statement_timeout_ms
        self._pool = ConnectionPool(self._connect_read_only, pool_size)

    @classmethod
    def from_url(cls, url: str, *, statement_timeout_ms: int | None, pool_size: int, read_only: bool) -> Self:
        """Every pooled connection is read-only (``default_transaction_read_only``) whatever ``read_only``
        says: PostgreSQL takes no lock at opening, so there is nothing else to leave out."""
        return cls(url, statement_timeout_ms=statement_timeout_ms, pool_size=pool_size)

    def __repr__(self) -> str:
        return f"PostgresBackend({redact_url(self.url)!r})"

    def identity(self) -> str:
        """The redacted URL plus the cluster's system identifier (when readable) and the database's OID."""
        parts = [redact_url(self.url)]
        for sql in (
            "SELECT system_identifier::text FROM pg_control_system()",
            "SELECT oid::text || ':' || datname FROM pg_database WHERE datname = current_database()",
        ):
            try:
                parts.append(str(self.execute(sql)[1][0][0]))
            except Exception:  # not readable for this role: the URL (and the OID) must do
                parts.append("?")
        return "postgres:" + ":".join(parts)

    def data_stamp(self) -> str:
        """The write counter and the next transaction id (it moves exactly when some transaction in the
        cluster writes: read-only queries, hint bits and checkpoints leave it alone, unlike the WAL
        position). A writing transaction is assigned an xid when it first writes, before it can commit:
        any committed write since the last stamp moved xmax (a miss, never stale). On a standby the
        replayed WAL position is the only signal."""
        _, rows = self.execute(
            "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text "
            "ELSE pg_snapshot_xmax(pg_current_snapshot())::text END"
        )
        return f"{self.data_version}:{rows[0][0]}"

    def tables(self) -> list[str]:
        return information_schema_tables(self)

    def columns(self, table: str) -> dict[str, str] | None:
        return information_schema_columns(self, table)

    def write_catalog(self, table: str) -> WriteCatalog:
        """Constraints, unique or exclusion indexes, defaults, triggers and rules from ``pg_catalog``."""
        regclass = quote_ident(table).replace("'", "''")
        relation = f"to_regclass('{regclass}')"
        _, rows = self.execute(
            "SELECT c.contype::text, ARRAY(SELECT a.attname::text FROM unnest(c.conkey) k "
            "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k) "
            f"FROM pg_constraint c WHERE c.conrelid = {relation} AND c.contype IN ('p', 'u', 'f', 'x')"
        )
        keys: list[tuple[str, list[str] | None]] = [(_CONSTRAINTS[contype], list(columns)) for contype, columns in rows]
        _, rows = self.execute(
            "SELECT i.indexprs IS NOT NULL OR i.indpred IS NOT NULL, ARRAY(SELECT a.attname::text "
            "FROM unnest(i.indkey) k JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k) "
            f"FROM pg_index i WHERE i.indrelid = {relation} AND (i.indisunique OR i.indisexclusion) "
            "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)"
        )
        keys += [("unique index", None if expression else list(columns)) for expression, columns in rows]
        _, rows = self.execute(
            f"SELECT a.attname::text, pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a LEFT JOIN pg_attrdef d "
            f"ON d.adrelid = a.attrelid AND d.adnum = a.attnum WHERE a.attrelid = {relation} AND a.attnum > 0 "
            "AND NOT a.attisdropped"
        )
        defaults = {str(c): d for c, d in rows}
        _, rows = self.execute(
            f"SELECT (SELECT count(*) FROM pg_trigger WHERE tgrelid = {relation} AND NOT tgisinternal) "
            f"+ (SELECT count(*) FROM pg_rewrite WHERE ev_class = {relation} AND rulename <> '_RETURN')"
        )
        triggers = ["a trigger or rule"] if rows and rows[0][0] else []
        return WriteCatalog(keys, defaults, triggers)

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
