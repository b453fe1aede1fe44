"""Issue #41 item 1: ``pld`` accounting whose cost does not grow with history.

The ledger keeps each analyst's and each dataset's composed privacy-loss distribution (``dpsql_ledger_pld``,
:mod:`dpsql.ledger.loss_state`) and composes each new charge into it; charges are quantised up to a grid of
3 significant digits. Checked here: the lattice composition against Google's dp-accounting (never below
it), the stored state against a recomposition of the rows (``ledger verify``), a reservation that reads no
past charge row, and a state written by someone without the signing key (forged, replayed, or signed with
the installation key a PostgreSQL writer role can read) never giving budget back. Timings: bench/reservation.py.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import uuid
from pathlib import Path

import pytest

pytest.importorskip("dp_accounting")

from dpsql.accountant import Allowance, Cost
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Ledger
from dpsql.ledger import loss_state as states
from dpsql.ledger.loss_state import Kept
from dpsql.pld import pld_epsilon
from dpsql.pld_state import Composed, LossState, on_grid, quantised

BUDGET = Allowance(1.0, 1e-6)
HUGE = Allowance(1e6, 0.5)


def _reserve(ledger: Ledger, dataset: str, cost: Cost, budget: Allowance = BUDGET, analyst: str = "alice") -> object:
    return ledger.reserve(
        dataset=dataset,
        analyst=analyst,
        cost=cost,
        dataset_budget=HUGE,
        analyst_budget=budget,
        fingerprint="q",
        accounting="pld",
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger(request: pytest.FixtureRequest) -> Ledger:
    return request.getfixturevalue(f"{request.param}_ledger")


def _fresh() -> str:
    return f"pld-{uuid.uuid4().hex[:8]}"


# --- the lattice composition ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lattice_composition_is_never_below_dp_accounting(seed: int) -> None:
    """The same pessimistic lattice as dp_accounting's (10⁻⁴): on ε whose ratio to the step is exact in floats
    (dp_accounting's ``ceil`` adds a step to a ratio a float ulp above an integer, ours does not), equal up
    to float rounding, and never below."""
    rng = random.Random(seed)
    epsilons = [k * 1e-4 for k in (rng.randint(10, 800) for _ in range(200)) if (k * 1e-4) / 1e-4 == k]
    costs = [Cost(e, rng.choice([0.0, 0.0, 1e-9])) for e in epsilons[:60]]
    composed = Composed.empty().add_all(costs)
    for delta in (1e-6, 1e-4, 1e-2):
        ours = composed.state.epsilon(delta)
        theirs = pld_epsilon(costs, delta, basic=False)
        assert ours >= theirs * (1 - 1e-9)
        assert ours == pytest.approx(theirs, rel=1e-6)


def test_state_round_trips_and_rejects_other_bytes() -> None:
    state = Composed.empty().add_all([Cost(0.03)] * 20 + [Cost(0.0123, 1e-8)]).state
    again = LossState.from_bytes(state.to_bytes())
    assert again.offset == state.offset and again.infinity == state.infinity
    assert again.epsilon(1e-6) == state.epsilon(1e-6)
    for bad in (b"", b"PLD1", state.to_bytes()[:-3], b"XXXX" + state.to_bytes()[4:]):
        with pytest.raises(ValueError):
            LossState.from_bytes(bad)


def test_grid_rounds_charges_up_to_three_significant_digits() -> None:
    values = (0.03, 0.012345, 1 / 3, 1e-4 + 3e-9, 0.0999999999)
    assert [on_grid(v) for v in values] == [0.03, 0.0124, 0.334, 0.000101, 0.1]
    cost = quantised(Cost(0.012345, 1.234e-7, 0.0, 1.234e-7))
    assert (cost.epsilon, cost.delta, cost.selection_delta) == (0.0124, 1.24e-7, 1.24e-7)
    # 1,000,000 distinct ε between 1e-4 and 2e-4 are at most 100 charged figures
    assert len({on_grid(1e-4 + i * 1e-10) for i in range(0, 1_000_000, 997)}) <= 101


# --- the ledger keeps it ----------------------------------------------------------------------------


def test_reserve_charges_on_the_grid_and_keeps_the_state_current(ledger: Ledger) -> None:
    dataset = _fresh()
    charge = _reserve(ledger, dataset, Cost(0.012345))
    assert charge.cost.epsilon == 0.0124  # type: ignore[attr-defined]
    (latest,) = ledger.charges(dataset, "alice", limit=1)
    assert latest.cost.epsilon == 0.0124
    for i in range(30):
        _reserve(ledger, dataset, Cost(0.01 + i * 1e-7), analyst=("alice", "bob")[i % 2])
    rows = ledger._read("SELECT scope, analyst, through FROM dpsql_ledger_pld WHERE dataset = ?", (dataset,))
    last: dict[str, int] = {}
    for record in ledger.charges(dataset, limit=100):
        last[record.analyst] = max(last.get(record.analyst, 0), record.id)
    stored = {(str(r[0]), str(r[1])): int(r[2]) for r in rows}
    # the stored states lag by less than STORE_EVERY charges (this process holds the current ones): the next
    # reservation reads at most that many past charge rows, however long the history
    for analyst in ("alice", "bob"):
        assert 0 <= last[analyst] - stored[(states.ANALYST, analyst)] < states.STORE_EVERY * 2
        assert states._KNOWN.get((ledger.url, dataset, states.ANALYST, analyst))[1].through == last[analyst]  # type: ignore[index]
    assert 0 <= max(last.values()) - stored[(states.DATASET, "")] < states.STORE_EVERY
    assert ledger.verify(dataset) == []
    # and the composition kept equals the rows recomposed
    states._KNOWN.clear()  # as another process would: the stored row, then the charges after it
    alice = states.load(ledger._read, ledger.url, ledger.signing_key(), dataset, "alice", ("analyst", "alice"))[0]
    alice_state = alice.composed.state
    costs = [c.cost for c in reversed(ledger.charges(dataset, "alice", limit=100))]
    assert alice_state.epsilon(1e-6) == pytest.approx(Composed.empty().add_all(costs).state.epsilon(1e-6), rel=1e-12)


def test_remaining_reads_the_kept_state(ledger: Ledger) -> None:
    dataset = _fresh()
    for _ in range(40):
        _reserve(ledger, dataset, Cost(0.03))
    left = ledger.remaining(dataset, "alice", budget=BUDGET, accounting="pld").epsilon
    assert left == pytest.approx(1 - pld_epsilon([Cost(0.03)] * 40, BUDGET.delta), rel=1e-6)


def _state_row(ledger: Ledger, dataset: str, scope: str = states.ANALYST) -> tuple[object, ...]:
    rows = ledger._read(states.STATES_SQL, (dataset, "alice"))
    return next(tuple(r) for r in rows if r[0] == scope)


def _write_state(ledger: Ledger, dataset: str, scope: str, analyst: str, kept: Kept, key: bytes) -> None:
    params = states.row(key, dataset, scope, analyst, kept)
    with ledger._append() as execute:
        execute(ledger._sql(states.UPSERT_SQL), params)
    states._KNOWN.clear()  # another process wrote it: this one has not seen it


def test_a_forged_state_gives_no_budget_back(ledger: Ledger, caplog: pytest.LogCaptureFixture) -> None:
    """A state claiming no loss, with a signature this installation's signing key did not make: ignored
    (rebuilt from the rows, one ERROR line), refused exactly where the honest ledger refuses; verify names it."""
    dataset = _fresh()
    for _ in range(65):
        _reserve(ledger, dataset, Cost(0.03))
    through = int(_state_row(ledger, dataset)[1])  # type: ignore[call-overload]
    forged = Kept(Composed(LossState.identity(), Composed.empty().add_all([Cost(0.03)] * 65).spent), through)
    for scope, name in ((states.ANALYST, "alice"), (states.DATASET, "")):
        _write_state(ledger, dataset, scope, name, forged, b"k" * 32)
    with caplog.at_level(logging.ERROR, logger="dpsql.ledger"), pytest.raises(PrivacyBudgetExhausted):
        _reserve(ledger, dataset, Cost(0.03))
    assert "not signed by this installation's signing key" in caplog.text
    assert ledger.spent(dataset, "alice").queries == 65
    # a state with the right content but another signature is rebuilt on the next charge; verify compares content
    _write_state(ledger, dataset, states.ANALYST, "alice", forged, b"k" * 32)
    problems = ledger.verify(dataset)
    assert any('composed PLD state of analyst "alice"' in p and "disagrees" in p for p in problems)


def test_a_replayed_older_state_is_caught_up_from_the_rows(ledger: Ledger) -> None:
    """A writer replaying an earlier signed row (its signature checks) only makes the state lag."""
    dataset = _fresh()
    for _ in range(20):  # the state is stored every STORE_EVERY charges (16)
        _reserve(ledger, dataset, Cost(0.03))
    old = _state_row(ledger, dataset)
    for _ in range(45):
        _reserve(ledger, dataset, Cost(0.03))
    with ledger._append() as execute:
        execute(
            ledger._sql(
                "UPDATE dpsql_ledger_pld SET through = ?, queries = ?, epsilon = ?, delta = ?, selection_delta = ?, "
                "state = ?, mac = ? WHERE dataset = ? AND scope = 'analyst' AND analyst = 'alice'"
            ),
            (*old[1:8], dataset),
        )
    states._KNOWN.clear()
    with pytest.raises(PrivacyBudgetExhausted):  # 65 fit, as without the replay
        _reserve(ledger, dataset, Cost(0.03))


def test_pg_state_signed_with_the_installation_key_is_refused(
    postgres_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """On PostgreSQL the writer role can read the installation key: the state is signed with the key file
    outside the database, so a state signed with the installation key is a forgery."""
    ledger = postgres_ledger
    assert ledger.signing_key() != ledger.installation_key()
    dataset = _fresh()
    for _ in range(65):
        _reserve(ledger, dataset, Cost(0.03))
    through = int(_state_row(ledger, dataset)[1])  # type: ignore[call-overload]
    forged = Kept(Composed(LossState.identity(), Composed.empty().add_all([Cost(0.03)] * 65).spent), through)
    for scope, name in ((states.ANALYST, "alice"), (states.DATASET, "")):
        _write_state(ledger, dataset, scope, name, forged, ledger.installation_key())
    with caplog.at_level(logging.ERROR, logger="dpsql.ledger"), pytest.raises(PrivacyBudgetExhausted):
        _reserve(ledger, dataset, Cost(0.03))
    assert "not signed by this installation's signing key" in caplog.text


def test_a_lost_state_is_rebuilt_and_deleted_rows_still_count(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(f"sqlite://{path}") as ledger:
        for _ in range(30):
            _reserve(ledger, "health", Cost(0.03))
        before = ledger.remaining("health", "alice", budget=BUDGET, accounting="pld").epsilon
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM dpsql_ledger_pld")
    conn.execute("DROP TRIGGER dpsql_ledger_no_delete")
    conn.execute("DELETE FROM dpsql_ledger WHERE id <= 20")
    conn.commit()
    conn.close()
    states._KNOWN.clear()
    with Ledger.open(f"sqlite://{path}") as ledger:
        assert ledger.remaining("health", "alice", budget=BUDGET, accounting="pld").epsilon <= before + 1e-12
        answered = 0
        while True:
            try:
                _reserve(ledger, "health", Cost(0.03))
            except PrivacyBudgetExhausted:
                break
            answered += 1
        assert answered <= 65 - 30
