"""Quantiles (MIN, MAX, median, percentile_cont/disc): the exponential mechanism over binned counts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpsql.aggregates.base import Rows, Selection
from dpsql.release.selection import QUANTILE_BINS, bin_midpoint, rank_error_bound, select_quantile_bin

if TYPE_CHECKING:
    from dpsql.plan import Measure, OutputItem, Plan
    from dpsql.release.calibrate import Budgeting
    from dpsql.session import PgType


class Quantile(Selection):
    kind = "quantile"

    def label(self, measure: Measure) -> str:
        return f"QUANTILE({measure.q:g}) OF clamp({measure.column}, {measure.lower:g}, {measure.upper:g})"

    def converter(self, measure: Measure) -> Callable[[Any], Any]:
        return float

    def select(self, plan: Plan, index: int, rows: Rows, histogram: Rows, epsilon: float) -> list[Any]:
        """The exponential mechanism, once per released group, over that group's bin counts."""
        nkeys = len(plan.keys)
        measure = plan.measures[index]
        assert measure.lower is not None and measure.upper is not None and measure.q is not None
        counts: dict[tuple[Any, ...], dict[int, int]] = {}
        for row in histogram:
            bin_ = row[nkeys]
            if bin_ is not None:
                group = counts.setdefault(tuple(row[:nkeys]), {})
                clamped = min(max(int(bin_), 0), QUANTILE_BINS - 1)  # the upper bound itself falls in bin B
                group[clamped] = group.get(clamped, 0) + int(row[nkeys + 1])
        sensitivity = plan.sensitivities(measure)[0]
        values = []
        for row in rows:
            chosen = select_quantile_bin(counts.get(tuple(row[:nkeys]), {}), measure.q, epsilon, sensitivity)
            values.append(bin_midpoint(chosen, measure.lower, measure.upper))
        return values

    def output_type(self, scope: Any, measures: tuple[int, ...]) -> PgType | None:
        return "double precision"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        if out.column.type == "bigint" and value is not None:
            return math.floor(value)  # MIN/MAX/percentile_disc of an int column: a value of the column's type
        return value

    def explain(self, out: OutputItem, plan: Plan, budgeting: Budgeting, confidence: float) -> dict[str, Any]:
        i = out.measures[0]
        sensitivity = plan.sensitivities(plan.measures[i])[0]
        return {
            "measure": f"{plan.measures[i].label}: exponential mechanism over {QUANTILE_BINS} bins",
            "sensitivity": sensitivity,
            "scale": 2 * sensitivity / budgeting.shares[i],
            "epsilon": budgeting.shares[i],
            "ci": float("nan"),
            "rank_error95": rank_error_bound(budgeting.shares[i], sensitivity, confidence),
        }


class QuantileDisc(Quantile):
    """percentile_disc, MIN and MAX: a quantile released in the column's own type."""

    kind = "quantile_disc"

    def output_type(self, scope: Any, measures: tuple[int, ...]) -> PgType | None:
        return "bigint" if scope.measures[measures[0]].integer else "double precision"
