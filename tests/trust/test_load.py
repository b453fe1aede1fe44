"""Load on a real ``dpsql serve`` process over a real PostgreSQL backend, and the backend going away.

* 50 concurrent psycopg clients (threads) send distinct DP queries for ~15 s (distinct texts, so the
  result cache never answers): no client error, the server's backend connections to the data
  database never exceed its pool size (8) during or after the load, and the server's RSS stays
  bounded. The heavy variant runs 200 clients for three minutes.
* The data PostgreSQL is stopped under load: every client gets a clean ErrorResponse (58P02 or
  08xxx) within the statement timeout, never a hang; PostgreSQL is restarted on the same port and
  data directory, and service resumes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from dpsql.backends.local_postgres import LocalPostgres, LocalPostgresError, start_local_postgres
from tests.trust.serverproc import DPSQL, ROOT, ServerProcess, start_server, write_policy

POOL_SIZE = 8  # PostgresBackend's default pool
ANALYSTS = ("analyst", "alice", "root", "postgres")
STATEMENT_TIMEOUT_MS = 10_000


@dataclass
class Data:
    pg: LocalPostgres
    datadir: Path
    port: int

    @property
    def dsn(self) -> str:
        return self.pg.dsn_for("health")


@pytest.fixture(scope="module")
def data_pg() -> Iterator[Data]:
    """A PostgreSQL holding the health demo table, in a datadir we keep so it can be restarted."""
    base = Path(tempfile.mkdtemp(prefix="dpsql-load-"))
    base.chmod(0o755)  # the server runs as an unprivileged user when we are root
    try:
        pg = start_local_postgres(datadir=base / "data")
    except LocalPostgresError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no local PostgreSQL: {exc}")
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE health")
    subprocess.run(
        [str(DPSQL), "demo-data", "--database", pg.dsn_for("health"), "--dataset", "health"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    data = Data(pg, base / "data", pg.port)
    try:
        yield data
    finally:
        data.pg.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_server(data_pg: Data, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("load")
    # up to 200 clients over 4 analysts: above the default caps (100 sessions, 32 per analyst)
    caps = ("--max-connections", "300", "--max-connections-per-analyst", "100")
    server = start_server(
        write_policy(tmp), tmp / "ledger.sqlite", tmp / "server.log", database=data_pg.dsn, extra_args=caps
    )
    try:
        yield server
    finally:
        server.stop()


def backend_connections(data: Data) -> int:
    with psycopg.connect(data.pg.dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = 'health' AND backend_type = 'client backend'"
        ).fetchone()  # not autovacuum workers, which also show the database's name
    assert row is not None
    return int(row[0])


def query_text(client: int, i: int) -> str:
    """Distinct texts (the alias), a few shapes, all δ-free (public domains or no keys)."""
    shape = i % 4
    if shape == 0:
        return f"SELECT COUNT(*) AS q_{client}_{i} FROM patients WHERE age > {i % 100}"
    if shape == 1:
        return f"SELECT sex, AVG(bmi) AS q_{client}_{i} FROM patients GROUP BY sex"
    if shape == 2:
        return f"SELECT SUM(visits) AS q_{client}_{i} FROM patients WHERE problem = 'Asthma'"
    return f"SELECT problem, COUNT(*) AS q_{client}_{i} FROM patients WHERE bmi < {20 + i % 30} GROUP BY problem"


@dataclass
class LoadStats:
    queries: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Sampler(threading.Thread):
    """Samples the server's RSS and the backend connection count every 0.5 s."""

    def __init__(self, server: ServerProcess, data: Data) -> None:
        super().__init__(daemon=True)
        self.server, self.data = server, data
        self.peak_rss = server.rss_kib()
        self.peak_backend = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.peak_rss = max(self.peak_rss, self.server.rss_kib())
            self.peak_backend = max(self.peak_backend, backend_connections(self.data))


