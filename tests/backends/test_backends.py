"""The same SQL gives the same answers on DuckDB and PostgreSQL, safely and concurrently."""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest

from dpsql.backends import (
    BACKENDS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    Backend,
    BackendBase,
    database_log,
    normalize_value,
    open_backend,
    redact_url,
    stored_type_mismatches,
)
from dpsql.backends.duckdb import DuckDBBackend, _database_path
from dpsql.backends.postgres import PostgresBackend
from dpsql.backends.spark import SparkBackend
from dpsql.cache import UNSEEN_WRITES_WINDOW
from dpsql.cache import keys as cache
from dpsql.errors import BackendError, QueryCanceled
from dpsql.writes import write_oracles

COLUMNS = [("id", "BIGINT"), ("region", "TEXT"), ("age", "INTEGER"), ("income", "DOUBLE PRECISION"),
           ("visited", "DATE")]  # fmt: skip
SECRET = "Zebulon-7731"  # a private value that must never appear in an error message


def _rows(n: int = 2_000) -> list[tuple[Any, ...]]:
    rng = random.Random(7)  # test data only; never used for noise
    regions = ["north", "south", "east", "west", SECRET]
    rows = []
    for i in range(n):
        rows.append(
            (
                i,
                regions[i % len(regions)],
                None if i % 97 == 0 else rng.randint(-5, 120),
                None if i % 89 == 0 else round(rng.uniform(-1000, 250_000), 2),
                dt.date(2024, 1, 1) + dt.timedelta(days=i % 366),
            )
        )
    return rows


ROWS = _rows()

QUERIES = [
    "SELECT COUNT(*) AS n FROM people",
    "SELECT COUNT(age) AS n, COUNT(DISTINCT region) AS r FROM people",
    "SELECT SUM(LEAST(GREATEST(age, 0), 100)) AS s FROM people",
    "SELECT SUM(LEAST(GREATEST(income, 0.0), 100000.0)) AS s FROM people",
    "SELECT region, COUNT(*) AS n, SUM(LEAST(GREATEST(age, 0), 100)) AS s FROM people GROUP BY region ORDER BY region",
    "SELECT EXTRACT(MONTH FROM visited) AS m, COUNT(*) AS n FROM people GROUP BY 1 ORDER BY 1",
    "SELECT AVG(LEAST(GREATEST(age, 0), 100)) AS a FROM people WHERE region <> 'north'",
    "SELECT region, SUM(CASE WHEN age IS NULL THEN 1 ELSE 0 END) AS nulls FROM people GROUP BY region ORDER BY region",
]


@pytest.fixture(scope="module")
def loaded_pg(pg_backend: Backend) -> Backend:
    pg_backend.load_rows("people", COLUMNS, ROWS, replace=True)
    return pg_backend


@pytest.fixture
def loaded_duckdb(duckdb_backend: Backend) -> Backend:
    duckdb_backend.load_rows("people", COLUMNS, iter(ROWS))
    return duckdb_backend


BOTH = pytest.mark.parametrize("loaded", ["loaded_duckdb", "loaded_pg"], indirect=True)
EMPTY = pytest.mark.parametrize("empty", ["duckdb_backend", "pg_backend"], indirect=True)


