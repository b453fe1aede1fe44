"""AVG = centre + noisy centred SUM / noisy COUNT: the centred sum halves the sensitivity."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from sqlglot import exp

from dpsql.aggregates.base import Aggregate, BiasRates, Recognised, Scope, Spending, measure_var
from dpsql.pgtypes import PgType
from dpsql.plan import OutputItem, Plan


def dp_avg(total: Any, count: Any, centre: Any) -> float | None:
    """AVG from a noisy centred sum and a noisy count; NULL when the *noisy* count is ≤ 0.

    An empty group's AVG is NULL in PostgreSQL. Deciding emptiness from the noisy count (never the
    true one) is post-processing of a released value, so the NULL costs no privacy.
    """
    if float(count) <= 0:
        return None
    return float(centre) + float(total) / max(float(count), 1.0)


class Avg(Aggregate):
    kind = "avg"
    null_when_empty = True
    recognises = (exp.Avg,)
    functions: ClassVar[dict[str, Callable[..., Any]]] = {"dp_avg": dp_avg}

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        """``dp_avg(Σ(x − c), N, c)``: centring on the bounds' midpoint halves the sum's sensitivity."""
        operand = scope.operand(node.this)
        total = scope.measure(scope.bounded_sum(operand, "avg", centred=True))
        count = scope.measure(scope.count_of(operand))
        centre = exp.Literal.number(scope.measures[total].centre)
        call = exp.Anonymous(this="dp_avg", expressions=[measure_var(total), measure_var(count), centre])
        return Recognised(call, self.kind, (total, count))

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "double precision"

    def output_clamp(self, scope: Any, measures: tuple[int, ...]) -> tuple[float, float] | None:
        """AVG stays inside the column's bounds."""
        m = scope.measures[measures[0]]
        return (m.lower, m.upper)

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        total_i, count_i = out.measures
        count = max(float(env[f"m{count_i}"]), 1.0)
        total = float(env[f"m{total_i}"])
        # delta method for (centre + S/N): independent noises on S and N
        total_w, count_w = widths[total_i], widths[count_i]
        assert total_w is not None and count_w is not None
        return math.hypot(total_w / count, count_w * abs(total) / count**2)

    def bias(self, out: OutputItem, plan: Plan, value: float, rates: BiasRates) -> tuple[float, float]:
        """Values beyond the bounds move an average by their excess per row (rows cut: none, spread alike)."""
        return rates.per_row.get(out.measures[0], (0.0, 0.0))

    def explain(self, out: OutputItem, plan: Plan, budgeting: Spending, confidence: float) -> dict[str, Any]:
        entry = super().explain(out, plan, budgeting, confidence)
        if out.noisy:
            entry["measure"] = "AVG = centre + noisy centred SUM / noisy COUNT"
        return entry
