"""COUNT(DISTINCT unit): one unit adds at most 1 to each of the ``max_groups`` groups it touches."""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.aggregates.base import Aggregate
from dpsql.plan import Measure, Plan


class CountUnits(Aggregate):
    kind = "count_units"
    once_per_unit = True

    def label(self, measure: Measure) -> str:
        return f"COUNT(DISTINCT {measure.column})"

    def sensitivities(self, measure: Measure, plan: Plan) -> tuple[float, float]:
        return float(plan.max_groups), float(plan.max_groups) ** 0.5

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Count(this=exp.Distinct(expressions=[value()]), big_int=True)