def run_load(server: ServerProcess, data: Data, clients: int, seconds: float) -> None:
    with server.connect() as conn:  # warm up
        conn.execute("SELECT COUNT(*) AS warm FROM patients").fetchall()
    rss_start = server.rss_kib()
    stats = LoadStats()
    stop_at = time.monotonic() + seconds
    barrier = threading.Barrier(clients)

    def client(cid: int) -> None:
        try:
            conn = server.connect(ANALYSTS[cid % len(ANALYSTS)])
        except psycopg.Error as exc:
            with stats.lock:
                stats.errors[f"connect {exc.sqlstate}"] += 1
            barrier.abort()
            return
        with conn:
            barrier.wait()
            i = 0
            while time.monotonic() < stop_at:
                i += 1
                started = time.monotonic()
                try:
                    conn.execute(query_text(cid, i)).fetchall()
                except psycopg.Error as exc:
                    with stats.lock:
                        stats.errors[exc.sqlstate or type(exc).__name__] += 1
                    continue
                with stats.lock:
                    stats.queries += 1
                    stats.latencies.append(time.monotonic() - started)

    sampler = Sampler(server, data)
    sampler.start()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 120)
    sampler.done.set()
    sampler.join()
    hung = sum(t.is_alive() for t in threads)
    after = backend_connections(data)
    lat = sorted(stats.latencies) or [0.0]
    print(
        f"\nload: {clients} connections x {seconds:.0f}s: {stats.queries} queries ({stats.queries / seconds:.0f}/s), "
        f"errors {dict(stats.errors) or 0}, latency p50 {lat[len(lat) // 2] * 1000:.0f} ms p99 "
        f"{lat[int(len(lat) * 0.99)] * 1000:.0f} ms; backend connections peak {sampler.peak_backend} "
        f"after {after}; RSS {rss_start} KiB -> peak {sampler.peak_rss} KiB"
    )
    assert hung == 0
    assert not stats.errors
    assert stats.queries > clients
    assert sampler.peak_backend <= POOL_SIZE and after <= POOL_SIZE
    assert sampler.peak_rss < 2 * rss_start + 100 * 1024
    assert "Traceback" not in server.log_text()


@pytest.mark.exclusive
def test_50_clients_for_15_seconds(pg_server: ServerProcess, data_pg: Data) -> None:
    assert backend_connections(data_pg) <= POOL_SIZE
    run_load(pg_server, data_pg, clients=50, seconds=15)


@pytest.mark.exclusive
@pytest.mark.heavy
def test_200_clients_for_3_minutes(pg_server: ServerProcess, data_pg: Data) -> None:
    run_load(pg_server, data_pg, clients=200, seconds=180)


@pytest.mark.exclusive
def test_backend_down_and_back_up(pg_server: ServerProcess, data_pg: Data) -> None:
    outcomes: Counter[str] = Counter()
    slowest = 0.0
    lock = threading.Lock()
    stop = threading.Event()

    def client(cid: int) -> None:
        nonlocal slowest
        with pg_server.connect(ANALYSTS[cid % len(ANALYSTS)]) as conn:
            conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
            i = 0
            while not stop.is_set():
                i += 1
                started = time.monotonic()
                try:
                    conn.execute(query_text(1000 + cid, i)).fetchall()
                    outcome = "ok"
                except psycopg.Error as exc:
                    outcome = exc.sqlstate or type(exc).__name__
                with lock:
                    outcomes[outcome] += 1
                    slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    data_pg.pg.stop()  # fast shutdown: in-flight backend queries are terminated
    time.sleep(2.0)
    with lock:
        during = dict(outcomes)
    data_pg.pg = start_local_postgres(datadir=data_pg.datadir, port=data_pg.port)
    resumed_after = None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        with lock:
            before = outcomes["ok"]
        time.sleep(0.5)
        with lock:
            if outcomes["ok"] > before + 8:
                resumed_after = time.monotonic() - t0
                break
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=STATEMENT_TIMEOUT_MS / 1000 + 10)
    print(
        f"\nbackend down/up: outcomes {dict(outcomes)} (while down: {during}); slowest reply {slowest:.2f}s; "
        f"service resumed {resumed_after}s after restart"
    )
    assert not any(t.is_alive() for t in threads), "a client hung"
    errors = {state for state in outcomes if state != "ok"}
    assert errors, "stopping the backend produced no error at all"
    assert all(state == "58P02" or state.startswith("08") for state in errors), errors
    assert slowest < STATEMENT_TIMEOUT_MS / 1000
    assert resumed_after is not None, "service did not resume after PostgreSQL came back"
    with pg_server.connect() as conn:
        conn.execute("SELECT COUNT(*) AS after_outage FROM patients").fetchall()
    assert backend_connections(data_pg) <= POOL_SIZE
    assert "Traceback" not in pg_server.log_text()
