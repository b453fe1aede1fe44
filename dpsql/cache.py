"""Result cache: an exactly repeated query returns the answer already released, at no cost.

Releasing the same noisy answer again is post-processing, so it costs no privacy; asking
again and getting *fresh* noise would cost ε again and let repeats be averaged. The key is
the normalised statement (sqlglot's canonical SQL, so whitespace, keyword case and
unquoted identifier case don't matter) with its bound parameters, the dataset, the
session's (ε, δ, mechanism) and its confidence level (``SET dpsql.confidence``: the stored
intervals, ``<name>_ci95`` columns and accuracy notes are computed at it). Rephrasings get
different keys and are charged normally; so is a repeat at another confidence level (fresh noise,
charged: recomputing intervals for stored values would need the pre-finish release, e.g. the noisy
count behind an AVG, which is not stored). Every other ``dpsql.*`` setting is either in the key or only
shapes the wire output from the stored result (``show_intervals``).
Entries are shared by all analysts of a dataset (an answer one analyst paid for is public
to the others at no extra privacy cost). A SQLite file makes the cache survive restarts; a
PostgreSQL table (``ResultCache.open("postgresql://…")``, the default next to a PostgreSQL ledger)
shares it between every ``dpsql serve`` process of an installation, so an exact repeat answered by
one process is a free hit on all the others.

Concurrency: an entry is one row written by one ``INSERT … ON CONFLICT DO NOTHING`` in its own
transaction, so a reader sees either no entry or the whole entry, never a half-written one, and the
first writer's answer is the one every later reader gets. Two processes that miss the same key at the
same moment both compute it and both are charged (each reservation is exact in the ledger); the
second answer is then dropped in favour of the first. That costs budget, never privacy.

The engine stores each result under :func:`result_key`: the query's key together with the
database's identity, its data version and a hash of the policy's content, so an answer
computed on another database (another file or server at the same URL), before a write, or
under a different policy is never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import secrets
import sqlite3
import threading
import time
from typing import Any

from dpsql.errors import LedgerUnavailable
from dpsql.session import Result

log = logging.getLogger("dpsql.cache")

#: The only globals a stored result may name: a shared cache table must not be a code-execution
#: channel for whoever can write to it (pickle would otherwise call anything it names).
_ALLOWED_GLOBALS = {
    ("dpsql.session", "Result"),
    ("dpsql.session", "OutputColumn"),
    ("datetime", "date"),
    ("datetime", "datetime"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("decimal", "Decimal"),
    ("uuid", "UUID"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _ResultUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"result cache entry names {module}.{name}, which is not allowed")
        return super().find_class(module, name)


def dump_result(result: Result) -> bytes:
    return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def load_result(blob: bytes) -> Result:
    """A stored result; only result classes and plain values are rebuilt (see ``_ALLOWED_GLOBALS``)."""
    result = _ResultUnpickler(io.BytesIO(blob)).load()
    if not isinstance(result, Result):
        raise pickle.UnpicklingError("result cache entry is not a result")
    return result


def cache_key(dataset: str, normalised_sql: str, params: Any, settings: tuple[Any, ...]) -> str:
    material = "\x1f".join([dataset, normalised_sql, repr(params), repr(settings)])
    return hashlib.sha256(material.encode()).hexdigest()


def result_key(query_key: str, database: str, data_stamp: str, policy_hash: str, confidence: float) -> str:
    """The stored key of a released result: the query's key, on this database, at this data version,
    under this policy, at this confidence level. An answer is never served for another database, other
    data or another policy, nor with intervals computed at another confidence."""
    material = "\x1f".join([query_key, database, data_stamp, policy_hash, repr(float(confidence))])
    return hashlib.sha256(material.encode()).hexdigest()


def policy_hash(policy: Any) -> str:
    """The policy's content (every field: bounds, budgets, analysts, units), hashed."""
    return hashlib.sha256(policy.model_dump_json().encode()).hexdigest()


