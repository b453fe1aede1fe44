"""Accuracy: the half-width of each released cell's confidence interval, from the noise used.

Counts and sums read their spec's exact tail (``half_width``); AVG and VARIANCE combine their
measures' independent noises by the delta method. Intervals are post-processing of public
scales and released values: they cost nothing. What has no ± interval (quantiles, modes) gets
an honest sentence instead (:func:`accuracy_notes`).
"""

from __future__ import annotations

import math
from typing import Any

from sqlglot import exp

from dpsql.aggregates import OUTPUTS
from dpsql.errors import InvalidParameterValue
from dpsql.plan import Measure, OutputItem, Plan
from dpsql.policy import Policy
from dpsql.release.calibrate import Budgeting
from dpsql.release.selection import quantile_grid, quantile_rank_error
from dpsql.session import Result, Session, ci_label


def confidence(policy: Policy, session: Session) -> float:
    """The session's CI level (or the policy's), checked: a bad one fails before any charge."""
    level = session.confidence if session.confidence is not None else policy.defaults.confidence
    if not 0 < level < 1:  # NaN fails too
        raise InvalidParameterValue(
            f"dpsql.confidence must be between 0 and 1 (exclusive), got {level:g}",
            hint="For example SET dpsql.confidence = 0.95.",
        )
    return level


