"""Calibration: how one query's (ε, δ) is split into a noise spec per measure and a charge.

Runs at planning time, before anything is reserved or read: every spec is checked samplable
here, so a setting no exact sampler can serve fails before the ledger is touched. With
``dpsql.accuracy`` set (accuracy-first, APEx-style), the ε is the least that meets the wanted
half-width (:func:`accuracy_epsilon`), found from public figures only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dpsql.accountant import Cost
from dpsql.errors import Error, FeatureNotSupported, InvalidParameterValue
from dpsql.lru import LRU
from dpsql.noise.mechanisms import (
    MECHANISMS,
    NoiseMechanism,
    NoiseSpec,
    Split,
    check_samplable,
    half_width,
    mechanism_names,
)
from dpsql.plan import Plan, integer_valued
from dpsql.policy import Policy
from dpsql.release.selection import selection_threshold
from dpsql.session import DEFAULT_MAX_SHARE, MAX_EPSILON, MIN_EPSILON, Session, ci_label

#: Accuracy-first's bisection stops when its bracket [lo, hi] has hi/lo ≤ 1 + this (then hi is used).
_ACCURACY_TOLERANCE = 1e-9
#: Accuracy-first's ε by what decides it (the plan's public figures, the target, confidence, δ, mechanism):
#: a repeated target over the same plan skips the bisection (issue #41: each one was free CPU work).
_ACCURACY_EPSILONS: LRU[tuple[Any, ...], float] = LRU(4096)


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
    #: Accuracy-first: the half-width every noisy measure was asked to meet (``dpsql.accuracy``), at the
    #: session's confidence; None when ε came from ``dpsql.epsilon`` or the policy. Not in the repr, so not
    #: in the measurement key (:func:`dpsql.cache.measurement_key`): the target sets no noise, ε does.
    accuracy: float | None = field(default=None, repr=False)
    #: The confidence level the ends of quantile value intervals are chosen at: the policy's default
    #: (None: the plan has none), never the session's, so a release is reused at any session level
    #: (spend once) and its note says the level it holds. In the repr, so in the measurement key.
    interval_level: float | None = None
    #: The ε the measurement itself is calibrated with: ``epsilon`` less what a DP cap choice or the bias
    #: estimate spend beside it (EXPLAIN splits this one over the outputs). Not in the repr (measurement key).
    measured: float | None = field(default=None, repr=False)
    #: The share of rows the caps cut, as the curator published it (:func:`published_cut`), that quantile
    #: value intervals cover (``dpsql.bias`` on; :func:`~dpsql.noise.exponential.cut_levels`); None: noise
    #: only. Public (the policy's); in the repr, so in the measurement key.
    interval_cut: float | None = None


#: A query answered from randomized-response values already stored: post-processing, no central cost.
FREE = Budgeting(0.0, 0.0, "randomized response", [None], Cost(epsilon=0.0), [0.0])


def budget(policy: Policy, plan: Plan, session: Session, confidence: float | None = None) -> Budgeting:
    """Validate the session's (or the policy's) ε, δ and mechanism, then calibrate; spends nothing.

    ``confidence`` (the session's checked CI level; None: the session's or the policy's) is what
    ``session.accuracy`` is measured at: with it set, ε is :func:`accuracy_epsilon`'s, not ``dpsql.epsilon``.
    """
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
    if session.accuracy is not None:
        level = confidence if confidence is not None else session.confidence or defaults.confidence
        # whether the analyst can (and means to) spend it is checked against the ledger before the charge,
        # with the grants and what is left (:func:`accuracy_guard`)
        epsilon = accuracy_epsilon(plan, session.accuracy, level, delta, mechanism, selecting)
    try:
        budgeting = calibrate(plan, epsilon, delta, mechanism, selecting)
    except ValueError as exc:  # calibration's own checks: a setting no exact sampler can serve
        raise InvalidParameterValue(
            f"cannot calibrate noise for ε={epsilon:g}, δ={delta:g}: {exc}",
            hint="Use a larger dpsql.epsilon (or a smaller dpsql.delta) for this query.",
        ) from None
    budgeting.accuracy = session.accuracy
    if any(m.aggregate.interval_end for m in plan.measures):
        budgeting.interval_level = defaults.confidence
        if session.bias is not False:
            budgeting.interval_cut = published_cut(plan)
    return budgeting


def published_cut(plan: Plan) -> float | None:
    """The share of rows cut the curator published for the query's tables (the largest), when the query runs at
    the policy's caps (a cap of its own cuts other rows); None otherwise. Public: the policy's."""
    if plan.tau is not None or plan.unit is None:
        return None
    shares = [s.table.published_rows_cut for s in plan.sources.private if s.table.published_rows_cut is not None]
    return max(shares) if shares else None


def accuracy_epsilon(
    plan: Plan, target: float, confidence: float, delta: float, mechanism: str, selecting: bool
) -> float:
    """The least ε at which every additively-noised measure's CI half-width (at ``confidence``) is ≤ ``target``.

    Bisection on log ε over [MIN_EPSILON, MAX_EPSILON]: a half-width only shrinks as ε grows (the
    noise scale is sensitivity/ε; real-valued measures' power-of-two grid can make it wiggle by half
    a grid step, ≤ 1/1024 of the scale, where it switches), and the returned ε is one that was checked
    to meet the target. Privacy: only the plan's public figures (policy bounds, contribution caps,
    group counts, the number of measures), δ, the mechanism and the confidence are read, never the
    data, so the choice (and its charge) is public and the same for the same query and settings.

    Refusals, before any charge: 0A000 when a measure is selected (quantile, mode: no half-width
    describes its error), 22023 when no ε ≤ MAX_EPSILON meets the target.
    """
    selected = {i for i, m in enumerate(plan.measures) if m.selected}
    if selected:
        names = [o.column.name for o in plan.outputs if selected.intersection(o.measures)]
        raise FeatureNotSupported(
            f"dpsql.accuracy cannot be met by column {', '.join(names) or 'a quantile or mode'}",
            hint="Quantiles (MIN, MAX, percentiles) and modes are chosen by the exponential mechanism: their error "
            "is a rank or a grid cell, not a ± half-width. RESET dpsql.accuracy and set dpsql.epsilon for this query.",
        )

    key = (_public_figures(plan), target, confidence, delta, mechanism, selecting)
    known = _ACCURACY_EPSILONS.get(key)
    if known is None:
        known = _ACCURACY_EPSILONS.put(key, _bisect(plan, target, confidence, delta, mechanism, selecting))
    if math.isinf(known):
        raise InvalidParameterValue(
            f"accuracy ±{target:g} at {ci_label(confidence)} % cannot be met by any ε ≤ {MAX_EPSILON:g}",
            hint="Ask for a wider interval (a larger dpsql.accuracy).",
        )
    return known


def _public_figures(plan: Plan) -> tuple[Any, ...]:
    """What accuracy-first's bisection reads of a plan: per measure its sensitivities and whether it is
    integer-valued, and the groups one unit may touch (all public)."""
    return (tuple((plan.sensitivities(m), integer_valued(m)) for m in plan.measures), plan.max_groups)


def _bisect(plan: Plan, target: float, confidence: float, delta: float, mechanism: str, selecting: bool) -> float:
    """:func:`accuracy_epsilon`'s bisection (``math.inf``: no ε ≤ MAX_EPSILON meets ``target``)."""

    def meets(epsilon: float) -> bool:
        try:
            noise = MECHANISMS[mechanism]
            specs = _specs(plan, noise, noise.split(epsilon, delta, len(plan.measures), selecting))
            for spec in specs:
                if spec is not None:
                    check_samplable(spec)
        except ValueError:  # no exact sampler at this ε: far too wide anyway
            return False
        return all(half_width(s, confidence) <= target for s in specs if s is not None)

    lo, hi = MIN_EPSILON, MAX_EPSILON
    if meets(lo):
        return lo
    if not meets(hi):
        return math.inf
    while hi / lo > 1 + _ACCURACY_TOLERANCE:
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:  # float resolution reached
            break
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def accuracy_guard(epsilon: float, session: Session, left: float, total: float) -> None:
    """Accuracy-first's guard (issue #38 item 5), before the charge: the ε ``dpsql.accuracy`` chose must
    fit what the analyst has ``left`` (of ``total``, the policy's budget plus the curator's grants), and
    take at most ``dpsql.max_share`` of it (25 % by default) unless ``dpsql.confirm_epsilon`` accepts it.
    A refusal names the ε it would take (22023); the figures are the query's and the analyst's own."""
    if session.accuracy is None:
        return
    need = _rounded_up(epsilon)
    what = f"accuracy ±{session.accuracy:g} needs ε={need}"
    of = f"the ε={left:.4g} you have left (ε={total:g} in all, grants included)"
    hint = "Ask for a wider interval (a larger dpsql.accuracy), fewer measures or groups, or RESET dpsql.accuracy "
    hint += "and choose dpsql.epsilon yourself."
    if epsilon > left * (1 + 1e-9):
        raise InvalidParameterValue(f"{what}, more than {of}", hint=hint)
    share = session.max_share if session.max_share is not None else DEFAULT_MAX_SHARE
    confirmed = session.confirm_epsilon is not None and epsilon <= session.confirm_epsilon * (1 + 1e-9)
    if epsilon > share * left * (1 + 1e-9) and not confirmed:
        raise InvalidParameterValue(
            f"{what}, more than {share:.0%} of {of}",
            hint=f"SET dpsql.confirm_epsilon = {need} to spend it on this query (or raise dpsql.max_share). " + hint,
        )


