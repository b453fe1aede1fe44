"""The server's limits against hostile analysts, with real clients against real servers.

Each test names the finding it guards: fair share of the worker pool (abandoned work keeps
counting), parsing off the event loop with an early size check, connection caps, per-session
state caps, the whole-startup deadline, SET validation, clean errors, timeouts.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import pytest

from dpsql.engine import Engine
from dpsql.server import ThreadedServer

from .conftest import Running, recv_exactly, sqlstate_of

# ~229 kB: under the 256 kB cap, about a second of parsing and analysis: the slowest statement found.
SLOW_SQL = (
    "SELECT COUNT(*) FROM patients WHERE age IN ("
    + ",".join(str(i) for i in range(40000))[:228000].rsplit(",", 1)[0]
    + ")"
)
COUNT_SQL = "SELECT COUNT(*) FROM patients"


@pytest.fixture(scope="module")
def limited(engine: Engine) -> Iterator[tuple[Running, ThreadedServer]]:
    """No catalog; small per-session caps so they are cheap to reach; 8 workers (4 per analyst)."""
    server = ThreadedServer(
        engine,
        catalog_dsn="",
        max_prepared=50,
        max_portals=5,
        max_settings=20,
        max_connections=40,
        max_connections_per_analyst=12,
        startup_timeout=1.0,
        statement_timeout=3.0,
    )
    try:
        yield Running(server.host, server.port, engine), server
    finally:
        server.stop()


def connect(running: Running, user: str, **extra: str) -> psycopg.Connection[Any]:
    return psycopg.connect(running.dsn(user, connect_timeout="10", **extra), autocommit=True)


def timed(conn: psycopg.Connection[Any], sql: str) -> float:
    started = time.monotonic()
    conn.execute(sql).fetchall()
    return time.monotonic() - started


# --- 1. shared pools: back-pressure, fair share, parsing off the loop ---------------------------------


@pytest.mark.exclusive
def test_abandoned_work_stays_within_the_analysts_share(limited: tuple[Running, ThreadedServer]) -> None:
    """statement_timeout=1ms and a flood of statements: the work left running never exceeds the
    analyst's share of the pool, and another analyst's COUNT stays fast."""
    running, server = limited
    ctx = server.server.ctx
    stop = threading.Event()
    peak = 0
    outcomes: dict[str | None, int] = {}

    def flood(i: int) -> None:
        with connect(running, "dave") as conn:
            conn.execute("SET statement_timeout = '1ms'")
            while not stop.is_set():
                state = sqlstate_of(lambda: conn.execute(SLOW_SQL).fetchall())
                outcomes[state] = outcomes.get(state, 0) + 1

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    latencies = []
    with connect(running, "carol") as conn:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            latencies.append(timed(conn, COUNT_SQL))
            peak = max(peak, ctx.slots.running.get("dave", 0))
            time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(f"\nfair share: dave outcomes {outcomes}, peak running {peak}, carol p50 {statistics.median(latencies):.3f}s")
    assert set(outcomes) == {"57014"}
    assert peak <= ctx.slots.per_analyst == 4
    assert statistics.median(latencies) < 0.1
    assert max(latencies) < 1.5


@pytest.mark.exclusive
def test_slowest_statements_do_not_delay_another_analyst(limited: tuple[Running, ThreadedServer]) -> None:
    """8 connections send the slowest statement; another analyst's COUNT: normal latency + < 1 s;
    no statement runs past the server's 3 s cap (each answers within it, plus scheduling slack)."""
    running, _ = limited
    with connect(running, "carol") as conn:
        baseline = statistics.median([timed(conn, COUNT_SQL) for _ in range(10)])
    stop = threading.Event()
    slowest = 0.0
    states: dict[str | None, int] = {}

    def slow() -> None:
        nonlocal slowest
        with connect(running, "erin") as conn:
            conn.execute("SET statement_timeout = '10min'")  # capped at the server's 3 s
            while not stop.is_set():
                started = time.monotonic()
                state = sqlstate_of(lambda: conn.execute(SLOW_SQL).fetchall())
                states[state] = states.get(state, 0) + 1
                slowest = max(slowest, time.monotonic() - started)

    threads = [threading.Thread(target=slow, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    with connect(running, "carol") as conn:
        loaded = [timed(conn, COUNT_SQL) for _ in range(20)]
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(
        f"\nslow statements: baseline {baseline * 1000:.1f} ms, under load p50 "
        f"{statistics.median(loaded) * 1000:.1f} ms max {max(loaded) * 1000:.1f} ms; erin {states}, "
        f"slowest reply {slowest:.2f}s"
    )
    assert max(loaded) < baseline + 1.0
    # the server stops waiting at 3 s; the rest is the 228 kB round trip with the clients in this process
    assert slowest < 3.0 + 1.5


def _flood(dsn: str, kind: str, seconds: float, out: Any) -> None:
    """A flooding client in its own process (its CPU must not count against the server's)."""
    big = "SELECT COUNT(*) FROM patients WHERE age IN (" + ",1" * 500_000 + ")"  # ~1,000,000 characters
    seen: set[str | None] = set()
    with psycopg.connect(dsn, autocommit=True) as conn:
        if kind == "timeout":
            conn.execute("SET statement_timeout = '1ms'")
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            seen.add(sqlstate_of(lambda: conn.execute(big if kind == "big" else SLOW_SQL)))
    out.put((kind, seen))


@pytest.mark.exclusive
def test_flooding_big_and_timed_out_statements(limited: tuple[Running, ThreadedServer]) -> None:
    """One client floods ~1 MiB statements (refused early, 54000), another floods timed-out
    queries; a third client's DP COUNT keeps p50 < 100 ms."""
    import multiprocessing

    running, _ = limited
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    procs = [
        mp.Process(target=_flood, args=(running.dsn(user), kind, 6.0, out), daemon=True)
        for user, kind in (("frank", "big"), ("frank", "big"), ("grace", "timeout"), ("grace", "timeout"))
    ]
    for p in procs:
        p.start()
    time.sleep(2.0)  # spawned processes import psycopg and connect
    with connect(running, "carol") as conn:
        latencies = [timed(conn, f"SELECT COUNT(*) AS n{i} FROM patients") for i in range(40)]
    seen: dict[str, set[str | None]] = {"big": set(), "timeout": set()}
    for _ in procs:
        kind, states = out.get(timeout=60)
        seen[kind] |= states
    for p in procs:
        p.join(timeout=30)
    p50 = statistics.median(latencies)
    print(f"\nfloods: {seen}; third client p50 {p50 * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    assert seen["big"] == {"54000"}
    assert seen["timeout"] == {"57014"}
    assert p50 < 0.1


def test_admission_queue_is_bounded(engine: Engine) -> None:
    """Beyond max_queued statements waiting for a worker, new ones are refused with 53400."""
    server = ThreadedServer(engine, catalog_dsn="", workers=2, analyst_workers=1, max_queued=1)
    running = Running(server.host, server.port, engine)
    try:
        states: list[str | None] = []

        def one() -> None:
            with connect(running, "root") as conn:
                states.append(sqlstate_of(lambda: conn.execute(SLOW_SQL)))

        threads = [threading.Thread(target=one, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert "53400" in states and None in states
    finally:
        server.stop()


# --- 2. per-connection state and sockets -----------------------------------------------------------


def test_prepared_statements_are_capped(limited: tuple[Running, ThreadedServer]) -> None:
    running, _ = limited
    with connect(running, "alice") as conn:
        pg = conn.pgconn
        for i in range(50):
            assert pg.prepare(f"s{i}".encode(), b"SELECT 1").status == psycopg.pq.ExecStatus.COMMAND_OK
        res = pg.prepare(b"s_over", b"SELECT 1")
        assert res.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"53400"
        conn.execute("DEALLOCATE s0")
        assert pg.prepare(b"s_again", b"SELECT 1").status == psycopg.pq.ExecStatus.COMMAND_OK
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the unnamed statement is never counted


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body


def _raw_session(running: Running, user: str) -> socket.socket:
    sock = socket.create_connection((running.host, running.port), timeout=10)
    params = f"user\0{user}\0database\0health\0\0".encode()
    sock.sendall(struct.pack("!II", len(params) + 8, 196608) + params)
    _read_until(sock, b"Z")
    return sock


def _read_until(sock: socket.socket, kind: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    while True:
        head = recv_exactly(sock, 5)
        body = recv_exactly(sock, struct.unpack("!I", head[1:])[0] - 4)
        out.append((head[:1], body))
        if head[:1] == kind:
            return out


def _sqlstates(messages: list[tuple[bytes, bytes]]) -> list[str]:
    states = []
    for kind, body in messages:
        if kind == b"E":
            fields = dict((f[:1], f[1:]) for f in body.split(b"\0") if f)
            states.append(fields[b"C"].decode())
    return states


def test_portals_are_capped(limited: tuple[Running, ThreadedServer]) -> None:
    running, _ = limited
    with _raw_session(running, "alice") as sock:
        batch = _message(b"P", b"\0SELECT 1\0\0\0")
        for i in range(6):
            batch += _message(b"B", f"p{i}\0".encode() + b"\0" + b"\0\0\0\0\0\0")
        batch += _message(b"S", b"")
        sock.sendall(_message(b"Q", b"BEGIN\0"))
        _read_until(sock, b"Z")
        sock.sendall(batch)
        assert _sqlstates(_read_until(sock, b"Z")) == ["53400"]


def test_custom_settings_are_capped(limited: tuple[Running, ThreadedServer]) -> None:
    running, _ = limited
    with connect(running, "alice") as conn:
        for i in range(20):
            conn.execute(f"SET app.x{i} = 'v'")
        assert sqlstate_of(lambda: conn.execute("SET app.one_more = 'v'")) == "53400"
        conn.execute("SET app.x0 = 'changed'")  # changing an existing one is fine
        assert sqlstate_of(lambda: conn.execute(f"SET app.x1 = '{'v' * 9000}'")) == "54000"
        conn.execute("RESET ALL")
        conn.execute("SET app.after_reset = 'v'")


@pytest.mark.exclusive
def test_startup_deadline_covers_the_whole_startup(limited: tuple[Running, ThreadedServer]) -> None:
    """Each packet arrives in time but the startup as a whole does not: cut at the deadline (1 s)."""
    running, _ = limited
    sock = socket.create_connection((running.host, running.port), timeout=10)
    started = time.monotonic()
    sock.sendall(struct.pack("!II", 8, 80877103))  # SSLRequest
    assert recv_exactly(sock, 1) == b"N"
    time.sleep(0.6)
    sock.sendall(struct.pack("!II", 8, 80877104))  # GSSENCRequest
    assert recv_exactly(sock, 1) == b"N"
    time.sleep(0.2)
    sock.sendall(struct.pack("!I", 40))  # a startup packet that never completes
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except OSError:
        pass
    sock.close()
    elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 2.0
    assert b"08P01" in data and b"authentication" in data


def test_connection_caps(engine: Engine) -> None:
    server = ThreadedServer(engine, catalog_dsn="", max_connections=4, max_connections_per_analyst=2)
    running = Running(server.host, server.port, engine)
    try:
        a1, a2 = connect(running, "alice"), connect(running, "alice")
        with pytest.raises(psycopg.OperationalError, match='too many connections for role "alice"'):
            connect(running, "alice")
        c1, c2 = connect(running, "carol"), connect(running, "carol")
        with pytest.raises(psycopg.OperationalError, match="sorry, too many clients already"):
            connect(running, "dave")
        a1.close()
        time.sleep(0.2)
        with connect(running, "dave") as d:
            assert d.execute("SELECT 1").fetchone() == (1,)
        for c in (a2, c1, c2):
            c.close()
    finally:
        server.stop()


def test_200_connections_from_one_analyst(dp_server: Running) -> None:
    """One analyst opens 200 connections: beyond its cap they are refused (53300), and another
    analyst's open session keeps answering catalog and DP queries, and new sessions still connect."""
    other = connect(dp_server, "carol")
    other.execute("SELECT COUNT(*) FROM pg_catalog.pg_class").fetchone()

    async def flood() -> tuple[list[Any], list[str]]:
        async def one() -> Any:
            try:
                return await asyncpg.connect(dp_server.url("erin"), timeout=30)
            except asyncpg.PostgresError as exc:
                return exc.sqlstate
            except (ConnectionError, OSError):  # refused before the startup packet: sockets are capped too
                return "53300"

        results = await asyncio.gather(*(one() for _ in range(200)))
        conns = [r for r in results if not isinstance(r, str)]
        errors = [r for r in results if isinstance(r, str)]
        # while they are all open, the other analyst works
        states.append(sqlstate_of(lambda: other.execute("SELECT COUNT(*) FROM pg_catalog.pg_class").fetchone()))
        states.append(sqlstate_of(lambda: other.execute(COUNT_SQL).fetchone()))
        states.append(sqlstate_of(lambda: connect(dp_server, "carol").close()))
        await asyncio.gather(*(c.close() for c in conns))
        return conns, errors

    states: list[str | None] = []
    conns, errors = asyncio.run(flood())
    other.close()
    print(f"\n200 connections: {len(conns)} accepted, refusals {set(errors)}; other analyst {states}")
    assert len(conns) == 32 and set(errors) == {"53300"}
    assert states == [None, None, None]


# --- 3. clean errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "SET dpsql.epsilon = 1e-300",
        "SET dpsql.epsilon = 1e308",
        "SET dpsql.epsilon = 'nan'",
        "SET dpsql.delta = 1e-300",
        "SET dpsql.confidence = 1",
    ],
)
def test_set_values_validated_at_set_time(limited: tuple[Running, ThreadedServer], sql: str) -> None:
    running, _ = limited
    with connect(running, "alice") as conn:
        assert sqlstate_of(lambda: conn.execute(sql)) == "22023"


@pytest.mark.parametrize(
    "sql",
    [
        "SET session_authorization = bob",
        "SET session_authorization TO 'carol'",
        "SET SESSION AUTHORIZATION carol",
        "SET ROLE carol",
        "SET role = carol",
        "SET LOCAL ROLE carol",
    ],
)
def test_identity_cannot_be_changed(limited: tuple[Running, ThreadedServer], sql: str) -> None:
    running, _ = limited
    with connect(running, "alice") as conn:
        assert sqlstate_of(lambda: conn.execute(sql)) == "42501"
        assert conn.execute("SELECT current_user").fetchone() == ("alice",)
        assert conn.execute("SHOW session_authorization").fetchone() == ("alice",)
        conn.execute("RESET SESSION AUTHORIZATION")
        conn.execute("SET session_authorization = alice")  # to oneself: allowed, as PostgreSQL
    with pytest.raises(psycopg.OperationalError):
        connect(running, "alice", options="'-c session_authorization=carol'")


def test_unexpected_errors_are_generic(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ThreadedServer(engine, catalog_dsn="")
    running = Running(server.host, server.port, engine)
    try:

        def broken(*_: Any) -> Any:
            raise RuntimeError("secret internals /srv/data/x.duckdb")

        monkeypatch.setattr(server.server.ctx.engine, "execute", broken)
        with connect(running, "alice") as conn:
            with pytest.raises(psycopg.errors.InternalError_) as info:
                conn.execute(COUNT_SQL)
            assert info.value.sqlstate == "XX000"
            assert "secret" not in str(info.value) and "Traceback" not in str(info.value)
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()


@pytest.mark.postgres  # the server's shadow catalog is a local PostgreSQL
def test_dead_shadow_is_a_connection_error(engine: Engine) -> None:
    server = ThreadedServer(engine)
    running = Running(server.host, server.port, engine)
    try:
        ctx = server.server.ctx
        if not ctx.catalog_available:
            pytest.skip("no local PostgreSQL for the shadow catalog")
        with connect(running, "alice") as conn:
            conn.execute("SELECT COUNT(*) FROM pg_catalog.pg_class").fetchone()
            assert ctx.shadow is not None
            ctx.shadow._local.stop()  # the shadow dies under an open session
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT COUNT(*) FROM pg_catalog.pg_class").fetchone()
            assert info.value.sqlstate == "08006"
            assert conn.execute(COUNT_SQL).fetchone() is not None  # DP queries still work
    finally:
        shadow, ctx.shadow = ctx.shadow, None
        server.stop()
        if shadow is not None:  # its supervisor would start a new one after this test (unmarked tests saw it)
            shadow.stop()


# --- 4. timeouts -------------------------------------------------------------------------------------


@pytest.mark.exclusive
def test_statement_timeout_is_capped_by_the_server(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ThreadedServer(engine, catalog_dsn="", statement_timeout=1.0, default_statement_timeout=0.5)
    running = Running(server.host, server.port, engine)
    slow = threading.Event()

    def sleepy(*_: Any) -> Any:
        slow.wait(10)
        raise RuntimeError("released")

    try:
        monkeypatch.setattr(server.server.ctx.engine, "execute", sleepy)
        with connect(running, "alice") as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("500",)
            started = time.monotonic()
            assert sqlstate_of(lambda: conn.execute(COUNT_SQL)) == "57014"
            assert 0.4 < time.monotonic() - started < 1.0
            conn.execute("SET statement_timeout = '10min'")
            started = time.monotonic()
            assert sqlstate_of(lambda: conn.execute(COUNT_SQL)) == "57014"
            assert 0.9 < time.monotonic() - started < 2.0
    finally:
        slow.set()
        server.stop()


@pytest.mark.exclusive
def test_idle_in_transaction_timeout(limited: tuple[Running, ThreadedServer]) -> None:
    running, _ = limited
    conn = connect(running, "alice")
    conn.execute("SET idle_in_transaction_session_timeout = '300ms'")
    conn.execute("BEGIN")
    time.sleep(1.0)
    with pytest.raises(psycopg.Error, match="idle-in-transaction"):
        conn.execute("SELECT 1")
    conn.close()


def test_a_statement_stopped_by_its_timeout_says_what_it_was_charged(
    limited: tuple[Running, ThreadedServer], engine: Engine
) -> None:
    """#28 item 4: a timeout that stops a statement after its reservation said 57014 with no DETAIL
    while the ledger held the ε. Now, over a sweep of timeouts hitting every phase (parsing, the
    reservation, the database statement, noising), what each outcome tells the analyst — the charge
    in a failure's DETAIL, or the answer's NOTICE — always equals what the ledger recorded."""
    running, _ = limited
    dataset = engine.policy.dataset
    seen: dict[str | None, int] = {}
    with connect(running, "erin") as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        for i in range(60):
            conn.execute(f"SET statement_timeout = '{1 + i % 20}ms'")
            before = engine.ledger.spent(dataset, "erin").epsilon
            notices.clear()
            state, detail = None, ""
            try:
                conn.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i} AND age < {200 + i}").fetchall()
            except psycopg.Error as exc:
                state, detail = exc.sqlstate, exc.diag.message_detail or ""
            spent = engine.ledger.spent(dataset, "erin").epsilon - before
            seen[state] = seen.get(state, 0) + 1
            told = 0.0
            if state is None:
                told = next(float(n.split("ε=")[1].split(";")[0]) for n in notices if "charged ε=" in n)
            elif "was charged for this statement" in detail:
                told = float(detail.split("ε=")[1].split(" ")[0])
            assert abs(told - spent) < 1e-9, (i, state, detail, notices, spent)
    print(f"\ntimeout sweep outcomes: {seen}")
    assert "57014" in seen


@pytest.mark.exclusive
def test_a_parameter_number_beyond_the_protocol_is_refused_at_once(limited: tuple[Running, ThreadedServer]) -> None:
    """A Parse of ``… $99999999`` with no declared types sized its type list by the number: 25–35 s
    of CPU and +1 GB RSS kept after disconnect. PostgreSQL numbers parameters up to 65535 (Bind's
    Int16 count): beyond that 42P02 at once, nothing run; ``$65535`` itself is still described."""
    running, _ = limited

    async def prepare(sql: str) -> tuple[str | None, float]:
        conn = await asyncpg.connect(running.url("frank"), timeout=30)
        started = time.monotonic()
        try:
            await conn.prepare(sql)
            return None, time.monotonic() - started
        except asyncpg.PostgresError as exc:
            return exc.sqlstate, time.monotonic() - started
        finally:
            await conn.close()

    for number in ("99999999", "99999999999999999999", "65536"):
        state, took = asyncio.run(prepare(f"SELECT COUNT(*) FROM patients WHERE age > ${number}"))
        assert (state, took < 2.0) == ("42P02", True), (number, state, took)
    state, _ = asyncio.run(prepare("SELECT COUNT(*) FROM patients WHERE age > $65535"))
    assert state is None
