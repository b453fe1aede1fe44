"""Result cache: an exactly repeated query returns the answer already released, at no cost.

Releasing the same noisy answer again is post-processing, so it costs no privacy; asking
again and getting *fresh* noise would cost ε again and let repeats be averaged. The key is
the normalised statement (sqlglot's canonical SQL, so whitespace, keyword case and
unquoted identifier case don't matter) with its bound parameters, the dataset and the
session's (ε, δ, mechanism). Rephrasings get different keys and are charged normally.
Entries are shared by all analysts of a dataset (an answer one analyst paid for is public
to the others at no extra privacy cost). A SQLite file makes the cache survive restarts.

The engine stores each result under :func:`result_key`: the query's key together with the
database's identity, its data version and a hash of the policy's content, so an answer
computed on another database (another file or server at the same URL), before a write, or
under a different policy is never served.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import secrets
import sqlite3
import threading
import time
from typing import Any

from dpsql.errors import LedgerUnavailable
from dpsql.session import Result


def cache_key(dataset: str, normalised_sql: str, params: Any, settings: tuple[Any, ...]) -> str:
    material = "\x1f".join([dataset, normalised_sql, repr(params), repr(settings)])
    return hashlib.sha256(material.encode()).hexdigest()


def result_key(query_key: str, database: str, data_stamp: str, policy_hash: str) -> str:
    """The stored key of a released result: the query's key, on this database, at this data version,
    under this policy. An answer is never served for another database, other data or another policy."""
    material = "\x1f".join([query_key, database, data_stamp, policy_hash])
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
    """Released results by key, in memory or in a SQLite file (``sqlite:///abs/path``)."""

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
    def open(cls, url: str, *, ttl_seconds: float | None = None) -> ResultCache:
        if url in ("memory", "sqlite:///:memory:"):
            return cls(":memory:", ttl_seconds=ttl_seconds)
        if not url.startswith("sqlite:///"):
            raise LedgerUnavailable("result cache URL must be sqlite:///<absolute path> or memory")
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
        result: Result = pickle.loads(row[1])
        return result, float(row[0])

    def put(self, key: str, result: Result) -> None:
        """Store a released result (first writer wins: a key's answer never changes)."""
        blob = pickle.dumps(result)
        with self._lock:
            self._conn.execute(
                "INSERT OR IGNORE INTO dpsql_result_cache (key, created, result) VALUES (?, ?, ?)",
                (key, time.time(), blob),
            )

    def close(self) -> None:
        with self._lock:
            self._conn.close()
