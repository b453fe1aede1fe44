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
from dpsql.release.apply import Released
from dpsql.release.calibrate import Budgeting
from dpsql.release.selection import (
    EXTREME_BETA,
    QuantileGrid,
    extreme_aims,
    nice,
    quantile_grid,
    quantile_rank_error,
    rank_error_bound,
)
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
#: Output kinds whose missing ± has its own note (quantiles, modes) or is a NULL (AVG, variance).
_OWN_NOTE_KINDS = (*_QUANTILE_KINDS, "mode")
#: Rows named in one note before "…".
_NOTE_ROWS = 5
#: Each released group's key, noisy count and the count's half-width.
Counts = list[tuple[tuple[Any, ...], float, float]]
#: A note starting with this is a warning (the server sends it with severity WARNING).
WARNING = "dpsql: WARNING: "


def accuracy_notes(
    plan: Plan, budgeting: Budgeting, level: float, result: Result, released: Released | None = None
) -> list[str]:
    """NOTICE texts for what a ± half-width cannot say: quantile and MIN/MAX value ranges, groups too
    small for a quantile, modes, bound-capped values, NULL AVGs, intervals clipped to what a value can
    be, and outputs without any interval (post-processed).

    Privacy: every figure here is a function of ε, the policy's bounds and domains, the grid and the
    confidence (all public), or of released values (a value equal to a bound, a quantile's grid cell,
    a NULL or a group's size judged from a *noisy* count in ``released``): post-processing, free. No
    true count or value is read.
    """
    notes: list[str] = []
    pct = ci_label(level)
    counts = _noisy_counts(plan, released)
    for o, out in enumerate(plan.outputs):
        values = [row[o] for row in result.rows]
        if (not isinstance(out.expr, exp.Var) or len(out.measures) != 1) and out.kind in ("avg", "variance"):
            notes.extend(_null_note(out.column.name, values))
        if out.kind in _QUANTILE_KINDS and isinstance(out.expr, exp.Var):
            i = out.measures[0]
            notes.extend(_quantile_notes(out, plan, budgeting, level, values, counts.get(plan.measures[i].column)))
            notes.extend(_bound_notes(out.column.name, plan.measures[i], values))
        elif out.kind == "mode" and isinstance(out.expr, exp.Var):
            i = out.measures[0]
            notes.append(_mode_note(out.column.name, plan.measures[i], plan, budgeting.shares[i], level, pct))
        elif out.noisy:
            widths = [acc[o] if o < len(acc) else None for acc in result.accuracy]
            shown = [w for w, v in zip(widths, values, strict=True) if v is not None]
            if out.kind not in _OWN_NOTE_KINDS and all(w is None for w in shown):
                if shown:
                    notes.append(
                        f"dpsql: no interval for column {out.column.name} (post-processed: computed from noisy "
                        "values by arithmetic, ROUND, a ratio or several measures; only bare aggregates and "
                        "constant multiples of one get ±)"
                    )
            else:
                notes.extend(_clip_note(out, plan, o, result, widths, pct))
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


