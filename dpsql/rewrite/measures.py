"""Pass 1, ``select_measures``: one SELECT over the sources with keys ``k<i>`` and raw aggregates ``m<i>``.

Quantile and mode measures read only ``COUNT(*)`` here; their values come from their histogram
query (:mod:`dpsql.rewrite.histogram`).
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Measure, Plan
from dpsql.plan.sources import from_node
from dpsql.rewrite._sql import key_column, measure_input


def _raw_measure(measure: Measure) -> exp.Expression:
    """The measure's own aggregate; selections count rows here (their values come from their histogram query)."""
    return measure.aggregate.raw_sql(measure, lambda: measure_input(measure))


def select_measures(select: exp.Select, plan: Plan) -> exp.Select:
    """One SELECT over the sources: group keys ``k<i>``, raw aggregates ``m<i>``."""
    projections = [exp.alias_(key_column(plan, i), f"k{i}", copy=False) for i in range(len(plan.keys))]
    projections += [exp.alias_(_raw_measure(m), f"m{i}", copy=False) for i, m in enumerate(plan.measures)]
    if not projections:
        projections = [exp.alias_(exp.Count(this=exp.Star(), big_int=True), "m_unused", copy=False)]
    select = select.select(*projections, append=False, copy=False)
    select = select.from_(from_node(plan.sources.sources[0], plan.sources.policy), copy=False)
    for join in plan.sources.joins:
        select.append("joins", join.copy())
    return select
