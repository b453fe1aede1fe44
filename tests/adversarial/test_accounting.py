"""Accounting attacks: zCDP must add up partition-selection δ, and huge sums must not be clipped.

Under ``budget.accounting: zcdp`` a query costs ρ (ε²/2 for Laplace) *plus* an additive
partition-selection δ; the ledger refuses once ε(Σρ, δ_budget − Σδ_sel) > ε_budget or Σδ_sel >
δ_budget, on SQLite and PostgreSQL alike. An oversized per-query δ is refused (22023) before
any charge. Integer sums beyond 2^52 are noised exactly, not clipped.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from dpsql.accountant import fmt
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import HEALTH_COLUMNS, health_rows
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Cost, Ledger, remaining_budget
from dpsql.noise.names import Mechanism
from dpsql.policy import Budget, Policy, load_policy
from dpsql.release import epsilon_to_rho, half_width, rho_to_epsilon
from dpsql.session import Session
from tests.policies import policy_yaml, table_yaml

ROOT = Path(__file__).resolve().parents[2]
GROUPED = "SELECT zip, COUNT(*) FROM patients GROUP BY zip"  # zip has no public domain: partition selection
PUBLIC = "SELECT sex, COUNT(*) FROM patients GROUP BY sex"  # public domain: no selection, no δ
RARE_ZIP = 2195


def _zcdp_policy(tmp_path: Path, **dataset_budget: float) -> Policy:
    doc = yaml.safe_load((ROOT / "schemas" / "health.yaml").read_text())
    doc["budget"]["accounting"] = "zcdp"
    doc["budget"]["dataset"].update(dataset_budget)
    path = tmp_path / "health_zcdp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_policy(path)


@pytest.fixture(scope="module")
def neighbours() -> Iterator[tuple[Backend, Backend]]:
    """Two DuckDB patients tables differing in one person, the only one with zip 2195."""
    base = [row for row in health_rows(10_000) if row[5] < 2190]
    rare = ("Rare", "999-99-9999", "Single", "Female", base[20][4], RARE_ZIP, "Other", "Asthma", 40, 22.0, 1)
    without, with_ = open_backend("duckdb://"), open_backend("duckdb://")
    without.load_rows("patients", HEALTH_COLUMNS, base)
    with_.load_rows("patients", HEALTH_COLUMNS, [*base, rare])
    yield without, with_
    without.close()
    with_.close()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'ledger.sqlite'}"
    return request.getfixturevalue("pg_new_database")()


def _sqlstate(call: Callable[[], object]) -> str:
    with pytest.raises(Error) as info:
        call()
    return info.value.sqlstate


def test_zcdp_selection_delta_is_summed_and_enforced(
    tmp_path: Path, neighbours: tuple[Backend, Backend], ledger_url: str
) -> None:
    policy = _zcdp_policy(tmp_path, delta=1.5e-5)  # alice δ 1e-5, bob δ 1e-5, dataset δ 1.5e-5
    engine = Engine(policy, neighbours[0], Ledger.open(ledger_url))
    ledger = engine.ledger
    alice = Session("alice", epsilon=0.3, delta=2e-6)
    # δ ≥ the cap, or ≥ the dataset's δ: 22023 before any charge
    for delta in (0.99, 1e-2, 1.5e-5):

        def grouped(d: float = delta) -> object:
            return engine.execute(GROUPED, Session("alice", epsilon=0.05, delta=d))

        state = _sqlstate(grouped)
        assert state == "22023"
    assert ledger.spent("health").queries == 0
    # Σδ_sel: 4 × 2e-6 fit in alice's 1e-5; the 5th would leave no δ for converting ρ: 53P01 before running
    for _ in range(4):
        assert engine.execute(GROUPED, alice).rows  # Laplace + partition selection works under zcdp
    assert _sqlstate(lambda: engine.execute(GROUPED, alice)) == "53P01"
    spent = ledger.spent("health", "alice")
    assert spent.queries == 4
    assert spent.selection_delta == pytest.approx(8e-6)
    assert spent.rho == pytest.approx(4 * 0.3**2 / 2)  # Laplace ε-DP counts ρ = ε²/2
    # queries without selection δ still fit: ρ converted at δ_budget − Σδ_sel = 2e-6
    assert engine.execute(PUBLIC, alice).rows
    remaining = ledger.remaining("health", "alice", budget=policy.analyst_budget("alice"), accounting="zcdp")
    assert remaining.delta == pytest.approx(2e-6)
    # the dataset sums every analyst's selection δ: bob gets 3 × 2e-6 (Σ 1.4e-5), the 4th exceeds 1.5e-5
    bob = Session("bob", epsilon=0.3, delta=2e-6)
    for _ in range(3):
        engine.execute(GROUPED, bob)
    with pytest.raises(Error, match='dataset "health"') as info:
        engine.execute(GROUPED, bob)
    assert info.value.sqlstate == "53P01"
    assert ledger.spent("health").selection_delta == pytest.approx(1.4e-5)
    assert ledger.spent("health", "bob").queries == 3
    assert [c.cost.selection_delta for c in ledger.charges("health", "bob")] == pytest.approx([2e-6] * 3)
    engine.ledger.close()


def test_zcdp_gaussian_selection_charges_rho_and_half_the_delta(
    tmp_path: Path, neighbours: tuple[Backend, Backend], ledger_url: str
) -> None:
    policy = _zcdp_policy(tmp_path)
    engine = Engine(policy, neighbours[0], Ledger.open(ledger_url))
    session = Session("alice", epsilon=1.0, delta=1e-6, mechanism="gaussian")
    result = engine.execute(GROUPED, session)
    spent = engine.ledger.spent("health", "alice")
    assert spent.rho == pytest.approx(epsilon_to_rho(1.0, 5e-7))  # conversion δ/2 is not composed
    assert spent.selection_delta == pytest.approx(5e-7)  # the threshold's δ/2 is
    # one accountant everywhere: the NOTICE, Ledger.remaining and the ledger's own check
    budget = policy.analyst_budget("alice")
    expected = budget.epsilon - rho_to_epsilon(spent.rho, budget.delta - spent.selection_delta)
    assert result.remaining_epsilon == pytest.approx(expected)
    shown = engine.ledger.remaining("health", "alice", budget=budget, accounting="zcdp").epsilon
    assert shown == pytest.approx(expected)
    assert f"remaining ε={fmt(expected, down=True)}" in result.notices[-1]  # 4 significant digits, never more
    engine.ledger.close()


def test_rare_key_never_released_under_zcdp(tmp_path: Path, neighbours: tuple[Backend, Backend]) -> None:
    """δ=0.99 used to release a one-person key in most runs; at a legal δ it never appears."""
    policy = _zcdp_policy(tmp_path)
    without, with_ = (Engine(policy, backend, Ledger.open("sqlite:///:memory:")) for backend in neighbours)
    _, true_rows = neighbours[0].execute("SELECT zip, COUNT(*) FROM patients GROUP BY zip")
    common = {row[0] for row in true_rows}
    assert RARE_ZIP not in common
    assert _sqlstate(lambda: with_.execute(GROUPED, Session("alice", epsilon=0.3, delta=0.99))) == "22023"
    seen: set[int] = set()
    for i in range(20):
        session = Session(
            "alice", epsilon=1.0 if i % 2 else 0.3, delta=1e-7, mechanism="gaussian" if i % 2 else "laplace"
        )
        keys = {row[0] for row in with_.execute(GROUPED, session).rows}
        assert RARE_ZIP not in keys
        seen |= keys
        assert {row[0] for row in without.execute(GROUPED, session).rows} <= common
    assert seen and seen <= common  # common keys do get through
    assert with_.ledger.spent("health", "alice").selection_delta == pytest.approx(10 * 1e-7 + 10 * 5e-8)


def test_pure_accounting_is_unchanged(neighbours: tuple[Backend, Backend]) -> None:
    policy = load_policy(ROOT / "schemas" / "health.yaml")
    engine = Engine(policy, neighbours[0], Ledger.open("sqlite:///:memory:"))
    # a δ above budget.max_query_delta is refused before the ledger, under either accounting
    assert _sqlstate(lambda: engine.execute(GROUPED, Session("alice", epsilon=0.1, delta=0.99))) == "22023"
    assert _sqlstate(lambda: engine.execute(GROUPED, Session("alice", epsilon=0.1, delta=5e-5))) == "53P01"
    result = engine.execute(GROUPED, Session("alice", epsilon=0.1, delta=1e-6))
    assert result.remaining_epsilon == pytest.approx(9.9)
    spent = engine.ledger.spent("health", "alice")
    assert (spent.epsilon, spent.delta, spent.selection_delta) == pytest.approx((0.1, 1e-6, 1e-6))


_SCHEMA_1 = """
CREATE TABLE dpsql_ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, dataset TEXT NOT NULL,
    analyst TEXT NOT NULL, fingerprint TEXT NOT NULL, epsilon REAL NOT NULL, delta REAL NOT NULL,
    rho REAL NOT NULL, accounting TEXT NOT NULL);
