"""The histogram query of a selection (quantile, mode) measure: its own first pass.

:func:`select_histogram` replaces the measure passes; the row passes (filter, group, bound) then
run in ``REWRITE_PASSES`` order (see :func:`dpsql.rewrite.histogram_query`).
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.expressions import clamp_sql
from dpsql.analyze.sources import from_node
from dpsql.plan import Measure, Plan
from dpsql.release.selection import QUANTILE_BINS
from dpsql.rewrite._sql import key_column, literal_number, measure_input


def _bin(column: exp.Expression, measure: Measure, bins: int) -> exp.Expression:
    """The bin (0..bins) of a value clamped to the measure's bounds, computed identically on every backend."""
    assert measure.lower is not None and measure.upper is not None
    value = clamp_sql(
        exp.cast(column, exp.DataType.Type.DOUBLE), literal_number(measure.lower), literal_number(measure.upper)
    )
    offset = exp.paren(exp.Sub(this=value, expression=literal_number(measure.lower)), copy=False)
    scaled = exp.Div(
        this=exp.paren(exp.Mul(this=offset, expression=exp.Literal.number(bins)), copy=False),
        expression=literal_number(measure.upper - measure.lower),
    )
    return exp.cast(exp.Floor(this=scaled), exp.DataType.Type.BIGINT)


def select_histogram(plan: Plan, index: int, bins: int = QUANTILE_BINS) -> exp.Select:
    """Counts per group key of a quantile measure's clamped values in ``bins`` equal bins, or of a
    mode measure's values: keys ``k<i>``, bin ``b`` and count ``n`` over the sources.

    The row passes then filter, group and bound it per unit like the main query; the exponential
    mechanism reads only these counts.
    """
    measure = plan.measures[index]
    column = measure_input(measure)
    bin_ = column if measure.kind == "mode" else _bin(column, measure, bins)
    keys = [key_column(plan, i) for i in range(len(plan.keys))]
    select = exp.select(
        *(exp.alias_(k, f"k{i}") for i, k in enumerate(keys)),
        exp.alias_(bin_, "b"),
        exp.alias_(exp.Count(this=exp.Star(), big_int=True), "n"),
    ).from_(from_node(plan.sources.sources[0]))
    for join in plan.sources.joins:
        select.append("joins", join.copy())
    return select
