"""WHERE constants narrow the domains of GROUP BY keys.

``WHERE problem = 'Asthma' GROUP BY problem`` releases one row, ``IS NOT NULL`` drops the NULL
group, a date range keeps only the months inside it. Only rows satisfying every top-level conjunct
are grouped, so a narrowed domain still contains every key such a row can have. Narrowing reads
only the query's constants and the policy: still no data.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.analyze.keys.base import as_datetime, literal_value
from dpsql.policy import ColumnPolicy


def _conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if node is None:
        return []
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    return [node]


def _constant(node: exp.Expression, policy: ColumnPolicy) -> object:
    """A checked WHERE constant (``check_where`` output) as a Python value of the column's type."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        text = node.this.name
        try:
            if node.to.this == exp.DataType.Type.DATE:
                value: object = dt.date.fromisoformat(text)
            else:
                value = dt.datetime.fromisoformat(text)
        except ValueError:
            return exp.Expression
        if policy.type == "date" and isinstance(value, dt.datetime):
            return _Stamp(value)  # a date compared with a timestamp: narrowed to whole days (a superset)
        if policy.type == "timestamp" and not isinstance(value, dt.datetime):
            return as_datetime(value)
        return value
    value = literal_value(node)
    if policy.type == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True)
class _Stamp:
    """A timestamp compared with a date column (``visit_date >= NOW() - INTERVAL '30 days'``)."""

    value: dt.datetime


@dataclass
class _Narrow:
    values: set[object] | None = None
    excluded: set[object] | None = None
    lower: Any = None
    upper: Any = None
    not_null: bool = False
    only_null: bool = False


def _key(column: exp.Expression) -> tuple[str, str] | None:
    while isinstance(column, exp.Paren):
        column = column.this
    if isinstance(column, exp.Column):
        return column.table, column.name
    return None


_FLIP: dict[type[exp.Expression], type[exp.Expression]] = {
    exp.GT: exp.LT,
    exp.GTE: exp.LTE,
    exp.LT: exp.GT,
    exp.LTE: exp.GTE,
    exp.EQ: exp.EQ,
    exp.NEQ: exp.NEQ,
}


def narrow_policies(
    where: exp.Expression | None, policies: Callable[[str, str], ColumnPolicy | None]
) -> dict[tuple[str, str], ColumnPolicy]:
    """Column policies narrowed by the constant constraints among WHERE's top-level conjuncts.

    ``where`` is the checked predicate (columns qualified, constants typed). Only rows satisfying
    every conjunct are grouped, so a narrowed domain still contains every key such a row can have;
    anything not understood (OR, NOT, LIKE…) only narrows nullability or nothing. The result
    depends on the query's constants and the policy, never on data.
    """
    found: dict[tuple[str, str], _Narrow] = {}

    def note(column: exp.Expression) -> tuple[_Narrow, ColumnPolicy] | None:
        key = _key(column)
        policy = policies(*key) if key is not None else None
        if key is None or policy is None:
            return None
        return found.setdefault(key, _Narrow()), policy

    for conjunct in _conjuncts(where):
        negated = False
        if isinstance(conjunct, exp.Not):
            negated, conjunct = True, conjunct.this
            while isinstance(conjunct, exp.Paren):
                conjunct = conjunct.this
        if isinstance(conjunct, exp.Escape):
            conjunct = conjunct.this
        if conjunct.args.get("negate"):  # sqlglot's IS NOT / NOT IN / NOT LIKE
            negated = not negated
        if isinstance(conjunct, exp.Column):
            got = note(conjunct)
            if got and got[1].type == "boolean":
                got[0].values = (got[0].values or {True, False}) & {not negated}
            continue
        if isinstance(conjunct, exp.Is):
            got = note(conjunct.this)
            if got is None:
                continue
            narrow, policy = got
            if isinstance(conjunct.expression, exp.Null):
                if negated:
                    narrow.not_null = True
                else:
                    narrow.only_null = True
            elif isinstance(conjunct.expression, exp.Boolean) and not negated:
                narrow.values = (narrow.values or {True, False}) & {bool(conjunct.expression.this)}
            continue
        if negated:
            if isinstance(conjunct, (exp.In, exp.Like, exp.ILike, *_FLIP)):  # NOT (x op c): x is not NULL
                got = note(conjunct.this)
                if got:
                    got[0].not_null = True
            continue
        if isinstance(conjunct, exp.Like | exp.ILike):
            got = note(conjunct.this)
            if got:
                got[0].not_null = True
            continue
        if isinstance(conjunct, exp.In):
            got = note(conjunct.this)
            if got:
                narrow, policy = got
                narrow.not_null = True
                values = {_constant(v, policy) for v in conjunct.expressions}
                if exp.Expression not in values:
                    values.discard(None)
                    narrow.values = values if narrow.values is None else narrow.values & values
            continue
        if isinstance(conjunct, exp.Between):
            got = note(conjunct.this)
            if got:
                _bound_range(got[0], got[1], exp.GTE, _constant(conjunct.args["low"], got[1]))
                _bound_range(got[0], got[1], exp.LTE, _constant(conjunct.args["high"], got[1]))
            continue
        if isinstance(conjunct, tuple(_FLIP)):
            op: type[exp.Expression] = type(conjunct)
            column, other = conjunct.this, conjunct.expression
            if _key(column) is None or (_key(other) is not None):
                if _key(other) is not None and _key(column) is not None:
                    for side in (column, other):
                        got = note(side)
                        if got:
                            got[0].not_null = True
                    continue
                column, other, op = other, column, _FLIP[op]
            got = note(column)
            if got:
                _bound_range(got[0], got[1], op, _constant(other, got[1]))
    return {key: _narrowed(policies(*key), narrow) for key, narrow in found.items()}  # type: ignore[arg-type]


