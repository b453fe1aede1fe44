"""Gaussian queries accounted in zCDP: ρ adds up, converted to (ε, δ) once, as OpenDP does."""

from __future__ import annotations

import opendp.prelude as dp
import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.release import epsilon_to_rho
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
    shown = spent.privacy_loss("zcdp", delta)[0]
    dp.enable_features("contrib")
    space = dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float)
    gaussian = dp.m.make_gaussian(*space, scale=1.0 / (2 * 100 * rho) ** 0.5)
    opendp_epsilon = dp.c.make_zCDP_to_approxDP(gaussian).map(1.0).epsilon(delta)
    assert f"{shown:.3g}" == f"{opendp_epsilon:.3g}"
    assert shown < 100 * 0.05 / 2  # far better than summing ε


def test_one_remaining_epsilon_everywhere_under_zcdp(tmp_path, capsys) -> None:
    """Issue #16's bar: after 40 Gaussian queries at ε=0.05 through the DB-API, the NOTICE,
    ``cursor.remaining_epsilon`` and ``dpsql budget --json`` show the accountant's number."""
    import json
    import re
    from pathlib import Path

    import dpsql
    from dpsql.cli import main
    from dpsql.dev.demo import demo_policy_path, load_demo
    from dpsql.ledger import remaining_budget

    text = Path(demo_policy_path("health")).read_text()
    policy_file = tmp_path / "zcdp.yaml"
    policy_file.write_text(text.replace("budget:\n", "budget:\n  accounting: zcdp\n", 1))
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    conn = dpsql.connect(policy_file, "duckdb://", "alice", ledger=ledger, epsilon=0.05, mechanism="gaussian")
    load_demo(conn.engine.backend, ["health"])
    cur = conn.cursor()
    for i in range(40):
        cur.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}")
    notice = float(re.search(r"remaining ε=([0-9.e+-]+)", cur.notices[-1]).group(1))
    engine = conn.engine
    accountant = remaining_budget(
        engine.ledger.spent("health", "alice"),
        engine.policy.analyst_budget("alice"),
        "zcdp",
    ).epsilon
    conn.close()
    assert main(["budget", "--policy", str(policy_file), "--ledger", ledger, "--analyst", "alice", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)[0]["epsilon_remaining"]
    shown = {f"{v:.3g}" for v in (notice, cur.remaining_epsilon, cli, accountant)}
    assert shown == {f"{accountant:.3g}"}
    assert accountant > 10 - 40 * 0.05  # better than subtracting Σε (8)
