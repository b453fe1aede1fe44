"""SUM of a clamped (possibly centred, possibly squared) value: sensitivity is the bounds' reach."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.aggregates.base import Aggregate, BiasRates, Recognised, Scope, measure_var
from dpsql.pgtypes import PgType
from dpsql.plan import Measure, OutputItem, Plan


class Sum(Aggregate):
    kind = "sum"
    direct = True
    explain_ci = True
    clamped_sum = True
    recognises = (exp.Sum,)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:

        index = scope.measure(scope.bounded_sum(scope.operand(node.this), "sum", centred=False))
        return Recognised(measure_var(index), self.kind, (index,))

    def label(self, measure: Measure) -> str:
        centre = f" - {measure.centre:g}" if measure.centre else ""
        term = f"clamp({measure.column}, {measure.lower:g}, {measure.upper:g}){centre}"
        return f"SUM(({term})^2)" if measure.square else f"SUM({term})"

    def row_sensitivity(self, measure: Measure) -> float:
        """``clamp(x) − centre`` moves by at most the bounds' reach from the centre (squared for variance)."""
        assert measure.lower is not None and measure.upper is not None
        reach = float(max(abs(measure.upper - measure.centre), abs(measure.lower - measure.centre)))
        return reach * reach if measure.square else reach

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Sum(this=value())

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "bigint" if scope.measures[measures[0]].integer else "double precision"

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return widths[out.measures[0]]

    def bias(self, out: OutputItem, plan: Plan, value: float, rates: BiasRates) -> tuple[float, float]:
        """Rows cut take their share of the total; values beyond the bounds add their excess (per unit of the
        clamped total)."""
        if not isinstance(out.expr, exp.Var):
            return 0.0, 0.0
        clamp = rates.per_total.get(out.measures[0], (0.0, 0.0))
        return abs(value) * (rates.cut[0] + clamp[0]), abs(value) * math.hypot(rates.cut[1], clamp[1])

    def value_range(self, out: OutputItem, plan: Plan) -> tuple[float, float] | None:
        """A sum of values clamped to non-negative (non-positive) bounds is non-negative (non-positive)."""
        m = plan.measures[out.measures[0]]
        if m.lower is not None and m.lower >= 0:
            return (0.0, math.inf)
        if m.upper is not None and m.upper <= 0:
            return (-math.inf, 0.0)
        return None
