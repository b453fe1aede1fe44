"""Partition selection on distinct-unit counts: which count is thresholded, and its exact threshold.

A unit adds at most 1 to each of at most ``max_groups_per_unit`` (L0) groups' selection count, so τ
depends on L0 and never on ``max_rows_per_unit``. Before this count the clinic's
``… FROM visits WHERE urgent GROUP BY department`` thresholded COUNT(*) at τ = 316 (Laplace) / 506
(Gaussian) and released nothing; the distinct-unit count gives 149 / 79.
"""

from __future__ import annotations

from typing import Any

import pytest

from dpsql.analyze import analyze
from dpsql.dev.demo import demo_policy_path
from dpsql.noise.mechanisms import noise_tail
from dpsql.noise.names import Mechanism
from dpsql.policy import Policy, load_policy
from dpsql.release import partition_threshold
from dpsql.release.calibrate import Budgeting, budget
from dpsql.session import Session
from tests.policies import clinic_selection_policy

BAR = "SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department"


def _budget(policy: Policy, sql: str, mechanism: Mechanism, **settings: Any) -> tuple[Budgeting, int]:
    plan = analyze(sql, policy)
    assert plan.selection_measure is not None
    return budget(policy, plan, Session("alice", mechanism=mechanism, **settings)), plan.selection_measure


@pytest.mark.parametrize(("mechanism", "expected"), [("laplace", 149), ("gaussian", 79)])
def test_threshold_counts_distinct_units_not_rows(mechanism: Mechanism, expected: int) -> None:
    policy = clinic_selection_policy()
    plan = analyze(BAR, policy)
    assert plan.selection_measure is not None
    selection = plan.measures[plan.selection_measure]
    assert (selection.kind, selection.column, selection.table) == ("count_units", "patient_id", "visits")
    assert plan.sensitivities(selection) == (5.0, 5.0**0.5)  # L0 = max_groups_per_unit, whatever max_rows
    budgeting, index = _budget(policy, BAR, mechanism)
    spec = budgeting.specs[index]
    assert spec is not None
    assert budgeting.threshold == expected
    assert budgeting.threshold == partition_threshold(spec, budgeting.selection_delta, max_partitions=5, max_rows=1)
    # exact: the smallest τ with P(1 + Z ≥ τ) ≤ δ/L0 for the sampled discrete noise
    target = budgeting.selection_delta / 5
    assert noise_tail(spec, expected - 1) <= target < noise_tail(spec, expected - 2)


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_threshold_does_not_grow_with_max_rows_per_unit(mechanism: Mechanism) -> None:
    thresholds = {
        rows: _budget(clinic_selection_policy(rows), BAR, mechanism)[0].threshold for rows in (5, 20, 1000, 100_000)
    }
    assert len(set(thresholds.values())) == 1, thresholds
    # L0 is min(max_groups_per_unit, max_rows): a unit with 2 rows touches at most 2 groups
    two, twenty = _budget(clinic_selection_policy(2), BAR, mechanism)[0].threshold, thresholds[20]
    assert two is not None and twenty is not None and two < twenty


def test_one_row_per_unit_shares_the_query_count() -> None:
    """patients (max_rows_per_unit 1): COUNT(*) already counts persons, one measure, no budget split."""
    plan = analyze("SELECT zip, COUNT(*) FROM patients GROUP BY zip", load_policy(demo_policy_path("clinic")))
    assert [m.kind for m in plan.measures] == ["count_star"] and plan.selection_measure == 0
    health = analyze("SELECT zip, COUNT(*) FROM patients GROUP BY zip", load_policy(demo_policy_path("health")))
    assert [m.kind for m in health.measures] == ["count_star"] and health.selection_measure == 0


def test_selection_count_is_shared_with_count_distinct_unit() -> None:
    """COUNT(DISTINCT patient_id) in the query is the selection count itself: noised once."""
    plan = analyze(
        "SELECT department, COUNT(DISTINCT patient_id) FROM visits GROUP BY department", clinic_selection_policy()
    )
    assert [m.kind for m in plan.measures] == ["count_units"] and plan.selection_measure == 0


def test_public_domain_needs_no_selection() -> None:
    plan = analyze(BAR, load_policy(demo_policy_path("clinic")))
    assert plan.selection_measure is None and plan.public_keys
    budgeting = budget(load_policy(demo_policy_path("clinic")), plan, Session("alice"))
    assert budgeting.threshold is None and budgeting.cost.delta == 0
