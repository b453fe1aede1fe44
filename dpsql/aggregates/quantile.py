"""Quantiles (MIN, MAX, median, percentile_cont/disc): the exponential mechanism over binned counts.

The histogram's cells are those of :func:`~dpsql.release.selection.quantile_grid` (exact integers
for an int column of at most 65,536 values, else 65,536 equal cells); the value is chosen by one
exponential mechanism, or two (run, then cell) over a larger grid — privacy argument in
:mod:`dpsql.release.selection`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from sqlglot import exp

from dpsql.aggregates.base import Recognised, Rows, Selection, measure_var
from dpsql.errors import FeatureNotSupported, InvalidParameterValue
from dpsql.release.selection import STAGE2_REACH, quantile_grid, quantile_rank_error, select_quantile

if TYPE_CHECKING:
    from dpsql.analyze.scope import Scope
    from dpsql.plan import Measure, OutputItem, Plan
    from dpsql.release.calibrate import Budgeting
    from dpsql.session import PgType


class Quantile(Selection):
    """median and percentile_cont: a continuous quantile."""

    kind = "quantile"
    recognises: ClassVar[tuple[type[exp.Expr], ...]] = (exp.Median, exp.PercentileCont)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        index = scope.measure(_quantile_measure(node, scope))
        return Recognised(measure_var(index), self.kind, (index,))

    def label(self, measure: Measure) -> str:
        return f"QUANTILE({measure.q:g}) OF clamp({measure.column}, {measure.lower:g}, {measure.upper:g})"

    def converter(self, measure: Measure) -> Callable[[Any], Any]:
        return float

    def select(self, plan: Plan, index: int, rows: Rows, histogram: Rows, epsilon: float) -> list[Any]:
        """The exponential mechanism(s), once per released group, over that group's cell counts.

        Groups without any value (and keys released without a histogram row) are chosen from an
        empty histogram like the others: whether a group has data changes nothing but utilities.
        """
        nkeys = len(plan.keys)
        measure = plan.measures[index]
        assert measure.lower is not None and measure.upper is not None and measure.q is not None
        grid = quantile_grid(measure.lower, measure.upper, measure.integer)
        counts: dict[tuple[Any, ...], dict[int, int]] = {}
        for row in histogram:
            cell = row[nkeys]
            if cell is not None:
                group = counts.setdefault(tuple(row[:nkeys]), {})
                clamped = min(max(int(cell), 0), grid.cells - 1)  # the upper bound itself falls in cell `cells`
                group[clamped] = group.get(clamped, 0) + int(row[nkeys + 1])
        sensitivity = plan.sensitivities(measure)[0]
        return [
            select_quantile(counts.get(tuple(row[:nkeys]), {}), measure.q, epsilon, sensitivity, grid) for row in rows
        ]

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "double precision"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        if out.column.type == "bigint" and value is not None:
            return math.floor(value)  # MIN/MAX/percentile_disc of an int column: a value of the column's type
        return value

    def explain(self, out: OutputItem, plan: Plan, budgeting: Budgeting, confidence: float) -> dict[str, Any]:
        i = out.measures[0]
        measure = plan.measures[i]
        assert measure.lower is not None and measure.upper is not None
        sensitivity = plan.sensitivities(measure)[0]
        grid = quantile_grid(measure.lower, measure.upper, measure.integer)
        cells = f"{grid.cells} integers" if grid.integer else f"{grid.cells} cells"
        extreme = measure.q in (0.0, 1.0)
        if grid.stride == 1:
            stages = ""
        elif extreme:
            stages = f" grouped in {grid.runs} runs"
        else:
            stages = f" in two stages ({grid.runs} runs, then a cell of the chosen run ±{STAGE2_REACH})"
        return {
            "measure": f"{measure.label}: exponential mechanism over {cells}{stages}",
            "sensitivity": sensitivity,
            "scale": 2 * sensitivity / budgeting.shares[i],
            "epsilon": budgeting.shares[i],
            "ci": float("nan"),
            "rank_error95": quantile_rank_error(budgeting.shares[i], sensitivity, grid, confidence, extreme=extreme),
        }


class QuantileDisc(Quantile):
    """percentile_disc, MIN and MAX: a quantile released in the column's own type."""

    kind = "quantile_disc"
    recognises = (exp.Min, exp.Max, exp.PercentileDisc)

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "bigint" if scope.measures[measures[0]].integer else "double precision"


def _quantile_measure(node: exp.Expression, scope: Scope) -> Measure:
    """MIN/MAX/median/percentile_cont/percentile_disc → a quantile measure over the clamped column."""
    from dpsql.analyze.scope import Operand
    from dpsql.analyze.sources import resolve_ref
    from dpsql.plan import Measure

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
