"""The privacy ledger never overspends, never forgets a committed charge, and fails closed.

Real SQLite files and a real PostgreSQL server (``pg_dsn`` from tests/pg.py); concurrency is
exercised with real threads and real processes racing for the last ε.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dpsql.errors import (
    InsufficientPrivilege,
    InvalidParameterValue,
    LedgerUnavailable,
    PrivacyBudgetExhausted,
    UndefinedObject,
)
from dpsql.ledger import (
    Allowance,
    AuditEntry,
    Cost,
    Ledger,
    Levers,
    PostgresLedger,
    Spent,
    max_rho,
)
from dpsql.policy import Budget
from dpsql.release import rho_to_epsilon

WORKER = Path(__file__).with_name("worker.py")
HUGE = Budget(epsilon=1e12, delta=0.5)


def _reserve(
    ledger: Ledger,
    cost: Cost,
    *,
    dataset: str = "health",
    analyst: str = "alice",
    dataset_budget: Budget = HUGE,
    analyst_budget: Budget = HUGE,
    **kwargs: object,
) -> object:
    return ledger.reserve(
        dataset=dataset,
        analyst=analyst,
        cost=cost,
        dataset_budget=dataset_budget,
        analyst_budget=analyst_budget,
        fingerprint="select count(*) from visits",
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path / 'ledger.sqlite'}"


@pytest.fixture
def ledger(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as opened:
        yield opened


# --- accounting (SQLite) --------------------------------------------------------------------


def test_reserve_records_charge_and_totals(ledger: Ledger) -> None:
    charge = _reserve(ledger, Cost(0.5, 1e-7))
    assert charge.analyst_spent == Spent(0.5, 1e-7, 0.0, 1)  # type: ignore[attr-defined]
    _reserve(ledger, Cost(0.25), analyst="bob")
    assert ledger.spent("health", "alice") == Spent(0.5, 1e-7, 0.0, 1)
    assert ledger.spent("health").epsilon == 0.75
    assert ledger.spent("health").queries == 2
    assert ledger.spent("other") == Spent()
    rows = ledger.summary("health")
    assert [(row.analyst, row.spent.epsilon, row.spent.queries) for row in rows] == [
        ("alice", 0.5, 1),
        ("bob", 0.25, 1),
    ]
    (latest,) = ledger.charges("health", "bob")
    assert latest.fingerprint == "select count(*) from visits"
    assert latest.cost.epsilon == 0.25
    assert latest.accounting == "pure"


def _refuses_after(ledger: Ledger, budget: float, cost: float) -> int:
    total = Budget(epsilon=budget)
    succeeded = 0
    while True:
        try:
            _reserve(ledger, Cost(cost), dataset_budget=HUGE, analyst_budget=total)
        except PrivacyBudgetExhausted:
            return succeeded
        succeeded += 1


def test_refuses_exactly_when_budget_exhausted(ledger: Ledger) -> None:
    assert _refuses_after(ledger, 3.0, 0.5) == 6
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(ledger, Cost(0.5), analyst_budget=Budget(epsilon=3.0))
    error = refused.value
    assert error.sqlstate == "53P01"
    assert error.message == 'privacy budget exhausted for analyst "alice"'
    assert error.detail == "spent ε=3 of 3, this query needs ε=0.5"
    assert error.hint == "Ask the data curator for more budget, or lower ε with SET dpsql.epsilon."
    assert ledger.spent("health", "alice") == Spent(3.0, 0.0, 6 * 0.125, 6)  # refusals record nothing


@pytest.mark.parametrize(("budget", "cost", "expected"), [(1.0, 0.1, 10), (1.0, 0.3, 3), (0.7, 0.7, 1)])
def test_float_steps_spend_the_whole_budget(ledger: Ledger, budget: float, cost: float, expected: int) -> None:
    assert _refuses_after(ledger, budget, cost) == expected


def test_delta_budget_composes_basically(ledger: Ledger) -> None:
    budget = Budget(epsilon=10, delta=1e-6)
    for _ in range(10):
        _reserve(ledger, Cost(0.1, 1e-7), analyst_budget=budget)
    with pytest.raises(PrivacyBudgetExhausted, match="alice") as refused:
        _reserve(ledger, Cost(0.1, 1e-7), analyst_budget=budget)
    assert "δ=1e-06" in str(refused.value.detail)
    _reserve(ledger, Cost(0.1), analyst_budget=budget)  # a pure-DP query still fits


def test_colluding_analysts_hit_the_dataset_budget(ledger: Ledger) -> None:
    dataset_budget = Budget(epsilon=2.0)
    analyst_budget = Budget(epsilon=1.5)
    _reserve(ledger, Cost(1.0), analyst="alice", dataset_budget=dataset_budget, analyst_budget=analyst_budget)
    _reserve(ledger, Cost(1.0), analyst="bob", dataset_budget=dataset_budget, analyst_budget=analyst_budget)
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(ledger, Cost(0.5), analyst="carol", dataset_budget=dataset_budget, analyst_budget=analyst_budget)
    assert refused.value.message == 'privacy budget exhausted for dataset "health"'
    # carol learns that the shared budget is exhausted, and her own query's need: not what others spent
    assert refused.value.detail == "The dataset's total privacy budget cannot cover this query (it needs ε=0.5)."
    assert "spent" not in str(refused.value.detail) and "2" not in str(refused.value.detail)
    with pytest.raises(PrivacyBudgetExhausted, match='analyst "alice"'):
        _reserve(ledger, Cost(0.75), analyst="alice", dataset_budget=HUGE, analyst_budget=analyst_budget)
    # Budgets are per dataset: another dataset is untouched.
    _reserve(ledger, Cost(1.0), dataset="census", dataset_budget=dataset_budget, analyst_budget=analyst_budget)


def test_zcdp_adds_rho(ledger: Ledger) -> None:
    budget = Budget(epsilon=1.0, delta=1e-6)
    rho_cap = max_rho(1.0, 1e-6)
    assert rho_to_epsilon(rho_cap, 1e-6) == pytest.approx(1.0)
    step = Cost(epsilon=0.4, delta=1e-7, rho=rho_cap / 4)
    for _ in range(4):
        _reserve(ledger, step, analyst_budget=budget, accounting="zcdp")
    spent = ledger.spent("health", "alice")
    assert spent.rho == pytest.approx(rho_cap)
    assert spent.epsilon == pytest.approx(1.6)  # (ε, δ) sums are kept, but zCDP composes better
    assert spent.privacy_loss("zcdp", 1e-6)[0] == pytest.approx(1.0)
    with pytest.raises(PrivacyBudgetExhausted, match="ρ="):
        _reserve(ledger, step, analyst_budget=budget, accounting="zcdp")
    remaining = ledger.remaining("health", "alice", budget=budget, accounting="zcdp")
    assert remaining.epsilon == pytest.approx(0.0, abs=1e-9)
    assert remaining.rho == pytest.approx(0.0, abs=1e-12)


def test_zcdp_counts_pure_costs_and_uses_the_exact_conversion(ledger: Ledger) -> None:
    budget = Budget(epsilon=1.0, delta=1e-6)
    charge = _reserve(ledger, Cost(0.1), analyst_budget=budget, accounting="zcdp")
    assert charge.analyst_spent.rho == pytest.approx(0.005)  # type: ignore[attr-defined]  # ε²/2
    left = max_rho(1.0, 1e-6) - 0.005  # the ρ the exact conversion still affords
    with pytest.raises(PrivacyBudgetExhausted):
        _reserve(ledger, Cost(0.5, 1e-7, rho=left * 1.001), analyst_budget=budget, accounting="zcdp")
    _reserve(ledger, Cost(0.5, 1e-7, rho=left * 0.999), analyst_budget=budget, accounting="zcdp")
    with pytest.raises(ValueError, match="rho"):
        _reserve(ledger, Cost(0.1, 1e-7), accounting="zcdp")  # (ε, δ>0) without ρ cannot compose
    with pytest.raises(PrivacyBudgetExhausted):  # zCDP with a δ=0 budget admits no ρ > 0
        _reserve(ledger, Cost(0.1), analyst="bob", analyst_budget=Budget(epsilon=5), accounting="zcdp")


def test_cost_is_validated() -> None:
    for bad in ({"epsilon": -1}, {"epsilon": math.nan}, {"epsilon": math.inf}, {"epsilon": 1, "delta": 1}):
        with pytest.raises(ValueError):
            Cost(**bad)


def test_spent_survives_a_restart(sqlite_url: str) -> None:
    first = Ledger.open(sqlite_url)
    for _ in range(3):
        _reserve(first, Cost(0.5))
    before = first.spent("health")
    first.close()
    with pytest.raises(LedgerUnavailable):
        first.spent("health")  # a closed ledger answers nothing
    with Ledger.open(sqlite_url) as second:
        assert second.spent("health") == before
        assert _refuses_after(second, 2.0, 0.5) == 1


def test_charges_cannot_be_deleted(sqlite_url: str, ledger: Ledger) -> None:
    _reserve(ledger, Cost(1.0))
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite://"))
    with pytest.raises(sqlite3.DatabaseError, match="never deleted"):
        conn.execute("DELETE FROM dpsql_ledger")
    conn.close()
    assert not hasattr(ledger, "refund")


def test_memory_ledger_is_shared_by_threads() -> None:
    with Ledger.open("sqlite:///:memory:") as memory:
        _race_threads(memory, "health", budget=3.0, cost=0.5, threads=8, attempts=3)


def _race_threads(ledger: Ledger, dataset: str, *, budget: float, cost: float, threads: int, attempts: int) -> None:
    total = Budget(epsilon=budget)
    outcomes: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def run(index: int) -> None:
        start.wait()
        for _ in range(attempts):
            try:
                _reserve(ledger, Cost(cost), dataset=dataset, analyst=f"a{index}", dataset_budget=total)
                ok = True
            except PrivacyBudgetExhausted:
                ok = False
            with lock:
                outcomes.append(ok)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(outcomes) == threads * attempts
    assert sum(outcomes) == math.floor(budget / cost + 1e-9)
    spent = ledger.spent(dataset)
    assert spent.queries == sum(outcomes)
    assert spent.epsilon <= budget * (1 + 1e-9)


def test_threads_race_for_the_last_epsilon(ledger: Ledger) -> None:
    _race_threads(ledger, "health", budget=3.0, cost=0.5, threads=8, attempts=3)


# --- many processes -------------------------------------------------------------------------


def _race_processes(url: str, open_ledger: Callable[[], Ledger], tmp_path: Path, dataset: str) -> None:
    budget, cost, processes = 3.0, 0.5, 16
    go = tmp_path / f"go-{dataset}"
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[2])}
    args = ["race", url, dataset, "shared", str(cost), str(budget), "2", "2", str(go)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(processes)
    ]
    time.sleep(0.5)  # let most of them reach the start line
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        results.append(json.loads(out))
    assert sum(r["ok"] + r["refused"] for r in results) == processes * 2 * 2
    assert sum(r["ok"] for r in results) == math.floor(budget / cost)
    with open_ledger() as ledger:
        spent = ledger.spent(dataset)
        assert spent.queries == math.floor(budget / cost)
        assert spent.epsilon <= budget * (1 + 1e-9)
        assert len(ledger.charges(dataset, limit=1000)) == spent.queries


def test_processes_race_for_the_last_epsilon(sqlite_url: str, tmp_path: Path) -> None:
    _race_processes(sqlite_url, lambda: Ledger.open(sqlite_url), tmp_path, "health")


def _sigkill_loses_nothing(url: str, open_ledger: Callable[[], Ledger], tmp_path: Path, dataset: str) -> None:
    log = tmp_path / f"log-{dataset}"
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[2])}
    proc = subprocess.Popen([sys.executable, str(WORKER), "loop", url, dataset, "victim", str(log)], env=env)
    deadline = time.monotonic() + 30
    while (not log.exists() or log.stat().st_size < 2 * 50) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    known = log.read_bytes().count(b"\n")
    assert known >= 50
    with open_ledger() as ledger:  # reopening also re-checks the file's integrity
        recorded = ledger.spent(dataset, "victim").queries
    assert known <= recorded <= known + 1  # at most the one charge committed but not yet logged


def test_sigkilled_process_loses_no_committed_charge(sqlite_url: str, tmp_path: Path) -> None:
    _sigkill_loses_nothing(sqlite_url, lambda: Ledger.open(sqlite_url), tmp_path, "health")


# --- failing closed -------------------------------------------------------------------------


def test_corrupt_file_is_unavailable(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(os.urandom(8192))
    with pytest.raises(LedgerUnavailable) as error:
        Ledger.open(f"sqlite://{garbage}")
    assert error.value.sqlstate == "58P01"
    assert error.value.message.startswith("privacy ledger unavailable: ")
    assert error.value.hint


def test_overwritten_ledger_is_unavailable(sqlite_url: str) -> None:
    with Ledger.open(sqlite_url) as ledger:
        for _ in range(20):
            _reserve(ledger, Cost(0.1))
    path = Path(sqlite_url.removeprefix("sqlite://"))
    with path.open("r+b") as handle:
        handle.seek(0)
        handle.write(b"\xde\xad\xbe\xef" * 64)
    with pytest.raises(LedgerUnavailable):
        Ledger.open(sqlite_url)


def test_corrupted_pages_are_detected(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'pages.sqlite'}"
    with Ledger.open(url) as ledger:
        for i in range(300):
            _reserve(ledger, Cost(0.001), analyst=f"analyst-{i}")
    path = tmp_path / "pages.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    size = path.stat().st_size
    with path.open("r+b") as handle:  # keep the header, trash every later page's first bytes
        for offset in range(4096, size, 4096):
            handle.seek(offset)
            handle.write(b"\x00garbage\xff" * 4)
    with pytest.raises(LedgerUnavailable):
        Ledger.open(url)


def test_missing_or_unusable_locations_are_unavailable(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for url in (
        f"sqlite://{tmp_path / 'missing' / 'ledger.sqlite'}",
        f"sqlite://{a_file / 'ledger.sqlite'}",
        f"sqlite://{tmp_path}",
        "sqlite://relative/ledger.sqlite",
        "mysql://somewhere/ledger",
    ):
        with pytest.raises(LedgerUnavailable):
            Ledger.open(url)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_unwritable_directory_is_unavailable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    Ledger.open(f"sqlite://{locked / 'existing.sqlite'}").close()
    locked.chmod(0o500)
    (locked / "existing.sqlite").chmod(0o400)
    try:
        for name in ("new.sqlite", "existing.sqlite"):
            with pytest.raises(LedgerUnavailable):
                Ledger.open(f"sqlite://{locked / name}")
    finally:
        locked.chmod(0o700)


def test_read_only_file_is_unavailable(tmp_path: Path) -> None:
    """Root ignores permissions, so make the file read-only the way SQLite itself sees it."""
    path = tmp_path / "ro.sqlite"
    Ledger.open(f"sqlite://{path}").close()
    ledger = Ledger.open(f"sqlite://{path}")
    # Swap this thread's connection for a read-only one: every write must fail closed.
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
    ledger._pool.use(ro)
    with pytest.raises(LedgerUnavailable, match="unavailable"):
        _reserve(ledger, Cost(0.1))
    ro.close()
    ledger.close()


def test_unreachable_postgres_is_unavailable() -> None:
    with pytest.raises(LedgerUnavailable, match="unavailable"):
        Ledger.open("postgresql://dpsql@127.0.0.1:1/nowhere?connect_timeout=2")


# --- PostgreSQL -----------------------------------------------------------------------------


@pytest.fixture
def pg_ledger(pg_dsn: str) -> Iterator[PostgresLedger]:
    with PostgresLedger(pg_dsn) as opened:
        yield opened


def _fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.mark.postgres
def test_pg_reserve_refuse_and_reopen(pg_dsn: str, pg_ledger: PostgresLedger) -> None:
    dataset = _fresh("health")
    assert _refuses_after_on(pg_ledger, dataset, 3.0, 0.5) == 6
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(pg_ledger, Cost(0.5), dataset=dataset, dataset_budget=Budget(epsilon=3.0))
    assert refused.value.message == f'privacy budget exhausted for dataset "{dataset}"'
    assert refused.value.detail == "The dataset's total privacy budget cannot cover this query (it needs ε=0.5)."
    with PostgresLedger(pg_dsn) as reopened:
        assert reopened.spent(dataset) == Spent(3.0, 0.0, 6 * 0.125, 6)
        assert [row.analyst for row in reopened.summary(dataset)] == ["alice"]
        assert len(reopened.charges(dataset)) == 6


def _refuses_after_on(ledger: Ledger, dataset: str, budget: float, cost: float) -> int:
    succeeded = 0
    while True:
        try:
            _reserve(ledger, Cost(cost), dataset=dataset, dataset_budget=Budget(epsilon=budget))
        except PrivacyBudgetExhausted:
            return succeeded
        succeeded += 1


@pytest.mark.postgres
def test_pg_zcdp_and_collusion(pg_ledger: PostgresLedger) -> None:
    dataset = _fresh("zcdp")
    budget = Budget(epsilon=1.0, delta=1e-6)
    step = Cost(epsilon=0.5, delta=1e-7, rho=max_rho(1.0, 1e-6) / 2)
    _reserve(pg_ledger, step, dataset=dataset, analyst="alice", dataset_budget=budget, accounting="zcdp")
    _reserve(pg_ledger, step, dataset=dataset, analyst="bob", dataset_budget=budget, accounting="zcdp")
    with pytest.raises(PrivacyBudgetExhausted, match="dataset"):
        _reserve(pg_ledger, step, dataset=dataset, analyst="carol", dataset_budget=budget, accounting="zcdp")
    assert pg_ledger.spent(dataset).rho == pytest.approx(max_rho(1.0, 1e-6))


@pytest.mark.postgres
def test_pg_threads_race(pg_ledger: PostgresLedger) -> None:
    _race_threads(pg_ledger, _fresh("threads"), budget=3.0, cost=0.5, threads=8, attempts=3)


@pytest.mark.postgres
def test_pg_processes_race(pg_dsn: str, tmp_path: Path) -> None:
    _race_processes(pg_dsn, lambda: PostgresLedger(pg_dsn), tmp_path, _fresh("procs"))


@pytest.mark.postgres
def test_pg_sigkilled_process_loses_no_committed_charge(pg_dsn: str, tmp_path: Path) -> None:
    _sigkill_loses_nothing(pg_dsn, lambda: PostgresLedger(pg_dsn), tmp_path, _fresh("kill"))


@pytest.mark.postgres
def test_pg_lost_connection_fails_closed_then_recovers(pg_dsn: str, pg_ledger: PostgresLedger) -> None:
    import psycopg

    dataset = _fresh("lost")
    _reserve(pg_ledger, Cost(0.1), dataset=dataset)
    pid = pg_ledger._conn().info.backend_pid
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(LedgerUnavailable):
        _reserve(pg_ledger, Cost(0.1), dataset=dataset)
    _reserve(pg_ledger, Cost(0.1), dataset=dataset)  # a fresh connection is made
    assert pg_ledger.spent(dataset).queries == 2
    with psycopg.connect(pg_dsn, autocommit=True) as admin, pytest.raises(psycopg.Error, match="never"):
        admin.execute("DELETE FROM dpsql_ledger WHERE dataset = %s", (dataset,))


def test_installation_key_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    first = Ledger.open(f"sqlite:///{path}")
    key = first.installation_key()
    first.close()
    assert len(key) == 32 and (path.stat().st_mode & 0o777) == 0o600
    again = Ledger.open(f"sqlite:///{path}")
    assert again.installation_key() == key  # kept: fingerprints stay comparable across restarts
    again.close()
    other = Ledger.open("memory")
    assert other.installation_key() != key  # another installation, another key
    other.close()


@pytest.mark.postgres
def test_pg_installation_key_is_shared(pg_dsn: str, pg_ledger: PostgresLedger) -> None:
    other = PostgresLedger(pg_dsn)
    try:
        assert other.installation_key() == pg_ledger.installation_key() and len(pg_ledger.installation_key()) == 32
    finally:
        other.close()


# --- typed budget values, curator levers and the audit trail (both stores) ---------------------


def test_typed_budget_values_compose() -> None:
    assert Cost(0.5, 1e-7, 0.1, 1e-7) + Cost(0.25) == Cost(0.75, 1e-7, 0.1 + 0.25**2 / 2, 1e-7)  # pure ε as ρ = ε²/2
    spent = Spent() + Cost(0.5, 0.0, 0.125) + Cost(0.5, 0.0, 0.125)
    assert spent == Spent(1.0, 0.0, 0.25, 2)
    assert spent + Spent(1.0, 0.0, 0.5, 1) == Spent(2.0, 0.0, 0.75, 3)  # two analysts together
    assert Spent.total([spent, spent]) == Spent(2.0, 0.0, 0.5, 4)
    limit = Allowance.of(Budget(epsilon=5, delta=1e-6)) + Allowance(2, 1e-6)
    assert limit == Allowance(7, 2e-6)
    assert Allowance(1, 0) <= limit and not (Allowance(8, 0) <= limit) and limit >= Allowance(7, 0)
    with pytest.raises(ValueError):
        Allowance(1, 1.0)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_ledger(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[Ledger]:
    url = sqlite_url if request.param == "sqlite" else request.getfixturevalue("pg_new_database")()
    with Ledger.open(url) as opened:
        yield opened


def test_grant_raises_the_limit_checked_in_the_reservation(any_ledger: Ledger) -> None:
    base = Budget(epsilon=1.0, delta=1e-6)
    _reserve(any_ledger, Cost(1.0), analyst_budget=base)
    with pytest.raises(PrivacyBudgetExhausted):
        _reserve(any_ledger, Cost(0.5), analyst_budget=base)
    any_ledger.grant(dataset="health", analyst="alice", epsilon=0.5, by="curator", reason="thesis")
    charge = _reserve(any_ledger, Cost(0.5), analyst_budget=base)
    assert charge.analyst_limit == Allowance(1.5, 1e-6)  # type: ignore[attr-defined]
    with pytest.raises(PrivacyBudgetExhausted):
        _reserve(any_ledger, Cost(0.1), analyst_budget=base)
    assert any_ledger.remaining("health", "alice", budget=base).epsilon == 0.0
    assert any_ledger.levers("health", "bob") == Levers()  # another analyst's limit is untouched


def test_frozen_analyst_is_refused_before_any_charge(any_ledger: Ledger) -> None:
    any_ledger.freeze(dataset="health", analyst="bob", by="curator", reason="probing")
    for check in (
        lambda: any_ledger.check_not_frozen("health", "bob"),
        lambda: _reserve(any_ledger, Cost(0.1), analyst="bob"),
    ):
        with pytest.raises(InsufficientPrivilege) as refused:
            check()
        assert refused.value.sqlstate == "42501"
        assert refused.value.message == 'the data curator froze the privacy budget of analyst "bob"'
        assert "probing" not in str(refused.value.detail) + str(refused.value.hint)  # no curator reason
    assert any_ledger.spent("health", "bob") == Spent()
    any_ledger.check_not_frozen("health", "alice")
    any_ledger.unfreeze(dataset="health", analyst="bob", by="curator")
    _reserve(any_ledger, Cost(0.1), analyst="bob")
    events = any_ledger.lever_events("health", "bob")
    assert [(e.kind, e.by, e.reason) for e in events] == [("unfreeze", "curator", ""), ("freeze", "curator", "probing")]


@pytest.mark.parametrize(
    ("epsilon", "delta", "reason", "message"),
    [
        (-1.0, 0.0, "r", "invalid grant: ε=-1.0, δ=0.0"),
        (math.inf, 0.0, "r", "invalid grant: ε=inf, δ=0.0"),
        (1.0, 1.0, "r", "invalid grant: ε=1.0, δ=1.0"),
        (0.0, 0.0, "r", "a grant must add some ε or δ"),
        (1.0, 0.0, "", "a grant needs a --reason"),
    ],
)
def test_invalid_grants_are_22023(ledger: Ledger, epsilon: float, delta: float, reason: str, message: str) -> None:
    with pytest.raises(InvalidParameterValue) as refused:
        ledger.grant(dataset="health", analyst="alice", epsilon=epsilon, delta=delta, by="c", reason=reason)
    assert refused.value.sqlstate == "22023" and refused.value.message == message
    assert ledger.lever_events("health") == []


def test_unknown_analyst_lever_is_42704(sqlite_url: str) -> None:
    from dpsql.cli import build_parser

    policy = str(Path(__file__).resolve().parents[2] / "schemas" / "health.yaml")
    args = build_parser().parse_args(
        ["budget", "freeze", "--analyst", "nobody", "--ledger", sqlite_url, "--policy", policy]
    )
    with pytest.raises(UndefinedObject) as refused:
        args.func(args)
    assert refused.value.sqlstate == "42704"
    assert refused.value.message == 'analyst "nobody" is not in the policy'


def test_curator_levers_need_a_policy(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No fallback to the demo's dataset (#28 item 6): without --policy a lever does nothing, exit 1."""
    from dpsql.cli import main

    for argv in (["budget", "grant", "--analyst", "bob", "--epsilon", "1", "--reason", "r"], ["audit"]):
        with pytest.raises(SystemExit) as stopped:
            main([*argv, "--ledger", sqlite_url])
        assert stopped.value.code == 1
        command = "budget grant" if argv[0] == "budget" else "audit"
        assert capsys.readouterr().err.startswith(f"ERROR:  dpsql {command} needs --policy")
    assert Ledger.open(sqlite_url).lever_events("health") == []


