"""Issue #41 items 2, 4 and 6: shared pools and free work, per analyst first.

* Every statement's CPU is metered per analyst (:mod:`dpsql.server.cpu_share`): while another analyst is
  active, the heaviest beyond its share waits and runs one statement at a time; alone, nobody waits.
* Memory: a reserved floor per session that k analysts filling the pool cannot take (prepared statements,
  small results); a session idle while holding more than its floor is ended (57P05).
* Pre-auth: a socket mid-handshake is never evicted by churn before its grace; IN lists are shrunk to
  the domain before the tree is copied; accuracy-first bisections are cached per plan and target.

Real servers and clients (psycopg, asyncpg, raw sockets); p50 bars are measured by bench/attacks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlglot import exp

from dpsql.analyze.in_lists import shrink_in_lists
from dpsql.analyze.parse import parse_statement
from dpsql.engine import Engine
from dpsql.errors import OutOfMemory, QueryCanceled
from dpsql.release import calibrate
from dpsql.server import ThreadedServer
from dpsql.server.cpu_share import CpuShare
from dpsql.server.frontdoor import PreAuth
from dpsql.server.memory import Memory
from dpsql.session import Session

from .conftest import Running
from .test_memory_bytes import FLUSH, SYNC, Raw, _parse, _query, sqlstate

MIB = 1 << 20


# --- the CPU share --------------------------------------------------------------------------------------


def test_cpu_share_only_holds_back_the_heaviest_while_others_are_active() -> None:
    now = [0.0]
    share = CpuShare(share=0.25, window=5.0, clock=lambda: now[0])
    share.started("attacker")
    share.finished("attacker", 6.0)  # a burst of heavy free work
    assert not share.must_wait("attacker")  # alone: work-conserving
    share.started("victim")
    share.finished("victim", 0.01)
    assert share.must_wait("attacker") and not share.must_wait("victim")
    now[0] += 3.0  # the victim went quiet: nobody is held back
    assert not share.must_wait("attacker")
    share.started("victim")  # the victim is back, the attacker's average has decayed but is still high
    assert share.must_wait("attacker")
    now[0] += 5.0 * 7  # long after: its average is below its share
    share.finished("victim", 0.01)
    assert not share.must_wait("attacker")


def test_cpu_share_admission_waits_then_serialises_and_times_out() -> None:
    async def scenario() -> None:
        share = CpuShare(share=0.25, window=1.0)
        share.started("victim")  # active, running
        share.started("attacker")
        share.finished("attacker", 2.0)  # rate 2.0 > 0.25: it yields
        started = time.monotonic()
        lock = await share.admit("attacker", lambda: 10.0)
        waited = time.monotonic() - started
        assert 1.5 < waited < 4  # ln(2 / 0.25) ≈ 2.1 windows
        assert share.must_wait("attacker")  # its next statement waits for this one (one at a time)
        with pytest.raises(QueryCanceled) as timed_out:
            await share.admit("attacker", lambda: 0.2)
        assert timed_out.value.sqlstate == "57014"
        lock.release()

    asyncio.run(scenario())


def _heavy_sql(n: int) -> str:
    """Free (EXPLAIN), long and not shrinkable (distinct floats, no domain): ~1 s of the server's CPU."""
    values = ",".join(f"{20 + i * 1e-4:.4f}" for i in range(n))
    return f"EXPLAIN SELECT COUNT(*) FROM patients WHERE bmi IN ({values})"


def test_an_analyst_flooding_free_work_runs_one_statement_at_a_time(engine: Engine) -> None:
    server = ThreadedServer(engine, catalog_dsn="", analyst_cpu_share=0.1)
    running = Running(server.host, server.port, engine)
    stop = threading.Event()
    errors: list[str] = []
    heavy = _heavy_sql(8000)

    def attacker() -> None:
        with psycopg.connect(running.dsn("analyst"), autocommit=True) as conn:
            while not stop.is_set():
                try:
                    conn.execute(heavy).fetchall()
                except psycopg.Error as exc:
                    errors.append(str(exc.sqlstate))

    def victim() -> None:
        with psycopg.connect(running.dsn("alice"), autocommit=True) as conn:
            conn.execute("SET dpsql.epsilon = 0.001")
            i = 0
            while not stop.is_set():
                i += 1
                conn.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i % 90}").fetchall()

    threads = [threading.Thread(target=attacker) for _ in range(4)] + [threading.Thread(target=victim)]
    try:
        for thread in threads:
            thread.start()
        ctx = server.server.ctx
        deadline = time.monotonic() + 60
        while not ctx.cpu_share.must_wait("analyst") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctx.cpu_share.must_wait("analyst"), "the attacker never had to yield"
        assert not ctx.cpu_share.must_wait("alice")
        drained = time.monotonic() + 60  # the statements admitted before it had to yield end first
        while ctx.slots.running.get("analyst", 0) > 1 and time.monotonic() < drained:
            time.sleep(0.05)
        seen: set[int] = set()
        until = time.monotonic() + 4
        while time.monotonic() < until:
            if ctx.cpu_share.must_wait("analyst"):
                seen.add(ctx.slots.running.get("analyst", 0))
            time.sleep(0.01)
        assert max(seen) <= 1, f"the attacker ran {max(seen)} statements at once while yielding"
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        server.stop()
    assert set(errors) <= {"57014"}


