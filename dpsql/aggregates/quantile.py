"""Quantiles (MIN, MAX, median, percentile_cont/disc): the exponential mechanism over binned counts.

The histogram's cells are those of :func:`~dpsql.noise.exponential.quantile_grid` (exact integers
for an int column of at most 65,536 values, else 65,536 equal cells); the value is chosen by one
exponential mechanism over them (MIN/MAX: over runs of cells). An interior quantile (median,
percentiles) comes with a value interval at the policy's confidence: two more measures of the same
histogram (:class:`QuantileEnd`), each an ε-DP choice of one end, so the query's ε is shared by three
measures for it — privacy argument in :mod:`dpsql.noise.exponential`. When the curator publishes the
share of rows the caps cut (``published_rows_cut``, ``dpsql.bias`` on), the ends cover the quantile of
*all* rows, wherever the cut rows lie (:func:`~dpsql.noise.exponential.cut_levels`); the value itself
stays the kept rows' quantile (no release can tell where the cut rows lie: they are beyond the cap).
MIN and MAX get theirs free (post-processing of the released value, :func:`_quantile_notes`), and they
reach to the bound, which covers cut rows too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from sqlglot import exp

from dpsql.aggregates.base import Operand, Recognised, Rows, Scope, Selection, Spending, measure_var
from dpsql.aggregates.notes import NOTE_ROWS, WARNING, Counts, Interval, number
from dpsql.errors import FeatureNotSupported, InvalidParameterValue
from dpsql.noise.exponential import (
    EXTREME_BETA,
    QuantileGrid,
    extreme_aims,
    interval_end,
    quantile_grid,
    quantile_rank_error,
    rank_error_bound,
    select_quantile,
)
from dpsql.pgtypes import PgType
from dpsql.plan import Measure, OutputItem, Plan
from dpsql.plan.sources import resolve_ref
from dpsql.session import ci_label


class Quantile(Selection):
    """median and percentile_cont: a continuous quantile."""

    kind = "quantile"
    recognises: ClassVar[tuple[type[exp.Expr], ...]] = (exp.Median, exp.PercentileCont)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        """The value's measure, then (0 < q < 1) the two ends of its value interval."""
        measure = _quantile_measure(node, scope)
        index = scope.measure(measure)
        if measure.q in (0.0, 1.0):  # MIN/MAX: the value range is post-processing of the value
            return Recognised(measure_var(index), self.kind, (index,))
        ends = tuple(scope.measure(replace(measure, kind=end.kind)) for end in (QUANTILE_LOW, QUANTILE_HIGH))
        return Recognised(measure_var(index), self.kind, (index, *ends))

    def label(self, measure: Measure) -> str:
        return f"QUANTILE({measure.q:g}) OF clamp({measure.column}, {measure.lower:g}, {measure.upper:g})"

    def converter(self, measure: Measure) -> Callable[[Any], Any]:
        return float

    def select(
        self,
        plan: Plan,
        index: int,
        rows: Rows,
        histogram: Rows,
        epsilon: float,
        *,
        level: float = 0.95,
        cut: float = 0.0,
    ) -> list[Any]:
        """The exponential mechanism, once per released group, over that group's cell counts.

        Groups without any value (and keys released without a histogram row) are chosen from an
        empty histogram like the others: whether a group has data changes nothing but utilities.
        """
        nkeys = len(plan.keys)
        measure = plan.measures[index]
        assert measure.q is not None
        grid = self.grid(measure)
        counts: dict[tuple[Any, ...], dict[int, int]] = {}
        for row in histogram:
            cell = row[nkeys]
            if cell is not None:
                group = counts.setdefault(tuple(row[:nkeys]), {})
                clamped = min(max(int(cell), 0), grid.cells - 1)  # the upper bound itself falls in cell `cells`
                group[clamped] = group.get(clamped, 0) + int(row[nkeys + 1])
        sensitivity = plan.sensitivities(measure)[0]
        return [
            self.choose(counts.get(tuple(row[:nkeys]), {}), measure.q, epsilon, sensitivity, grid, level, cut)
            for row in rows
        ]

    def choose(
        self,
        counts: Mapping[int, int],
        q: float,
        epsilon: float,
        sensitivity: float,
        grid: QuantileGrid,
        level: float,
        cut: float = 0.0,
    ) -> float:
        """One group's released value from its cell counts (``cut``: what an interval end covers)."""
        return select_quantile(counts, q, epsilon, sensitivity, grid)

    def interval(self, out: OutputItem, plan: Plan, env: Mapping[str, Any]) -> Interval | None:
        """The released ends of an interior quantile's value interval (post-processing). Each end is on
        its side of the exact quantile with probability ≥ 1 − β/2 on its own; crossed ends (possible when
        the group is nearly empty) are shown as the range between them, which can only hold more.
        MIN/MAX: their 95% range, from the released value's run (or cell) to the bound (the note's)."""
        measure = plan.measures[out.measures[0]]
        if measure.q in (0.0, 1.0):
            value = env.get(f"m{out.measures[0]}")
            if not isinstance(value, int | float) or measure.lower is None or measure.upper is None:
                return None
            grid = self.grid(measure)
            _, edge_low, edge_high = grid.candidate(float(value), grid.stride > 1)
            return (edge_low, measure.upper) if measure.q == 1.0 else (measure.lower, edge_high)
        if len(out.measures) != 3:
            return None
        low, high = (env.get(f"m{i}") for i in out.measures[1:])
        if not isinstance(low, int | float) or not isinstance(high, int | float):
            return None
        return float(min(low, high)), float(max(low, high))

    def grid(self, measure: Measure) -> QuantileGrid:
        """Exact integers or equal cells over the column's bounds (:func:`quantile_grid`): public."""
        assert measure.lower is not None and measure.upper is not None
        return quantile_grid(measure.lower, measure.upper, measure.integer)

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "double precision"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        if out.column.type == "bigint" and value is not None:
            return math.floor(value)  # MIN/MAX/percentile_disc of an int column: a value of the column's type
        return value

    def notes(
        self,
        out: OutputItem,
        plan: Plan,
        budgeting: Spending,
        level: float,
        values: list[Any],
        counts: Mapping[str | None, Counts],
        intervals: Sequence[tuple[str, Interval | None]] | None = None,
    ) -> list[str] | None:
        """The value interval (rank error without one), small groups, values at a bound."""
        measure = plan.measures[out.measures[0]]
        notes = _quantile_notes(out, plan, budgeting, level, values, counts.get(measure.column), intervals)
        return notes + _bound_notes(out.column.name, measure, values)

    def explain(self, out: OutputItem, plan: Plan, budgeting: Spending, confidence: float) -> dict[str, Any]:
        i = out.measures[0]
        measure = plan.measures[i]
        assert measure.lower is not None and measure.upper is not None
        sensitivity = plan.sensitivities(measure)[0]
        grid = quantile_grid(measure.lower, measure.upper, measure.integer)
        cells = f"{grid.cells} integers" if grid.integer else f"{grid.cells} cells"
        extreme = measure.q in (0.0, 1.0)
        stages = f" grouped in {grid.runs} runs" if grid.stride > 1 and extreme else ""
        if len(out.measures) == 3:
            ends = f"{grid.runs} runs" if grid.stride > 1 else cells
            level = budgeting.interval_level or confidence
            stages += f"; its {ci_label(level)}% value interval: one more for each end, over {ends}"
        return {
            "measure": f"{measure.label}: exponential mechanism over {cells}{stages}",
            "sensitivity": sensitivity,
            "scale": 2 * sensitivity / budgeting.shares[i],
            "epsilon": sum(budgeting.shares[j] for j in out.measures),
            "ci": float("nan"),
            "rank_error95": quantile_rank_error(budgeting.shares[i], sensitivity, grid, confidence, extreme=extreme),
        }