@pytest.fixture
def loaded(request: pytest.FixtureRequest) -> Backend:
    """The ``people`` table on the backend named by the parameter (only that one is started)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def empty(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(request.param)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-6)
    return a == b


@pytest.mark.parametrize("sql", QUERIES)
def test_same_results_on_duckdb_and_postgres(loaded_duckdb: Backend, loaded_pg: Backend, sql: str) -> None:
    d_cols, d_rows = loaded_duckdb.execute(sql)
    p_cols, p_rows = loaded_pg.execute(sql)
    assert d_cols == p_cols
    assert len(d_rows) == len(p_rows) > 0
    for d_row, p_row in zip(d_rows, p_rows, strict=True):
        assert all(_same(x, y) for x, y in zip(d_row, p_row, strict=True)), (d_row, p_row)


@BOTH
def test_values_match_python(loaded: Backend) -> None:
    expected = sum(min(max(r[2], 0), 100) for r in ROWS if r[2] is not None)
    _, rows = loaded.execute("SELECT COUNT(*), SUM(LEAST(GREATEST(age, 0), 100)) FROM people")
    assert rows == [(len(ROWS), expected)]
    assert all(type(v) is int for v in rows[0])  # Decimal / HUGEINT normalised


def test_dialects() -> None:
    assert open_backend("duckdb://").dialect == "duckdb"
    assert open_backend("postgresql://u@127.0.0.1:1/x").dialect == "postgres"  # lazy: no connection yet
    assert open_backend("postgres://u@127.0.0.1:1/x").dialect == "postgres"
    with pytest.raises(BackendError):
        open_backend("mysql://x")


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("duckdb://", ":memory:"),
        ("duckdb:///:memory:", ":memory:"),
        ("duckdb:///srv/data/a.duckdb", "/srv/data/a.duckdb"),
    ],
)
def test_duckdb_url_paths(url: str, path: str) -> None:
    assert _database_path(url) == path


def test_duckdb_file_database(tmp_path: Any) -> None:
    url = f"duckdb://{tmp_path}/x.duckdb"
    backend = open_backend(url)
    backend.load_rows("t", [("a", "INTEGER")], [(1,), (2,)])
    backend.close()
    reopened = open_backend(url)
    assert reopened.execute("SELECT SUM(a) AS s FROM t") == (["s"], [(3,)])
    reopened.close()


def test_redact_url() -> None:
    assert redact_url("postgresql://alice:s3cret@db:5432/x") == "postgresql://alice:***@db:5432/x"
    assert "s3cret" not in repr(open_backend("postgresql://alice:s3cret@db:5432/x"))


def test_normalize_value() -> None:
    assert normalize_value(Decimal("12")) == 12 and type(normalize_value(Decimal("12"))) is int
    assert normalize_value(Decimal("12.50")) == 12.5
    assert normalize_value("x") == "x"


@BOTH
def test_errors_do_not_leak_data(loaded: Backend, caplog: pytest.LogCaptureFixture) -> None:
    backend = loaded
    failing = [
        f"SELECT CAST(region AS INTEGER) FROM people WHERE region = '{SECRET}'",  # error quotes it
        "SELECT no_such_column FROM people",
        "SELECT FROM WHERE",
        "SELECT 1; SELECT 2",  # a second statement is never run
    ]
    for sql in failing:
        with caplog.at_level(logging.DEBUG), pytest.raises(BackendError) as info:
            backend.execute(sql)
        err = info.value
        assert err.sqlstate == "58P02"
        assert SECRET not in str(err) and SECRET not in repr(err.args)
        assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    # Only the operator-only database log keeps the original message, below WARNING (pytest attaches
    # caplog to non-propagating loggers; tests/adversarial/test_front_doors.py checks that an analyst's
    # own process never prints it).
    assert SECRET in caplog.text
    assert {r.name for r in caplog.records if SECRET in r.getMessage()} == {database_log.name}
    assert all(r.levelno < logging.WARNING for r in caplog.records if r.name == database_log.name)
    # the pool/cursor is still usable after errors
    assert backend.execute("SELECT COUNT(*) AS n FROM people") == (["n"], [(len(ROWS),)])


@BOTH
def test_execute_is_read_only(loaded: Backend) -> None:
    backend = loaded
    for sql in ["DELETE FROM people", "CREATE TABLE evil (a INT)", "INSERT INTO people (id) VALUES (-1)"]:
        with pytest.raises(BackendError):
            backend.execute(sql)
    if backend.dialect == "postgres":
        with pytest.raises(BackendError):  # a second statement (after leaving read-only) never runs
            backend.execute("SET transaction_read_only = off; DELETE FROM people")
    assert backend.execute("SELECT COUNT(*) FROM people")[1] == [(len(ROWS),)]


def test_postgres_statement_timeout(loaded_pg: Backend) -> None:
    backend = open_backend(loaded_pg.url, statement_timeout_ms=200)
    try:
        with pytest.raises(QueryCanceled, match="statement timeout") as info:
            backend.execute("SELECT pg_sleep(5)")
        assert info.value.sqlstate == "57014"
        assert backend.execute("SELECT 1 AS one") == (["one"], [(1,)])
    finally:
        backend.close()


def test_duckdb_statement_timeout() -> None:
    backend = open_backend("duckdb://", statement_timeout_ms=200)
    try:
        with pytest.raises(QueryCanceled, match="statement timeout") as info:
            backend.execute("SELECT COUNT(*) FROM range(100000000000) a")
        assert info.value.sqlstate == "57014"
        assert backend.execute("SELECT 1 AS one") == (["one"], [(1,)])
    finally:
        backend.close()


def test_postgres_unreachable_is_backend_error() -> None:
    backend = open_backend("postgresql://nobody:pw-Secret@127.0.0.1:1/x")
    with pytest.raises(BackendError) as info:
        backend.execute("SELECT 1")
    assert "pw-Secret" not in str(info.value)
    backend.close()


def test_every_backend_has_a_default_timeout() -> None:
    backend = open_backend("duckdb://")
    try:
        assert backend.statement_timeout_ms == DEFAULT_STATEMENT_TIMEOUT_MS  # type: ignore[attr-defined]
    finally:
        backend.close()


@EMPTY
def test_load_rows_replace_and_bad_types(empty: Backend) -> None:
    empty.load_rows("rep", [("a", "INTEGER")], [(1,)], replace=True)
    with pytest.raises(BackendError):
        empty.load_rows("rep", [("a", "INTEGER")], [(1,)])  # exists, no replace
    empty.load_rows("rep", [("a", "INTEGER"), ("b", "NUMERIC(10, 2)")], [(2, Decimal("1.5"))], replace=True)
    assert empty.execute("SELECT a, b FROM rep") == (["a", "b"], [(2, 1.5)])
    with pytest.raises(BackendError):
        empty.load_rows("bad", [("a", "INT); DROP TABLE rep; --")], [])
    empty.execute_script("DROP TABLE IF EXISTS s1; CREATE TABLE s1 (x INT); INSERT INTO s1 VALUES (4), (5);")
    assert empty.execute("SELECT SUM(x) FROM s1")[1] == [(9,)]


@EMPTY
def test_load_rows_nulls_first(empty: Backend) -> None:
    rows = [(None, None)] * 1500 + [(2**40, "late")]
    empty.load_rows("nf", [("big", "BIGINT"), ("s", "TEXT")], rows, replace=True)
    assert empty.execute("SELECT MAX(big), MAX(s), COUNT(*) FROM nf")[1] == [(2**40, "late", 1501)]


@BOTH
def test_concurrent_execute(loaded: Backend) -> None:
    backend = loaded
    queries = [QUERIES[i % len(QUERIES)] for i in range(64)]
    expected = {sql: backend.execute(sql) for sql in QUERIES}
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(backend.execute, queries))
    for sql, result in zip(queries, results, strict=True):
        assert result == expected[sql]


@EMPTY
def test_load_rows_keeps_nan_apart_from_null(empty: Backend) -> None:
    rows = [(1.0, 1), (float("nan"), 2), (None, 3), (float("inf"), 4)]
    empty.load_rows("nan", [("x", "DOUBLE PRECISION"), ("i", "INTEGER")], rows, replace=True)
    got = empty.execute("SELECT i, x IS NULL, CAST(x AS TEXT) FROM nan ORDER BY i")[1]
    assert [(i, isnull) for i, isnull, _ in got] == [(1, False), (2, False), (3, True), (4, False)]
    assert got[1][2].lower() == "nan" and got[3][2].lower() in ("inf", "infinity")


def test_duckdb_groups_dense_units_in_a_perfect_hash_table() -> None:
    """Person-level queries group by the privacy unit; ids spanning 2^17 values must not fall back to hashing."""
    backend = open_backend("duckdb://")
    try:
        backend.execute_script("CREATE TABLE ev AS SELECT i % 100000 AS user_id FROM range(300000) r(i)")
        plan = "".join(str(r) for r in backend.execute("EXPLAIN SELECT user_id, COUNT(*) FROM ev GROUP BY user_id")[1])
        assert "PERFECT_HASH_GROUP_BY" in plan.upper().replace(" ", "_")
    finally:
        backend.close()


@BOTH
def test_statement_hook_cancels_a_running_statement(loaded: Backend) -> None:
    """The seam the server uses for clients that gave up: the hook receives each statement's cancel."""
    import contextlib
    import threading
    import time

    from dpsql.backends import statement_hook

    slow = (
        "SELECT pg_sleep(20)"
        if loaded.dialect == "postgres"
        else "SELECT COUNT(*) FROM range(100000000000) a, range(10) b WHERE a.range % 7 = b.range"
    )
    offered: list[object] = []

    @contextlib.contextmanager
    def hook(cancel: Callable[[], object]) -> Iterator[None]:
        offered.append(cancel)
        yield

    outcome: list[BaseException] = []

    def run() -> None:
        with statement_hook(hook):
            try:
                loaded.execute(slow)
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    while not offered and time.monotonic() - started < 10:
        time.sleep(0.01)
    time.sleep(0.2)
    offered[-1]()  # type: ignore[operator]
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert isinstance(outcome[0], QueryCanceled) and outcome[0].sqlstate == "57014"
    assert loaded.execute("SELECT 1 AS one") == (["one"], [(1,)])  # the connection/pool is still usable


