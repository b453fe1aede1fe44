"""Partition selection on neighbouring databases (DuckDB and PostgreSQL): one person cannot surface a key.

Neighbours of the clinic demo, each differing from it in one added patient (``STRANGER``):

- ``secret``: 300 visits, all in a department nobody else uses (``Xenology``);
- ``heavy``: 300 visits in Oncology and 50 in each other department (8 groups, 600 rows).

``visits.department`` is used without its public domain (``tests.policies``), so its keys are
partition-selected on a noisy count of distinct patients. tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import DEPARTMENTS, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.noise.names import Mechanism
from dpsql.plan import Physical
from dpsql.policy import Budget, Budgets, Policy
from dpsql.release.apply import centre_rows
from dpsql.rewrite import to_sql
from dpsql.session import Session
from tests.policies import clinic_selection_policy

STRANGER = 99_999
SECRET = "Xenology"
SQL = "SELECT department, COUNT(*) FROM visits GROUP BY department"
NAMES = [d[0] for d in DEPARTMENTS]


def _visits(department: str, first_id: int, n: int) -> str:
    return (
        f"INSERT INTO visits SELECT {first_id} + i, {STRANGER}, '{department}', DATE '2024-12-31', 100.0, true "
        f"FROM generate_series(1, {n}) AS t(i);"
    )


def _add_stranger(backend: Backend, visits: list[tuple[str, int]]) -> None:
    script = f"INSERT INTO patients VALUES ({STRANGER}, 50000, 'Stranger', 40, 'Female', 2150);"
    first = 1_000_000
    for department, n in visits:
        script += _visits(department, first, n)
        first += n
    backend.execute_script(script)


NEIGHBOURS: dict[str, list[tuple[str, int]]] = {
    "d": [],
    "secret": [(SECRET, 300)],
    "heavy": [("Oncology", 300), *((name, 50) for name in NAMES if name != "Oncology"), ("Zoology", 50)],
}


def _open(url: str, visits: list[tuple[str, int]]) -> Backend:
    backend = open_backend(url)
    load_demo(backend, ["clinic"])
    if visits:
        _add_stranger(backend, visits)
    return backend


@pytest.fixture(scope="module")
def duck_neighbours() -> Iterator[dict[str, Backend]]:
    backends = {name: _open("duckdb://", visits) for name, visits in NEIGHBOURS.items()}
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.fixture(scope="module")
def pg_neighbours(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    backends = {name: _open(pg_new_database(), visits) for name, visits in NEIGHBOURS.items()}
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.fixture(params=["duckdb", "postgres"])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def neighbours(request: pytest.FixtureRequest, dialect: str) -> dict[str, Backend]:
    return request.getfixturevalue("duck_neighbours" if dialect == "duckdb" else "pg_neighbours")


def _roomy(policy: Policy) -> Policy:
    """Budgets large enough for many runs (each run is still charged)."""
    return policy.model_copy(
        update={"budget": Budgets(dataset=Budget(epsilon=1e6, delta=0.5), analyst=Budget(epsilon=1e5, delta=0.1))}
    )


@pytest.mark.parametrize("max_rows", [20, 1000])
@pytest.mark.parametrize(("mechanism", "epsilon"), [("laplace", 1.0), ("laplace", 4.0), ("gaussian", 1.0)])
def test_key_held_by_one_person_is_never_released(
    neighbours: dict[str, Backend], max_rows: int, mechanism: Mechanism, epsilon: float
) -> None:
    """20 runs on each neighbour: the stranger's department never appears; the others always do, and
    threshold, charge and outcome are the same on both (nothing but the noisy rows may differ)."""
    policy = _roomy(clinic_selection_policy(max_rows))
    session = Session("alice", epsilon=epsilon, delta=1e-6, mechanism=mechanism)
    engines = {name: Engine(policy, neighbours[name], Ledger.open("sqlite:///:memory:")) for name in ("d", "secret")}
    prepared = {name: engine.prepare(SQL, session) for name, engine in engines.items()}
    assert prepared["d"].budgeting == prepared["secret"].budgeting  # τ, noise and charge are data-independent
    for name, engine in engines.items():
        for _ in range(20):
            result = engine.execute(SQL, session)
            assert sorted(r[0] for r in result.rows) == sorted(NAMES), (name, result.rows)
            assert result.epsilon_spent == pytest.approx(epsilon)


@pytest.mark.parametrize("native", [False, True], ids=["md5", "native-hash"])
@pytest.mark.parametrize("max_rows", [20, 1000])
def test_many_rows_add_at_most_one_to_a_selection_count(
    neighbours: dict[str, Backend], dialect: str, max_rows: int, native: bool
) -> None:
    """Pre-noise selection counts on D and on D + a patient with 300 rows in Oncology and rows in 7
    other groups: each group's distinct-patient count moves by at most 1, and at most
    ``max_groups_per_unit`` (5) groups move, whatever ``max_rows_per_unit``; the row count moves by up
    to ``max_rows`` in total."""
    policy = clinic_selection_policy(max_rows)
    native_hash = native and dialect == "duckdb"  # DuckDB's HASH exists on DuckDB only
    plan = replace(analyze(SQL, policy), physical=Physical("fixed-salt", hash="duckdb" if native_hash else "md5"))
    assert plan.selection_measure is not None and plan.max_groups == 5

    def counts(backend: Backend) -> dict[str, tuple[int, ...]]:
        _, rows = backend.execute(to_sql(plan, dialect))
        return {r[0]: tuple(r[1:]) for r in centre_rows(plan, rows)}

    before, after = counts(neighbours["d"]), counts(neighbours["heavy"])
    s = 1 + plan.selection_measure
    star = next(1 + i for i, m in enumerate(plan.measures) if m.kind == "count_star")
    moved = {k: after[k][s - 1] - before.get(k, (0, 0))[s - 1] for k in after}
    assert set(moved.values()) <= {0, 1}, moved
    assert 1 <= sum(moved.values()) <= 5, moved
    rows_moved = sum(after[k][star - 1] - before.get(k, (0, 0))[star - 1] for k in after)
    # the row count moves by the stranger's kept rows: max_rows, or 5 groups' rows (≤ 300 + 4·50)
    assert rows_moved == 20 if max_rows == 20 else 250 <= rows_moved <= 500


def test_selection_counts_identical_on_duckdb_and_postgres(
    duck_neighbours: dict[str, Backend], pg_neighbours: dict[str, Backend]
) -> None:
    """The same bounded distinct-patient counts on both backends (same salt): which keys a person can
    surface never depends on the backend."""
    plan = replace(analyze(SQL, clinic_selection_policy()), physical=Physical("fixed-salt"))
    for name in ("d", "heavy"):
        duck = duck_neighbours[name].execute(to_sql(plan, "duckdb"))[1]
        pg = pg_neighbours[name].execute(to_sql(plan, "postgres"))[1]
        assert sorted(duck) == sorted(pg)
