"""``budget.accounting: pld``: the ledger composes its recorded charges by privacy-loss distribution.

Issue #29 item 5: with a (1, 10⁻⁶) budget, ε = 0.03 Laplace-priced queries, pure accounting answers
33 and PLD (the generic (ε, δ) PLD of every charge, bench/accounting.py) 65. The refusal is the same
53P01, records nothing, and the remaining ε is the composed loss so far. On SQLite and PostgreSQL
ledgers, and end to end through the engine with a policy naming ``accounting: pld``.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

pytest.importorskip("dp_accounting")

from dpsql import pld
from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.errors import PolicyError, PrivacyBudgetExhausted
from dpsql.ledger import Cost, Ledger, Spent
from dpsql.policy import Budget, Policy, parse_policy
from dpsql.session import Session
from tests.demos import demo_fixture

BUDGET = Budget(epsilon=1.0, delta=1e-6)
HUGE = Budget(epsilon=1e6, delta=0.5)


def _reserve(ledger: Ledger, dataset: str, cost: Cost, accounting: str, **budgets: Budget) -> object:
    return ledger.reserve(
        dataset=dataset,
        analyst="alice",
        cost=cost,
        dataset_budget=budgets.get("dataset_budget", HUGE),
        analyst_budget=budgets.get("analyst_budget", BUDGET),
        fingerprint="select count(*) from visits",
        accounting=accounting,  # type: ignore[arg-type]
    )


def _answered(ledger: Ledger, dataset: str, accounting: str, *, queries: int = 0, rows: int = 0) -> int:
    """How many ε = 0.03 charges fit before the first refusal (checked to record nothing), after
    ``queries`` charges counted in the totals and ``rows`` charge rows."""
    answered = 0
    remaining = [BUDGET.epsilon]
    while True:
        try:
            _reserve(ledger, dataset, Cost(0.03), accounting)
        except PrivacyBudgetExhausted as refused:
            assert refused.sqlstate == "53P01"
            assert ledger.spent(dataset, "alice").queries == queries + answered  # the refusal recorded nothing
            assert len(ledger.charges(dataset, limit=1000)) == rows + answered
            return answered
        answered += 1
        if accounting == "pld":
            left = ledger.remaining(dataset, "alice", budget=BUDGET, accounting="pld").epsilon
            assert left < remaining[-1]  # each charge composes more loss
            remaining.append(left)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request: pytest.FixtureRequest) -> Ledger:
    return request.getfixturevalue(f"{request.param}_ledger")


def _fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def test_pld_answers_more_than_pure(ledger: Ledger) -> None:
    assert _answered(ledger, _fresh("pure"), "pure") == 33
    dataset = _fresh("pld")
    answered = _answered(ledger, dataset, "pld")
    assert answered >= 60
    assert answered == 65  # bench/README.md: the generic PLD of ε = 0.03
    spent = ledger.spent(dataset, "alice")
    assert (spent.queries, spent.delta) == (answered, 0.0)
    assert (spent.epsilon, spent.rho) == pytest.approx((answered * 0.03, answered * 0.03**2 / 2))
    (latest,) = ledger.charges(dataset, "alice", limit=1)
    assert latest.accounting == "pld"
    assert latest.cost == Cost(0.03, 0.0, 0.03**2 / 2)  # recorded as under pure accounting


def test_pld_refusal_message_and_remaining(ledger: Ledger) -> None:
    dataset = _fresh("pld")
    charge = None
    for _ in range(65):
        charge = _reserve(ledger, dataset, Cost(0.03), "pld")
    left = ledger.remaining(dataset, "alice", budget=BUDGET, accounting="pld")
    composed = pld.pld_epsilon([Cost(0.03)] * 65, BUDGET.delta)
    assert 65 * 0.03 > 1 > composed  # beyond basic composition, within the budget by PLD
    assert left.epsilon == pytest.approx(1 - composed)
    assert left.delta == BUDGET.delta
    assert charge.remaining("pld").epsilon == pytest.approx(left.epsilon)  # type: ignore[attr-defined]
    # pure figures from the same rows: nothing left by basic composition
    assert ledger.remaining(dataset, "alice", budget=BUDGET, accounting="pure").epsilon == 0
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(ledger, dataset, Cost(0.03), "pld")
    error = refused.value
    assert error.sqlstate == "53P01"
    assert error.message == 'privacy budget exhausted for analyst "alice"'
    assert error.detail is not None
    assert error.detail.startswith("spent ε=0.99") and "composed by PLD at δ=1e-06" in error.detail
    assert error.detail.endswith("this query needs ε=0.03, which would total ε=1.008")
    assert error.hint == "Ask the data curator for more budget, or lower ε with SET dpsql.epsilon."
    # the dataset's budget: same check, a refusal without the others' figures
    other = _fresh("pld")
    for _ in range(65):
        _reserve(ledger, other, Cost(0.03), "pld", analyst_budget=HUGE, dataset_budget=BUDGET)
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(ledger, other, Cost(0.03), "pld", analyst_budget=HUGE, dataset_budget=BUDGET)
    assert refused.value.message == f'privacy budget exhausted for dataset "{other}"'
    assert refused.value.detail == "The dataset's total privacy budget cannot cover this query (it needs ε=0.03)."


def test_pld_composes_mixed_charges_and_selection_delta(ledger: Ledger) -> None:
    dataset = _fresh("mixed")
    costs = [Cost(0.05), Cost(0.02, 1e-7, 0.0, 1e-7), Cost(0.1, 2e-8, 0.004, 0.0), Cost(0.05)]
    for cost in costs:
        _reserve(ledger, dataset, cost, "pld")
    left = ledger.remaining(dataset, "alice", budget=BUDGET, accounting="pld").epsilon
    assert left == pytest.approx(1 - pld.pld_epsilon(costs, BUDGET.delta))
    # selection δ adds up: ten charges of 10⁻⁷ fill a 10⁻⁶ budget (the last by basic composition's cap: no δ is
    # left for the PLD), an eleventh is refused
    selecting, budget = _fresh("selection"), Budget(epsilon=5.0, delta=1e-6)
    for _ in range(10):
        _reserve(ledger, selecting, Cost(1e-3, 1e-7, 0.0, 1e-7), "pld", analyst_budget=budget)
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(ledger, selecting, Cost(1e-3, 1e-7, 0.0, 1e-7), "pld", analyst_budget=budget)
    assert refused.value.detail == "spent partition-selection δ=1e-06 of 1e-06, this query needs δ=1e-07"
    assert ledger.spent(selecting, "alice").queries == 10
    assert ledger.remaining(selecting, "alice", budget=budget, accounting="pld").epsilon == pytest.approx(5 - 0.01)


def test_pld_deleted_charge_rows_give_no_budget_back(tmp_path: Path) -> None:
    """The reconciled sums still count charges whose rows were deleted by hand (as one more charge)."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(f"sqlite://{path}") as ledger:
        for _ in range(30):
            _reserve(ledger, "health", Cost(0.03), "pld")
        before = ledger.remaining("health", "alice", budget=BUDGET, accounting="pld").epsilon
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER dpsql_ledger_no_delete")
    conn.execute("DELETE FROM dpsql_ledger WHERE id <= 20")
    conn.commit()
    conn.close()
    with Ledger.open(f"sqlite://{path}") as ledger:
        after = ledger.remaining("health", "alice", budget=BUDGET, accounting="pld").epsilon
        assert after <= before + 1e-12
        assert _answered(ledger, "health", "pld", queries=30, rows=10) <= 65 - 30


