"""Aggregates as registered types: one module per aggregate, one table per stage's key.

Each module owns what differs between aggregates at every stage: its measures' label, sensitivity
and raw SQL, how released values become Python values, selection over a histogram (quantile,
mode), its output's coercion after noise, confidence interval and EXPLAIN line. Stages look an
aggregate up by the kind the analyzer gave its measure (:data:`MEASURES`) or output
(:data:`OUTPUTS`) instead of testing kind strings. Importing this package registers
:data:`MEASURES` with the plan (:data:`dpsql.plan.MEASURE_AGGREGATES`), below it: ``measure.aggregate``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.aggregates.avg import Avg
from dpsql.aggregates.base import Aggregate, Expression, Key, Operand, Scope, Selection, Spending
from dpsql.aggregates.bivariate import Bivariate
from dpsql.aggregates.count import Count, CountStar
from dpsql.aggregates.distinct import CountDistinct
from dpsql.aggregates.mode import Mode
from dpsql.aggregates.quantile import QUANTILE_HIGH, QUANTILE_LOW, Quantile, QuantileDisc
from dpsql.aggregates.sum import Sum
from dpsql.aggregates.units import CountUnits
from dpsql.aggregates.variance import Variance
from dpsql.plan import MEASURE_AGGREGATES

__all__ = [
    "AGGREGATE_NODES",
    "MEASURES",
    "OUTPUTS",
    "Aggregate",
    "Key",
    "Operand",
    "Scope",
    "Selection",
    "Spending",
    "recogniser",
    "supported_functions",
]

#: Measure kind → the aggregate that labels, bounds, computes and converts it.
MEASURES: dict[str, Aggregate] = {
    a.kind: a
    for a in (
        CountStar(),
        Count(),
        CountUnits(),
        CountDistinct(),
        Sum(),
        Quantile(),
        QUANTILE_LOW,
        QUANTILE_HIGH,
        Mode(),
    )
}
MEASURE_AGGREGATES.update(MEASURES)
#: Output kind → the aggregate that coerces, bounds the error of, and explains it.
OUTPUTS: dict[str, Aggregate] = {
    a.kind: a
    for a in (Key(), Count(), Sum(), Avg(), Variance(), Bivariate(), Quantile(), QuantileDisc(), Mode(), Expression())
}

#: sqlglot call type → the aggregate that recognises it (``f() WITHIN GROUP``: keyed by ``f``).
RECOGNISERS: dict[type[exp.Expr], Aggregate] = {
    node: aggregate for aggregate in OUTPUTS.values() for node in aggregate.recognises
}
#: Name → function combining noisy measures in an output expression (``dp_avg(m0, m1, c)``).
RELEASE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    name: fn for aggregate in OUTPUTS.values() for name, fn in aggregate.functions.items()
}
#: Every aggregate call type: refused where aggregates are not allowed (WHERE, GROUP BY, nesting).
AGGREGATE_NODES: tuple[type[exp.Expr], ...] = (*RECOGNISERS, exp.WithinGroup)


def recogniser(node: exp.Expr) -> Aggregate | None:
    """The registered aggregate for a call, or None when ``node`` is not an aggregate call."""
    if isinstance(node, exp.WithinGroup):
        return RECOGNISERS.get(type(node.this))
    return RECOGNISERS.get(type(node))


@functools.cache
def supported_functions() -> tuple[str, ...]:
    """The PostgreSQL names of the registered aggregate functions, in registry order: what hints and
    supported-lists name (generated here, so a new aggregate is listed by registering it)."""
    names: list[str] = []
    for aggregate in OUTPUTS.values():
        for node in aggregate.recognises:
            args = {"this": exp.column("x")} | (
                {"expression": exp.column("y")} if "expression" in node.arg_types else {}
            )
            name = node(**args).sql(dialect="postgres").split("(", 1)[0]
            if name not in names:
                names.append(name)
    return tuple(names)