class QuantileEnd(Quantile):
    """One end of an interior quantile's value interval: a measure chosen from the quantile's own
    histogram (:func:`~dpsql.noise.exponential.interval_end`), never an output of its own."""

    upper: ClassVar[bool]
    recognises = ()
    interval_end = True

    def label(self, measure: Measure) -> str:
        return f"{'UPPER' if self.upper else 'LOWER'} END OF {super().label(measure)}"

    def choose(
        self,
        counts: Mapping[int, int],
        q: float,
        epsilon: float,
        sensitivity: float,
        grid: QuantileGrid,
        level: float,
        cut: float = 0.0,
    ) -> float:
        return interval_end(counts, q, epsilon, sensitivity, grid, level, self.upper, cut)


class QuantileLow(QuantileEnd):
    kind = "quantile_low"
    upper = False


class QuantileHigh(QuantileEnd):
    kind = "quantile_high"
    upper = True


QUANTILE_LOW, QUANTILE_HIGH = QuantileLow(), QuantileHigh()


class QuantileDisc(Quantile):
    """percentile_disc, MIN and MAX: a quantile released in the column's own type."""

    kind = "quantile_disc"
    recognises = (exp.Min, exp.Max, exp.PercentileDisc)

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "bigint" if scope.measures[measures[0]].integer else "double precision"


