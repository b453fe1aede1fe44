"""Issue #27 item 4: post-processing sandboxes count against the analyst's share, with real servers.

The outer statement of a composite query runs over released rows only, so once its inner queries are
cached it is free to send again and again. One analyst running cross joins and large windows over
released rows on several sessions raised another analyst's median latency 10x and took GBs of memory.
Now (:mod:`dpsql.outer.admission`) sandboxes are admitted process-wide (memory capped in total, one per
analyst) and have their CPU time charged to their analyst.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.engine import Engine
from dpsql.errors import ConfigurationLimitExceeded, Error, QueryCanceled
from dpsql.outer import admission
from dpsql.outer.admission import RESERVED_BYTES, Admission
from dpsql.outer.sandbox import Sandbox
from dpsql.server import ThreadedServer

from .conftest import Running, eventually, sqlstate_of

ROOT = Path(__file__).resolve().parents[2]
#: 280 released rows whatever the noise (every key has a public domain), cached after the first run.
RELEASED = (
    "WITH s AS (SELECT sex, problem, marital_status, ethnicity, COUNT(*) AS n FROM patients "
    "GROUP BY sex, problem, marital_status, ethnicity) "
)
CHEAP = RELEASED + "SELECT COUNT(*) FROM s"
#: 280^4 = 6e9 rows to count: minutes of CPU.
SLOW = RELEASED + "SELECT COUNT(*) FROM s a, s b, s c, s d"
_SHORT_TEXTS = ", ".join(f"substr(a.sex, 1, 1) || '{i % 10}' AS c{i}" for i in range(20))
#: The attack: cross joins and windows over released rows (22M rows each), and 1,000,000 rows of 20
#: two-character texts, which held 1.3 GB per statement when only text lengths were counted.
HEAVY = [
    RELEASED + f"SELECT {_SHORT_TEXTS} FROM s a, s b, s c LIMIT 1000000",
    SLOW,
    RELEASED + "SELECT a.problem, b.problem, c.problem, a.n + b.n + c.n AS t FROM s a, s b, s c",
    RELEASED + "SELECT a.n, b.n, c.n, row_number() OVER (ORDER BY a.n * b.n - c.n) FROM s a, s b, s c",
]
#: Past this the attack is stopped early (today's code would take GBs more): the bar is missed anyway.
RSS_GUARD_MB = 1536
#: The other analyst's query: a DP COUNT, never the same text twice (so never from the cache).
VICTIM = "SELECT COUNT(*) FROM patients WHERE age > {} AND age < {}"

_LAUNCHER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.server.conftest import open_engine
from dpsql.outer.admission import ADMISSION
from dpsql.server.server import run
engine = open_engine(trust=True)
print("ready", flush=True)
run(engine, port=0, catalog_dsn="", on_listening=lambda port: print("listening", port, flush=True))
print(json.dumps({"peak": ADMISSION.peak, "capacity": ADMISSION.capacity}), flush=True)
"""


def _connect(port: int, user: str) -> psycopg.Connection[Any]:
    dsn = f"host=127.0.0.1 port={port} user={user} dbname=health connect_timeout=20"
    return psycopg.connect(dsn, autocommit=True)


def _timed(conn: psycopg.Connection[Any], sql: str) -> float:
    started = time.monotonic()
    conn.execute(sql).fetchall()
    return time.monotonic() - started


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _accepts(port: int) -> bool:
    try:
        _connect(port, "carol").close()
    except psycopg.OperationalError:
        return False
    return True


@pytest.fixture()
def serve_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``dpsql serve``'s server over the demo data in a process of its own (its RSS is the server's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(ROOT)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        lines = iter(proc.stdout.readline, "")  # the server bound port 0 and says which port it got
        port = next(int(line.split()[1]) for line in lines if line.startswith("listening "))
        assert eventually(lambda: _accepts(port), 60)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.exclusive