def database_identity(backend: Any) -> str:
    """Which database a backend reads, as stable as it can be told apart cheaply.

    DuckDB file: its resolved path. In-memory DuckDB (and unknown backends): a token drawn per
    backend object, so nothing is shared across processes. PostgreSQL: the redacted URL plus the
    cluster's system identifier (when readable) and the database's OID.
    """
    from dpsql.backends import redact_url

    url = redact_url(str(getattr(backend, "url", "")))
    dialect = getattr(backend, "dialect", "")
    path = getattr(backend, "path", None)
    if dialect == "duckdb" and path and path != ":memory:":
        return f"duckdb:{os.path.realpath(path)}"
    if dialect == "postgres":
        parts = [url]
        for sql in (
            "SELECT system_identifier::text FROM pg_control_system()",
            "SELECT oid::text || ':' || datname FROM pg_database WHERE datname = current_database()",
        ):
            try:
                parts.append(str(backend.execute(sql)[1][0][0]))
            except Exception:  # not readable for this role: the URL (and the OID) must do
                parts.append("?")
        return "postgres:" + ":".join(parts)
    token = getattr(backend, "_dpsql_cache_token", None)
    if token is None:
        token = secrets.token_hex(16)
        backend._dpsql_cache_token = token
    return f"{dialect}:{url}:{token}"


def data_stamp(backend: Any) -> str:
    """A stamp that changes whenever the data may have: the backend's write counter, plus for a
    DuckDB file its size and modification time (and its WAL's), for PostgreSQL the next transaction id
    (it moves exactly when some transaction in the cluster writes: read-only queries, hint bits and
    checkpoints leave it alone, unlike the WAL position)."""
    parts = [str(int(getattr(backend, "data_version", 0)))]
    dialect = getattr(backend, "dialect", "")
    path = getattr(backend, "path", None)
    if dialect == "duckdb" and path and path != ":memory:":
        for name in (path, path + ".wal"):
            try:
                stat = os.stat(name)
                parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
            except OSError:
                parts.append("-")
    elif dialect == "postgres":
        # a writing transaction is assigned an xid when it first writes, before it can commit: any
        # committed write since the last stamp moved xmax (a miss, never stale). On a standby the
        # replayed WAL position is the only signal.
        _, rows = backend.execute(
            "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text "
            "ELSE pg_snapshot_xmax(pg_current_snapshot())::text END"
        )
        parts.append(str(rows[0][0]))
    return ":".join(parts)


class ResultCache:
    """Released results by key, in memory or in a SQLite file (``sqlite:///abs/path``); for a
    PostgreSQL table open it with :meth:`open` (``postgresql://…``, a :class:`PostgresResultCache`)."""

    def __init__(self, path: str = ":memory:", *, ttl_seconds: float | None = None) -> None:
        self.ttl_seconds = ttl_seconds
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS dpsql_result_cache "
                "(key TEXT PRIMARY KEY, created REAL NOT NULL, result BLOB NOT NULL)"
            )
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"result cache unavailable: {exc}") from None

    @classmethod
    def beside(cls, ledger_url: str) -> ResultCache:
        """The cache next to a ledger (:func:`default_cache_url`)."""
        return cls.open(default_cache_url(ledger_url))

    @classmethod
    def open(cls, url: str, *, ttl_seconds: float | None = None) -> ResultCache:
        if url in ("memory", "sqlite:///:memory:"):
            return cls(":memory:", ttl_seconds=ttl_seconds)
        if url.startswith(("postgresql://", "postgres://")):
            return PostgresResultCache(url, ttl_seconds=ttl_seconds)
        if not url.startswith("sqlite:///"):
            raise LedgerUnavailable("result cache URL must be sqlite:///<absolute path>, postgresql://… or memory")
        return cls(url.removeprefix("sqlite://"), ttl_seconds=ttl_seconds)

    def get(self, key: str) -> Result | None:
        entry = self.get_entry(key)
        return None if entry is None else entry[0]

    def get_entry(self, key: str) -> tuple[Result, float] | None:
        """The stored result and when it was first computed (seconds since the epoch)."""
        with self._lock:
            row = self._conn.execute("SELECT created, result FROM dpsql_result_cache WHERE key = ?", (key,)).fetchone()
        if row is None or (self.ttl_seconds is not None and time.time() - row[0] > self.ttl_seconds):
            return None
        return load_result(row[1]), float(row[0])

    def put(self, key: str, result: Result) -> None:
        """Store a released result (first writer wins: a key's answer never changes)."""
        blob = dump_result(result)
        with self._lock:
            self._conn.execute(
                "INSERT OR IGNORE INTO dpsql_result_cache (key, created, result) VALUES (?, ?, ?)",
                (key, time.time(), blob),
            )

    def clear(self) -> int:
        """Delete every entry (``dpsql cache clear``); returns how many. Repeats are then charged again."""
        with self._lock:
            return int(self._conn.execute("DELETE FROM dpsql_result_cache").rowcount)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def default_cache_url(ledger_url: str) -> str:
    """Where results are cached next to a ledger: its SQLite file, its PostgreSQL database (shared by
    every process on that ledger), else per-process memory."""
    if ledger_url.startswith(("sqlite:///", "postgresql://", "postgres://")) and ledger_url != "sqlite:///:memory:":
        return ledger_url
    return "memory"


