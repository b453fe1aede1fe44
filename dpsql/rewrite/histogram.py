"""The histogram query of a selection (quantile, mode) measure: its own first pass.

:func:`select_histogram` replaces the measure passes; the row passes (filter, group, bound) then
run in ``REWRITE_PASSES`` order (see :func:`dpsql.rewrite.histogram_query`).
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.aggregates import Selection
from dpsql.analyze.expressions import clamp_sql
from dpsql.noise.exponential import QuantileGrid
from dpsql.plan import Plan
from dpsql.plan.sources import from_node
from dpsql.rewrite._sql import key_column, literal_number, measure_input


def _cell(column: exp.Expression, grid: QuantileGrid) -> exp.Expression:
    """The cell (0..cells) of a value clamped to the grid's bounds, computed identically on every backend.

    Integer cells are ``value − lower`` (exact in double precision for the int columns the grid
    admits); equal cells ``floor((value − lower)·cells / (upper − lower))``.
    """
    lower = literal_number(grid.lower)
    value = clamp_sql(exp.cast(column, exp.DataType.Type.DOUBLE), lower, literal_number(grid.upper))
    offset: exp.Expression = exp.paren(exp.Sub(this=value, expression=lower), copy=False)
    if not grid.integer:
        offset = exp.Div(
            this=exp.paren(exp.Mul(this=offset, expression=exp.Literal.number(grid.cells)), copy=False),
            expression=literal_number(grid.upper - grid.lower),
        )
    return exp.cast(exp.Floor(this=offset), exp.DataType.Type.BIGINT)


def select_histogram(plan: Plan, index: int, bins: int | None = None) -> exp.Select:
    """Counts per group key of a quantile measure's clamped values in the cells of its grid
    (:meth:`dpsql.aggregates.Selection.grid`; or ``bins`` equal cells when given), or of a
    mode measure's values: keys ``k<i>``, cell ``b`` and count ``n`` over the sources.

    The row passes then filter, group and bound it per unit like the main query; the exponential
    mechanism reads only these counts.
    """
    measure = plan.measures[index]
    column = measure_input(measure)
    selection = measure.aggregate
    assert isinstance(selection, Selection)
    grid = selection.grid(measure)
    if grid is None:  # chosen among public candidates (mode): the values are the bins
        bin_ = column
    else:
        if bins is not None:
            grid = QuantileGrid(grid.lower, grid.upper, bins, False)
        bin_ = _cell(column, grid)
    keys = [key_column(plan, i) for i in range(len(plan.keys))]
    select = exp.select(
        *(exp.alias_(k, f"k{i}") for i, k in enumerate(keys)),
        exp.alias_(bin_, "b"),
        exp.alias_(exp.Count(this=exp.Star(), big_int=True), "n"),
    ).from_(from_node(plan.sources.sources[0], plan.sources.policy))
    for join in plan.sources.joins:
        select.append("joins", join.copy())
    return select
