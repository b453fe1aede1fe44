"""Result cache: an exactly repeated query returns the answer already released, at no cost.

Releasing the same noisy answer again is post-processing, so it costs no privacy; asking
again and getting *fresh* noise would cost ε again and let repeats be averaged. The key is
the normalised statement (sqlglot's canonical SQL, so whitespace, keyword case and
unquoted identifier case don't matter) with its bound parameters, the dataset, the
session's (ε, δ, mechanism) and its confidence level (``SET dpsql.confidence``: the stored
intervals, ``<name>_ci95`` columns and accuracy notes are computed at it). Every other ``dpsql.*``
setting is either in the key or only shapes the wire output from the stored result (``show_intervals``).

Beside each answer the released *measurements* are stored (noisy keys and measures before the output
post-processing) under :func:`stored_measurement_key`: a rephrasing that measures the same thing the
same way (another LIMIT, ORDER BY, HAVING, aliases or confidence level) is finished again from them
for free (:mod:`dpsql.step`, "Measurement reuse"). A rephrasing that measures something else (another
filter, another ε) has another measurement key and is charged normally.
Entries are shared by all analysts of a dataset (an answer one analyst paid for is public
to the others at no extra privacy cost). A SQLite file makes the cache survive restarts; a
PostgreSQL table (``ResultCache.open("postgresql://…")``, the default next to a PostgreSQL ledger)
shares it between every ``dpsql serve`` process of an installation, so an exact repeat answered by
one process is a free hit on all the others.

Concurrency: an entry is one row written by one ``INSERT … ON CONFLICT DO NOTHING`` in its own
transaction, so a reader sees either no entry or the whole entry, never a half-written one, and the
first writer's answer is the one every later reader gets. Two processes that miss the same key at the
same moment both compute it and both are charged (each reservation is exact in the ledger); the
second answer is then dropped in favour of the first. That costs budget, never privacy. An entry that
fails verification (see "entries as signed data" below) is a miss, and the fresh answer replaces exactly
the bad bytes that were read (a conditional UPDATE), so a concurrent valid entry is never overwritten.

The engine stores each result under :func:`result_key`: the query's key together with the
database's identity, its data version and a hash of the policy's content, so an answer
computed on another database (another file or server at the same URL), before a write, or
under a different policy is never served.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import decimal
import hashlib
import hmac
import itertools
import json
import logging
import numbers
import os
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from dpsql.backends import Backend
from dpsql.errors import LedgerUnavailable
from dpsql.pgtypes import PG_TYPE_OIDS
from dpsql.session import OutputColumn, Result

log = logging.getLogger("dpsql.cache")

# -- entries as signed data ------------------------------------------------------------------------
#
# Whoever can write the cache table (anyone holding the cache's or ledger's database credentials)
# must not be able to run code in, or change the answers of, every ``dpsql serve`` process. So an
# entry is *data*, never an object graph: a JSON document of typed values (no class is ever looked up
# by a name found in it), preceded by a version tag and an HMAC-SHA256 under a key derived from the
# installation key (:func:`result_cache_key`). The MAC is checked in constant time before a byte of the
# JSON is parsed, and it covers the entry's cache key, so an entry is served only under the key it was
# written for (payloads swapped between keys fail). An entry that fails is a miss: the query is then
# charged and answered afresh, and the fresh answer replaces the bad entry. Older entries (pickles,
# before format 1) carry no tag and are misses the same way.
#
# What the MAC does not cover: a writer who can also read the installation key (``dpsql_ledger_meta``,
# the same database when the cache sits beside the ledger, its default) can forge entries; they are
# still only data, so the worst is a wrong answer served for free, no worse than what the same
# credentials already allow on the ledger. A separate cache database or a role without SELECT on
# ``dpsql_ledger_meta`` keeps the MAC's guarantee.

#: Leads every entry of this format; anything else (an old pickle, a foreign blob) is a miss.
ENTRY_TAG = b"dpsql result cache 1\n"
_MAC_SIZE = hashlib.sha256().digest_size
#: Largest entry stored or read back (bytes): a row written by hand cannot make a reader allocate more.
#: A larger result is not cached (an exact repeat is then charged again: budget, never privacy).
MAX_ENTRY_BYTES = 64 << 20


def result_cache_key(installation_key: bytes) -> bytes:
    """The key that signs result cache entries: derived from the installation key with its own label,
    so it signs nothing else and reveals nothing of the installation key or its other derived keys."""
    return hmac.new(installation_key, b"dpsql result cache v1", hashlib.sha256).digest()


class UnusableEntry(ValueError):
    """A stored entry that must not be served; ``reason`` names why without quoting the entry."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _corrupt() -> UnusableEntry:
    return UnusableEntry("malformed")


