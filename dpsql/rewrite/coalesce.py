"""Pass 5, ``coalesce_sums``: SUM over no rows releases 0, not NULL."""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan


def coalesce_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """SUM over no rows is NULL; release 0 instead so emptiness is not revealed exactly."""
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.clamped_sum:
            projection = select.expressions[offset + i]
            projection.set("this", exp.Coalesce(this=projection.this, expressions=[exp.Literal.number(0)]))
    return select
