"""Result cache: an exactly repeated query returns the answer already released, at no cost.

Releasing the same noisy answer again is post-processing, so it costs no privacy; asking
again and getting *fresh* noise would cost ε again and let repeats be averaged. The key is
the normalised statement (sqlglot's canonical SQL, so whitespace, keyword case and
unquoted identifier case don't matter) with its bound parameters, the dataset and the
session's (ε, δ, mechanism). Rephrasings get different keys and are charged normally.
Entries are shared by all analysts of a dataset (an answer one analyst paid for is public
to the others at no extra privacy cost). A SQLite file makes the cache survive restarts.
"""

from __future__ import annotations

import hashlib
import pickle
import sqlite3
import threading
import time
from typing import Any

from dpsql.errors import LedgerUnavailable
from dpsql.session import Result


def cache_key(dataset: str, normalised_sql: str, params: Any, settings: tuple[Any, ...]) -> str:
    material = "\x1f".join([dataset, normalised_sql, repr(params), repr(settings)])
    return hashlib.sha256(material.encode()).hexdigest()


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
        with self._lock:
            row = self._conn.execute("SELECT created, result FROM dpsql_result_cache WHERE key = ?", (key,)).fetchone()
        if row is None or (self.ttl_seconds is not None and time.time() - row[0] > self.ttl_seconds):
            return None
        result: Result = pickle.loads(row[1])
        return result

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