def test_one_analysts_sandboxes_do_not_slow_another_analyst(serve_process: tuple[subprocess.Popen[str], int]) -> None:
    """The issue's attack, by one analyst on 8 sessions for 15 s (each statement may run 20 s, and is free:
    its inner query is cached): another analyst's DP COUNT p50 stays
    within 3x its idle p50 measured just before, the server's peak RSS stays under 1 GB, and at most
    the cap of sandboxes ran at once (one: one analyst)."""
    proc, port = serve_process
    with _connect(port, "dave") as conn:
        conn.execute(CHEAP).fetchall()  # the inner query released once: every HEAVY statement is free now
    rss_before = _status_mb(proc.pid, "VmRSS")
    n = [0]

    def victim_sql() -> str:
        n[0] += 1
        return VICTIM.format(n[0] % 90, 200 + n[0])

    outcomes: dict[str | None, int] = {}
    stop = threading.Event()

    def attack(first: int) -> None:
        with _connect(port, "dave") as conn:
            conn.execute("SET statement_timeout = '20s'")
            k = first
            while not stop.is_set():
                sql = HEAVY[k % len(HEAVY)]
                k += 1
                state = sqlstate_of(lambda sql=sql: conn.execute(sql).fetchall())  # type: ignore[misc]
                outcomes[state] = outcomes.get(state, 0) + 1

    with _connect(port, "carol") as carol:
        carol.execute("SET statement_timeout = '30s'")
        for _ in range(5):
            _timed(carol, victim_sql())
        idle = statistics.median(_timed(carol, victim_sql()) for _ in range(30))
        threads = [threading.Thread(target=attack, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(2)
        busy: list[float] = []
        peak_rss = 0.0
        ends = time.monotonic() + 15
        while time.monotonic() < ends and peak_rss < RSS_GUARD_MB:
            busy.append(_timed(carol, victim_sql()))
            peak_rss = max(peak_rss, _status_mb(proc.pid, "VmRSS"))
            time.sleep(0.02)
        stop.set()
        if peak_rss >= RSS_GUARD_MB:
            proc.kill()
            pytest.fail(
                f"the server's RSS reached {peak_rss:.0f} MB (idle p50 {idle * 1000:.1f} ms, under attack "
                f"{statistics.median(busy) * 1000:.1f} ms)"
            )
        for t in threads:
            t.join(60)
    hwm = _status_mb(proc.pid, "VmHWM")
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    stats = json.loads(out[out.rindex("{") :])  # after DuckDB's progress bars, if any
    p50 = statistics.median(busy)
    print(
        f"\nsandbox attack (dave x 8 sessions, 15 s): carol COUNT p50 idle {idle * 1000:.1f} ms, "
        f"under attack {p50 * 1000:.1f} ms ({p50 / idle:.2f}x, {len(busy)} queries, "
        f"p90 {sorted(busy)[len(busy) * 9 // 10] * 1000:.0f} ms); server RSS {rss_before:.0f} MB before, "
        f"peak {max(peak_rss, hwm):.0f} MB; sandboxes at once {stats['peak']} (cap {stats['capacity']}); "
        f"dave's outcomes {outcomes}"
    )
    assert not any(t.is_alive() for t in threads)
    assert set(outcomes) <= {None, "54000", "57014"}, outcomes
    assert p50 <= 3 * idle
    assert max(peak_rss, hwm) < 1024
    assert stats["peak"] == 1 <= stats["capacity"]


# -- admission, timeout and cancel through a server ----------------------------------------------------


def _start(conn: psycopg.Connection[Any], sql: str, states: list[str | None]) -> threading.Thread:
    thread = threading.Thread(target=lambda: states.append(sqlstate_of(lambda: conn.execute(sql).fetchall())))
    thread.start()
    return thread


@pytest.mark.exclusive
def test_cap_timeout_and_cancel(engine: Engine) -> None:
    """Two sandboxes at once (512 MB, 256 MB each), one per analyst: a third analyst's statement, and
    the same analyst's second one, wait for a place and get 57014 at their timeout (or on cancel); a
    cancelled sandbox stops and gives its place to the next analyst."""
    server = ThreadedServer(engine, catalog_dsn="", statement_timeout=None)
    gate = server.server.ctx.sandboxes
    running = Running(server.host, server.port, engine)
    conns: list[psycopg.Connection[Any]] = []
    try:
        assert gate is admission.ADMISSION and gate.capacity == 2 and gate.per_analyst == 1
        alice, alice2, carol, dave = (_connect(running.port, u) for u in ("alice", "alice", "carol", "dave"))
        conns = [alice, alice2, carol, dave]
        for conn in conns:
            conn.execute(CHEAP).fetchall()  # released (or cached): the statements below are free
            conn.execute("SET statement_timeout = '60s'")
        gate.peak = 0
        states: dict[str, list[str | None]] = {"alice": [], "carol": []}
        slow = {user: _start(conn, SLOW, states[user]) for user, conn in (("alice", alice), ("carol", carol))}
        assert eventually(lambda: gate.total == 2, 10), gate.running

        dave.execute("SET statement_timeout = '1s'")
        alice2.execute("SET statement_timeout = '1s'")
        for conn in (dave, alice2):
            started = time.monotonic()
            assert sqlstate_of(lambda conn=conn: conn.execute(CHEAP).fetchall()) == "57014"  # type: ignore[misc]
            assert time.monotonic() - started < 5
        assert eventually(lambda: gate.waiting == 0, 5)  # the timed-out statements stopped waiting
        assert gate.peak == 2

        dave.execute("SET statement_timeout = '60s'")
        waiting: list[str | None] = []
        waiter = _start(dave, CHEAP, waiting)
        assert eventually(lambda: gate.waiting == 1, 10)
        started = time.monotonic()
        dave.cancel_safe(timeout=10)
        waiter.join(10)
        assert waiting == ["57014"] and time.monotonic() - started < 5  # cancelled while waiting

        started = time.monotonic()
        alice.cancel_safe(timeout=10)
        slow["alice"].join(10)
        assert states["alice"] == ["57014"] and time.monotonic() - started < 5
        assert eventually(lambda: gate.total == 1, 10)  # the sandbox really stopped
        assert dave.execute(CHEAP).fetchone() == (280,)  # admitted in alice's place

        carol.cancel_safe(timeout=10)
        slow["carol"].join(10)
        assert states["carol"] == ["57014"]
        assert eventually(lambda: gate.total == 0 and not server.server.ctx.slots.running, 10)
        assert gate.peak == 2
    finally:
        for conn in conns:
            conn.close()
        server.stop()


# -- the admission itself ----------------------------------------------------------------------------


def _acquire_in_thread(gate: Admission, analyst: str, deadline: float | None, out: list[object]) -> threading.Thread:
    def go() -> None:
        try:
            gate.acquire(analyst, deadline)
            out.append("admitted")
        except Error as exc:
            out.append(exc.sqlstate)

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_admission_order_share_and_queue_bound() -> None:
    gate = Admission(memory=2 * RESERVED_BYTES, per_analyst=1, max_waiting=2)
    gate.acquire("a", None)
    second_a: list[object] = []
    waiting_a = _acquire_in_thread(gate, "a", None, second_a)  # a's share is taken: waits
    assert eventually(lambda: gate.waiting == 1, 5)
    gate.acquire("b", None)  # b goes past a's waiting statement: a place is free, b is under its share
    assert gate.total == 2 and second_a == []
    third: list[object] = []
    waiting_c = _acquire_in_thread(gate, "c", None, third)
    assert eventually(lambda: gate.waiting == 2, 5)
    with pytest.raises(ConfigurationLimitExceeded) as caught:
        gate.acquire("d", None)
    assert caught.value.sqlstate == "53400"
    gate.release("b")  # c (not a: its share is still taken) gets b's place
    waiting_c.join(5)
    assert third == ["admitted"] and second_a == []
    gate.release("a")
    waiting_a.join(5)
    assert second_a == ["admitted"]
    assert gate.peak == 2 and gate.running == {"a": 1, "c": 1}


@pytest.mark.exclusive
def test_admission_wait_ends_at_the_deadline() -> None:
    gate = Admission(memory=RESERVED_BYTES)
    gate.acquire("a", None)
    started = time.monotonic()
    with pytest.raises(QueryCanceled) as caught:
        gate.acquire("b", time.monotonic() + 0.5)
    assert caught.value.sqlstate == "57014" and "statement timeout" in str(caught.value)
    assert 0.4 < time.monotonic() - started < 3 and gate.waiting == 0
    gate.release("a")
    gate.acquire("b", time.monotonic() + 1)


@pytest.mark.exclusive
def test_cpu_time_is_charged_to_the_analyst() -> None:
    """An analyst whose sandboxes used more CPU than its bucket waits before its next one; others don't."""
    gate = Admission(memory=4 * RESERVED_BYTES, cpu_rate=1.0, cpu_burst=0.5)
    gate.acquire("a", None)
    gate.release("a", cpu_seconds=2.0)  # 1.5 s in debt
    assert 1.0 < gate.cpu_wait("a") <= 1.6 and gate.cpu_wait("b") == 0
    with pytest.raises(QueryCanceled):
        gate.acquire("a", time.monotonic() + 0.3)
    gate.acquire("b", time.monotonic() + 0.1)
    started = time.monotonic()
    gate.acquire("a", time.monotonic() + 5)
    assert 0.5 < time.monotonic() - started < 3


def test_sandbox_runs_at_the_priority_of_its_query(engine: Engine) -> None:
    """The sandbox's work runs on the statement's own thread, at its priority (issue #37: at nice 19 the
    same statements took twice as long on a busy host), and its CPU time is charged."""
    seen: list[tuple[int, int]] = []
    original = Sandbox.run

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return original(self, *args, **kwargs)

    from dpsql.session import Session

    gate = admission.ADMISSION
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Sandbox, "run", spy)  # the class admission runs
        engine.execute(RELEASED + "SELECT COUNT(*) FROM s a, s b, s c", Session("grace"))
    assert seen == [(threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))]
    assert gate.cpu_wait("grace") == 0 and gate.running == {}
