"""VAR_POP/VAR_SAMP/STDDEV: from noisy Σ(x−c)², Σ(x−c) and N (three measures), post-processed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

from sqlglot import exp

from dpsql.aggregates.base import Aggregate, Recognised, Scope, measure_var
from dpsql.pgtypes import PgType
from dpsql.plan import OutputItem, Plan

#: Variance family → (PostgreSQL's output name, sample variance?, square root?)
_FAMILY: dict[type[exp.Expr], tuple[str, bool, bool]] = {
    exp.Variance: ("variance", True, False),
    exp.VariancePop: ("var_pop", False, False),
    exp.Stddev: ("stddev", True, True),
    exp.StddevSamp: ("stddev_samp", True, True),
    exp.StddevPop: ("stddev_pop", False, True),
}


def dp_variance(squares: Any, total: Any, count: Any, sample: bool, root: bool) -> float | None:
    """Variance from noisy centred Σ(x−c)², Σ(x−c) and count: E[(x−c)²] − E[x−c]², floored at 0."""
    if float(count) <= 0:
        return None  # an empty group, judged from the noisy count only (post-processing), like AVG
    n = max(float(count), 1.0)
    if sample and n < 2:
        return None  # PostgreSQL: var_samp of one value is NULL
    mean = float(total) / n
    variance = max(float(squares) / n - mean * mean, 0.0)
    if sample:
        variance *= n / (n - 1)
    return math.sqrt(variance) if root else variance


class Variance(Aggregate):
    kind = "variance"
    null_when_empty = True
    recognises = tuple(_FAMILY)
    functions: ClassVar[dict[str, Callable[..., Any]]] = {"dp_variance": dp_variance}

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:

        function, sample, root = _FAMILY[type(node)]
        operand = scope.operand(node.this)
        centred = scope.bounded_sum(operand, function, centred=True)
        square = dataclasses.replace(centred, square=True)
        if square.sensitivity >= 2.0**62:  # squares beyond BIGINT: sum them as doubles
            square = dataclasses.replace(square, integer=False)
        squares = scope.measure(square)
        total = scope.measure(centred)
        count = scope.measure(scope.count_of(operand))
        call = exp.Anonymous(
            this="dp_variance",
            expressions=[
                measure_var(squares),
                measure_var(total),
                measure_var(count),
                exp.Boolean(this=sample),
                exp.Boolean(this=root),
            ],
        )
        return Recognised(call, self.kind, (squares, total, count))

    def output_name(self, node: exp.Expr) -> str | None:
        return _FAMILY[type(node)][0]

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "double precision"

    def value_range(self, out: OutputItem, plan: Plan) -> tuple[float, float] | None:
        """A variance (or standard deviation) is never negative."""
        return (0.0, math.inf)

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        """Delta method for var = S2/N − (S1/N)² (and its square root), from the three noises' half-widths."""
        squares_i, total_i, count_i = out.measures
        w2, w1, wn = widths[squares_i], widths[total_i], widths[count_i]
        sample = bool(out.expr.expressions[3].this)
        if w2 is None or w1 is None or wn is None or (sample and float(env[f"m{count_i}"]) < 2):
            return None
        n = max(float(env[f"m{count_i}"]), 1.0)
        s2, s1 = float(env[f"m{squares_i}"]), float(env[f"m{total_i}"])
        width = math.sqrt((w2 / n) ** 2 + (2 * s1 * w1 / n**2) ** 2 + (wn * (s2 / n**2 - 2 * s1 * s1 / n**3)) ** 2)
        root = bool(out.expr.expressions[4].this)
        variance = max(s2 / n - (s1 / n) ** 2, 0.0)
        if sample:
            width *= n / (n - 1)
            variance *= n / (n - 1)
        if not root:
            return width
        return width / (2 * math.sqrt(variance)) if variance > 0 else math.sqrt(width)