_PG_CACHE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS dpsql_result_cache "
    "(key TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, result BYTEA NOT NULL)"
)
#: Serialises the CREATE TABLE of processes starting together (CREATE … IF NOT EXISTS can still race).
_PG_CACHE_LOCK = (0x64707371, 1)


class PostgresResultCache(ResultCache):
    """The result cache as a table in a PostgreSQL database (normally the ledger's), shared by processes.

    One connection per thread (like the PostgreSQL ledger), autocommit: each ``put`` is a single
    atomic ``INSERT … ON CONFLICT DO NOTHING`` and each ``get`` a single ``SELECT``. A cache that
    cannot be reached is a miss (the ledger, usually the same server, then decides) and a failed store
    is logged and dropped: the answer was paid for and is returned either way.
    """

    def __init__(self, url: str, *, ttl_seconds: float | None = None) -> None:
        self.url = url
        self.ttl_seconds = ttl_seconds
        self._lock = threading.Lock()
        self._local = threading.local()
        self._connections: list[Any] = []
        self._pid = os.getpid()
        self._closed = False
        self._connection()  # a bad URL fails at open, like the ledger

    def _connect(self) -> Any:
        import psycopg

        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in self.url:
            kwargs["connect_timeout"] = 10
        try:
            conn = psycopg.connect(self.url, **kwargs)
            conn.execute("SET statement_timeout = '30s'")
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", _PG_CACHE_LOCK)
                conn.execute(_PG_CACHE_SCHEMA)
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"result cache unavailable: {str(exc).strip()}") from None
        return conn

    def _connection(self) -> Any:
        if self._closed:
            raise LedgerUnavailable("result cache unavailable: closed")
        if os.getpid() != self._pid:  # forked: never share a libpq connection with the parent
            self._pid = os.getpid()
            self._local = threading.local()
            self._connections = []
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = self._connect()
            with self._lock:
                self._connections.append(conn)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            with contextlib.suppress(Exception):  # already failing
                conn.close()

    def get_entry(self, key: str) -> tuple[Result, float] | None:
        import psycopg

        try:
            sql = "SELECT created, result FROM dpsql_result_cache WHERE key = %s"
            row = self._connection().execute(sql, (key,)).fetchone()
        except (psycopg.Error, LedgerUnavailable) as exc:
            log.warning("result cache read failed, treated as a miss: %s", str(exc).strip())
            self._drop()
            return None
        if row is None or (self.ttl_seconds is not None and time.time() - row[0] > self.ttl_seconds):
            return None
        try:
            return load_result(bytes(row[1])), float(row[0])
        except Exception as exc:  # a corrupt or foreign entry is never served
            log.warning("result cache entry unreadable, treated as a miss: %s", exc)
            return None

    def put(self, key: str, result: Result) -> None:
        import psycopg

        blob = dump_result(result)
        try:
            self._connection().execute(
                "INSERT INTO dpsql_result_cache (key, created, result) VALUES (%s, %s, %s) "
                "ON CONFLICT (key) DO NOTHING",
                (key, time.time(), blob),
            )
        except (psycopg.Error, LedgerUnavailable) as exc:
            log.warning("result cache write failed, answer not cached: %s", str(exc).strip())
            self._drop()

    def clear(self) -> int:
        return int(self._connection().execute("DELETE FROM dpsql_result_cache").rowcount)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            with contextlib.suppress(Exception):
                conn.close()
