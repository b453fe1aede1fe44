"""Result cache entries are signed data (issue #27, item 5): whoever can write the cache table can
neither run code in dpsql nor have an answer served that dpsql did not release under that key.

Real stores (a SQLite file, a PostgreSQL database) and a real engine over the health demo: a tampered,
foreign, swapped or old (pickled) entry is a miss, the repeat is charged and answered afresh, the fresh
answer replaces the bad entry, and later queries keep working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import decimal
import json
import logging
import math
import pickle  # noqa: TID251 - only to write the attacks (old entries, the Result.__init__ exploit) into the table
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.backends import Backend
from dpsql.cache import (
    ENTRY_TAG,
    MEASUREMENT_TAG,
    RESULT_FIELDS,
    UNSTORED_FIELDS,
    PostgresResultCache,
    ResultCache,
    dump_result,
    result_cache_key,
    seal,
)
from dpsql.cache import stores as cache_module
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.pgtypes import PgType
from dpsql.policy import Policy
from dpsql.session import OutputColumn, Result, Session
from dpsql.synopsis import reuse
from tests.kinds import new_database_url

ROOT = Path(__file__).resolve().parents[2]
COUNT = "SELECT COUNT(*) FROM patients WHERE age > 30"
GROUPED = "SELECT sex, COUNT(*) FROM patients GROUP BY sex"
EPSILON = 0.1
#: How a stored measurement (not an answer) reads in its entry.
MEASUREMENT = f'"command_tag":"{MEASUREMENT_TAG}"'.encode()
#: How a release's entry in the coarsening index reads (dpsql.synopsis.reuse).
INDEX = f'"command_tag":"{reuse.TAG}"'.encode()

#: pickle of the old exploit: BUILD on the class ``Result`` with slot state {"__init__": set}, i.e.
#: ``setattr(Result, "__init__", set)``; every name in it was on the old unpickler's allow-list.
EXPLOIT = b"\x80\x02cdpsql.session\nResult\nN}X\x08\x00\x00\x00__init__cbuiltins\nset\ns\x86b."


class Table:
    """The cache table as its database's credentials see it: read and write rows directly."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.url.startswith("sqlite:///"):
            with contextlib.closing(sqlite3.connect(self.url.removeprefix("sqlite://"))) as conn:
                rows = conn.execute(sql, params).fetchall()
                conn.commit()
                return rows
        with psycopg.connect(self.url, autocommit=True) as pg:
            cur = pg.execute(sql.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []

    def entries(self) -> dict[str, bytes]:
        """The answers stored (the released measurements stored beside them left out)."""
        rows = self._run("SELECT key, result FROM dpsql_result_cache")
        return {key: bytes(blob) for key, blob in rows if MEASUREMENT not in bytes(blob) and INDEX not in bytes(blob)}

    def write(self, key: str, blob: bytes) -> None:
        self._drop_measurements()
        self._run("UPDATE dpsql_result_cache SET result = ? WHERE key = ?", (blob, key))

    def insert(self, key: str, blob: bytes) -> None:
        self._drop_measurements()
        self._run("INSERT INTO dpsql_result_cache (key, created, result) VALUES (?, ?, ?)", (key, time.time(), blob))

    def _drop_measurements(self) -> None:
        """A tampered answer must be a charged miss: no earlier release of its measurement to be
        finished again from instead, nor finer cells to sum (those paths: tests/synopsis/test_measurement_reuse.py,
        tests/synopsis/test_coarsening.py)."""
        for key, blob in self._run("SELECT key, result FROM dpsql_result_cache"):
            if MEASUREMENT in bytes(blob) or INDEX in bytes(blob):
                self._run("DELETE FROM dpsql_result_cache WHERE key = ?", (key,))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ledger and cache store: a SQLite file, or a fresh PostgreSQL database."""
    return new_database_url(request.param, request, tmp_path)


@pytest.fixture
def engine(health_policy: Policy, health_duckdb: Backend, store_url: str) -> Iterator[Engine]:
    """The health engine with its ledger and result cache in the same store (the default layout)."""
    engine = Engine(health_policy, health_duckdb, Ledger.open(store_url), ResultCache.open(store_url))
    yield engine
    engine.ledger.close()  # the session's DuckDB backend stays open
    assert engine.cache is not None
    engine.cache.close()


def _ask(engine: Engine, sql: str) -> Result:
    return engine.execute(sql, Session("alice", epsilon=EPSILON))


def _spent(engine: Engine) -> float:
    return engine.ledger.spent("health", "alice").epsilon


def _assert_charged_then_cached(engine: Engine, sql: str) -> Result:
    """A tampered entry is a miss: the repeat is charged; the one after is a free hit on the fresh answer."""
    before = _spent(engine)
    fresh = _ask(engine, sql)
    assert fresh.epsilon_spent == EPSILON and _spent(engine) == pytest.approx(before + EPSILON)
    assert "charged" in fresh.notices[0] and "result cache" not in fresh.notices[0]
    again = _ask(engine, sql)
    assert again.epsilon_spent == 0 and "result cache" in again.notices[0]
    assert again.rows == fresh.rows and _spent(engine) == pytest.approx(before + EPSILON)
    return fresh


def _only_entry(table: Table) -> tuple[str, bytes]:
    entries = table.entries()
    assert len(entries) == 1
    return next(iter(entries.items()))


# -- every value type, through each store -------------------------------------------------------------

_AWARE = dt.timezone(dt.timedelta(hours=5, minutes=30))
_VALUES: list[tuple[str, PgType, list[Any]]] = [  # column, PostgreSQL type, values (one per row)
    ("i", "bigint", [0, -7, 2**62, 2**200, None]),
    ("f", "double precision", [1.5, math.nan, math.inf, -math.inf, -0.0]),
    ("f2", "double precision", [5e-324, 1.7976931348623157e308, 0.1, -2.5e-10, None]),
    (
        "n",
        "numeric",
        [
            decimal.Decimal("12.345"),
            decimal.Decimal("NaN"),
            decimal.Decimal("-Infinity"),
            decimal.Decimal("1E+2"),
            decimal.Decimal("-0.00"),
        ],
    ),
    ("s", "text", ["", "naïve ☃ 𝄞", "tab\there\nnul\x00", '["f", "1.5"]', "\ud800"]),
    ("b", "boolean", [True, False, None, True, False]),
    ("d", "date", [dt.date(2024, 2, 29), dt.date.min, dt.date.max, None, dt.date(1970, 1, 1)]),
    (
        "ts",
        "timestamp",
        [
            dt.datetime(2024, 1, 2, 3, 4, 5, 678901),
            dt.datetime.min,
            dt.datetime.max,
            None,
            dt.datetime(1999, 12, 31, 23, 59, 59),
        ],
    ),
    (
        "tz",
        "timestamp with time zone",
        [
            dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
            dt.datetime(2024, 6, 1, 12, 0, 0, 1, tzinfo=_AWARE),
            None,
            dt.datetime(1900, 1, 1, tzinfo=dt.timezone(-dt.timedelta(hours=9))),
            dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        ],
    ),
    (
        "t",
        "text",
        [dt.time(0, 0), dt.time(23, 59, 59, 999999), dt.time(12, 30, tzinfo=_AWARE), None, dt.time(1, 2, 3)],
    ),
    (
        "iv",
        "text",
        [dt.timedelta(0), dt.timedelta(days=-3, seconds=5, microseconds=7), dt.timedelta.max, dt.timedelta.min, None],
    ),
    ("x", "text", [b"", b"\x00\xff\x80binary", bytearray(b"ba"), None, bytes(range(256))]),
    ("u", "text", [uuid.UUID(int=0), uuid.UUID("12345678-1234-5678-1234-567812345678"), None, None, None]),
]


def _every_type() -> Result:
    columns = [OutputColumn(name, pg_type, [True, False, None][i % 3]) for i, (name, pg_type, _) in enumerate(_VALUES)]
    rows = [tuple(values[r] for _, _, values in _VALUES) for r in range(5)]
    widths = [None, 0.5, math.inf, math.nan, 3.0, None, None, None, None, None, None, None, None]
    return Result(
        columns=columns,
        rows=rows,
        accuracy=[tuple(widths)] * len(rows),
        epsilon_spent=0.25,
        delta_spent=1e-9,
        remaining_epsilon=9.75,
        notices=["dpsql: charged ε=0.25; remaining ε=9.75", "note: ± ü \x00"],
        command_tag="SELECT 5",
    )


def _same(a: Any, b: Any) -> bool:
    """Equal value and type, telling NaN, -0.0 and UTC offsets apart (bytearray comes back as bytes)."""
    if isinstance(a, bytearray):
        return type(b) is bytes and a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, decimal.Decimal):
        return str(a) == str(b)
    if isinstance(a, dt.datetime | dt.time):  # aware times compare by instant: the offset must be kept too
        return a.replace(tzinfo=None) == b.replace(tzinfo=None) and a.utcoffset() == b.utcoffset()
    return bool(a == b)


def _assert_same_result(got: Result, want: Result) -> None:
    assert got.columns == want.columns and [c.noisy for c in got.columns] == [c.noisy for c in want.columns]
    assert len(got.rows) == len(want.rows) and all(type(row) is tuple for row in got.rows)
    for got_row, want_row in zip(got.rows, want.rows, strict=True):
        for (name, _, _), g, w in zip(_VALUES, got_row, want_row, strict=True):
            assert _same(w, g), (name, w, g)
    for got_row, want_row in zip(got.accuracy, want.accuracy, strict=True):
        assert type(got_row) is tuple and all(_same(w, g) for w, g in zip(want_row, got_row, strict=True))
    for name in ("epsilon_spent", "delta_spent", "remaining_epsilon", "notices", "command_tag"):
        assert getattr(got, name) == getattr(want, name), name


def test_entry_holds_every_result_field() -> None:
    """A field added to Result (or OutputColumn) must be added to the entry format too."""
    assert {f.name for f in dataclasses.fields(Result)} == set(RESULT_FIELDS) | set(UNSTORED_FIELDS)
    assert {f.name for f in dataclasses.fields(OutputColumn)} == {"name", "type", "noisy"}


@pytest.mark.parametrize("other_process", [False, True])
def test_every_value_type_round_trips(store_url: str, other_process: bool) -> None:
    key = b"k" * 32
    want = _every_type()
    writer = ResultCache.open(store_url)
    reader = ResultCache.open(store_url) if other_process else writer
    try:
        assert isinstance(writer, PostgresResultCache) == store_url.startswith("postgresql")
        writer.use_installation_key(key)
        reader.use_installation_key(key)
        before = time.time()
        writer.put("q", want)
        entry = reader.get_entry("q")
        assert entry is not None
        _assert_same_result(entry[0], want)
        assert before <= entry[1] <= time.time()
        stored = Table(store_url).entries()["q"]
        assert stored.startswith(ENTRY_TAG) and b"dpsql.session" not in stored  # data, no class names
        json.loads(stored[len(ENTRY_TAG) + 32 :])  # plain JSON after the tag and the MAC
    finally:
        writer.close()
        if reader is not writer:
            reader.close()


def test_memory_cache_round_trips_and_reads_only_its_own_entries() -> None:
    cache, other = ResultCache(), ResultCache()
    want = _every_type()
    cache.put("q", want)
    entry = cache.get_entry("q")
    assert entry is not None
    _assert_same_result(entry[0], want)
    other._conn.execute(  # an entry copied into another cache not signed with the same key
        "INSERT INTO dpsql_result_cache VALUES (?, ?, ?)",
        cache._conn.execute("SELECT key, created, result FROM dpsql_result_cache").fetchone(),
    )
    assert other.get("q") is None


def test_unrepresentable_value_is_not_cached(caplog: pytest.LogCaptureFixture) -> None:
    cache = ResultCache()
    odd = Result([OutputColumn("c", "text")], [(object(),)], [(None,)], 0.1, 0.0)
    with caplog.at_level(logging.WARNING, logger="dpsql.cache"):
        cache.put("q", odd)
        cache.put("q", odd)
    assert cache.get("q") is None
    assert [r.getMessage() for r in caplog.records] == [
        "result not cached: it holds a value an entry cannot represent (TypeError: object)"
    ]


def test_first_valid_writer_wins(store_url: str) -> None:
    caches = [ResultCache.open(store_url), ResultCache.open(store_url)]
    try:
        for c in caches:
            c.use_installation_key(b"i" * 32)
        caches[0].put("q", Result([OutputColumn("n", "bigint")], [(41,)], [(3.0,)], 0.5, 0.0))
        caches[1].put("q", Result([OutputColumn("n", "bigint")], [(99,)], [(3.0,)], 0.5, 0.0))
        assert [c.get("q").rows for c in caches] == [[(41,)], [(41,)]]
    finally:
        for c in caches:
            c.close()


# -- tampering through the table, against a real engine --------------------------------------------


def test_flipped_byte_is_a_charged_miss(engine: Engine, store_url: str) -> None:
    first = _ask(engine, GROUPED)
    table = Table(store_url)
    key, blob = _only_entry(table)
    for position in (len(blob) - 5, len(ENTRY_TAG) + 3, 2):  # the document, the MAC, the tag
        flipped = bytearray(blob)
        flipped[position] ^= 0x01
        table.write(key, bytes(flipped))
        _assert_charged_then_cached(engine, GROUPED)
        blob = table.entries()[key]
    assert len(_ask(engine, COUNT).rows) == 1  # other queries unaffected
    assert first.columns == _ask(engine, GROUPED).columns


def test_json_without_a_valid_mac_is_never_served(
    engine: Engine, store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _ask(engine, COUNT)
    table = Table(store_url)
    key, _ = _only_entry(table)
    forged = Result([OutputColumn("count", "bigint")], [(123456789,)], [(None,)], 0.0, 0.0, notices=["FORGED-MARK"])
    document = dump_result(key, forged, time.time())
    unsigned = ENTRY_TAG + b"\x00" * 32 + document
    for entry in (unsigned, seal(result_cache_key(b"another installation"), document)):
        table.write(key, entry)
        with caplog.at_level(logging.WARNING, logger="dpsql.cache"):
            assert engine.cache is not None
            assert engine.cache.get(key) is None and engine.cache.get(key) is None  # read twice: logged once
            fresh = _assert_charged_then_cached(engine, COUNT)
        assert fresh.rows != [(123456789,)] and "FORGED-MARK" not in fresh.notices
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad signature" in warnings[0].getMessage()
    assert "FORGED-MARK" not in caplog.text and "123456789" not in caplog.text


def test_swapped_payloads_are_misses(engine: Engine, store_url: str) -> None:
    count, grouped = _ask(engine, COUNT), _ask(engine, GROUPED)
    table = Table(store_url)
    entries = table.entries()
    assert len(entries) == 2
    (k1, b1), (k2, b2) = entries.items()
    table.write(k1, b2)
    table.write(k2, b1)
    assert _assert_charged_then_cached(engine, COUNT).columns == count.columns
    assert _assert_charged_then_cached(engine, GROUPED).columns == grouped.columns


def test_old_pickle_entries_are_misses(engine: Engine, store_url: str) -> None:
    released = _ask(engine, COUNT)
    table = Table(store_url)
    key, _ = _only_entry(table)
    table.write(key, pickle.dumps(released))  # what the previous format stored
    _assert_charged_then_cached(engine, COUNT)
    assert table.entries()[key].startswith(ENTRY_TAG)  # replaced by the fresh answer


def test_exploit_pickle_is_inert(engine: Engine, store_url: str) -> None:
    # the payload really is the attack: loaded by pickle it rebinds Result.__init__ (in a child process)
    probe = "import pickle, sys; from dpsql.session import Result; pickle.loads(sys.stdin.buffer.read()); "
    probe += "print(Result.__init__ is set)"
    child = subprocess.run(
        [sys.executable, "-c", probe], input=EXPLOIT, capture_output=True, cwd=ROOT, check=True, timeout=60
    )
    assert child.stdout.strip() == b"True"

    init = Result.__init__
    try:
        _ask(engine, COUNT)
        table = Table(store_url)
        key, _ = _only_entry(table)
        table.write(key, EXPLOIT)
        table.insert("f" * 64, EXPLOIT)  # also under a key no query has
        _assert_charged_then_cached(engine, COUNT)
        assert engine.cache is not None and engine.cache.get("f" * 64) is None
        assert Result.__init__ is init
        assert len(_ask(engine, GROUPED).rows) >= 1  # later queries keep working
    finally:
        Result.__init__ = init  # type: ignore[method-assign]  # never leave a broken class to other tests


def test_oversized_row_is_a_miss(engine: Engine, store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _ask(engine, COUNT)
    table = Table(store_url)
    key, blob = _only_entry(table)
    monkeypatch.setattr(cache_module, "MAX_ENTRY_BYTES", len(blob) + 100)
    table.write(key, blob + b"\x00" * 200)  # a row too large to be read back at all
    _assert_charged_then_cached(engine, COUNT)
    assert table.entries()[key].startswith(ENTRY_TAG) and len(table.entries()[key]) <= len(blob) + 100


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.replace(b'"rows":[[0,', b'"rows":[[{"zz":1},'),  # an unknown tag
        lambda d: d.replace(b'"rows":[[0,', b'"rows":[[[1,2],'),  # a value of no released type
        lambda d: d.replace(b'"accuracy":[[5,', b'"accuracy":[[99999999999,'),  # more widths than rows
        lambda d: d.replace(b'"bigint"', b'"json"'),  # a type dpsql does not release
        lambda d: d.replace(b'{"d":"2024-02-29"}', b'{"d":"2024-02-30"}'),  # a value that does not parse
        lambda d: d.replace(b'"command_tag":"SELECT 5"', b'"command_tag":"SELECT 5","extra":1'),
        lambda d: b"[" * 100_000 + b"]" * 100_000,  # deep nesting
    ],
)
def test_signed_but_malformed_documents_are_misses(change: Callable[[bytes], bytes]) -> None:
    """Parsing is strict even behind a valid MAC (only the installation can write one): a document
    dpsql would not write is a miss, never an exception or a partly built result."""
    cache = ResultCache()
    cache.use_installation_key(b"k" * 32)
    document = dump_result("q", _every_type(), time.time())
    changed = change(document)
    assert changed != document
    cache._conn.execute(
        "INSERT INTO dpsql_result_cache VALUES ('q', 0, ?)", (seal(result_cache_key(b"k" * 32), changed),)
    )
    assert cache.get_entry("q") is None