def _quantile_measure(node: exp.Expression, scope: Scope) -> Measure:
    """MIN/MAX/median/percentile_cont/percentile_disc → a quantile measure over the clamped column."""
    if isinstance(node, exp.WithinGroup):
        inner, order = node.this, node.expression
        fraction = inner.this
        if not (isinstance(fraction, exp.Literal) and not fraction.is_string and 0 <= float(fraction.name) <= 1):
            raise InvalidParameterValue(
                "percentile value must be a constant between 0 and 1", hint="Write e.g. percentile_cont(0.9)."
            )
        ordered = order.expressions[0] if isinstance(order, exp.Order) and len(order.expressions) == 1 else None
        if ordered is None:
            raise FeatureNotSupported("WITHIN GROUP needs exactly one ORDER BY column")
        q = float(fraction.name)
        if ordered.args.get("desc"):
            q = 1.0 - q
        argument, function = ordered.this, _sql_name(inner)
    else:
        q = {exp.Min: 0.0, exp.Max: 1.0, exp.Median: 0.5}[type(node)]  # type: ignore[index]  # a quantile node
        argument, function = node.this, _sql_name(node)
    while isinstance(argument, exp.Paren):
        argument = argument.this
    if not isinstance(argument, exp.Column):
        raise FeatureNotSupported(f"{function} over an expression is not supported yet")
    source, name, policy = resolve_ref(argument, scope.sources)
    bounds = scope.bounded_sum(Operand(source.alias, name, policy), function, centred=False)
    return Measure(
        kind="quantile",
        column=name,
        table=source.alias,
        lower=bounds.lower,
        upper=bounds.upper,
        integer=bounds.integer,
        q=q,
    )


def _sql_name(node: exp.Expression) -> str:
    return node.sql_name().lower() if isinstance(node, exp.Func) else node.key


