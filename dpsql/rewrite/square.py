"""Pass 4, ``square_sums``: VARIANCE's sums of squared centred values, computed without error oracles."""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite._sql import sum_argument

#: A centred float value closer than 2^-500 to 0 is squared as 0: PostgreSQL raises "underflow" when
#: a product of non-zero doubles rounds to 0 (DuckDB returns 0), so that error would depend on data.
_SQUARE_SNAP = 2.0**-500


def square_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """Variance reads the sum of squared centred values: its sensitivity is the squared half-range."""
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.clamped_sum and measure.square:
            value = sum_argument(select, offset + i)
            # BIGINT before multiplying: an int4 product could overflow only on some rows (an error oracle)
            copied = value.copy()
            if measure.integer:
                term: exp.Expression = exp.cast(copied, exp.DataType.Type.BIGINT, copy=False)
            else:
                near_zero = exp.and_(
                    exp.GT(this=copied.copy(), expression=exp.Neg(this=exp.Literal.number(_SQUARE_SNAP))),
                    exp.LT(this=copied.copy(), expression=exp.Literal.number(_SQUARE_SNAP)),
                )
                term = exp.Case().when(near_zero, exp.Literal.number(0)).else_(copied)
            value.replace(exp.Mul(this=term, expression=term.copy()))
    return select
