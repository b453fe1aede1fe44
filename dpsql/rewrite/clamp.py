"""Pass 2, ``clamp_inputs``: every summed value clamped to its declared bounds (what bounds sensitivity)."""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.expressions import clamp_sql
from dpsql.plan import Plan
from dpsql.rewrite._sql import literal_number, sum_argument


def clamp_inputs(select: exp.Select, plan: Plan) -> exp.Select:
    """Clamp every summed value to its declared bounds: this is what bounds sensitivity.

    Measures in ``plan.physical.proven`` are only cast: the database proved every value already inside.
    """
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if not measure.clamped_sum:
            continue
        aggregate = select.expressions[offset + i].this
        value = sum_argument(select, offset + i)
        typed = value if measure.integer else exp.cast(value, exp.DataType.Type.DOUBLE, copy=False)
        clamped = (
            typed
            if i in plan.physical.proven
            else clamp_sql(typed, literal_number(measure.lower), literal_number(measure.upper))
        )
        aggregate.set("this", clamped)
    return select
