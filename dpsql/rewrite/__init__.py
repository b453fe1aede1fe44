"""Rewrite: a plan becomes the SQL the backend runs, built by passes in one order.

The generated query computes only the plan's measures (counts and clamped, possibly
centred, sums) per group key. Passes run in the order of ``REWRITE_PASSES``, each
``(select, plan) -> select`` (building on the select it is given), one module per pass, and the
result is transpiled to the backend's dialect. Keys are aliased ``k<i>`` and measures ``m<i>`` so
release code never parses names; a centred sum also reads ``z<i>`` (its exact count), folded
into ``m<i>`` by :func:`dpsql.release.apply.centre_rows` before noise. A selection measure's
histogram query replaces the measure passes with :func:`~dpsql.rewrite.histogram.select_histogram`
and runs the row passes.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite.bounding import bound_contributions
from dpsql.rewrite.centre import centre_sums
from dpsql.rewrite.clamp import clamp_inputs
from dpsql.rewrite.coalesce import coalesce_sums
from dpsql.rewrite.filter import filter_rows
from dpsql.rewrite.group import group_by_keys
from dpsql.rewrite.histogram import select_histogram
from dpsql.rewrite.measures import select_measures
from dpsql.rewrite.square import square_sums

__all__ = [
    "MEASURE_PASSES",
    "REWRITE_PASSES",
    "ROW_PASSES",
    "histogram_queries",
    "histogram_query",
    "rewrite",
    "to_sql",
]

RewritePass = Callable[[exp.Select, Plan], exp.Select]

#: Passes that build and shape the measures (a histogram query builds its own instead).
MEASURE_PASSES: tuple[RewritePass, ...] = (select_measures, clamp_inputs, centre_sums, square_sums, coalesce_sums)
#: Passes over rows and groups: every query runs them, histogram queries too.
ROW_PASSES: tuple[RewritePass, ...] = (filter_rows, group_by_keys, bound_contributions)
#: The rewrite, in order.
REWRITE_PASSES: tuple[RewritePass, ...] = MEASURE_PASSES + ROW_PASSES


def rewrite(plan: Plan) -> exp.Select:
    """The measurement query for ``plan`` as a sqlglot AST (PostgreSQL semantics)."""
    select = exp.Select()
    for rewrite_pass in REWRITE_PASSES:
        select = rewrite_pass(select, plan)
    return select


def histogram_query(plan: Plan, index: int, bins: int | None = None) -> exp.Select:
    """The histogram a selection measure is chosen from, filtered, grouped and bounded like the main query."""
    select = select_histogram(plan, index, bins)
    for rewrite_pass in ROW_PASSES:
        select = rewrite_pass(select, plan)
    return select


def histogram_queries(plan: Plan, render: Callable[[exp.Expression], str]) -> list[tuple[int, str]]:
    """(measure index, SQL) of the histogram each selection (quantile, mode) measure is chosen from,
    rendered by the backend (``Backend.render``)."""
    return [(i, render(histogram_query(plan, i))) for i, m in enumerate(plan.measures) if m.selected]


def to_sql(plan: Plan, dialect: str) -> str:
    """Transpile the measurement query to the backend's dialect."""
    return rewrite(plan).sql(dialect=dialect)