# --- memory: a floor per session ---------------------------------------------------------------------


def test_floors_are_reserved_whatever_the_others_hold() -> None:
    memory = Memory(statement=48 * MIB, session=48 * MIB, analyst=40 * MIB, total=64 * MIB, floor=1 * MIB)
    sessions = {}
    for name in ("a", "b", "c", "victim"):
        sessions[name] = memory.session()
        sessions[name].open(name)
    held = []
    for name in ("a", "b"):  # two analysts fill the shared pool (64 MiB less four floors)
        with pytest.raises(OutOfMemory):
            while True:
                held.append(sessions[name].hold("cursor", 4 * MIB))
    with pytest.raises(OutOfMemory) as full:
        sessions["c"].hold("prepared statement", 4 * MIB)
    assert "of which 1.0 MB is reserved for each session" in (full.value.detail or "")
    small = sessions["victim"].hold("prepared statement", 900 * 1024)  # within its floor: always
    assert memory.shared <= memory.total_cap - 4 * MIB
    small.release()
    sessions["victim"].close()
    assert memory.sessions == 3


def test_another_analyst_prepares_statements_while_three_fill_the_pool(engine: Engine) -> None:
    """Three analysts hold the whole shared pool with big prepared statements; a fourth's asyncpg session
    (named prepared statements for everything) and a result of 70 rows still work."""
    server = ThreadedServer(
        engine, catalog_dsn="", max_memory=24 * MIB, max_analyst_memory=8 * MIB, max_session_memory=8 * MIB
    )
    running = Running(server.host, server.port, engine)
    comment = "/*" + "\U0001f600" * 249_000 + "*/"  # ~1 MB held (a 4-byte character each), under the length cap
    clients: list[Raw] = []
    try:
        for user in ("analyst", "carol", "dave"):
            client = Raw(server.port, user)
            clients.append(client)
            for i in range(20):
                client.send(_parse(f"s{i}", f"{comment} -- {i}") + FLUSH)
                if sqlstate(client.until(b"1")) is not None:
                    client.send(SYNC)
                    client.until(b"Z")
                    break
        assert server.server.ctx.memory.shared > 19 * MIB  # the shared pool (24 MiB less the floors) is full

        async def victim() -> list[Any]:
            conn = await asyncpg.connect(host=running.host, port=running.port, user="alice", database="health")
            try:
                await conn.execute("SET dpsql.epsilon = 0.01")
                rows = [await conn.fetchval("SELECT COUNT(*) FROM patients WHERE age > $1", i) for i in range(3)]
                rows.append(await conn.fetch("SELECT problem, sex, ethnicity, COUNT(*) FROM patients GROUP BY 1, 2, 3"))
                return rows
            finally:
                await conn.close()

        answers = asyncio.run(victim())
        assert len(answers) == 4 and len(answers[-1]) > 50
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_a_session_idle_while_holding_beyond_its_floor_is_ended(engine: Engine) -> None:
    server = ThreadedServer(engine, catalog_dsn="", idle_holding_timeout=1.0)
    try:
        holder = Raw(server.port, "analyst")
        comment = "/*" + "\U0001f600" * 249_000 + "*/"  # ~1 MB each: two are beyond the 1 MiB floor
        holder.send(_parse("big1", comment + " SELECT 1") + _parse("big2", comment + " SELECT 2") + SYNC)
        assert sqlstate(holder.until(b"Z")) is None
        light = Raw(server.port, "alice")
        light.send(_parse("small", "SELECT 1") + SYNC)
        assert sqlstate(light.until(b"Z")) is None
        time.sleep(2.5)
        ended = _read_until_closed(holder.sock, 10)
        assert b"57P05" in ended and b"terminating connection due to idle-session timeout" in ended
        light.send(_query("SELECT 1"))  # within its floor: still there
        assert sqlstate(light.until(b"Z")) is None
        holder.close()
        light.close()
    finally:
        server.stop()


def _read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


# --- pre-auth: churn never evicts a handshake in progress --------------------------------------------------