def test_optional_capabilities_are_in_the_protocol(loaded_duckdb: Backend, loaded_pg: Backend) -> None:
    """data_version, row_hash, top_rows and proven_ranges exist on every backend: no getattr probing needed."""
    for backend in (loaded_duckdb, loaded_pg):
        assert isinstance(backend, Backend)
        assert isinstance(backend.data_version, int) and backend.row_hash in ("md5", "duckdb", "postgres")
        assert isinstance(backend.proven_ranges("t", ["x"]), dict)
    assert (loaded_duckdb.row_hash, loaded_duckdb.top_rows) == ("duckdb", "min_by")
    assert (loaded_pg.row_hash, loaded_pg.top_rows) == ("postgres", "row_number")
    assert loaded_pg.data_version == 0 and loaded_pg.proven_ranges("t", ["x"]) == {}


# --- capabilities: every difference is declared on the backend's class ----------------------------


def test_every_difference_is_declared_on_the_class() -> None:
    """No backend inherits a silent answer: each says on its own class whether its stamp sees writes made
    outside dpsql and whether it has information_schema; a backend that does not cannot be defined."""
    for cls in BACKENDS:
        for name in ("schemes", "dialect", "sees_outside_writes", "information_schema"):
            assert name in vars(cls), (cls.__name__, name)
    assert (DuckDBBackend.sees_outside_writes, PostgresBackend.sees_outside_writes) == (True, True)
    assert SparkBackend.sees_outside_writes is False and SparkBackend.information_schema is False
    assert SparkBackend.write_catalog(object.__new__(SparkBackend), "t") is None  # no writes on Spark
    with pytest.raises(TypeError, match="sees_outside_writes"):

        class Silent(BackendBase):
            schemes = ("silent",)
            dialect = "duckdb"
            information_schema = False


