"""Resource limits of the post-processing sandbox, and the result cache's confidence level (issue #26).

The outer statement of a composite query runs over released rows only, so it is free once its inner
queries are released or cached: it must not be a way to hold a core or the server's memory. Listed in
tests/adversarial/README.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dpsql
from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error, QueryCanceled
from dpsql.ledger import Ledger
from dpsql.outer import sandbox
from dpsql.policy import load_policy
from dpsql.server.limits import Job
from dpsql.session import Session

#: 280 released rows whatever the noise: every key has a public domain (2 x 7 x 4 x 5).
RELEASED = (
    "WITH s AS (SELECT sex, problem, marital_status, ethnicity, COUNT(*) AS n FROM patients "
    "GROUP BY sex, problem, marital_status, ethnicity) "
)
#: 280^4 = 6e9 rows to count: minutes of CPU in the sandbox.
SLOW = RELEASED + "SELECT COUNT(*) FROM s a, s b, s c, s d"
_W = "((problem || problem || problem || problem) || (problem || problem || problem || problem))"
#: ~100 MB: 280 x 280 rows of ~1.3 kB each (strings grown by concatenation, then a cross join).
LARGE = (
    RELEASED
    + "SELECT a.w || b.problem AS big FROM (SELECT w || w || w || w || w || w || w || w AS w FROM "
    + f"(SELECT {_W.replace('problem', 'w')} AS w FROM (SELECT {_W} AS w FROM s) x) y) a, s b"
)
INNER = "(SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) t"
RECURSIVE = [
    f"WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT * FROM r, {INNER}",
    "WITH RECURSIVE r AS (SELECT COUNT(*) AS n FROM patients UNION ALL SELECT n + 1 FROM r) SELECT * FROM r",
    f"SELECT * FROM {INNER} WHERE n > (WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i FROM r) SELECT 1)",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT COUNT(*) FROM patients",
]
SIZED = [
    f"SELECT repeat(sex, 1000000) FROM {INNER}",
    f"SELECT lpad(sex, 100000000, 'x') FROM {INNER}",
    f"SELECT rpad(sex, 100000000) FROM {INNER}",
    f"SELECT generate_series(1, n) FROM {INNER}",
    f"SELECT unnest(ARRAY[1, 2, 3]) FROM {INNER}",
    f"SELECT * FROM {INNER}, unnest(ARRAY[1, 2, 3]) u",
    f"SELECT * FROM {INNER}, range(1000)",
    f"SELECT * FROM {INNER}, generate_series(1, 1000)",
    f"SELECT string_agg(a.sex, ',') FROM {INNER.replace(' t', ' a')}, {INNER.replace(' t', ' b')}",
    f"SELECT array_agg(n) FROM {INNER}",
    f"SELECT format('%1000000000s', sex) FROM {INNER}",
    f"SELECT range(n) FROM {INNER}",
    f"SELECT list_resize([1], 100000000) FROM {INNER}",
]


@pytest.fixture(scope="module")
def health_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://", statement_timeout_ms=0)
    load_demo(backend, ["health"])
    yield backend
    backend.close()


def _engine(backend: Backend, cache: ResultCache | None = None) -> Engine:
    return Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:"), cache)


def _refusal(engine: Engine, sql: str) -> tuple[str, float]:
    with pytest.raises(Error) as caught:
        engine.execute(sql, Session("alice"))
    return caught.value.sqlstate, engine.ledger.spent("health", "alice").epsilon


@pytest.mark.parametrize("sql", RECURSIVE, ids=[f"recursive-{i}" for i in range(len(RECURSIVE))])
def test_recursive_cte_refused_free(health_backend: Backend, sql: str) -> None:
    engine = _engine(health_backend)
    assert _refusal(engine, sql) == ("0A000", 0.0)
    with pytest.raises(Error) as caught:
        engine.explain(sql, Session("alice"))
    assert caught.value.sqlstate == "0A000"


@pytest.mark.parametrize("sql", SIZED, ids=[f"sized-{i}" for i in range(len(SIZED))])
def test_row_and_size_making_functions_refused_free(health_backend: Backend, sql: str) -> None:
    assert _refusal(_engine(health_backend), sql) == ("0A000", 0.0)


def test_concatenation_still_answered(health_backend: Backend) -> None:
    """What the refusals leave: ordinary string and arithmetic post-processing."""
    result = _engine(health_backend).execute(
        f"SELECT sex || '/' || CAST(n AS TEXT), upper(sex), n * 2 FROM {INNER} ORDER BY 1", Session("alice")
    )
    assert [row[1] for row in result.rows] == ["FEMALE", "MALE"]


def _timed_out(run: Callable[[], object]) -> tuple[str, str, float]:
    started = time.monotonic()
    with pytest.raises(Error) as caught:
        run()
    return caught.value.sqlstate, str(caught.value).splitlines()[0], time.monotonic() - started


def test_slow_outer_statement_times_out_in_engine(health_backend: Backend) -> None:
    engine = _engine(health_backend)
    engine.execute(RELEASED + "SELECT COUNT(*) FROM s", Session("alice"))  # warm: plans, demo tables
    health_backend.statement_timeout_ms = 1500  # type: ignore[attr-defined]
    try:
        state, message, took = _timed_out(lambda: engine.execute(SLOW, Session("alice", epsilon=0.5)))
    finally:
        health_backend.statement_timeout_ms = 0  # type: ignore[attr-defined]
    assert (state, message) == ("57014", "canceling statement due to statement timeout")
    assert took < 10
    # charged: the budget is reserved before the inner query runs, as for a database statement that times out
    assert engine.ledger.spent("health", "alice").epsilon == pytest.approx(1.5)


def test_slow_outer_statement_times_out_through_dbapi(tmp_path: Path) -> None:
    path = tmp_path / "health.duckdb"
    backend = open_backend(f"duckdb:///{path}")
    load_demo(backend, ["health"])
    backend.close()
    policy = demo_policy_path("health")
    with dpsql.connect(policy, f"duckdb:///{path}", "alice", ledger="memory", statement_timeout_ms=1500) as conn:
        cur = conn.cursor()
        state, message, took = _timed_out(lambda: cur.execute(SLOW))
    assert (state, message) == ("57014", "canceling statement due to statement timeout")
    assert took < 10


def test_server_job_interrupt_reaches_the_sandbox(health_backend: Backend) -> None:
    """``dpsql serve`` runs each statement as a :class:`Job` in a worker thread holding one of the
    analyst's worker slots until the work has stopped (``WorkSlots``). The sandbox offers its interrupt
    to the job like a backend statement, so cancelling (or the session's statement timeout) stops it and
    frees the analyst's slot: post-processing counts against the analyst's fair share."""
    engine = _engine(health_backend)  # no engine timeout: only the job can stop it
    job = Job()
    outcome: list[BaseException | object] = []

    def work() -> None:
        try:
            outcome.append(job.run(engine.execute, SLOW, Session("alice")))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()
    job.interrupt()
    thread.join(10)
    assert not thread.is_alive(), "the sandbox did not stop"
    (error,) = outcome
    assert isinstance(error, QueryCanceled) and error.sqlstate == "57014"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_large_result_is_refused_without_growing_the_process(health_backend: Backend) -> None:
    engine = _engine(health_backend)
    engine.execute(RELEASED + "SELECT COUNT(*) FROM s", Session("alice"))  # warm
    base, peak, done = _rss_mb(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(Error) as caught:
            engine.execute(LARGE, Session("alice"))
    finally:
        done.set()
        watcher.join()
    assert caught.value.sqlstate == "54000"
    assert str(caught.value).splitlines()[0] == f"the result exceeds {sandbox.MAX_RESULT_BYTES} bytes"
    assert peak[0] - base < 500, f"RSS grew from {base:.0f} MB to {peak[0]:.0f} MB"


def test_byte_cap_is_a_setting(health_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "MAX_RESULT_BYTES", 4096)
    engine = _engine(health_backend)
    with pytest.raises(Error) as caught:
        engine.execute(RELEASED + "SELECT a.problem, b.problem FROM s a, s b", Session("alice"))
    assert (caught.value.sqlstate, str(caught.value).splitlines()[0]) == ("54000", "the result exceeds 4096 bytes")
    assert len(engine.execute(RELEASED + "SELECT COUNT(*) FROM s", Session("alice")).rows) == 1


# -- the result cache and the confidence level --------------------------------------------------------

CACHED = "SELECT problem, COUNT(*), median(age) FROM patients GROUP BY problem"


@pytest.fixture(scope="module")
def cache_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    backends = {"duckdb": open_backend("duckdb://"), "postgres": open_backend(pg_new_database())}
    for backend in backends.values():
        load_demo(backend, ["health"])
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.mark.parametrize("name", ["duckdb", "postgres"])
def test_cache_is_keyed_on_confidence(cache_backends: dict[str, Backend], name: str) -> None:
    engine = _engine(cache_backends[name], ResultCache(":memory:"))
    low = engine.execute(CACHED, Session("alice", confidence=0.5))
    high = engine.execute(CACHED, Session("alice", confidence=0.99))
    # a 99% request is not served the 50% answer: the 50% release's measurements are finished again with
    # 99% intervals and notes (a function of the noise scale and the level only: free, #29 item 1)
    assert high.epsilon_spent == 0.0 and high.rows == low.rows
    low_widths, high_widths = [r[1] or 0.0 for r in low.accuracy], [r[1] or 0.0 for r in high.accuracy]
    assert all(0 < lo < h for lo, h in zip(low_widths, high_widths, strict=True))  # COUNT's ± wider at 99%
    # the median's value intervals are chosen at the policy's level (95%, #40): the same released ends, said so
    ranges = [n for n in high.notices if "95% value intervals" in n]
    assert len(ranges) == 1 and ranges == [n for n in low.notices if "95% value intervals" in n]
    again_low = engine.execute(CACHED, Session("alice", confidence=0.5))
    again_high = engine.execute(CACHED, Session("alice", confidence=0.99))
    assert (again_low.rows, again_low.accuracy, again_low.epsilon_spent) == (low.rows, low.accuracy, 0.0)
    assert (again_high.rows, again_high.accuracy, again_high.epsilon_spent) == (high.rows, high.accuracy, 0.0)
    assert [n for n in again_low.notices if "95% value intervals" in n] == ranges
    # the policy's default (95%) given explicitly or not: one entry
    engine.execute(CACHED, Session("alice"))
    assert engine.execute(CACHED, Session("alice", confidence=0.95)).epsilon_spent == 0.0
    assert engine.ledger.spent("health", "alice").epsilon == pytest.approx(1.0)  # one measurement


def test_composite_inner_cache_keyed_on_confidence(health_backend: Backend) -> None:
    """An inner query's stored release is shared with the same query sent alone, so it carries the same
    key; at another confidence the inner query's *measurement* is reused (its intervals are a function of
    the noise scale and the level only: post-processing, free, #29), never fresh noise."""
    engine = _engine(health_backend, ResultCache(":memory:"))
    sql = f"SELECT * FROM {INNER} ORDER BY n DESC"
    engine.execute("SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex", Session("alice", confidence=0.5))
    assert engine.execute(sql, Session("alice", confidence=0.5)).epsilon_spent == 0.0
    assert engine.execute(sql, Session("alice", confidence=0.9)).epsilon_spent == 0.0
    assert engine.ledger.spent("health", "alice").epsilon == pytest.approx(1.0)