#: Values JSON types by itself: written and read back as they are. Floats are JSON numbers (Python's
#: json writes NaN and ±Infinity as bare tokens and reads them back; a float's text always has a '.'
#: or an exponent, an int's never, so the two cannot be confused).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _encode_other(value: Any) -> Any:
    """A value JSON cannot type by itself, as a one-key object ``{tag: payload}``."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, decimal.Decimal):
        return {"n": str(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats and other reals
        return float(value)
    if isinstance(value, dt.datetime):
        return {"ts": dt.datetime.isoformat(value)}
    if isinstance(value, dt.date):
        return {"d": dt.date.isoformat(value)}
    if isinstance(value, dt.time):
        return {"t": dt.time.isoformat(value)}
    if isinstance(value, dt.timedelta):
        return {"iv": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"x": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, uuid.UUID):
        return {"u": str(value)}
    raise TypeError(type(value).__name__)


_ENCODERS: dict[type, Callable[[Any], Any]] = {
    decimal.Decimal: lambda v: {"n": str(v)},
    dt.datetime: lambda v: {"ts": v.isoformat()},
    dt.date: lambda v: {"d": v.isoformat()},
}


def _encode_rows(rows: list[tuple[Any, ...]]) -> list[Any]:
    """Rows for JSON (tuples are written as arrays): a row of plain values as it is, others tagged."""
    if _PLAIN.issuperset(map(type, itertools.chain.from_iterable(rows))):  # the common result: nothing to tag
        return rows
    return [
        row
        if _PLAIN.issuperset(map(type, row))
        else [value if type(value) in _PLAIN else _ENCODERS.get(type(value), _encode_other)(value) for value in row]
        for row in rows
    ]


def _encode_widths(rows: list[tuple[float | None, ...]]) -> list[list[Any]]:
    """Accuracy rows as ``[count, widths]`` runs of equal consecutive rows (they mostly repeat one tuple)."""
    runs: list[list[Any]] = []
    previous: Any = None
    for row in rows:
        if runs and (row is previous or row == previous):
            runs[-1][0] += 1
        else:
            runs.append([1, [None if w is None else float(w) for w in row]])
        previous = row
    return runs


def _text(payload: Any) -> str:
    if type(payload) is not str:
        raise _corrupt()
    return payload


def _interval(payload: Any) -> dt.timedelta:
    if type(payload) is not list or len(payload) != 3 or any(type(p) is not int for p in payload):
        raise _corrupt()
    return dt.timedelta(days=payload[0], seconds=payload[1], microseconds=payload[2])


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "n": lambda p: decimal.Decimal(_text(p)),
    "ts": lambda p: dt.datetime.fromisoformat(_text(p)),
    "d": lambda p: dt.date.fromisoformat(_text(p)),
    "t": lambda p: dt.time.fromisoformat(_text(p)),
    "iv": _interval,
    "x": lambda p: base64.b64decode(_text(p), validate=True),
    "u": lambda p: uuid.UUID(_text(p)),
}
#: Every type a released value may have once read back.
_VALUE_TYPES = _PLAIN | {decimal.Decimal, dt.datetime, dt.date, dt.time, dt.timedelta, bytes, uuid.UUID}

#: The fields of :class:`Result` an entry holds (every one: a test checks none is added unnoticed).
RESULT_FIELDS = (
    "columns",
    "rows",
    "accuracy",
    "epsilon_spent",
    "delta_spent",
    "remaining_epsilon",
    "notices",
    "command_tag",
)
_DOCUMENT_FIELDS = frozenset({"key", "created", *RESULT_FIELDS})
#: Fields an entry leaves out: quantiles' value intervals (the notes stating them are kept).
UNSTORED_FIELDS = ("intervals",)


def _object(pairs: dict[str, Any]) -> Any:
    """JSON objects while parsing: a tagged value is rebuilt by its tag's decoder (values only, never a
    class named by the entry), the document is kept as a dict, anything else is refused."""
    if len(pairs) == 1:
        ((tag, payload),) = pairs.items()
        decode = _DECODERS.get(tag)
        if decode is not None:
            return decode(payload)
    if pairs.keys() == _DOCUMENT_FIELDS:
        return pairs
    raise _corrupt()


def dump_result(key: str, result: Result, created: float) -> bytes:
    """The JSON document of a released result stored under ``key`` (TypeError or ValueError: a value
    an entry cannot hold; the result is then not cached)."""
    document = {
        "key": key,
        "created": float(created),
        "columns": [[c.name, c.type, c.noisy] for c in result.columns],
        "rows": _encode_rows(result.rows),
        "accuracy": _encode_widths(result.accuracy),
        "epsilon_spent": float(result.epsilon_spent),
        "delta_spent": float(result.delta_spent),
        "remaining_epsilon": None if result.remaining_epsilon is None else float(result.remaining_epsilon),
        "notices": [str(n) for n in result.notices],
        "command_tag": str(result.command_tag),
    }
    return json.dumps(document, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _list(item: Any) -> list[Any]:
    if type(item) is not list:
        raise _corrupt()
    return item


def _float(item: Any) -> float:
    if type(item) is not float:
        raise _corrupt()
    return item


def load_result(key: str, document: bytes) -> tuple[Result, float]:
    """The result (and when it was first computed) in a document written by :func:`dump_result` under
    ``key``; UnusableEntry for anything else. Only values are built: no name in it selects code."""
    try:
        data = json.loads(document, object_hook=_object)
    except UnusableEntry:
        raise
    except (ValueError, RecursionError):
        raise _corrupt() from None
    if type(data) is not dict:
        raise _corrupt()
    if data["key"] != key:
        raise UnusableEntry("stored under another key")
    columns = []
    for column in _list(data["columns"]):
        if type(column) is not list or len(column) != 3:
            raise _corrupt()
        name, type_name, noisy = column
        if type(name) is not str or type_name not in PG_TYPE_OIDS or noisy not in (True, False, None):
            raise _corrupt()
        columns.append(OutputColumn(name, type_name, noisy))
    rows = []
    for row in _list(data["rows"]):
        if type(row) is not list or len(row) != len(columns) or not _VALUE_TYPES.issuperset(map(type, row)):
            raise _corrupt()
        rows.append(tuple(row))
    accuracy: list[tuple[float | None, ...]] = []
    for run in _list(data["accuracy"]):  # one width tuple per row at most: counts cannot make it allocate more
        if (
            type(run) is not list
            or len(run) != 2
            or type(run[0]) is not int
            or not 0 < run[0] <= len(rows) - len(accuracy)
        ):
            raise _corrupt()
        widths = _list(run[1])
        if not {float, type(None)}.issuperset(map(type, widths)):
            raise _corrupt()
        accuracy.extend([tuple(widths)] * run[0])
    notices = _list(data["notices"])
    if any(type(n) is not str for n in notices) or type(data["command_tag"]) is not str:
        raise _corrupt()
    remaining = data["remaining_epsilon"]
    result = Result(
        columns=columns,
        rows=rows,
        accuracy=accuracy,
        epsilon_spent=_float(data["epsilon_spent"]),
        delta_spent=_float(data["delta_spent"]),
        remaining_epsilon=None if remaining is None else _float(remaining),
        notices=list(notices),
        command_tag=data["command_tag"],
    )
    return result, _float(data["created"])


def seal(mac_key: bytes, document: bytes) -> bytes:
    """An entry: the format tag, the HMAC-SHA256 of tag and document, then the document."""
    return ENTRY_TAG + hmac.new(mac_key, ENTRY_TAG + document, hashlib.sha256).digest() + document


def unseal(mac_key: bytes, key: str, entry: Any) -> tuple[Result, float]:
    """The result in a stored entry, after its MAC has been checked (constant time) and before anything
    in it is parsed; UnusableEntry when it is of another format, altered, signed by another
    installation or stored under another key."""
    if not isinstance(entry, bytes | bytearray | memoryview):
        raise UnusableEntry("not an entry")
    entry = bytes(entry)
    if not entry.startswith(ENTRY_TAG):
        raise UnusableEntry("unknown format")
    mac = entry[len(ENTRY_TAG) : len(ENTRY_TAG) + _MAC_SIZE]
    document = entry[len(ENTRY_TAG) + _MAC_SIZE :]
    expected = hmac.new(mac_key, ENTRY_TAG + document, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise UnusableEntry("bad signature")
    return load_result(key, document)


def cache_key(dataset: str, normalised_sql: str, params: Any, settings: tuple[Any, ...]) -> str:
    material = "\x1f".join([dataset, normalised_sql, repr(params), repr(settings)])
    return hashlib.sha256(material.encode()).hexdigest()


def measurement_key(dataset: str, measurement_sql: str, histograms: Any, params: Any, plan: Any, budgeting: Any) -> str:
    """The key of a query's *measurement*, whatever its output post-processing (see :mod:`dpsql.step`):
    the rewritten DP query as rendered (table, filters, keys, bounds, clamps, the salted physical
    choices), its histogram queries, its bound parameters, what the plan measures (``plan``: the keys
    with their domains, the measures with their bounds, quantiles and candidates, the selection count)
    and the budgeting (ε, δ, mechanism, every noise spec and share, the selection threshold): everything
    that sets the distribution of the released measurements. Output expressions, aliases, HAVING,
    ORDER BY and LIMIT/OFFSET are not in it: they are applied after the noise, never in the SQL."""
    parts = [dataset, measurement_sql, repr(histograms), repr(params), repr(plan), repr(budgeting)]
    material = "\x1f".join(["measurement", *parts])
    return hashlib.sha256(material.encode()).hexdigest()


def stored_measurement_key(measurement: str, database: str, data_stamp: str, policy_hash: str) -> str:
    """The stored key of released measurements: the measurement's key on this database, at this data
    version, under this policy (the rules of :func:`result_key`). No confidence level: the intervals
    are recomputed from the noise specs at the asking query's level. Domain-separated from result keys."""
    material = "\x1f".join(["released measurements", measurement, database, data_stamp, policy_hash])
    return hashlib.sha256(material.encode()).hexdigest()


