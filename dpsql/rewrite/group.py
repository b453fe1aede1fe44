"""Pass 7, ``group_by_keys``: GROUP BY the keys (and a histogram query's bin)."""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite._sql import key_column


def group_by_keys(select: exp.Select, plan: Plan) -> exp.Select:
    """GROUP BY the keys ``k<i>``, then a histogram query's bin ``b`` (the measurement query has none)."""
    groups = [key_column(plan, i) for i in range(len(plan.keys))]
    groups += [projection.this.copy() for projection in select.expressions if projection.alias == "b"]
    if groups:
        select = select.group_by(*groups, copy=False)
    return select