def test_preauth_protects_a_handshake_for_its_grace() -> None:
    evicted: list[str] = []
    preauth = PreAuth(limit=10, per_address=3, grace=60.0)
    mid = [preauth.enter("10.0.0.1", functools.partial(evicted.append, f"mid{n}")) for n in range(3)]
    for pending in mid:
        assert pending is not None
        pending.stage, pending.started = 2, time.monotonic()
    assert preauth.enter("10.0.0.1", lambda: evicted.append("new")) is None  # the newcomer goes, not them
    assert evicted == []
    preauth.leave(mid[0])
    silent = preauth.enter("10.0.0.1", lambda: evicted.append("silent"))
    assert silent is not None
    assert preauth.enter("10.0.0.1", lambda: evicted.append("newer")) is not None  # a silent one goes first
    assert evicted == ["silent"]


def test_churn_from_the_analysts_own_address_fails_no_login(engine: Engine) -> None:
    """256 new silent sockets a second from 127.0.0.1 while alice opens fresh connections from it."""
    server = ThreadedServer(engine, catalog_dsn="", max_preauth_per_address=50)
    running = Running(server.host, server.port, engine)
    stop = threading.Event()

    def churn() -> None:
        opened: list[socket.socket] = []
        while not stop.is_set():
            for _ in range(16):
                with contextlib.suppress(OSError):
                    opened.append(socket.create_connection((running.host, running.port), timeout=5))
            while len(opened) > 200:
                opened.pop(0).close()
            time.sleep(1 / 16)
        for sock in opened:
            sock.close()

    attacker = threading.Thread(target=churn)
    attacker.start()
    failures = 0
    try:
        time.sleep(1.0)
        for i in range(25):
            try:
                with psycopg.connect(running.dsn("alice", connect_timeout="20"), autocommit=True) as conn:
                    conn.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}").fetchall()
            except psycopg.Error:
                failures += 1
    finally:
        stop.set()
        attacker.join(30)
        evicted = server.server.ctx.preauth.evicted
        server.stop()
    assert evicted > 100  # the churn really hit the cap
    assert failures == 0


# --- free work: IN lists and accuracy bisections -----------------------------------------------------------


def _in_values(sql: str, engine: Engine) -> list[str]:
    tree = parse_statement(sql)
    shrink_in_lists(tree, engine.policy)
    found = tree.find(exp.In)
    assert found is not None
    return [v.sql(dialect="postgres") for v in found.expressions]


def test_in_lists_are_shrunk_to_the_domain_and_deduplicated(engine: Engine) -> None:
    junk = ",".join(f"'d{i:05d}'" for i in range(5000))
    sql = f"SELECT COUNT(*) FROM patients WHERE problem IN ('Asthma', {junk}, 'Asthma', 'Obesity')"
    assert _in_values(sql, engine) == ["'Asthma'", "'d00000'", "'Obesity'"]  # one value outside stands for all
    assert _in_values("SELECT COUNT(*) FROM patients WHERE age IN (1, 1.0, 2, 01, 3)", engine) == ["1", "2", "3"]
    # NOT IN keeps its meaning: one outside value, never an empty list
    not_in = "SELECT COUNT(*) FROM patients WHERE NOT problem IN ('x', 'y', 'z')"
    assert _in_values(not_in, engine) == ["'x'"]
    # a quoted name that is not the policy's column, parameters and casts are kept as written
    assert _in_values("""SELECT COUNT(*) FROM patients WHERE "Problem" IN ('x', 'y')""", engine) == ["'x'", "'y'"]
    kept = _in_values("SELECT COUNT(*) FROM patients WHERE problem IN ($1, 'x', CAST('y' AS TEXT), 'z')", engine)
    assert kept == ["$1", "'x'", "CAST('y' AS TEXT)"]


def test_a_long_junk_in_list_answers_as_the_short_one(engine: Engine) -> None:
    session = Session("alice", epsilon=0.5)
    junk = ",".join(f"'d{i:06d}'" for i in range(12000))
    long = engine.execute(f"EXPLAIN SELECT COUNT(*) FROM patients WHERE problem IN ('Asthma', {junk})", session)
    short = engine.execute("EXPLAIN SELECT COUNT(*) FROM patients WHERE problem IN ('Asthma', 'd000000')", session)
    assert long.rows == short.rows


def test_accuracy_bisection_is_cached_per_plan_and_target(engine: Engine) -> None:
    session = Session("alice", accuracy=12345.0)
    engine.execute("EXPLAIN SELECT COUNT(*) FROM patients WHERE age > 3", session)
    size = len(calibrate._ACCURACY_EPSILONS._items)
    started = time.perf_counter()
    engine.execute("EXPLAIN SELECT COUNT(*) FROM patients WHERE age > 4", session)  # same plan figures, target
    assert len(calibrate._ACCURACY_EPSILONS._items) == size
    assert time.perf_counter() - started < 5
    engine.execute("EXPLAIN SELECT COUNT(*) FROM patients WHERE age > 4", Session("alice", accuracy=12346.0))
    assert len(calibrate._ACCURACY_EPSILONS._items) == size + 1
