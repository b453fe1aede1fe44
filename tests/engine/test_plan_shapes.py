"""A statement planned once is priced at every ε (Engine._shape / _priced): the same plan object, and
exactly what a fresh engine prepares at that ε (SQL, budgeting, keys, cap choice, bias estimate)."""

from __future__ import annotations

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.noise.names import Mechanism
from dpsql.policy import Policy, load_policy
from dpsql.prepared import Prepared
from dpsql.session import AUTO, Session
from tests.demos import demo_fixture

clinic = demo_fixture("clinic", scope="module")


@pytest.fixture(scope="module")
def clinic_policy() -> Policy:
    return load_policy(demo_policy_path("clinic"))


QUERIES = [
    "SELECT SUM(cost), AVG(cost), COUNT(*) FROM visits",
    "SELECT p.sex, COUNT(*), AVG(r.dose_mg) FROM patients p JOIN prescriptions r ON r.patient_id = p.id GROUP BY p.sex",
]


def _same(a: Prepared, b: Prepared) -> None:
    assert a.sql == b.sql
    assert a.budgeting == b.budgeting
    assert a.cache_key == b.cache_key and a.measurement_key == b.measurement_key
    assert a.histograms == b.histograms and a.fingerprint == b.fingerprint
    assert a.cap == b.cap and a.bias == b.bias
    assert repr(a.plan) == repr(b.plan)


@pytest.mark.parametrize("sql", QUERIES)
@pytest.mark.parametrize("cap", [None, AUTO, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_a_new_epsilon_is_priced_not_planned_again(
    clinic_policy: Policy, clinic: Backend, sql: str, cap: int | str | None, bias: bool
) -> None:
    engine = Engine(clinic_policy, clinic, Ledger.open("sqlite:///:memory:"))
    first = engine.prepare(sql, Session("alice", epsilon=1.0, max_rows_per_unit=cap, bias=bias))
    settings: list[tuple[float, Mechanism]] = [(0.37, "laplace"), (2.5, "gaussian")]
    for epsilon, mechanism in settings:
        session = Session("alice", epsilon=epsilon, max_rows_per_unit=cap, bias=bias, mechanism=mechanism)
        again = engine.prepare(sql, session)
        assert again.plan is first.plan  # the shape was reused
        assert again.budgeting.epsilon == epsilon
        fresh = Engine(clinic_policy, clinic, engine.ledger).prepare(sql, session)  # (its fingerprint key)
        _same(again, fresh)
        if again.bias is not None and again.bias.totals:
            assert again.bias.epsilon == pytest.approx(0.2 * epsilon)


def test_settings_that_change_the_plan_are_planned_apart(clinic_policy: Policy, clinic: Backend) -> None:
    engine = Engine(clinic_policy, clinic, Ledger.open("sqlite:///:memory:"))
    sql = QUERIES[0]
    at = {cap: engine.prepare(sql, Session("alice", epsilon=1.0, max_rows_per_unit=cap)) for cap in (None, 2, AUTO)}
    assert len({id(p.plan) for p in at.values()}) == 3
    assert at[2].plan.max_rows == 2 and at[AUTO].cap is not None
    off = engine.prepare(sql, Session("alice", epsilon=1.0, bias=False))
    assert off.bias is None and at[None].bias is not None and off.plan is not at[None].plan
