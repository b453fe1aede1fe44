"""Reads of randomized-response columns: a count over one such column is answered locally.

A column collected with randomized response holds answers already perturbed at write time
(ε-local DP, :mod:`dpsql.localdp`). Counting it is post-processing of stored values, so it is
answered from them, debiased, at no central cost; any other read of such a column is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.errors import FeatureNotSupported, InvalidParameterValue
from dpsql.localdp import RandomizedResponse
from dpsql.plan import Plan


@dataclass(frozen=True, slots=True)
class LocalQuery:
    """A count over a randomized-response column: which column, mechanism, and value filter."""

    mechanism: RandomizedResponse
    sql: str
    value: Any = None
    filtered: bool = False


def local_query(plan: Plan, render: Callable[[exp.Expression], str]) -> LocalQuery | None:
    """A count over one randomized-response column, answered from its perturbed values; None otherwise.

    Queries that read such a column in any other way are refused: central noise on perturbed
    data would spend budget to estimate nothing useful, and mixing in other columns would
    release central data without noise.
    """
    local_columns = [
        (source, name, column.local_mechanism())
        for source in plan.sources.sources
        for name, column in source.table.columns.items()
        if column.randomized_response is not None
    ]
    if not local_columns:
        return None
    used = _columns_used(plan)
    touched = [(s, n, m) for s, n, m in local_columns if (s.alias, n) in used]
    if not touched:
        return None
    source, name, mechanism = touched[0]
    key_ok = all((k.table, k.column) == (source.alias, name) for k in plan.keys) and len(plan.keys) <= 1
    value = _equality_value(plan.where, source.alias, name)
    where_ok = plan.where is None or value is not None
    only_counts = all(m.star for m in plan.measures)
    shape_ok = key_ok and where_ok and only_counts
    if len(touched) > 1 or plan.sources.joins or used - {(source.alias, name)} or not shape_ok:
        raise FeatureNotSupported(
            f'"{name}" is collected with randomized response: it can only be counted on its own',
            hint=f"Ask SELECT {name}, COUNT(*) FROM {source.name} GROUP BY {name}, "
            f"or SELECT COUNT(*) FROM {source.name} WHERE {name} = <value>.",
        )
    assert mechanism is not None
    if value is not None and value not in mechanism.domain:
        raise InvalidParameterValue(f'"{value}" is not a possible answer for "{name}"')
    column = exp.column(name, quoted=True)
    sql = render(
        exp.select(column, exp.Count(this=exp.Star(), big_int=True))
        .from_(exp.table_(source.table.source or source.name, quoted=True))
        .group_by(column.copy())
    )
    return LocalQuery(mechanism, sql, value, value is not None)


def _columns_used(plan: Plan) -> set[tuple[str | None, str | None]]:
    used: set[tuple[str | None, str | None]] = {(k.table, k.column) for k in plan.keys}
    used |= {(m.table, m.column) for m in plan.measures if not m.star}
    if plan.where is not None:
        used |= {(c.table, c.name) for c in plan.where.find_all(exp.Column)}
    return used


def _equality_value(where: exp.Expression | None, alias: str, name: str) -> Any:
    if not isinstance(where, exp.EQ):
        return None
    column, literal = (where.this, where.expression)
    if not isinstance(column, exp.Column) or (column.table, column.name) != (alias, name):
        return None
    if isinstance(literal, exp.Boolean):
        return bool(literal.this)
    if isinstance(literal, exp.Literal):
        return literal.name if literal.is_string else float(literal.name)
    return None