def test_remaining_reported_by_every_reader_is_a_lower_bound() -> None:
    """From sums alone (dpsql budget, the dashboard) pld reads as basic composition: never more than PLD."""
    from dpsql.accountant import remaining_budget

    spent = Spent(40 * 0.03, 0.0, 0.0, 40)
    assert remaining_budget(spent, BUDGET, "pld").epsilon == 0.0
    assert spent.privacy_loss("pld", BUDGET.delta) == (spent.epsilon, spent.delta)


# --- the policy and the engine ----------------------------------------------------------------------


def _pld_policy_text() -> str:
    text = Path(demo_policy_path("health")).read_text()
    text = text.replace("budget:\n", "budget:\n  accounting: pld\n", 1)
    old = "analyst: {epsilon: 10.0, delta: 1.0e-5}"
    assert old in text
    return text.replace(old, "analyst: {epsilon: 1.0, delta: 1.0e-6}", 1)


def test_policy_accepts_pld_and_names_the_extra_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = parse_policy(_pld_policy_text())
    assert policy.budget.accounting == "pld"
    monkeypatch.setattr(pld, "available", lambda: False)
    with pytest.raises(PolicyError) as refused:
        parse_policy(_pld_policy_text(), "pld.yaml")
    assert "budget.accounting: pld accounting needs Google's dp-accounting package" in refused.value.message
    assert "pld extra" in refused.value.message


health_duckdb = demo_fixture("health", scope="module")


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_engine_end_to_end_under_pld(
    store: str, health_duckdb: Backend, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    policy: Policy = parse_policy(_pld_policy_text())
    url = f"sqlite://{tmp_path / 'ledger.sqlite'}" if store == "sqlite" else request.getfixturevalue("pg_dsn")
    ledger = Ledger.open(url)
    if store == "postgres":
        policy = policy.model_copy(update={"dataset": _fresh("health")})
    engine = Engine(policy, health_duckdb, ledger)
    session = Session("alice", epsilon=0.03)
    answered, shown = 0, 1.0
    try:
        while True:
            try:
                result = engine.execute(f"SELECT COUNT(*) FROM patients WHERE age > {answered}", session)
            except PrivacyBudgetExhausted as refused:
                assert refused.sqlstate == "53P01"
                break
            answered += 1
            assert result.remaining_epsilon is not None and result.remaining_epsilon < shown
            shown = result.remaining_epsilon
            assert any("remaining ε=" in notice for notice in result.notices)
        assert answered == 65
        spent = ledger.spent(policy.dataset, "alice")
        assert spent.queries == 65  # the refusal recorded nothing
        left = ledger.remaining(
            policy.dataset, "alice", budget=policy.analyst_budget("alice"), accounting="pld", dataset_budget=None
        )
        assert shown == pytest.approx(left.epsilon)
        assert 0 < left.epsilon < 0.01
    finally:
        ledger.close()
