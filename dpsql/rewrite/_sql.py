"""Small SQL builders the rewrite passes share: a measure's input, a key column, literals."""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Measure, Plan


def measure_input(measure: Measure) -> exp.Expression:
    """The value a measure aggregates: its column, or its bounded expression."""
    if measure.expr is not None:
        return measure.expr.copy()
    return exp.column(measure.column, table=measure.table, quoted=True)  # type: ignore[arg-type]


def key_column(plan: Plan, index: int) -> exp.Expression:
    """The SQL of group key ``index``: its column, or its expression over clamped columns."""
    key = plan.keys[index]
    if key.expr is not None:
        return key.expr.copy()
    return exp.column(key.column, table=key.table, quoted=True)


def sum_argument(select: exp.Select, index: int) -> exp.Expression:
    aggregate = select.expressions[index].this
    assert isinstance(aggregate, exp.Sum)
    argument: exp.Expression = aggregate.this
    return argument


def literal_number(value: float | None) -> exp.Expression:
    assert value is not None
    number = int(value) if float(value).is_integer() else value
    literal = exp.Literal.number(abs(number))
    return exp.Neg(this=literal) if number < 0 else literal
