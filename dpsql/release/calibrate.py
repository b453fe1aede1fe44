"""Calibration: how one query's (ε, δ) is split into a noise spec per measure and a charge.

Runs at planning time, before anything is reserved or read: every spec is checked samplable
here, so a setting no exact sampler can serve fails before the ledger is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dpsql.accountant import Cost
from dpsql.errors import InvalidParameterValue
from dpsql.noise.mechanisms import MECHANISMS, NoiseSpec, check_samplable, mechanism_names
from dpsql.plan import Plan, integer_valued
from dpsql.policy import Policy
from dpsql.release.selection import selection_threshold
from dpsql.session import Session


@dataclass(slots=True)
class Budgeting:
    """How one query's (ε, δ) is spent: a noise spec per measure and the charge."""

    epsilon: float
    delta: float
    mechanism: str
    #: Noise per measure; None for quantile measures (exponential mechanism, see ``shares``).
    specs: list[NoiseSpec | None]
    cost: Cost
    #: Pure-ε share of each measure (what the exponential mechanism of a quantile uses).
    shares: list[float] = field(default_factory=list)
    #: Partition-selection threshold on the distinct-unit count (None when keys are public).
    threshold: int | None = None
    selection_delta: float = 0.0


#: A query answered from randomized-response values already stored: post-processing, no central cost.
FREE = Budgeting(0.0, 0.0, "randomized response", [None], Cost(epsilon=0.0), [0.0])


def budget(policy: Policy, plan: Plan, session: Session) -> Budgeting:
    """Validate the session's (or the policy's) ε, δ and mechanism, then calibrate; spends nothing."""
    defaults = policy.defaults
    epsilon = session.epsilon if session.epsilon is not None else defaults.epsilon
    delta = session.delta if session.delta is not None else defaults.delta
    mechanism = session.mechanism or defaults.mechanism
    if mechanism not in MECHANISMS:
        raise InvalidParameterValue(
            f'unknown mechanism "{mechanism}"', hint=f"dpsql.mechanism is one of: {', '.join(mechanism_names())}."
        )
    if epsilon <= 0 or not math.isfinite(epsilon):
        raise InvalidParameterValue("dpsql.epsilon must be a positive number")
    if not 0 <= delta < 1:
        raise InvalidParameterValue("dpsql.delta must be in [0, 1)")
    if not plan.measures:
        return Budgeting(0.0, 0.0, mechanism, [], Cost(epsilon=0.0))
    selecting = plan.selection_measure is not None
    uses_delta = selecting or MECHANISMS[mechanism].uses_delta
    _check_query_delta(policy, delta, uses_delta)
    if uses_delta and delta == 0:
        raise InvalidParameterValue(
            "this query needs δ > 0",
            hint="Grouping by a column without a public domain, and the Gaussian mechanism, "
            "need SET dpsql.delta to a small positive value.",
        )
    try:
        budgeting = calibrate(plan, epsilon, delta, mechanism, selecting)
    except ValueError as exc:  # calibration's own checks: a setting no exact sampler can serve
        raise InvalidParameterValue(
            f"cannot calibrate noise for ε={epsilon:g}, δ={delta:g}: {exc}",
            hint="Use a larger dpsql.epsilon (or a smaller dpsql.delta) for this query.",
        ) from None
    return budgeting


def calibrate(plan: Plan, epsilon: float, delta: float, mechanism: str, selecting: bool) -> Budgeting:
    """Noise per measure and the charge, from validated settings; every spec checked samplable."""
    k = len(plan.measures)
    noise = MECHANISMS[mechanism]
    split = noise.split(epsilon, delta, k, selecting)
    specs: list[NoiseSpec | None] = [
        None
        if m.selected
        else noise.calibrate(plan.sensitivities(m), split, integer=integer_valued(m), cells=plan.max_groups)
        for m in plan.measures
    ]
    shares = [split.share] * k
    cost = split.cost
    budgeting = Budgeting(epsilon, cost.delta, mechanism, specs, cost, shares)
    if selecting:
        assert plan.selection_measure is not None
        budgeting.selection_delta = split.selection_delta
        spec = specs[plan.selection_measure]
        assert spec is not None
        budgeting.threshold = selection_threshold(plan, spec, budgeting.selection_delta)
    for calibrated in specs:
        if calibrated is not None:
            check_samplable(calibrated)
    return budgeting


def _check_query_delta(policy: Policy, delta: float, uses_delta: bool) -> None:
    """Cap a query's δ before any charge, under either accounting.

    δ is the probability that the guarantee fails outright (a rare key released, a Gaussian tail):
    it must be ≤ ``budget.max_query_delta`` (default 10⁻³) and below the dataset's δ budget. Under
    zcdp the selection δ is added up, not converted; under pure accounting a large δ would also
    make the Gaussian calibration degenerate (δ = 0.99 gives ε → 0). The analyst's own δ budget is
    then enforced by the ledger (53P01) before the query runs.
    """
    budget = policy.budget
    if not uses_delta or delta == 0:
        return
    if delta > budget.max_query_delta or delta >= budget.dataset.delta:
        raise InvalidParameterValue(
            f"dpsql.delta={delta:g} is too large for one query",
            hint=f"A query's δ must be ≤ {budget.max_query_delta:g} "
            f"and below the dataset's δ budget {budget.dataset.delta:g}; use e.g. SET dpsql.delta = 1e-7.",
        )
