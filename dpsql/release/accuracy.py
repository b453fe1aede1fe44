"""Accuracy: the half-width of each released cell's confidence interval, from the noise used.

Counts and sums read their spec's exact tail (``half_width``); AVG and VARIANCE combine their
measures' independent noises by the delta method. Intervals are post-processing of public
scales and released values: they cost nothing. What has no ± interval (quantiles, modes) gets
an honest sentence instead (:func:`accuracy_notes`; each aggregate writes its own,
:meth:`dpsql.aggregates.Aggregate.notes`).
"""

from __future__ import annotations

import math
from typing import Any

from sqlglot import exp

from dpsql.aggregates import OUTPUTS, Key
from dpsql.aggregates.notes import NOTE_ROWS, Counts, null_note, number
from dpsql.errors import InvalidParameterValue
from dpsql.plan import OutputItem, Plan
from dpsql.policy import Policy
from dpsql.release.apply import Released
from dpsql.release.calibrate import Budgeting
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


def accuracy_notes(
    plan: Plan,
    budgeting: Budgeting,
    level: float,
    result: Result,
    released: Released | None = None,
    widened: set[int] | frozenset[int] = frozenset(),
) -> list[str]:
    """NOTICE texts for what a ± half-width cannot say: quantile and MIN/MAX value ranges, groups too
    small for a quantile, modes, bound-capped values, NULL AVGs, intervals clipped to what a value can
    be, and outputs without any interval (post-processed).

    Privacy: every figure here is a function of ε, the policy's bounds and domains, the grid and the
    confidence (all public), or of released values (a value equal to a bound, a quantile's grid cell,
    a NULL or a group's size judged from a *noisy* count in ``released``): post-processing, free. No
    true count or value is read. ``widened``: columns whose ± covers the estimated bias of
    :mod:`dpsql.release.bias` (never clipped to what the clamped value can be).
    """
    notes: list[str] = []
    pct = ci_label(level)
    counts = _noisy_counts(plan, released)
    for o, out in enumerate(plan.outputs):
        values = [row[o] for row in result.rows]
        aggregate = OUTPUTS[out.kind]
        if aggregate.null_when_empty and (not isinstance(out.expr, exp.Var) or len(out.measures) != 1):
            notes.extend(null_note(out.column.name, values))
        own = (
            aggregate.notes(out, plan, budgeting, level, values, counts, _intervals(plan, result, o))
            if isinstance(out.expr, exp.Var)
            else None
        )
        if own is not None:
            notes.extend(own)
        elif out.noisy:
            widths = [acc[o] if o < len(acc) else None for acc in result.accuracy]
            shown = [w for w, v in zip(widths, values, strict=True) if v is not None]
            if not aggregate.own_note and all(w is None for w in shown):
                if shown:
                    notes.append(
                        f"dpsql: no interval for column {out.column.name} (post-processed: computed from noisy "
                        "values by arithmetic, ROUND, a ratio or several measures; only bare aggregates and "
                        "constant multiples of one get ±)"
                    )
            elif o not in widened:  # a ± widened by the bias reaches beyond what the clamped value can be
                notes.extend(_clip_note(out, plan, o, result, widths, pct))
    return notes


def bias_note(plan: Plan, level: float, covered: float | None = None) -> str | None:
    """What the intervals leave out: the bias of contribution bounding, said every time it can apply.

    An interval (a ±, or a quantile's value range) covers the noise only. Values clamped to the declared
    bounds and rows beyond a unit's ``max_rows``/``max_groups`` shift answers too, by an amount the analyst
    cannot see (a curator's ``dpsql policy report`` measures it). Names only the policy's bounds and caps,
    and only caps that can leave a row out (:func:`caps_cut`): public, so the note is the same on every
    neighbouring database. A quantile's own note names its bounds. ``covered``: the share of rows cut the
    curator published, which the value ranges of a query without a ± cover (``Budgeting.interval_cut``)."""
    additive = any(not m.selected for m in plan.measures)
    if not additive and not any(m.q is not None for m in plan.measures):
        return None  # a mode: no interval to qualify
    clamps: list[str] = []
    for m in plan.measures:
        if m.clamped_sum and m.lower is not None and m.upper is not None:
            what = m.column if m.expr is None and m.column else "summed expressions"
            text = f"{what} to [{m.lower:g}, {m.upper:g}]"
            if text not in clamps:
                clamps.append(text)
    parts = [f"values clamped ({', '.join(clamps)})"] if clamps else []
    rows = "1 row" if plan.max_rows == 1 else f"{plan.max_rows} rows"
    pct = ci_label(level)
    if covered is not None and not additive:
        noise = (
            f"the noise and the {100 * covered:.3g} % of rows cut beyond {rows} per "
            f"{plan.sources.unit_description} the curator published for the whole table"
        )
        return f"dpsql: the {pct}% value ranges cover {noise}" + (f", not the bias of {parts[0]}" if parts else "")
    if plan.unit is not None and caps_cut(plan):
        groups = f" in at most {plan.max_groups} groups" if plan.keys and plan.max_groups > 1 else ""
        parts.append(
            f"at most {rows}{groups} per {plan.sources.unit_description}{plan.cap_origin} (rows beyond are left out)"
        )
    if not parts:
        return None
    lead = f"±{pct}% covers" if additive else f"the {pct}% value ranges cover"
    return f"dpsql: {lead} the noise only, not the bias of " + "; ".join(parts)