#: The command tag of a stored measurement (a :class:`Result` holding released keys and noisy measures).
MEASUREMENT_TAG = "DPSQL MEASUREMENT"


def measurement_result(nkeys: int, keys: list[tuple[Any, ...]], columns: list[list[Any]]) -> Result:
    """Released measurements as a storable :class:`Result`: per released group its ``nkeys`` key values,
    then each measure's noisy value. Only released values: raw measures are never passed here."""
    names = [f"k{i}" for i in range(nkeys)] + [f"m{i}" for i in range(len(columns))]
    rows = [(*key[:nkeys], *(column[j] for column in columns)) for j, key in enumerate(keys)]
    return Result(
        columns=[OutputColumn(name, "text", None) for name in names],
        rows=rows,
        accuracy=[],
        epsilon_spent=0.0,
        delta_spent=0.0,
        command_tag=MEASUREMENT_TAG,
    )


def measurements(stored: Result, nkeys: int, nmeasures: int) -> tuple[list[tuple[Any, ...]], list[list[Any]]] | None:
    """The released keys and noisy measure columns in a stored measurement; None when it is not one of
    this shape (never served then)."""
    if stored.command_tag != MEASUREMENT_TAG or len(stored.columns) != nkeys + nmeasures:
        return None
    keys = [row[:nkeys] for row in stored.rows]
    return keys, [[row[nkeys + i] for row in stored.rows] for i in range(nmeasures)]


