"""The DP step (dpsql/step.py): one composition rule (the accountant's), typed notices, one public seam.

A composite statement is charged ``Cost.total`` of its parts: the same numbers the outer/ code
composed by its own rule before the accountant owned it (pinned here against that rule), and in the
ledger ρ counts each pure-ε part as ε²/2 (not the square of the summed ε).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from dpsql.accountant import Cost, fmt
from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session
from dpsql.step import Notice, NoticeKind, Severity

ROOT = Path(__file__).resolve().parents[2]
TWO_PARTS = "SELECT 'count' AS stat, COUNT(*) AS v FROM patients UNION ALL SELECT 'mean', AVG(age) FROM patients"

COSTS = [
    Cost(0.25),  # Laplace
    Cost(0.5, 1e-6, 0.0, 1e-6),  # Laplace with partition selection
    Cost(1.0, 1e-6, 0.0421, 5e-7),  # Gaussian with selection
    Cost(0.3, 1e-7, 0.02),  # Gaussian
    Cost(0.125, 0.0, 0.0, 0.0),
]
WITHOUT_RHO = Cost(0.4, 1e-6)  # (ε, δ>0) without ρ: only ε and δ compose


def _previous_rule(costs: list[Cost]) -> Cost:
    """How dpsql/outer/run.py composed costs before the accountant owned composition."""
    rho = 0.0
    for c in costs:
        try:
            rho += c.zcdp_rho()
        except ValueError:
            rho = 0.0
            break
    return Cost(
        epsilon=sum(c.epsilon for c in costs),
        delta=sum(c.delta for c in costs),
        rho=rho,
        selection_delta=sum(c.selection_delta for c in costs),
    )


@pytest.mark.parametrize("n", range(1, len(COSTS) + 1))
def test_cost_total_is_the_previous_composition_exactly(n: int) -> None:
    for costs in (COSTS[:n], [*COSTS[:n], WITHOUT_RHO], [WITHOUT_RHO, *COSTS[:n]]):
        assert Cost.total(costs) == _previous_rule(costs)  # equal floats, not approximately


def test_adding_a_pure_cost_counts_its_rho() -> None:
    """``+`` never drops a pure-ε side from ρ (it used to add raw ``rho`` fields, 0 for Laplace)."""
    total = Cost(0.5, 1e-7, 0.1, 1e-7) + Cost(0.25)
    assert total.zcdp_rho() == 0.1 + 0.25**2 / 2
    assert (Cost(0.25) + Cost(0.25)).zcdp_rho() == 2 * 0.25**2 / 2 < 0.5**2 / 2


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_composite_statement_is_charged_the_accountants_total(
    tmp_path: Path, health_duckdb: Backend, accounting: str
) -> None:
    doc = yaml.safe_load(demo_policy_path("health").read_text())
    doc["budget"]["accounting"] = accounting
    path = tmp_path / "health.yaml"
    path.write_text(yaml.safe_dump(doc))
    engine = Engine(load_policy(path), health_duckdb, Ledger.open("sqlite:///:memory:"))
    session = Session("alice", epsilon=0.25, bias=False)  # (each part one measurement: ρ = ε²/2 each)
    parts = [
        engine.prepare(sql, session).budgeting.cost
        for sql in ("SELECT COUNT(*) FROM patients", "SELECT AVG(age) FROM patients")
    ]
    result = engine.execute(TWO_PARTS, session)
    (charge,) = engine.ledger.charges("health", "alice")
    expected = Cost.total(parts)
    assert (charge.cost.epsilon, charge.cost.delta) == (expected.epsilon, expected.delta) == (0.5, 0.0)
    assert charge.cost.rho == expected.zcdp_rho() == 2 * 0.25**2 / 2  # each part's ε²/2, not (Σε)²/2
    assert result.epsilon_spent == 0.5
    assert result.remaining_epsilon is not None
    left = fmt(result.remaining_epsilon, down=True)
    assert result.notices[-2] == f'dpsql: charged ε=0.5 for 2 DP sub-queries; remaining ε={left} for analyst "alice"'
    notice = result.notices[-2]
    assert isinstance(notice, Notice) and notice.kind is NoticeKind.CHARGE


def test_a_query_alone_is_charged_its_own_cost(engine: Engine) -> None:
    session = Session("alice", epsilon=0.5)
    cost = engine.prepare("SELECT COUNT(*) FROM patients", session).budgeting.cost
    result = engine.execute("SELECT COUNT(*) FROM patients", session)
    (charge,) = engine.ledger.charges("health", "alice")
    assert (charge.cost.epsilon, charge.cost.delta) == (cost.epsilon, cost.delta)
    assert result.remaining_epsilon is not None
    left = fmt(result.remaining_epsilon, down=True)
    assert result.notices[-1] == f'dpsql: charged ε=0.5; remaining ε={left} for analyst "alice"'
    assert all(isinstance(n, Notice) for n in result.notices)


def test_notices_are_typed_and_render_as_before() -> None:
    charged = Notice.charged(Cost(0.5, 1e-6), 9.5, "alice", 1)
    assert charged == 'dpsql: charged ε=0.5, δ=1e-06 for 1 DP sub-query; remaining ε=9.5 for analyst "alice"'
    assert (charged.kind, charged.severity, charged.sqlstate) == (NoticeKind.CHARGE, Severity.NOTICE, "00000")
    warning = Notice.of("dpsql: WARNING: the median of a group of 3 rows is mostly noise")
    assert (warning.kind, warning.severity, warning.sqlstate) == (NoticeKind.NOTE, Severity.WARNING, "01000")
    assert warning.message == "dpsql: the median of a group of 3 rows is mostly noise"  # the wire's text
    assert str(warning) == "dpsql: WARNING: the median of a group of 3 rows is mostly noise"  # CLI, DB-API
    # the server's grouping rule is unchanged: a budget notice is one that says "charged"
    for text in ("dpsql: answered from the result cache; no budget charged", "dpsql: charged ε=1", "dpsql: note"):
        assert Notice.of(text).budget == ("charged" in text)
    assert Notice.of(charged) is charged
    again = copy.deepcopy(charged)
    assert again == charged and again.kind is NoticeKind.CHARGE
    with pytest.raises(AttributeError):
        charged.kind = NoticeKind.NOTE


def test_outer_uses_only_the_engines_public_members() -> None:
    for path in (ROOT / "dpsql" / "outer").glob("*.py"):
        assert not re.search(r"\bengine\._", path.read_text()), path