def _rounded_up(epsilon: float) -> str:
    """ε to 4 significant digits, rounded up: a needed ε just above the budget never reads as equal to it."""
    step = 10.0 ** (math.floor(math.log10(epsilon)) - 3)
    return f"{math.ceil(epsilon / step) * step:.4g}"


def _specs(plan: Plan, noise: NoiseMechanism, split: Split) -> list[NoiseSpec | None]:
    """The noise of each measure under ``split``; None for selected ones (exponential mechanism)."""
    return [
        None
        if m.selected
        else noise.calibrate(plan.sensitivities(m), split, integer=integer_valued(m), cells=plan.max_groups)
        for m in plan.measures
    ]


def threshold_at(plan: Plan, budgeting: Budgeting, epsilon: float) -> int | None:
    """The partition-selection threshold the same query would have at ``epsilon`` (same δ and mechanism),
    or None when no sampler serves it: public figures, for the note on an empty answer."""
    try:
        return calibrate(plan, epsilon, budgeting.delta, budgeting.mechanism, True).threshold
    except (Error, ValueError):
        return None


def calibrate(plan: Plan, epsilon: float, delta: float, mechanism: str, selecting: bool) -> Budgeting:
    """Noise per measure and the charge, from validated settings; every spec checked samplable."""
    k = len(plan.measures)
    noise = MECHANISMS[mechanism]
    split = noise.split(epsilon, delta, k, selecting)
    specs = _specs(plan, noise, split)
    shares = [split.share] * k
    cost = split.cost
    budgeting = Budgeting(epsilon, cost.delta, mechanism, specs, cost, shares, measured=epsilon)
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