def _bound_range(narrow: _Narrow, policy: ColumnPolicy, op: type[exp.Expression], value: Any) -> None:
    narrow.not_null = True
    if value is exp.Expression or value is None:
        return
    if op is exp.EQ and not isinstance(value, _Stamp):
        narrow.values = {value} if narrow.values is None else narrow.values & {value}
        return
    if op is exp.NEQ and not isinstance(value, _Stamp):
        narrow.excluded = (narrow.excluded or set()) | {value}
        return
    if policy.type == "text" or isinstance(value, bool | str):
        return  # text order depends on the collation: never narrowed
    if isinstance(value, _Stamp):  # the day it falls in: inclusive on both sides, a superset
        if op in (exp.EQ, exp.NEQ):
            return
        inclusive: dict[type[exp.Expression], type[exp.Expression]] = {exp.GT: exp.GTE, exp.LT: exp.LTE}
        value, op = value.value.date(), inclusive.get(op, op)
    strict = op in (exp.GT, exp.LT)
    if policy.type == "int" and isinstance(value, int | float):
        exact = float(value).is_integer() and not strict  # x >= 2 keeps 2; x > 2, x >= 2.5 start at 3
        if op in (exp.GT, exp.GTE):
            value = int(value) if exact else math.floor(value) + 1
        else:
            value = int(value) if exact else math.ceil(value) - 1
    elif policy.type == "date" and isinstance(value, dt.date) and strict:
        step = dt.timedelta(days=1)
        try:
            value = value + step if op is exp.GT else value - step
        except OverflowError:
            return
    if op in (exp.GT, exp.GTE):
        narrow.lower = value if narrow.lower is None else max(narrow.lower, value)
    else:
        narrow.upper = value if narrow.upper is None else min(narrow.upper, value)


def _narrowed(policy: ColumnPolicy, narrow: _Narrow) -> ColumnPolicy:
    update: dict[str, object] = {}
    if narrow.only_null:
        return policy.model_copy(update={"domain": [], "nullable": policy.nullable and not narrow.not_null})
    if narrow.not_null:
        update["nullable"] = False
    lower: Any = policy.lower
    upper: Any = policy.upper
    if policy.type == "timestamp":  # declared as dates or timestamps; constants are timestamps
        lower = None if lower is None else as_datetime(lower)
        upper = None if upper is None else as_datetime(upper)
    comparable = policy.type in ("int", "float", "date", "timestamp")
    if comparable and narrow.lower is not None:
        lower = narrow.lower if lower is None else max(lower, narrow.lower)
    if comparable and narrow.upper is not None:
        upper = narrow.upper if upper is None else min(upper, narrow.upper)
    if lower is not None and upper is not None:
        update["lower"], update["upper"] = lower, upper
    values: list[object] | None = None
    if policy.domain is not None:
        values = list(policy.domain)
    elif policy.type == "boolean":
        values = [False, True]
    if narrow.values is not None:
        values = [v for v in values if v in narrow.values] if values is not None else sorted(narrow.values, key=repr)
        if comparable:
            values = sorted(narrow.values, key=lambda v: v)  # type: ignore[arg-type, return-value]
            if policy.domain is not None:
                values = [v for v in values if v in policy.domain]
    if values is not None:
        if narrow.excluded:
            values = [v for v in values if v not in narrow.excluded]
        if comparable:
            values = [v for v in values if (lower is None or v >= lower) and (upper is None or v <= upper)]
        update["domain"] = values
    elif lower is not None and upper is not None and lower > upper:
        update["domain"] = []
    return policy.model_copy(update=update)
