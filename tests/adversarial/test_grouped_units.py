"""A person counts once per group, whatever an expression key maps together (issue #26, item 2).

``SELECT DISTINCT FLOOR(cost * 10) FROM visits`` partition-selects buckets on a noisy count of
distinct patients. One added patient (``STRANGER``) holds 20 visits whose costs all differ but share
the bucket 19995 that nobody else reaches. The cells bounding used to sum the patient's partial
distinct counts over their (patient, raw cost) cells, so the bucket's count was 20 and it was
released every time; it must count 1, and a count of 1 is below every selection threshold.
On the clinic demo (``visits.department`` without its domain), DuckDB and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.plan import Physical
from dpsql.policy import Budget, Budgets
from dpsql.release.apply import centre_rows
from dpsql.rewrite import to_sql
from dpsql.session import Session
from tests.policies import clinic_selection_policy

STRANGER = 99_999
BUCKET = 19995
SQL = "SELECT DISTINCT FLOOR(cost * 10) FROM visits"
MONTHLY = "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(DISTINCT patient_id) FROM visits GROUP BY m"


def _open(url: str, stranger: bool) -> Backend:
    backend = open_backend(url)
    load_demo(backend, ["clinic"])
    if stranger:
        backend.execute_script(
            f"INSERT INTO patients VALUES ({STRANGER}, 50000, 'Stranger', 40, 'Female', 2150);"
            f"INSERT INTO visits SELECT 1000000 + i, {STRANGER}, 'Oncology', DATE '2024-12-01' + CAST(i AS INTEGER), "
            "1999.5 + i / 1000.0, false FROM generate_series(0, 19) AS t(i);"
        )
    return backend


@pytest.fixture(scope="module")
def duck_pair() -> Iterator[dict[str, Backend]]:
    pair = {"d": _open("duckdb://", False), "stranger": _open("duckdb://", True)}
    yield pair
    for backend in pair.values():
        backend.close()


@pytest.fixture(scope="module")
def pg_pair(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    pair = {"d": _open(pg_new_database(), False), "stranger": _open(pg_new_database(), True)}
    yield pair
    for backend in pair.values():
        backend.close()


@pytest.fixture(params=["duckdb", "postgres"])
def pair(request: pytest.FixtureRequest) -> dict[str, Backend]:
    return request.getfixturevalue("duck_pair" if request.param == "duckdb" else "pg_pair")


def test_a_bucket_held_by_one_person_is_never_released(pair: dict[str, Backend]) -> None:
    """ε=5, δ=1e-6 (a low threshold), 20 runs on each neighbour: bucket 19995 never appears (it was
    released 20/20 times with the stranger), the same threshold and charge on both."""
    policy = clinic_selection_policy().model_copy(
        update={"budget": Budgets(dataset=Budget(epsilon=1e6, delta=0.5), analyst=Budget(epsilon=1e5, delta=0.1))}
    )
    session = Session("alice", epsilon=5.0, delta=1e-6)
    engines = {name: Engine(policy, backend, Ledger.open("sqlite:///:memory:")) for name, backend in pair.items()}
    assert engines["d"].prepare(SQL, session).budgeting == engines["stranger"].prepare(SQL, session).budgeting
    for name, engine in engines.items():
        for _ in range(20):
            result = engine.execute(SQL, session)
            assert BUCKET not in {int(r[0]) for r in result.rows if r[0] is not None}, name
            assert result.epsilon_spent == pytest.approx(5.0)


def test_distinct_patients_per_month_move_by_at_most_one(pair: dict[str, Backend]) -> None:
    """Un-noised: the stranger's 20 visits over one month and a few days of the next move each month's
    distinct-patient count by at most 1 (it moved by up to 20 against a stated sensitivity of 5)."""
    plan = analyze(MONTHLY, clinic_selection_policy())
    dialect = pair["d"].dialect
    for physical in (Physical("salt"), Physical("salt", hash="duckdb" if dialect == "duckdb" else "postgres")):
        bound = replace(plan, physical=physical)
        before, after = (
            {r[0]: r[1] for r in centre_rows(bound, b.execute(to_sql(bound, dialect))[1])} for b in pair.values()
        )
        moved = {m: after.get(m, 0) - before.get(m, 0) for m in set(before) | set(after)}
        assert set(moved.values()) <= {0, 1}, moved
        assert 1 <= sum(moved.values()) <= plan.max_groups
