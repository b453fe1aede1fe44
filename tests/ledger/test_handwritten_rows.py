"""Round 3 of the ledger audit: hand-written charge rows never give budget back.

* A: one charge row with NULL running sums (it looks written before schema 5) and a lowered total gave
  the spent budget back: SQLite's trigger now refuses such a row, and readers (SQLite and PostgreSQL,
  their triggers bypassed) fall back to the rows themselves, so spent never drops below them.
* B: a hand-written absurd (ε=1e308) or infinite charge row was ignored; it now exhausts the budget
  (53P01) and readers show it (inf, or at least the row's ε).

Real SQLite files and real PostgreSQL databases (``pg_new_database``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpsql.dev.demo import demo_policy_path
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Cost, Ledger
from dpsql.policy import Budget, load_policy

ROOT = Path(__file__).resolve().parents[2]
POLICY = load_policy(demo_policy_path("health"))
SMALL = Budget(epsilon=1.0, delta=1e-5)
DATASET = Budget(epsilon=50.0, delta=1e-4)
_BARE_ROW = (
    "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting) "
    "VALUES (?, 'health', ?, 'hand', ?, 0, 0, 'pure')"
)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'ledger.sqlite'}"
    return str(request.getfixturevalue("pg_new_database")())


def _reserve(ledger: Ledger, analyst: str = "bob", epsilon: float = 0.5, dataset: Budget = DATASET) -> object:
    return ledger.reserve(
        dataset="health",
        analyst=analyst,
        cost=Cost(epsilon),
        dataset_budget=dataset,
        analyst_budget=SMALL,
        fingerprint="f",
    )


def _execute(ledger: Ledger, sql: str, params: tuple[object, ...] = ()) -> None:
    """Run ``sql`` as a hand with the ledger's own credentials would."""
    with ledger._append() as execute:
        execute(ledger._sql(sql), params)


def _bypass_triggers(ledger: Ledger, url: str) -> None:
    """What someone with the file (SQLite) or the owner's role (PostgreSQL) can do."""
    if url.startswith("sqlite"):
        for trigger in ("dpsql_ledger_finite", "dpsql_ledger_sums"):
            _execute(ledger, f"DROP TRIGGER IF EXISTS {trigger}")
    else:
        _execute(ledger, "ALTER TABLE dpsql_ledger DISABLE TRIGGER USER")


def _now(ledger: Ledger) -> object:
    return ledger._timestamp(dt.datetime.now(dt.UTC))


def _dpsql(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, "--policy", str(ROOT / "schemas" / "health.yaml")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sqlite_refuses_a_charge_row_without_running_sums(tmp_path: Path) -> None:
    with Ledger.open(f"sqlite://{tmp_path / 'l.sqlite'}") as ledger:
        _reserve(ledger)
        with pytest.raises(Exception, match="privacy ledger charges carry their running sums"):
            _execute(ledger, _BARE_ROW, (_now(ledger), "bob", 0.0))
        lowered = (
            "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, "
            "selection_delta, sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries, ds_epsilon, "
            "ds_delta, ds_rho, ds_selection_delta, ds_queries) "
            "VALUES (?, 'health', 'bob', 'hand', 0, 0, 0, 'pure', 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 9)"
        )
        with pytest.raises(Exception, match="privacy ledger charges carry their running sums"):
            _execute(ledger, lowered, (_now(ledger),))
        _reserve(ledger)  # dpsql's own rows pass: ε=1 of 1
        assert ledger.verify("health") == []


def test_a_null_sum_row_and_a_lowered_total_give_nothing_back(any_url: str) -> None:
    """Audit item A: the newest row's sums NULL, the totals set to 0: spent stays what the rows say."""
    with Ledger.open(any_url) as ledger:
        _reserve(ledger)
        _reserve(ledger)  # bob has spent his whole ε=1
        _bypass_triggers(ledger, any_url)
        _execute(ledger, _BARE_ROW, (_now(ledger), "bob", 0.0))
        _execute(ledger, "UPDATE dpsql_ledger_totals SET epsilon = 0, queries = 0")
        assert ledger.spent("health", "bob").epsilon == 1.0
        assert ledger.spent("health").epsilon == 1.0
        assert [r.spent.epsilon for r in ledger.summary("health")] == [1.0]
        with pytest.raises(PrivacyBudgetExhausted) as refused:
            _reserve(ledger, epsilon=0.1)
        assert refused.value.sqlstate == "53P01"
        problems = ledger.verify("health")
        assert any("no running sums" in p for p in problems), problems


@pytest.mark.parametrize("epsilon", [1e308, math.inf])
def test_an_absurd_or_infinite_hand_written_row_exhausts(any_url: str, epsilon: float, tmp_path: Path) -> None:
    """Audit item B: a bare row of ε=1e308 (finite) or inf for an analyst is counted: 53P01 for that analyst
    and, as the row alone is above the dataset's budget, for everyone; `dpsql budget` shows it."""
    with Ledger.open(any_url) as ledger:
        _reserve(ledger, analyst="alice")
        _bypass_triggers(ledger, any_url)
        _execute(ledger, _BARE_ROW, (_now(ledger), "alice", epsilon))
        assert ledger.spent("health", "alice").epsilon >= epsilon
        assert ledger.spent("health").epsilon >= epsilon
        summary = {r.analyst: r.spent.epsilon for r in ledger.summary("health")}
        assert summary["alice"] >= epsilon
        for analyst in ("alice", "carol"):  # carol: the dataset's budget is gone too
            with pytest.raises(PrivacyBudgetExhausted) as refused:
                _reserve(ledger, analyst=analyst, epsilon=0.1)
            assert refused.value.sqlstate == "53P01"
    listed = _dpsql("budget", "--json", "--ledger", any_url, home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    alice = {r["analyst"]: r for r in json.loads(listed.stdout)}["alice"]
    assert alice["epsilon_remaining"] == 0.0
    assert alice["epsilon_spent"] is None or alice["epsilon_spent"] >= epsilon


def test_sums_on_a_row_below_its_own_cost_are_not_trusted(any_url: str) -> None:
    """A hand-written row whose sums are lower than its own ε reads by its rows instead."""
    with Ledger.open(any_url) as ledger:
        _reserve(ledger)
        _bypass_triggers(ledger, any_url)
        _execute(
            ledger,
            "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, "
            "selection_delta, sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries, ds_epsilon, "
            "ds_delta, ds_rho, ds_selection_delta, ds_queries) "
            "VALUES (?, 'health', 'bob', 'hand', 5, 0, 0, 'pure', 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1)",
            (_now(ledger),),
        )
        _execute(ledger, "UPDATE dpsql_ledger_totals SET epsilon = 0, queries = 0")
        assert ledger.spent("health", "bob").epsilon == 5.5
        with pytest.raises(PrivacyBudgetExhausted):
            _reserve(ledger, epsilon=0.1)


def test_an_honest_ledger_still_reads_from_the_last_row(any_url: str) -> None:
    """No fallback on an honest ledger: the running sums are trusted and agree with the totals."""
    with Ledger.open(any_url) as ledger:
        for analyst in ("alice", "bob", "alice"):
            _reserve(ledger, analyst=analyst, epsilon=0.25)
        assert ledger.spent("health", "alice").epsilon == 0.5
        assert ledger.spent("health").queries == 3
        assert ledger.verify() == []
