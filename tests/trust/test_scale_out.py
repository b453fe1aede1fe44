"""Scale-out: several real ``dpsql serve`` processes sharing one PostgreSQL ledger and result cache.

Two throwaway PostgreSQL clusters: one holds the ledger and the result cache, the other the data.
They must be separate servers: the PostgreSQL data stamp is the cluster's next transaction id, so a
ledger in the data's own cluster would move it with every charge and no cached answer would ever
match again (README, deployment). Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dpsql.ledger import Ledger
from tests.trust.serverproc import ServerProcess, write_policy

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"dpsql listening on [^:\s]+:(\d+)")

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[object, object]]:
    from dpsql.backends.local_postgres import start_local_postgres

    with contextlib.ExitStack() as stack:
        try:
            ledger_pg = stack.enter_context(start_local_postgres())
            data_pg = stack.enter_context(start_local_postgres())
        except Exception as exc:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"no local PostgreSQL: {exc}")
        yield ledger_pg, data_pg


def _new_database(pg: object) -> str:
    name = "dpsql_" + os.urandom(4).hex()
    with psycopg.connect(pg.dsn, autocommit=True) as conn:  # type: ignore[attr-defined]
        conn.execute(f'CREATE DATABASE "{name}"')
    return str(pg.dsn_for(name))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def data_url(clusters: tuple[object, object]) -> str:
    from dpsql.backends import open_backend
    from dpsql.dev.demo import load_demo

    url = _new_database(clusters[1])
    backend = open_backend(url)
    try:
        load_demo(backend, ["health"])
    finally:
        backend.close()
    return url


@pytest.fixture
def ledger_url(clusters: tuple[object, object]) -> str:
    url = _new_database(clusters[0])
    Ledger.open(url).close()  # the schema once, before processes race to create it
    return url


def start(policy: Path, ledger: str, database: str, log_path: Path, *extra: str, listeners: int = 1) -> ServerProcess:
    """``python -m dpsql.cli serve`` (this checkout's code) on port 0; waits for ``listeners`` workers."""
    argv = [sys.executable, "-m", "dpsql.cli", "serve", "--policy", str(policy), "--database", database]
    argv += ["--ledger", ledger, "--port", "0", "--catalog-dsn", "", "--log-level", "info", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    server = ServerProcess(proc, log_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ports = _LISTENING.findall(log_path.read_text(errors="replace"))
        if len(ports) >= listeners:
            assert len(set(ports)) == 1, ports
            server.port = int(ports[0])
            return server
        if not server.alive():
            raise AssertionError(f"dpsql serve exited {proc.returncode}:\n{server.log_text()[-4000:]}")
        time.sleep(0.05)
    server.kill()
    raise AssertionError(f"dpsql serve did not start:\n{server.log_text()[-4000:]}")


@contextlib.contextmanager
def servers(count: int, policy: Path, ledger: str, database: str, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    try:
        for i in range(count):
            started.append(
                start(policy, ledger, database, tmp_path / f"serve{i}.log", "--max-connections-per-analyst", "64")
            )
        yield started
    finally:
        for server in started:
            server.stop()


def test_two_processes_one_ledger_spend_exactly_the_budget(tmp_path: Path, ledger_url: str, data_url: str) -> None:
    """64 clients over two processes race for 1.0 ε at 0.1 ε each: exactly 10 answers, the rest 53P01."""
    policy = write_policy(tmp_path, analyst_epsilon=1.0, dataset_epsilon=1000.0)
    with servers(2, policy, ledger_url, data_url, tmp_path) as (one, two):
        conns = [(one if i % 2 else two).connect() for i in range(64)]
        for conn in conns:
            conn.execute("SET dpsql.epsilon = 0.1")
        barrier = threading.Barrier(64)
        outcomes: list[str] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            barrier.wait(timeout=60)
            try:  # distinct texts: no answer can come from the cache
                conns[i].execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}").fetchall()
                outcome = "ok"
            except psycopg.Error as exc:
                outcome = exc.sqlstate or f"error {exc}"
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for conn in conns:
            conn.close()
    assert len(outcomes) == 64
    assert outcomes.count("ok") == 10, outcomes
    assert outcomes.count("53P01") == 54, outcomes
    ledger = Ledger.open(ledger_url)
    try:
        spent = ledger.spent("health", "analyst")
        assert spent.queries == 10 and spent.epsilon == pytest.approx(1.0)
    finally:
        ledger.close()


def _notices(conn: psycopg.Connection) -> list[str]:
    seen: list[str] = []
    conn.add_notice_handler(lambda diag: seen.append(diag.message_primary or ""))
    return seen


def test_repeat_answered_by_one_process_is_a_free_hit_on_the_other(
    tmp_path: Path, ledger_url: str, data_url: str
) -> None:
    policy = write_policy(tmp_path, analyst_epsilon=5.0, dataset_epsilon=1000.0)
    sql = "SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex ORDER BY sex"
    with servers(2, policy, ledger_url, data_url, tmp_path) as (one, two):
        with one.connect() as first:
            seen = _notices(first)
            first.execute("SET dpsql.epsilon = 0.5")
            answer = first.execute(sql).fetchall()
        assert any("charged ε=0.5" in n for n in seen), seen
        ledger = Ledger.open(ledger_url)
        try:
            before = ledger.spent("health", "analyst")
            with two.connect() as second:
                seen = _notices(second)
                second.execute("SET dpsql.epsilon = 0.5")
                again = second.execute("select SEX, count(*) as n from patients group by sex order by sex").fetchall()
            after = ledger.spent("health", "analyst")
        finally:
            ledger.close()
    assert again == answer  # the same released noise, not a fresh draw
    assert any("answered from the result cache" in n for n in seen), seen
    assert not any("charged ε" in n for n in seen), seen
    assert (after.epsilon, after.queries) == (before.epsilon, before.queries)
    assert before.epsilon == pytest.approx(0.5) and before.queries == 1


def test_processes_on_one_ledger_share_the_row_selection_salt(ledger_url: str, tmp_path: Path) -> None:
    """Every engine on a ledger picks a heavy person's rows with the same salt (a repeat sent to another
    worker sees the same sample); another installation (ledger) gets another salt."""
    from dpsql.commands import open_engine

    policy = write_policy(tmp_path)
    ns = argparse.Namespace(policy=str(policy), database="demo", statement_timeout=10.0, ledger=ledger_url)
    engines = [open_engine(ns) for _ in range(2)]
    other = open_engine(argparse.Namespace(**{**vars(ns), "ledger": "memory"}))
    try:
        assert engines[0]._salt == engines[1]._salt
        assert len(engines[0]._salt) == 32 and other._salt != engines[0]._salt
    finally:
        for engine in [*engines, other]:
            engine.close()


def test_processes_2_on_one_port_both_workers_serve(tmp_path: Path, ledger_url: str, data_url: str) -> None:
    policy = write_policy(tmp_path)
    log_path = tmp_path / "workers.log"
    server = start(
        policy, ledger_url, data_url, log_path, "--processes", "2", "--max-connections-per-analyst", "64", listeners=2
    )
    try:
        conns = [server.connect() for _ in range(24)]  # held open together: the kernel spreads them
        try:
            for conn in conns[:4]:
                assert conn.execute("SELECT COUNT(*) FROM patients").fetchone() is not None
        finally:
            for conn in conns:
                conn.close()
        workers = set(re.findall(r"\[worker (\d+) pid \d+\] connection analyst=analyst", server.log_text()))
        assert workers == {"0", "1"}, server.log_text()[-3000:]
    finally:
        server.stop()
    assert not server.alive()
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/dpsql-pwned",))


def test_postgres_cache_first_writer_wins_and_never_unpickles_code(ledger_url: str) -> None:
    import pickle  # noqa: TID251 - the attack: a pickle written into the cache table

    from dpsql.cache import PostgresResultCache, ResultCache
    from dpsql.session import OutputColumn, Result

    cache = ResultCache.open(ledger_url)
    other = ResultCache.open(ledger_url)
    with Ledger.open(ledger_url) as ledger:  # every Engine on this ledger signs with its installation key
        installation_key = ledger.installation_key()
    cache.use_installation_key(installation_key)
    other.use_installation_key(installation_key)
    try:
        assert isinstance(cache, PostgresResultCache)
        first = Result([OutputColumn("n", "bigint")], [(41,)], [(3.0,)], 0.5, 0.0)
        cache.put("k", first)
        other.put("k", Result([OutputColumn("n", "bigint")], [(99,)], [(3.0,)], 0.5, 0.0))
        entry = other.get_entry("k")
        assert entry is not None and entry[0].rows == [(41,)]
        assert other.get("missing") is None
        with psycopg.connect(ledger_url, autocommit=True) as conn:  # whoever can write the table
            conn.execute("INSERT INTO dpsql_result_cache VALUES ('evil', 0, %s)", (pickle.dumps(_Boom()),))
        assert cache.get("evil") is None and not Path("/tmp/dpsql-pwned").exists()
    finally:
        cache.close()
        other.close()