class _BlindDuckDB(DuckDBBackend):
    """A backend whose stamp cannot see writes made outside dpsql (as Spark's), on DuckDB for speed."""

    sees_outside_writes = False


def test_a_stamp_blind_to_outside_writes_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    """Such a backend's cache stamp also names a short time window: an answer is served at most
    UNSEEN_WRITES_WINDOW seconds, never indefinitely after a write dpsql did not see."""
    blind, seeing = _BlindDuckDB("duckdb://"), DuckDBBackend("duckdb://")
    now = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])  # the module dpsql.cache reads the clock from
    first = (cache.data_stamp(blind), cache.data_stamp(seeing))
    now[0] += UNSEEN_WRITES_WINDOW
    assert cache.data_stamp(blind) != first[0]
    assert cache.data_stamp(seeing) == first[1] == "0"  # an in-memory database is written only through dpsql
    blind.close()
    seeing.close()


def test_duckdb_identity_and_stamp(tmp_path: Any) -> None:
    path = tmp_path / "d.duckdb"
    backend = DuckDBBackend(f"duckdb:///{path}")
    assert cache.database_identity(backend) == f"duckdb:{path.resolve()}"
    before = cache.data_stamp(backend)
    backend.execute_script("CREATE TABLE t AS SELECT 1 AS x; CHECKPOINT")
    assert cache.data_stamp(backend) != before
    memory = DuckDBBackend("duckdb://")
    assert memory.identity() == memory.identity() != DuckDBBackend("duckdb://").identity()
    backend.close()
    memory.close()


def test_stored_types_and_write_catalog_on_duckdb() -> None:
    """The stored-type refusal reads DuckDB's catalog case-insensitively, like DuckDB resolves names."""
    backend = open_backend("duckdb://")
    backend.execute_script("CREATE TABLE Answers (id INTEGER PRIMARY KEY, score VARCHAR, ok BOOLEAN)")
    assert backend.tables() == ["Answers"]
    assert backend.columns("answers") == {"id": "INTEGER", "score": "VARCHAR", "ok": "BOOLEAN"}
    assert backend.columns("absent") is None
    declared = {"id": "int", "score": "float", "ok": "boolean"}
    assert stored_type_mismatches(backend, "answers", declared) == [("score", "VARCHAR")]
    assert write_oracles(backend, "Answers", ["score"]) == []
    assert write_oracles(backend, "Answers", ["id"]) == ['a PRIMARY KEY on "id"']
    backend.close()


def test_open_backend_dispatches_on_the_class_schemes() -> None:
    for cls in BACKENDS:
        for scheme in cls.schemes:
            assert scheme in ("duckdb", "postgresql", "postgres", "spark", "sc")
    read_only = open_backend("duckdb://", read_only=True)
    assert isinstance(read_only, DuckDBBackend) and not read_only.read_only  # in memory: nothing to share
    read_only.close()
