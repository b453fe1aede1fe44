"""Pass 3, ``centre_sums``: AVG's and VARIANCE's sums centred on the bounds' midpoint (half the sensitivity).

The centring of plain sums is folded in after the query, before noise, by
:func:`dpsql.release.apply.centre_rows`.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite._sql import literal_number, measure_input, sum_argument


def centre_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """Centre AVG's and variance's sums so their sensitivity is half the range.

    Squared sums subtract the centre in SQL; plain ones read their exact count ``z<i>`` alongside,
    and :func:`dpsql.release.apply.centre_rows` subtracts ``centre·z<i>`` before noise (one less operation per row).
    """
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.clamped_sum and measure.centre and measure.square:
            value = sum_argument(select, offset + i)
            value.replace(exp.Sub(this=value.copy(), expression=literal_number(measure.centre)))
    for i in plan.post_centred():
        m = plan.measures[i]
        nullable = m.expr is not None or plan.sources.column_policy(m.table, m.column).nullable
        counted = exp.Count(this=measure_input(m) if nullable else exp.Star(), big_int=True)
        select = select.select(exp.alias_(counted, f"z{i}", copy=False), copy=False)
    return select