CREATE TABLE dpsql_ledger_totals (dataset TEXT NOT NULL, analyst TEXT NOT NULL, epsilon REAL NOT NULL,
    delta REAL NOT NULL, rho REAL NOT NULL, queries INTEGER NOT NULL, last_at TEXT NOT NULL,
    PRIMARY KEY (dataset, analyst));
INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting)
    VALUES ('2026-01-01T00:00:00+00:00', 'health', 'alice', 'f', 1.0, 4e-6, 0.01, 'zcdp');
INSERT INTO dpsql_ledger_totals VALUES ('health', 'alice', 1.0, 4e-6, 0.01, 1, '2026-01-01T00:00:00+00:00');
"""


def _check_migrated(ledger: Ledger) -> None:
    spent = ledger.spent("health", "alice")
    assert spent.selection_delta == pytest.approx(4e-6)  # old δ counted as selection δ: conservative
    assert ledger.charges("health", "alice")[0].cost.selection_delta == pytest.approx(4e-6)
    budget = Budget(epsilon=10, delta=1e-5)
    step = Cost(epsilon=0.1, delta=2e-6, selection_delta=2e-6)

    def reserve() -> None:
        ledger.reserve(
            dataset="health",
            analyst="alice",
            cost=step,
            dataset_budget=budget,
            analyst_budget=budget,
            fingerprint="g",
            accounting="zcdp",
        )

    for _ in range(2):
        reserve()
    with pytest.raises(Error) as info:  # 4e-6 + 3 × 2e-6 = 1e-5: nothing left to convert ρ at
        reserve()
    assert info.value.sqlstate == "53P01"
    assert ledger.spent("health", "alice").selection_delta == pytest.approx(8e-6)
    left = remaining_budget(ledger.spent("health", "alice"), budget, "zcdp")
    assert left.delta == pytest.approx(2e-6)


def test_schema_1_sqlite_ledger_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(_SCHEMA_1)
    with Ledger.open(f"sqlite://{path}") as ledger:
        _check_migrated(ledger)
    with Ledger.open(f"sqlite://{path}") as reopened:  # a second open does not migrate again
        assert reopened.spent("health", "alice").selection_delta == pytest.approx(8e-6)


@pytest.mark.postgres
def test_schema_1_postgres_ledger_is_migrated(pg_new_database: Callable[[], str]) -> None:
    import psycopg

    url = pg_new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        schema = (
            _SCHEMA_1.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "bigserial PRIMARY KEY")
            .replace("at TEXT", "at timestamptz")
            .replace("REAL", "double precision")
        )
        conn.execute(schema)
    with Ledger.open(url) as ledger:
        _check_migrated(ledger)
    with Ledger.open(url) as reopened:
        assert reopened.spent("health", "alice").selection_delta == pytest.approx(8e-6)


# --- sums beyond 2^52 ---------------------------------------------------------------------------

_BIG_COLUMNS = """
huge: {type: int, lower: 0, upper: 200000000000000000, nullable: false}
wide: {type: int, lower: 0, upper: 10000000000000, nullable: false}
"""
_BIG_POLICY = policy_yaml(
    "bigsums",
    table_yaml("amounts", _BIG_COLUMNS),
    budget="{dataset: {epsilon: 50, delta: 1.0e-4}, analyst: {epsilon: 10, delta: 1.0e-5}}",
    trust=True,
)


@pytest.fixture(params=["duckdb", "postgres"])
def big_backend(request: pytest.FixtureRequest) -> Iterator[tuple[Backend, list[tuple[int, int]]]]:
    url = "duckdb://" if request.param == "duckdb" else request.getfixturevalue("pg_new_database")()
    backend = open_backend(url)
    rng = random.Random(7)
    rows = [(rng.randrange(5 * 10**16, 15 * 10**16), rng.randrange(5 * 10**12, 10**13)) for _ in range(1000)]
    backend.load_rows("amounts", [("huge", "BIGINT"), ("wide", "BIGINT")], rows)
    yield backend, rows
    backend.close()


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_sums_beyond_2_to_52_are_released_unclipped(
    tmp_path: Path, big_backend: tuple[Backend, list[tuple[int, int]]], mechanism: Mechanism
) -> None:
    """Σ ≈ 1e20 (values ~1e17, coarse grid) and Σ ≈ 7.5e15 (values ~1e13, grid 1, > 2^52): near the truth."""
    backend, rows = big_backend
    path = tmp_path / "big.yaml"
    path.write_text(_BIG_POLICY)
    engine = Engine(load_policy(path), backend, Ledger.open("sqlite:///:memory:"))
    session = Session("alice", epsilon=1.0, delta=1e-6, mechanism=mechanism)
    for index, column in enumerate(("huge", "wide")):
        sql = f"SELECT SUM({column}) FROM amounts"
        released = engine.execute(sql, session).rows[0][0]
        spec = engine.prepare(sql, session).budgeting.specs[0]
        assert spec is not None
        truth = sum(row[index] for row in rows)
        assert truth > 2**52
        width = half_width(spec, 0.95)
        assert width > 0 and width % spec.grid == 0  # the CI is on the grid actually used
        assert abs(released - truth) <= 4 * width, (column, released, truth, width)
    engine.ledger.close()
