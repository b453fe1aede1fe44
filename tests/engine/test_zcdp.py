"""Gaussian queries accounted in zCDP: ρ adds up, converted to (ε, δ) once, as OpenDP does."""

from __future__ import annotations

import opendp.prelude as dp
import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.release import epsilon_to_rho, rho_to_epsilon
from dpsql.session import Session


def test_hundred_gaussian_queries_compose_in_zcdp(health_policy: Policy, health_duckdb: Backend) -> None:
    budgets = health_policy.budget.model_copy(update={"accounting": "zcdp"})
    policy = health_policy.model_copy(update={"budget": budgets})
    engine = Engine(policy, health_duckdb, Ledger.open("sqlite:///:memory:"))
    session = Session("alice", epsilon=0.05, delta=1e-7, mechanism="gaussian")
    for i in range(100):
        engine.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}", session)
    rho = epsilon_to_rho(0.05, 1e-7)
    spent = engine.ledger.spent("health", "alice")
    assert spent.rho == pytest.approx(100 * rho, rel=1e-9)
    delta = policy.analyst_budget("alice").delta
    shown = spent.privacy_loss("zcdp", delta, rho_to_epsilon)[0]
    dp.enable_features("contrib")
    space = dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float)
    gaussian = dp.m.make_gaussian(*space, scale=1.0 / (2 * 100 * rho) ** 0.5)
    opendp_epsilon = dp.c.make_zCDP_to_approxDP(gaussian).map(1.0).epsilon(delta)
    assert f"{shown:.3g}" == f"{opendp_epsilon:.3g}"
    assert shown < 100 * 0.05 / 2  # far better than summing ε