def result_key(query_key: str, database: str, data_stamp: str, policy_hash: str, confidence: float) -> str:
    """The stored key of a released result: the query's key, on this database, at this data version,
    under this policy, at this confidence level. An answer is never served for another database, other
    data or another policy, nor with intervals computed at another confidence."""
    material = "\x1f".join([query_key, database, data_stamp, policy_hash, repr(float(confidence))])
    return hashlib.sha256(material.encode()).hexdigest()


def policy_hash(policy: Any) -> str:
    """The policy's content (every field: bounds, budgets, analysts, units), hashed."""
    return hashlib.sha256(policy.model_dump_json().encode()).hexdigest()


def database_identity(backend: Backend) -> str:
    """Which database a backend reads, as stable as it can be told apart cheaply (:meth:`Backend.identity`:
    a DuckDB file's resolved path, a PostgreSQL cluster and database; otherwise a token per backend
    object, so nothing is shared across processes)."""
    return backend.identity()


#: How long an answer is served for a backend whose stamp cannot see writes made outside dpsql
#: (``sees_outside_writes = False``: Spark), in seconds. The stamp then also names the current window,
#: so a repeat in the next window misses and is charged again: a stale answer is bounded in age,
#: never served indefinitely.
UNSEEN_WRITES_WINDOW = 60


def data_stamp(backend: Backend) -> str:
    """A stamp that changes whenever the data may have (:meth:`Backend.data_stamp`): the backend's write
    counter, plus for a DuckDB file its size and modification time (and its WAL's), for PostgreSQL the
    next transaction id. For a backend that cannot see outside writes, also the current time window."""
    stamp = backend.data_stamp()
    if not backend.sees_outside_writes:
        stamp += f":w{int(time.time() // UNSEEN_WRITES_WINDOW)}"
    return stamp


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
            raise _corrupt() from None

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
        self._lock = threading.Lock()
        self._init_signing()
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
                row = conn.execute("SELECT to_regclass('dpsql_result_cache')").fetchone()
                if row is None or row[0] is None:  # a ledger-writer role may not create tables (README roles)
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
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            with contextlib.suppress(Exception):
                conn.close()