def caps_cut(plan: Plan) -> bool:
    """Whether the caps can leave a row out. Not when the query reads only the person table itself: its
    unit is the table's own ``privacy_unit``, other tables' ``references`` point at it (a key: one row per
    person) and ``max_rows_per_unit`` is 1. Policy facts only."""
    private = plan.sources.private
    if len(private) != 1:
        return True
    source = private[0]
    table = source.table
    unit = table.privacy_unit
    if unit is None or source.unit_column != unit or plan.max_rows != 1:  # (a unit through hops: no unit_column)
        return True
    tables = plan.sources.policy.tables.values()
    return not any(
        t.references is not None and (t.references.table, t.references.to) == (source.name, unit) for t in tables
    )


def _noisy_counts(plan: Plan, released: Released | None) -> dict[str | None, Counts]:
    """Per column, each released group's key, noisy count and its half-width, from the query's own
    released counts (COUNT(*) for every column, COUNT(col) for its column; unfiltered ones only).
    Released values only: a group's size is judged on noise, never on its true count."""
    if released is None:
        return {}
    nkeys = len(plan.keys)
    found: dict[str | None, int] = {}
    for i, m in enumerate(plan.measures):
        if m.expr is None and m.counts:
            found.setdefault(None if m.star else m.column, i)
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


def _row_label(plan: Plan, row: tuple[Any, ...]) -> str:
    """How a note names a row: its released key values, space-separated (empty without keys)."""
    keys = [k for k, item in enumerate(plan.outputs) if isinstance(OUTPUTS[item.kind], Key)]
    return " ".join(str(row[k]) for k in keys) + " " if keys else ""


def _intervals(plan: Plan, result: Result, o: int) -> list[tuple[str, tuple[float, float] | None]] | None:
    """Each row's label and column ``o``'s released value interval, when the result has any."""
    if len(result.intervals) != len(result.rows):
        return None
    return [(_row_label(plan, row), ranges[o]) for row, ranges in zip(result.rows, result.intervals, strict=True)]


def _clip_note(out: OutputItem, plan: Plan, o: int, result: Result, widths: list[Any], pct: str) -> list[str]:
    """``count: 95% interval clipped to its possible range [0, ∞): 2 ±5 is 0 to 7``: an interval
    intersected with what the value can be (a count ≥ 0, an AVG inside the declared bounds):
    post-processing of a released value and a public half-width."""
    bounds = OUTPUTS[out.kind].value_range(out, plan)
    if bounds is None:
        return []
    low, high = bounds
    clipped = []
    for row, width in zip(result.rows, widths, strict=False):
        value = row[o]
        if not isinstance(value, int | float) or not isinstance(width, int | float) or not math.isfinite(width):
            continue
        if value - width < low or value + width > high:
            lo, hi = max(low, value - width), min(high, value + width)
            name = _row_label(plan, row)
            interval = f"{number(lo, width)} to {number(hi, width)}"
            clipped.append(f"{name}{number(value, width)} ±{number(width, width)} is {interval}")
    if not clipped:
        return []
    limits = f"[{_bound(low)}, {_bound(high)}{')' if high == math.inf else ']'}".replace("[-∞", "(-∞")
    if len(result.rows) == 1:
        return [f"dpsql: {out.column.name}: {pct}% interval clipped to its possible range {limits}: {clipped[0]}"]
    more = "; …" if len(clipped) > NOTE_ROWS else ""
    return [
        f"dpsql: {out.column.name}: {pct}% intervals clipped to its possible range {limits} in {len(clipped)} "
        f"of {len(result.rows)} rows: " + "; ".join(clipped[:NOTE_ROWS]) + more
    ]


def _bound(x: float) -> str:
    return "∞" if x == math.inf else "-∞" if x == -math.inf else f"{x:g}"
