"""The result cache's stores: a SQLite file or memory (:class:`ResultCache`) and a PostgreSQL table shared
by every process of an installation (:class:`PostgresResultCache`). Concurrency and signing: see
:mod:`dpsql.cache`."""

from __future__ import annotations

import logging
import secrets
import sqlite3
import threading
import time
from typing import Any

from dpsql.cache.codec import UnusableEntry, dump_result, result_cache_key, seal, unseal
from dpsql.errors import LedgerUnavailable
from dpsql.ledger.connections import ThreadConnections
from dpsql.session import Result

log = logging.getLogger("dpsql.cache")

#: Largest entry stored or read back (bytes): a row written by hand cannot make a reader allocate more.
#: A larger result is not cached (an exact repeat is then charged again: budget, never privacy).
MAX_ENTRY_BYTES = 64 << 20


class ResultCache:
    """Released results by key, in memory or in a SQLite file (``sqlite:///abs/path``); for a
    PostgreSQL table open it with :meth:`open` (``postgresql://…``, a :class:`PostgresResultCache`).

    Entries are signed (see :func:`seal`). Until :meth:`use_installation_key` is called (the
    :class:`~dpsql.engine.Engine` does, with its ledger's key) the cache signs with a random key of
    its own: it then reads back only what it wrote itself, and nothing another process or a person
    wrote is ever served.
    """

    def __init__(self, path: str = ":memory:", *, ttl_seconds: float | None = None) -> None:
        self.ttl_seconds = ttl_seconds
        self._lock = threading.Lock()
        self._init_signing()
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS dpsql_result_cache "
                "(key TEXT PRIMARY KEY, created REAL NOT NULL, result BLOB NOT NULL)"
            )
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"result cache unavailable: {exc}") from None

    def _init_signing(self) -> None:
        self._mac_key = secrets.token_bytes(32)
        #: Keys (and unstorable types) already warned about: a bad entry read on every repeat logs once.
        self._warned: set[str] = set()

    def use_installation_key(self, installation_key: bytes) -> None:
        """Sign and verify entries under this installation's key (:func:`result_cache_key`): every
        process on one ledger then shares entries, and no one without the key can write one."""
        self._mac_key = result_cache_key(installation_key)

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
        """The stored result and when it was first computed (seconds since the epoch, as signed).

        An entry that fails verification or parsing is a miss (logged once, without its content):
        the caller then charges and answers the query as for any miss."""
        found = self._fetch(key)
        if found is None:
            return None
        try:
            result, created = self._open(key, found[0])
        except UnusableEntry as exc:
            self._warn_once(key, "result cache entry %s… is unusable (%s), treated as a miss", key[:12], exc.reason)
            return None
        if self.ttl_seconds is not None and time.time() - created > self.ttl_seconds:
            return None
        return result, created

    def put(self, key: str, result: Result) -> None:
        """Store a released result (first writer wins among valid entries: a key's answer never
        changes; an unusable entry under the key is replaced). A result holding a value an entry
        cannot represent, or too large, is not stored: its repeat is charged again."""
        created = time.time()
        try:
            entry = seal(self._mac_key, dump_result(key, result, created))
        except (TypeError, ValueError, ArithmeticError) as exc:  # e.g. a value of an unknown type
            what = type(exc).__name__ + (f": {exc}" if isinstance(exc, TypeError) else "")  # a type name, never a value
            self._warn_once(what, "result not cached: it holds a value an entry cannot represent (%s)", what)
            return
        if len(entry) > MAX_ENTRY_BYTES:
            self._warn_once("size", "result not cached: larger than %d bytes", MAX_ENTRY_BYTES)
            return
        self._store(key, created, entry)

    def _open(self, key: str, entry: Any) -> tuple[Result, float]:
        """A fetched entry (None: too large to read) as a result, or UnusableEntry."""
        if entry is None:
            raise UnusableEntry("too large")
        try:
            return unseal(self._mac_key, key, entry)
        except UnusableEntry:
            raise
        except Exception:  # a value that does not parse (only possible with the key): never served
            raise UnusableEntry("malformed") from None

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what in self._warned:
            return
        if len(self._warned) >= 4096:
            self._warned.clear()
        self._warned.add(what)
        log.warning(message, *args)

    def _fetch(self, key: str) -> tuple[bytes | None] | None:
        """The stored entry under ``key`` (None inside when larger than MAX_ENTRY_BYTES), None if none."""
        with self._lock:
            return self._fetch_locked(key)

    def _fetch_locked(self, key: str) -> tuple[bytes | None] | None:
        row = self._conn.execute(
            "SELECT CASE WHEN length(result) <= ? THEN result END FROM dpsql_result_cache WHERE key = ?",
            (MAX_ENTRY_BYTES, key),
        ).fetchone()
        return None if row is None else (row[0],)

    def _store(self, key: str, created: float, entry: bytes) -> None:
        with self._lock:
            sql = "INSERT OR IGNORE INTO dpsql_result_cache (key, created, result) VALUES (?, ?, ?)"
            if self._conn.execute(sql, (key, created, entry)).rowcount:
                return
            found = self._fetch_locked(key)
            if found is None or self._usable(key, found[0]):
                return
            # replace only the entry just read (a concurrent valid one is kept): too large, or these bytes
            update = "UPDATE dpsql_result_cache SET created = ?, result = ? WHERE key = ? AND "
            if found[0] is None:
                self._conn.execute(update + "length(result) > ?", (created, entry, key, MAX_ENTRY_BYTES))
            else:
                self._conn.execute(update + "result = ?", (created, entry, key, found[0]))

    def _usable(self, key: str, entry: Any) -> bool:
        try:
            self._open(key, entry)
        except UnusableEntry:
            return False
        return True

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
_PG_FETCH = "SELECT CASE WHEN octet_length(result) <= %s THEN result END FROM dpsql_result_cache WHERE key = %s"
_PG_REPLACE = "UPDATE dpsql_result_cache SET created = %s, result = %s WHERE key = %s AND "
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
        self._init_signing()
        self._pool = ThreadConnections(lambda: LedgerUnavailable("result cache unavailable: closed"))
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
                row = conn.execute("SELECT to_regclass('dpsql_result_cache')").fetchone()
                if row is None or row[0] is None:  # a ledger-writer role may not create tables (README roles)
                    conn.execute(_PG_CACHE_SCHEMA)
        except psycopg.Error as exc:
            raise LedgerUnavailable(f"result cache unavailable: {str(exc).strip()}") from None
        return conn

    def _connection(self) -> Any:
        conn = self._pool.current()
        if conn is None or conn.closed or conn.broken:
            conn = self._pool.keep(self._connect())
        return conn

    def _drop(self) -> None:
        self._pool.drop()

    def _fetch(self, key: str) -> tuple[bytes | None] | None:
        import psycopg

        try:
            row = self._connection().execute(_PG_FETCH, (MAX_ENTRY_BYTES, key)).fetchone()
        except (psycopg.Error, LedgerUnavailable) as exc:
            log.warning("result cache read failed, treated as a miss: %s", str(exc).strip())
            self._drop()
            return None
        return None if row is None else (None if row[0] is None else bytes(row[0]),)

    def _store(self, key: str, created: float, entry: bytes) -> None:
        import psycopg

        try:
            conn = self._connection()
            sql = (
                "INSERT INTO dpsql_result_cache (key, created, result) VALUES (%s, %s, %s) ON CONFLICT (key) DO NOTHING"
            )
            if conn.execute(sql, (key, created, entry)).rowcount:
                return
            row = conn.execute(_PG_FETCH, (MAX_ENTRY_BYTES, key)).fetchone()
            found = None if row is None or row[0] is None else bytes(row[0])
            if row is None or self._usable(key, found):
                return
            # replace only the entry just read (a concurrent valid one is kept): too large, or these bytes
            if found is None:
                conn.execute(_PG_REPLACE + "octet_length(result) > %s", (created, entry, key, MAX_ENTRY_BYTES))
            else:
                conn.execute(_PG_REPLACE + "result = %s", (created, entry, key, found))
        except (psycopg.Error, LedgerUnavailable) as exc:
            log.warning("result cache write failed, answer not cached: %s", str(exc).strip())
            self._drop()

    def clear(self) -> int:
        return int(self._connection().execute("DELETE FROM dpsql_result_cache").rowcount)

    def close(self) -> None:
        self._pool.close()