def _quantile_notes(
    out: OutputItem,
    plan: Plan,
    budgeting: Budgeting,
    level: float,
    values: list[Any],
    counts: Counts | None,
) -> list[str]:
    """A quantile's accuracy in words, from public quantities and its released values only.

    MIN/MAX: a value range, ``between ~25.3 and 80 at 95%``: the mechanism picks a candidate beyond
    all the data with probability ≤ β = 5% (``selection.extreme_aims``), so the true extreme lies
    between the released value's grid cell (or run) and the bound, plus how many values may lie
    beyond it (the aim of the released value's candidate plus the rank error). Other quantiles: the
    rank error, as quantile levels when the group's noisy count is released. A value range for
    those would need the values at the ranks around it, which are not released: said so.
    Then a warning for groups whose *noisy* count is too small for the quantile to mean anything.
    """
    i = out.measures[0]
    measure = plan.measures[i]
    assert measure.lower is not None and measure.upper is not None and measure.q is not None
    name, column = out.column.name, measure.column
    grid = quantile_grid(measure.lower, measure.upper, measure.integer)
    sensitivity, epsilon = plan.sensitivities(measure)[0], budgeting.shares[i]
    pct = ci_label(level)
    clamp = f"noise only; bounds [{measure.lower:g}, {measure.upper:g}] clamp {column}"
    released = [float(v) for v in values if isinstance(v, int | float)]
    notes: list[str] = []
    if measure.q in (0.0, 1.0):
        top = measure.q == 1.0
        runs = grid.stride > 1
        candidates = grid.runs if runs else grid.cells
        aims = extreme_aims(epsilon, sensitivity, candidates)
        error = rank_error_bound(epsilon, sensitivity, level, candidates)
        reach, ranges = 0.0, []
        for v in released:
            index, low, high = grid.candidate(v, runs)
            aim = aims[candidates - 1 - index] if top else aims[index]
            reach = max(reach, aim + error)
            ranges.append((low, measure.upper) if top else (measure.lower, high))
        depth = math.ceil(reach or aims[0] + error)
        extreme, side = ("maximum", "above") if top else ("minimum", "below")
        sure = ci_label(1.0 - EXTREME_BETA)
        if len(ranges) == 1:
            low, high = ranges[0]
            exact = grid.integer and not runs
            ends = (_approx(low, grid, exact, high - low), _approx(high, grid, exact, high - low))
            between = f"between {ends[0]} and {ends[1]}" if low < high else f"{ends[0]} (the declared bound)"
            where = f"the group's values lie {side} {_number(released[0])}"
        else:
            bound = measure.upper if top else measure.lower
            between = f"between ~each row's value and {bound:g}" if top else f"between {bound:g} and ~each row's value"
            where = f"a group's values lie {side} its value"
        floor_, why = aims[0] + error, f"the depth it must aim at plus its {pct}% rank error"
        notes.append(
            f"dpsql: {name}: {between} at {sure}% ({clamp}); no DP mechanism finds the exact {extreme}: "
            f"at {pct}% at most {depth} of {where}{_size_hint(floor_, counts)}"
        )
    else:
        error = quantile_rank_error(epsilon, sensitivity, grid, level)
        levels = ""
        if counts is not None and len(counts) == 1 and len(released) == 1:
            _, noisy, width = counts[0]
            n = noisy - width
            if n > 2 * error:
                low_q, high_q = max(0.0, measure.q - error / n), min(1.0, measure.q + error / n)
                levels = (
                    f", i.e. between the group's p{math.floor(low_q * 100):d} and p{math.ceil(high_q * 100):d} "
                    f"(from its noisy count ~{_number(noisy)})"
                )
        floor_, why = 2 * error, f"twice its {pct}% rank error"
        notes.append(
            f"dpsql: {name} has no ± interval (exponential mechanism): at {pct}% its rank is within "
            f"{math.ceil(error)} of the exact {measure.q:g}-quantile's{levels}; a value range would need "
            f"the data ({clamp}){_size_hint(floor_, counts)}"
        )
    notes.extend(_small_group_note(name, floor_, why, counts, plan))
    return notes


def _small_group_note(name: str, floor_: float, why: str, counts: Counts | None, plan: Plan) -> list[str]:
    """``WARNING: median(x) means little …`` for groups whose *noisy* count (released by the same
    query) is below what the quantile needs; without a released count the quantile's note says what
    size it needs instead (a fact of the policy and ε)."""
    need = math.ceil(floor_)
    if counts is None:
        return []
    small = [(key, noisy) for key, noisy, _ in counts if noisy < need]
    if not small:
        return []
    if not plan.keys:
        return [f"{WARNING}{name} means little here: the noisy count ~{_number(small[0][1])} is below {need} ({why})"]
    named = ", ".join(", ".join(str(k) for k in key) for key, _ in small[:_NOTE_ROWS])
    sizes = ", ".join(f"~{_number(noisy)}" for _, noisy in small[:_NOTE_ROWS])
    more = ", …" if len(small) > _NOTE_ROWS else ""
    return [
        f"{WARNING}{name} means little in {len(small)} of {len(counts)} groups ({named}{more}): their noisy "
        f"counts ({sizes}{more}) are below {need} ({why})"
    ]