def test_audit_trail_is_append_only(any_ledger: Ledger) -> None:
    at = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    entries = [
        AuditEntry(at - dt.timedelta(days=5), "health", "alice", "f1", "SELECT COUNT(*) FROM t", "answered", "00000"),
        AuditEntry(at, "health", "bob", "f2", "SELECT x FROM t", "refused", "42803", latency_ms=0.5),
    ]
    any_ledger.record_audit(entries)
    rows = any_ledger.audit("health")
    assert [(r.analyst, r.outcome, r.sqlstate) for r in rows] == [
        ("bob", "refused", "42803"),
        ("alice", "answered", "00000"),
    ]
    assert [r.analyst for r in any_ledger.audit("health", since=at - dt.timedelta(days=1))] == ["bob"]
    assert [r.analyst for r in any_ledger.audit("health", "alice")] == ["alice"]
    assert any_ledger.audit("other") == []
    any_ledger.grant(dataset="health", analyst="alice", epsilon=1, by="c", reason="r")
    for table in ("dpsql_audit", "dpsql_ledger_levers"):
        for sql in (f"DELETE FROM {table}", f"UPDATE {table} SET analyst = 'x'"):
            with pytest.raises(Exception, match=r"never|append-only"), any_ledger._append() as execute:
                execute(sql, ())
    assert len(any_ledger.audit("health")) == 2 and len(any_ledger.lever_events("health")) == 1
