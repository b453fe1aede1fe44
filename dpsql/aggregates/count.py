"""COUNT(*) and COUNT(column): sensitivity 1 per row, released as non-negative integers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.aggregates.base import Aggregate, BiasRates, Operand, Recognised, Scope, measure_var
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType
from dpsql.plan import Measure, OutputItem, Plan
from dpsql.plan.sources import resolve_ref


class CountStar(Aggregate):
    kind = "count_star"
    counts_rows = True
    counts_values = True

    def label(self, measure: Measure) -> str:
        return "COUNT(*)"


class Count(Aggregate):
    """COUNT(column) measures, and every count output (COUNT(*) included)."""

    kind = "count"
    counts_values = True
    direct = True
    explain_ci = True
    recognises = (exp.Count,)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        """COUNT(*), COUNT(col) (COUNT(*) when col is never NULL) and COUNT(DISTINCT unit)."""

        if isinstance(node.this, exp.Distinct):
            measure = _distinct_units(node, scope)
        elif isinstance(node.this, exp.Star) or node.this is None:
            measure = Measure(kind="count_star")
        else:
            measure = scope.count_of(_counted(node.this, scope))
        index = scope.measure(measure)
        return Recognised(measure_var(index), self.kind, (index,))

    def label(self, measure: Measure) -> str:
        return f"COUNT({measure.column})"

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Count(this=value(), big_int=True)

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "bigint"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        return value if value is None else max(round(value), 0)

    def direct_values(self, values: list[Any], convert: Callable[[Any], Any]) -> list[Any]:
        return [max(round(v), 0) for v in values]

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return widths[out.measures[0]]

    def bias(self, out: OutputItem, plan: Plan, value: float, rates: BiasRates) -> tuple[float, float]:
        """Rows cut lower a count by its share of them (a count of distinct units loses none)."""
        if not isinstance(out.expr, exp.Var) or plan.measures[out.measures[0]].aggregate.once_per_unit:
            return 0.0, 0.0
        return abs(value) * rates.cut[0], abs(value) * rates.cut[1]

    def value_range(self, out: OutputItem, plan: Plan) -> tuple[float, float] | None:
        """A count is never negative."""
        return (0.0, math.inf)


def _counted(argument: exp.Expression, scope: Scope) -> Operand:
    """COUNT(x)'s operand. An identifier may be counted (TPC-H Q13's ``count(o_orderkey)``): how many of
    a group's rows hold one is what ``COUNT(*) … WHERE id IS NOT NULL`` says; its values never leave."""
    column = argument.unnest() if isinstance(argument, exp.Paren) else argument
    if isinstance(column, exp.Column):
        source, name, policy = resolve_ref(column, scope.sources, identifiers=True)
        if policy.identifier:
            return Operand(source.alias, name, policy)
    return scope.operand(argument)


def _distinct_units(node: exp.Expression, scope: Scope) -> Measure:
    """COUNT(DISTINCT <privacy unit>): each unit adds at most 1 per group; COUNT(DISTINCT col) of
    another column: at most ``max_rows`` values in all (see :mod:`dpsql.aggregates.distinct`)."""
    argument = node.this.expressions[0] if len(node.this.expressions) == 1 else None
    while isinstance(argument, exp.Paren):
        argument = argument.this
    if not isinstance(argument, exp.Column):
        raise FeatureNotSupported(
            "COUNT(DISTINCT ...) is supported on one column only",
            hint="Count distinct values of a declared column, e.g. COUNT(DISTINCT department).",
        )
    source, name, _ = resolve_ref(argument, scope.sources, identifiers=True)
    if scope.sources.unit is not None and name == source.unit_column:
        return Measure(kind="count_units", column=name, table=source.alias)
    source, name, _ = resolve_ref(argument, scope.sources)  # identifiers other than the unit: 42501
    return Measure(kind="count_distinct", column=name, table=source.alias)