def _size_hint(floor_: float, counts: Counts | None) -> str:
    """Without a released count: the group size a quantile needs to mean anything (ε and policy only)."""
    if counts is not None:
        return ""
    return f"; it means little unless the group holds well over {math.ceil(floor_)} values (add COUNT(*) to see)"


def _noisy_counts(plan: Plan, released: Released | None) -> dict[str | None, Counts]:
    """Per column, each released group's key, noisy count and its half-width, from the query's own
    released counts (COUNT(*) for every column, COUNT(col) for its column; unfiltered ones only).
    Released values only: a group's size is judged on noise, never on its true count."""
    if released is None:
        return {}
    nkeys = len(plan.keys)
    found: dict[str | None, int] = {}
    for i, m in enumerate(plan.measures):
        if m.expr is None and m.kind in ("count_star", "count"):
            found.setdefault(None if m.kind == "count_star" else m.column, i)
    out: dict[str | None, Counts] = {}
    columns = {m.column for m in plan.measures if m.selected}
    for column in columns:
        index = found.get(column, found.get(None))
        if index is None:
            continue
        out[column] = [
            (tuple(row[:nkeys]), float(released.columns[index][j]), float(released.widths[j][index] or 0.0))
            for j, row in enumerate(released.rows)
        ]
    return out


def _clip_note(out: OutputItem, plan: Plan, o: int, result: Result, widths: list[Any], pct: str) -> list[str]:
    """``count: 95% interval clipped to its possible range [0, ∞): 2 ±5 is 0 to 7``: an interval
    intersected with what the value can be (a count ≥ 0, an AVG inside the declared bounds):
    post-processing of a released value and a public half-width."""
    bounds = OUTPUTS[out.kind].value_range(out, plan)
    if bounds is None:
        return []
    low, high = bounds
    keys = [k for k, item in enumerate(plan.outputs) if item.kind == "key"]
    clipped = []
    for row, width in zip(result.rows, widths, strict=False):
        value = row[o]
        if not isinstance(value, int | float) or not isinstance(width, int | float) or not math.isfinite(width):
            continue
        if value - width < low or value + width > high:
            lo, hi = max(low, value - width), min(high, value + width)
            name = " ".join(str(row[k]) for k in keys) + " " if keys else ""
            interval = f"{_number(lo, width)} to {_number(hi, width)}"
            clipped.append(f"{name}{_number(value, width)} ±{_number(width, width)} is {interval}")
    if not clipped:
        return []
    limits = f"[{_bound(low)}, {_bound(high)}{')' if high == math.inf else ']'}".replace("[-∞", "(-∞")
    if len(result.rows) == 1:
        return [f"dpsql: {out.column.name}: {pct}% interval clipped to its possible range {limits}: {clipped[0]}"]
    more = "; …" if len(clipped) > _NOTE_ROWS else ""
    return [
        f"dpsql: {out.column.name}: {pct}% intervals clipped to its possible range {limits} in {len(clipped)} "
        f"of {len(result.rows)} rows: " + "; ".join(clipped[:_NOTE_ROWS]) + more
    ]


def _bound(x: float) -> str:
    return "∞" if x == math.inf else "-∞" if x == -math.inf else f"{x:g}"


def _approx(x: float, grid: QuantileGrid, exact: bool, width: float) -> str:
    """A range end: a bound or an exact integer as is, the edge of a cell (or run) of ``width`` as ``~x``."""
    if exact or x in (grid.lower, grid.upper):
        return _number(x)
    return "~" + _number(x, width)


def _number(x: float, width: float | None = None) -> str:
    """A released number as notes show it: rounded like result cells (two significant digits of
    ``width``, else six significant digits), without exponent or trailing zeros."""
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    if width is not None and width > 0 and math.isfinite(width):
        x = nice(x, width)
    text = f"{x:.6g}" if width is None or "e" in repr(x) else repr(x)
    return text.removesuffix(".0")


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
