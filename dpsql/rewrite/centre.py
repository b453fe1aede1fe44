"""Pass 3, ``centre_sums``: AVG's and VARIANCE's sums centred on the bounds' midpoint (half the sensitivity).

Also :func:`centre_rows`, which folds the centring of plain sums in after the query, before noise.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite._sql import literal_number, measure_input, sum_argument


def centre_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """Centre AVG's and variance's sums so their sensitivity is half the range.

    Squared sums subtract the centre in SQL; plain ones read their exact count ``z<i>`` alongside,
    and :func:`centre_rows` subtracts ``centre·z<i>`` before noise (one less operation per row).
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


def centre_rows(plan: Plan, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows of the measurement query with each ``m<i> − centre·z<i>`` folded in and the ``z`` columns dropped."""
    centred = plan.post_centred()
    if not centred:
        return rows
    width = len(plan.keys) + len(plan.measures)
    columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width + len(centred))]
    for z, i in enumerate(centred, start=width):
        measure, c = plan.measures[i], plan.measures[i].centre
        centre = int(c) if measure.integer and float(c).is_integer() else c
        m = len(plan.keys) + i
        columns[m] = [(v or 0) - centre * n for v, n in zip(columns[m], columns[z], strict=True)]
    return list(zip(*columns[:width], strict=True))
