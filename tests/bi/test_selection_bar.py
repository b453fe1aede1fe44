"""The issue #17 bar, as a BI tool would ask it: grouped counts of person-level clinic data.

``SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department`` used to return no row
(partition selection's threshold was 316, scaled by max_rows_per_unit = 20, and ``department`` had no
domain). Now ``visits.department`` borrows the public ``departments.name`` domain, so the six
departments come back; and without a domain, selection counts distinct persons, so a key many people
hold is released however many rows each may contribute. Real engine on DuckDB and PostgreSQL, and
psycopg through the server.
"""

from __future__ import annotations

import psycopg
import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import DEPARTMENTS, demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.server import ThreadedServer
from dpsql.session import Session
from tests.demos import demo_fixture
from tests.policies import clinic_selection_policy

BAR = "SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department"
NAMES = [d[0] for d in DEPARTMENTS]


clinic_duck = demo_fixture("clinic", scope="module")
clinic_pg = demo_fixture("clinic", kind="postgres", scope="module")


@pytest.fixture(params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("clinic_duck" if request.param == "duckdb" else "clinic_pg")


def _engine(policy: Policy, backend: Backend) -> Engine:
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"))


def test_bar_returns_the_six_departments(backend: Backend) -> None:
    engine = _engine(load_policy(demo_policy_path("clinic")), backend)
    _, truth = backend.execute("SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department")
    true = dict(truth)
    result = engine.execute(BAR, Session("alice"))
    assert [r[0] for r in result.rows] == NAMES  # the public domain, in its declared order
    for name, count in result.rows:
        # a patient has ≤ 20 urgent visits in one department: bounding keeps every row; noise b = 20
        assert abs(count - true[name]) < 400, (name, count, true[name])
    assert result.epsilon_spent == pytest.approx(1.0)


@pytest.mark.parametrize("max_rows", [20, 1000])
def test_selection_releases_keys_many_persons_hold(backend: Backend, max_rows: int) -> None:
    """No domain: each department has ~1,000 patients, far above τ = 149 for any max_rows_per_unit."""
    engine = _engine(clinic_selection_policy(max_rows), backend)
    sql = "SELECT department, COUNT(*) FROM visits GROUP BY department"
    prepared = engine.prepare(sql, Session("alice"))
    assert prepared.budgeting.threshold == 149  # a row count would need ≥ max_rows + 15·max_rows here
    result = engine.execute(sql, Session("alice"))
    assert sorted(r[0] for r in result.rows) == sorted(NAMES)


def test_explain_names_the_distinct_unit_count(clinic_duck: Backend) -> None:
    engine = _engine(clinic_selection_policy(), clinic_duck)
    explanation = engine.explain(BAR, Session("alice"))
    assert explanation.keys == ("department (partition selection: noisy COUNT(DISTINCT patient_id) >= 149, δ=1e-06)")
    public = _engine(load_policy(demo_policy_path("clinic")), clinic_duck).explain(BAR, Session("alice"))
    assert public.keys == "public domain: department"


def test_bar_through_psycopg(clinic_duck: Backend) -> None:
    engine = _engine(load_policy(demo_policy_path("clinic")), clinic_duck)
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        with psycopg.connect(f"host={server.host} port={server.port} user=analyst dbname=clinic") as conn:
            rows = conn.execute(BAR).fetchall()
    finally:
        server.stop()
    assert [r[0] for r in rows] == NAMES and all(isinstance(r[1], int) for r in rows)