def accuracy(out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
    """Half-width of the confidence interval of one released cell, from the scales used (each
    aggregate's own: the spec's tail for counts and sums, the delta method for AVG and VARIANCE)."""
    return OUTPUTS[out.kind].accuracy(out, env, widths)


#: Output kinds chosen by the exponential mechanism over a quantile grid.
_QUANTILE_KINDS = ("quantile", "quantile_disc")


def accuracy_notes(plan: Plan, budgeting: Budgeting, level: float, result: Result) -> list[str]:
    """NOTICE texts for what a ± half-width cannot say: quantiles and modes, bound-capped values, NULL AVGs.

    Privacy: every figure here is a function of ε, the policy's bounds and domains, the grid and the
    confidence (all public), or of the released values themselves (a value equal to a bound, a NULL
    decided from a noisy count): post-processing, free. No true count or value is read.
    """
    notes: list[str] = []
    pct = ci_label(level)
    for o, out in enumerate(plan.outputs):
        if not isinstance(out.expr, exp.Var) or len(out.measures) != 1:
            if out.kind in ("avg", "variance"):
                notes.extend(_null_note(out.column.name, [row[o] for row in result.rows]))
            continue
        i = out.measures[0]
        measure = plan.measures[i]
        values = [row[o] for row in result.rows]
        if out.kind in _QUANTILE_KINDS:
            notes.append(_quantile_note(out, plan, budgeting, level, pct))
            notes.extend(_bound_notes(out.column.name, measure, values))
        elif out.kind == "mode":
            notes.append(_mode_note(out.column.name, measure, plan, budgeting.shares[i], level, pct))
    return notes


def bias_note(plan: Plan, level: float) -> str | None:
    """What the ± intervals leave out: the bias of contribution bounding, said every time it can apply.

    An interval covers the noise only. Values clamped to the declared bounds and rows beyond a unit's
    ``max_rows``/``max_groups`` shift answers too, by an amount the analyst cannot see (a curator's
    ``dpsql policy report`` measures it). Names only the policy's bounds and caps: public, so the
    note is the same on every neighbouring database."""
    if not any(not m.selected for m in plan.measures):
        return None
    clamps: list[str] = []
    for m in plan.measures:
        if m.clamped_sum and m.lower is not None and m.upper is not None:
            what = m.column if m.expr is None and m.column else "summed expressions"
            text = f"{what} to [{m.lower:g}, {m.upper:g}]"
            if text not in clamps:
                clamps.append(text)
    parts = [f"values clamped ({', '.join(clamps)})"] if clamps else []
    if plan.unit is not None:
        rows = "1 row" if plan.max_rows == 1 else f"{plan.max_rows} rows"
        groups = f" in at most {plan.max_groups} groups" if plan.keys and plan.max_groups > 1 else ""
        parts.append(f"at most {rows}{groups} per {plan.sources.unit_description} (rows beyond are left out)")
    if not parts:
        return None
    return f"dpsql: ±{ci_label(level)}% covers the noise only, not the bias of " + "; ".join(parts)


def _quantile_note(out: OutputItem, plan: Plan, budgeting: Budgeting, level: float, pct: str) -> str:
    """The rank error bound EXPLAIN shows (``rank_error95``), said in words; MIN/MAX also say where they aim."""
    i = out.measures[0]
    measure = plan.measures[i]
    assert measure.lower is not None and measure.upper is not None and measure.q is not None
    rank = OUTPUTS[out.kind].explain(out, plan, budgeting, level)["rank_error95"]
    head = f"dpsql: {out.column.name} has no ± interval (exponential mechanism): at {pct}% "
    if measure.q in (0.0, 1.0):
        grid = quantile_grid(measure.lower, measure.upper, measure.integer)
        sensitivity = plan.sensitivities(measure)[0]
        # the rank MIN/MAX aim at (selection._extreme_rank): the 95% bound over the candidates
        aim = max(1.0, quantile_rank_error(budgeting.shares[i], sensitivity, grid, 0.95, extreme=True))
        side, beyond = ("largest", "above") if measure.q == 1.0 else ("smallest", "below")
        if grid.stride > 1:  # chosen among runs of cells, released at the run's middle
            width = (measure.upper - measure.lower) * grid.stride / grid.cells
            beyond += f" its run of width {width:.4g}"
        else:
            beyond += " it"
        return (
            head + f"at most {math.ceil(aim + rank)} of its group's values lie {beyond} "
            f"(it aims {_values(math.ceil(aim))} in from the {side}: no DP mechanism finds the exact extreme)"
        )
    return head + f"its rank is within {math.ceil(rank)} of the exact {measure.q:g}-quantile's rank"


def _values(n: int) -> str:
    return f"{n} value" if n == 1 else f"{n} values"


def _bound_notes(name: str, measure: Measure, values: list[Any]) -> list[str]:
    """``max is capped at the declared upper bound 110`` (or floored at the lower): values are clamped
    to the policy's bounds, so a released value at a bound may stand for anything beyond it (a
    statement about the released value only)."""
    notes = []
    for bound, which in (
        (measure.upper, "capped at the declared upper"),
        (measure.lower, "floored at the declared lower"),
    ):
        hits = sum(1 for v in values if isinstance(v, int | float) and bound is not None and v == bound)
        if hits:
            where = "" if len(values) == 1 else f" (in {hits} of {len(values)} rows)"
            notes.append(
                f"dpsql: {name} is {which} bound {bound:g} of {measure.column}{where}: "
                f"values are clamped to [{measure.lower:g}, {measure.upper:g}] before the choice"
            )
    return notes


def _mode_note(name: str, measure: Measure, plan: Plan, epsilon: float, level: float, pct: str) -> str:
    """Report-noisy-max with exponential noise of scale b = Δ/ε over N candidates: every noise is at
    most b·ln(N/β) with probability ≥ 1 − β (union bound), so the winner's count is at most that far
    below the most frequent candidate's (the noises are non-negative)."""
    candidates = len(measure.domain or ())
    scale = plan.sensitivities(measure)[0] / epsilon
    gap = scale * math.log(max(candidates, 1) / (1.0 - level))
    return (
        f"dpsql: {name} has no ± interval (report-noisy-max among {candidates} public values): at {pct}% "
        f"the chosen value's count is within {gap:.4g} of the most frequent value's count"
    )


def _null_note(name: str, values: list[Any]) -> list[str]:
    """Say why an AVG/variance is NULL: its noisy count was ≤ 0 (decided from released values only)."""
    nulls = sum(1 for v in values if v is None)
    if not nulls:
        return []
    where = "" if len(values) == 1 else f" in {nulls} of {len(values)} rows"
    return [f"dpsql: {name} is NULL{where}: its noisy count is <= 0 (the group looks empty)"]
