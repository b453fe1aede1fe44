"""Rewrite: a plan becomes the SQL the backend runs, built by small pure passes.

The generated query computes only the plan's measures (counts and clamped, possibly
centred, sums) per group key. Passes run in the order of ``REWRITE_PASSES``, each
``(select, plan) -> select``, and the result is transpiled to the backend's dialect.
Keys are aliased ``k<i>`` and measures ``m<i>`` so release code never parses names.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.plan import Measure, Plan

RewritePass = Callable[[exp.Select, Plan], exp.Select]


def _source(plan: Plan) -> exp.Table:
    return exp.table_(plan.table.source or plan.table_name, quoted=True)


def _raw_measure(measure: Measure) -> exp.Expression:
    if measure.kind == "count_star":
        return exp.Count(this=exp.Star(), big_int=True)
    column = exp.column(measure.column, quoted=True)  # type: ignore[arg-type]
    if measure.kind == "count":
        return exp.Count(this=column, big_int=True)
    return exp.Sum(this=column)


def select_measures(select: exp.Select, plan: Plan) -> exp.Select:
    """One SELECT over the source table: group keys ``k<i>``, raw aggregates ``m<i>``."""
    projections = [exp.alias_(exp.column(k.column, quoted=True), f"k{i}") for i, k in enumerate(plan.keys)]
    projections += [exp.alias_(_raw_measure(m), f"m{i}") for i, m in enumerate(plan.measures)]
    if not projections:
        projections = [exp.alias_(exp.Count(this=exp.Star(), big_int=True), "m_unused")]
    return select.select(*projections, append=False).from_(_source(plan), copy=False)


def _sum_argument(select: exp.Select, index: int) -> exp.Expression:
    aggregate = select.expressions[index].this
    assert isinstance(aggregate, exp.Sum)
    return aggregate.this


def clamp_inputs(select: exp.Select, plan: Plan) -> exp.Select:
    """Clamp every summed value to its declared bounds: this is what bounds sensitivity."""
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.kind != "sum":
            continue
        value = _sum_argument(select, offset + i)
        typed = value.copy() if measure.integer else exp.cast(value.copy(), "double precision")
        value.replace(_clamp(typed, _number(measure.lower), _number(measure.upper)))
    return select


def _clamp(value: exp.Expression, lower: exp.Expression, upper: exp.Expression) -> exp.Expression:
    """CASE rather than GREATEST/LEAST: NULL must stay NULL, and those two treat NULL differently
    across engines (PostgreSQL ignores NULL arguments)."""
    return (
        exp.Case()
        .when(exp.LT(this=value, expression=lower), lower)
        .when(exp.GT(this=value.copy(), expression=upper), upper)
        .else_(value.copy())
    )


def centre_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """Subtract the centre from AVG's sums so their sensitivity is half the range."""
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.kind == "sum" and measure.centre:
            value = _sum_argument(select, offset + i)
            value.replace(exp.Sub(this=value.copy(), expression=_number(measure.centre)))
    return select


def coalesce_sums(select: exp.Select, plan: Plan) -> exp.Select:
    """SUM over no rows is NULL; release 0 instead so emptiness is not revealed exactly."""
    offset = len(plan.keys)
    for i, measure in enumerate(plan.measures):
        if measure.kind == "sum":
            projection = select.expressions[offset + i]
            projection.set("this", exp.Coalesce(this=projection.this, expressions=[exp.Literal.number(0)]))
    return select


def filter_rows(select: exp.Select, plan: Plan) -> exp.Select:
    return select.where(plan.where.copy(), copy=False) if plan.where is not None else select


def group_by_keys(select: exp.Select, plan: Plan) -> exp.Select:
    if plan.keys:
        select = select.group_by(*(exp.column(k.column, quoted=True) for k in plan.keys), copy=False)
    return select


def _number(value: float | None) -> exp.Expression:
    assert value is not None
    number = int(value) if float(value).is_integer() else value
    literal = exp.Literal.number(abs(number))
    return exp.Neg(this=literal) if number < 0 else literal


#: The rewrite, in order.
REWRITE_PASSES: tuple[RewritePass, ...] = (
    select_measures,
    clamp_inputs,
    centre_sums,
    coalesce_sums,
    filter_rows,
    group_by_keys,
)


def rewrite(plan: Plan) -> exp.Select:
    """The measurement query for ``plan`` as a sqlglot AST (PostgreSQL semantics)."""
    select = exp.Select()
    for rewrite_pass in REWRITE_PASSES:
        select = rewrite_pass(select, plan)
    return select


def to_sql(plan: Plan, dialect: str) -> str:
    """Transpile the measurement query to the backend's dialect."""
    return rewrite(plan).sql(dialect=dialect)