def _quantile_notes(
    out: OutputItem,
    plan: Plan,
    budgeting: Spending,
    level: float,
    values: list[Any],
    counts: Counts | None,
    intervals: Sequence[tuple[str, Interval | None]] | None = None,
) -> list[str]:
    """A quantile's accuracy in words, from public quantities and its released values only.

    MIN/MAX: a value range, ``between ~25.3 and 80 at 95%``: the mechanism picks a candidate beyond
    all the data with probability ≤ β = 5% (:func:`~dpsql.noise.exponential.extreme_aims`), so the
    true extreme lies between the released value's grid cell (or run) and the bound, plus how many
    values may lie beyond it (the aim of the released value's candidate plus the rank error). Other
    quantiles: their released value interval (:class:`QuantileEnd`), else (a stored release without
    one) the rank error, as quantile levels when the group's noisy count is released. Then a warning
    for groups whose *noisy* count is too small for the quantile to mean anything.
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
        candidates = grid.runs if grid.stride > 1 else grid.cells
        aims = extreme_aims(epsilon, sensitivity, candidates)
        error = rank_error_bound(epsilon, sensitivity, level, candidates)
        floor_, why = aims[0] + error, f"the depth it must aim at plus its {pct}% rank error"
        notes.append(_extreme_note(name, measure, grid, aims, error, pct, clamp, released, counts))
    elif intervals is not None and len(out.measures) == 3:
        error = quantile_rank_error(epsilon, sensitivity, grid, level)
        floor_, why = 2 * error, f"twice its {pct}% rank error"
        shares = [budgeting.shares[j] for j in out.measures]
        ends_level = budgeting.interval_level or level  # the policy's level the ends were chosen at
        if budgeting.interval_cut is not None:  # the ends cover the rows cut (noise.exponential.cut_levels)
            share = f"{100 * budgeting.interval_cut:.3g} %"
            covered = f"{share} of rows cut beyond the cap the curator published for the table"
            clamp = clamp.replace("noise only;", f"noise and the {covered};")
        notes.extend(_interval_notes(name, grid, shares, ends_level, clamp, values, intervals))
    else:
        error = quantile_rank_error(epsilon, sensitivity, grid, level)
        floor_, why = 2 * error, f"twice its {pct}% rank error"
        notes.append(_rank_note(name, measure.q, error, pct, clamp, released, counts))
    notes.extend(_small_group_note(name, floor_, why, counts, plan))
    return notes


def _extreme_note(
    name: str,
    measure: Measure,
    grid: QuantileGrid,
    aims: Sequence[float],
    error: float,
    pct: str,
    clamp: str,
    released: list[float],
    counts: Counts | None,
) -> str:
    """MIN/MAX's value range: between the released value's grid cell (or run) and the declared bound, and
    how many values may lie beyond it (the aim of the released value's candidate plus the rank error)."""
    assert measure.lower is not None and measure.upper is not None
    top = measure.q == 1.0
    runs = grid.stride > 1
    candidates = grid.runs if runs else grid.cells
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
        where = f"the group's values lie {side} {number(released[0])}"
    else:
        bound = measure.upper if top else measure.lower
        between = f"between ~each row's value and {bound:g}" if top else f"between {bound:g} and ~each row's value"
        where = f"a group's values lie {side} its value"
    return (
        f"dpsql: {name}: {between} at {sure}% ({clamp}); no DP mechanism finds the exact {extreme}: "
        f"at {pct}% at most {depth} of {where}{_size_hint(aims[0] + error, counts)}"
    )


def _rank_note(
    name: str, q: float, error: float, pct: str, clamp: str, released: list[float], counts: Counts | None
) -> str:
    """A quantile without a value interval (a stored release without one): its rank error, as quantile
    levels when the group's noisy count is released."""
    levels = ""
    if counts is not None and len(counts) == 1 and len(released) == 1:
        _, noisy, width = counts[0]
        n = noisy - width
        if n > 2 * error:
            low_q, high_q = max(0.0, q - error / n), min(1.0, q + error / n)
            levels = (
                f", i.e. between the group's p{math.floor(low_q * 100):d} and p{math.ceil(high_q * 100):d} "
                f"(from its noisy count ~{number(noisy)})"
            )
    return (
        f"dpsql: {name} has no ± interval (exponential mechanism): at {pct}% its rank is within "
        f"{math.ceil(error)} of the exact {q:g}-quantile's{levels}; a value range would need "
        f"the data ({clamp}){_size_hint(2 * error, counts)}"
    )


def _interval_notes(
    name: str,
    grid: QuantileGrid,
    shares: list[float],
    level: float,
    clamp: str,
    values: list[Any],
    intervals: Sequence[tuple[str, Interval | None]],
) -> list[str]:
    """``p90: between 433.5 and 1558.6, at 95% (…)``, or per row: the released ends, rounded outwards to two
    significant digits of a run's width (never narrower than released)."""
    width = grid.width * grid.stride
    how = (
        f"the exponential mechanism chose the value at ε={shares[0]:.4g} and each end at ε={shares[1]:.4g} of "
        f"this query's ε; {clamp}"
    )
    shown = [
        (label, value, ends)
        for (label, ends), value in zip(intervals, values, strict=False)
        if ends is not None and isinstance(value, int | float)
    ]
    if not shown:
        return []
    pct = ci_label(level)

    def between(ends: Interval, joint: str) -> str:
        low, high = (_outward(x, grid, width, up) for x, up in ((ends[0], False), (ends[1], True)))
        whole = ", the whole range" if (ends[0], ends[1]) == (grid.lower, grid.upper) else ""
        return f"{low}{joint}{high}{whole}"

    if len(values) == 1:
        return [f"dpsql: {name}: between {between(shown[0][2], ' and ')}, at {pct}% ({how})"]
    rows = [f"{label}{number(value)} ({between(ends, ' to ')})" for label, value, ends in shown[:NOTE_ROWS]]
    more = "; …" if len(shown) > NOTE_ROWS else ""
    return [f"dpsql: {name}: {pct}% value intervals ({how}): " + "; ".join(rows) + more]


def _outward(x: float, grid: QuantileGrid, width: float, up: bool) -> str:
    """An interval end as shown: a bound or an integer as is, else rounded away from the value to two
    significant digits of ``width`` (the shown interval holds the released one)."""
    if grid.integer or x in (grid.lower, grid.upper) or not (width > 0 and math.isfinite(width)):
        return number(x)
    scale = 10.0 ** (1 - math.floor(math.log10(width)))
    shown = (math.ceil(x * scale) if up else math.floor(x * scale)) / scale
    return number(min(max(shown, grid.lower), grid.upper))


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
        return [f"{WARNING}{name} means little here: the noisy count ~{number(small[0][1])} is below {need} ({why})"]
    named = ", ".join(", ".join(str(k) for k in key) for key, _ in small[:NOTE_ROWS])
    sizes = ", ".join(f"~{number(noisy)}" for _, noisy in small[:NOTE_ROWS])
    more = ", …" if len(small) > NOTE_ROWS else ""
    return [
        f"{WARNING}{name} means little in {len(small)} of {len(counts)} groups ({named}{more}): their noisy "
        f"counts ({sizes}{more}) are below {need} ({why})"
    ]


def _size_hint(floor_: float, counts: Counts | None) -> str:
    """Without a released count: the group size a quantile needs to mean anything (ε and policy only)."""
    if counts is not None:
        return ""
    return f"; it means little unless the group holds well over {math.ceil(floor_)} values (add COUNT(*) to see)"


def _approx(x: float, grid: QuantileGrid, exact: bool, width: float) -> str:
    """A range end: a bound or an exact integer as is, the edge of a cell (or run) of ``width`` as ``~x``."""
    if exact or x in (grid.lower, grid.upper):
        return number(x)
    return "~" + number(x, width)


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
