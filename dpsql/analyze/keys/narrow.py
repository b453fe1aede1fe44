"""WHERE constants narrow the domains of GROUP BY keys.

``WHERE problem = 'Asthma' GROUP BY problem`` releases one row, ``IS NOT NULL`` drops the NULL
group, a date range keeps only the months inside it. Only rows satisfying every top-level conjunct
are grouped, so a narrowed domain still contains every key such a row can have. Narrowing reads
only the query's constants and the policy: still no data.
"""

from __future__ import annotations

import datetime as dt
import math
import re
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


def _equal_to(value: object, policy: ColumnPolicy) -> set[object]:
    """The column values equal to a constant (``x = c``, ``x IN (…, c)``), as both backends compare.

    A date equals a timestamp only at midnight (the date is promoted), an integer never equals a
    fraction, and nothing equals NULL: such constants match no row and add no group."""
    if isinstance(value, _Stamp):
        stamp = value.value
        return {stamp.date()} if stamp == dt.datetime(stamp.year, stamp.month, stamp.day) else set()
    if value is None or (policy.type == "int" and isinstance(value, float) and not value.is_integer()):
        return set()
    return {value}


def _equal_to_any(constants: list[exp.Expression], policy: ColumnPolicy) -> set[object] | None:
    """The column values equal to some constant of a list; None when one is not understood."""
    values: set[object] = set()
    for node in constants:
        value = _constant(node, policy)
        if value is exp.Expression:
            return None
        values |= _equal_to(value, policy)
    return values


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
    ``NOT IN`` removes its constants, an OR of equalities/INs on one column keeps their union, and
    ``LIKE``/``ILIKE`` keep the declared domain values the pattern matches (evaluated here only when the
    evaluation is certainly the database's: no escapes, ASCII for ILIKE — otherwise a value is kept, a
    superset); anything else not understood only narrows nullability or nothing. The result depends on the
    query's constants and the policy, never on data.
    """
    found: dict[tuple[str, str], _Narrow] = {}

    def note(column: exp.Expression) -> tuple[_Narrow, ColumnPolicy] | None:
        key = _key(column)
        policy = policies(*key) if key is not None else None
        if key is None or policy is None:
            return None
        return found.setdefault(key, _Narrow()), policy

    for conjunct in _conjuncts(where):
        _narrow_conjunct(conjunct, note)
    return {key: _narrowed(policies(*key), narrow) for key, narrow in found.items()}  # type: ignore[arg-type]


#: The narrowing a column of the policy collects (None: not a policy column), created on first sight.
_Note = Callable[[exp.Expression], "tuple[_Narrow, ColumnPolicy] | None"]


def _narrow_conjunct(conjunct: exp.Expression, note: _Note) -> None:
    """What one top-level conjunct says about the columns it constrains (nothing when not understood)."""
    union = _or_of_equalities(conjunct)
    if union is not None:
        got = note(union[0])
        if got:
            narrow, policy = got
            values = _equal_to_any(union[1], policy)
            narrow.not_null = True
            if values is not None:
                narrow.values = values if narrow.values is None else narrow.values & values
        return
    negated = False
    if isinstance(conjunct, exp.Not):
        negated, conjunct = True, conjunct.this
        while isinstance(conjunct, exp.Paren):
            conjunct = conjunct.this
    escape: str | None = None  # the checked WHERE sends every LIKE with ESCAPE '\\' (where.py)
    if isinstance(conjunct, exp.Escape):
        escape = conjunct.expression.name if isinstance(conjunct.expression, exp.Literal) else ""
        conjunct = conjunct.this
    if conjunct.args.get("negate"):  # sqlglot's IS NOT / NOT IN / NOT LIKE
        negated = not negated
    if isinstance(conjunct, exp.Column):
        got = note(conjunct)
        if got and got[1].type == "boolean":
            got[0].values = (got[0].values or {True, False}) & {not negated}
    elif isinstance(conjunct, exp.Is):
        _narrow_is(conjunct, negated, note)
    elif negated:
        _narrow_negated(conjunct, note)
    else:
        _narrow_comparison(conjunct, escape, note)


def _narrow_is(conjunct: exp.Is, negated: bool, note: _Note) -> None:
    """``x IS [NOT] NULL``, ``x IS TRUE``/``FALSE``."""
    got = note(conjunct.this)
    if got is None:
        return
    narrow = got[0]
    if isinstance(conjunct.expression, exp.Null):
        if negated:
            narrow.not_null = True
        else:
            narrow.only_null = True
    elif isinstance(conjunct.expression, exp.Boolean) and not negated:
        narrow.values = (narrow.values or {True, False}) & {bool(conjunct.expression.this)}


def _narrow_negated(conjunct: exp.Expression, note: _Note) -> None:
    """``NOT (x op c)``: x is not NULL; ``x NOT IN (a, b)`` also drops a and b."""
    if not isinstance(conjunct, (exp.In, exp.Like, exp.ILike, *_FLIP)):
        return
    got = note(conjunct.this)
    if not got:
        return
    got[0].not_null = True
    if isinstance(conjunct, exp.In) and not conjunct.args.get("query"):
        # x NOT IN (a, b): a and b are not grouped (a NULL in the list passes no row at
        # all; not narrowed further then, a superset)
        constants = [_constant(v, got[1]) for v in conjunct.expressions]
        values = _equal_to_any(conjunct.expressions, got[1])
        if values is not None and None not in constants:
            got[0].excluded = (got[0].excluded or set()) | values


def _narrow_comparison(conjunct: exp.Expression, escape: str | None, note: _Note) -> None:
    """``x LIKE p``, ``x IN (…)``, ``x BETWEEN a AND b`` and ``x op c`` (either side), un-negated."""
    if isinstance(conjunct, exp.Like | exp.ILike):
        got = note(conjunct.this)
        if got:
            narrow, policy = got
            narrow.not_null = True
            matched = _like_domain(conjunct, policy, escape)
            if matched is not None:
                narrow.values = matched if narrow.values is None else narrow.values & matched
    elif isinstance(conjunct, exp.In):
        got = note(conjunct.this)
        if got:
            narrow, policy = got
            narrow.not_null = True
            listed = conjunct.expressions and not conjunct.args.get("query")  # x IN (SELECT …): not a list
            values = _equal_to_any(conjunct.expressions, policy) if listed else None
            if values is not None:
                narrow.values = values if narrow.values is None else narrow.values & values
    elif isinstance(conjunct, exp.Between):
        got = note(conjunct.this)
        if got:
            _bound_range(got[0], got[1], exp.GTE, _constant(conjunct.args["low"], got[1]))
            _bound_range(got[0], got[1], exp.LTE, _constant(conjunct.args["high"], got[1]))
    elif isinstance(conjunct, tuple(_FLIP)):
        op: type[exp.Expression] = type(conjunct)
        column, other = conjunct.this, conjunct.expression
        if _key(column) is None or (_key(other) is not None):
            if _key(other) is not None and _key(column) is not None:
                for side in (column, other):
                    got = note(side)
                    if got:
                        got[0].not_null = True
                return
            column, other, op = other, column, _FLIP[op]
        got = note(column)
        if got:
            _bound_range(got[0], got[1], op, _constant(other, got[1]))


def _or_of_equalities(node: exp.Expression) -> tuple[exp.Expression, list[exp.Expression]] | None:
    """``x = a OR x = b OR x IN (c, d)`` (one column, constants only): the column and every constant."""
    while isinstance(node, exp.Paren):
        node = node.this
    if not isinstance(node, exp.Or):
        return None
    column: tuple[str, str] | None = None
    node_of_column: exp.Expression | None = None
    constants: list[exp.Expression] = []
    stack: list[exp.Expression] = [node]
    while stack:
        part = stack.pop()
        while isinstance(part, exp.Paren):
            part = part.this
        if isinstance(part, exp.Or):
            stack += [part.this, part.expression]
            continue
        if isinstance(part, exp.EQ):
            side, other = part.this, part.expression
            if _key(side) is None:
                side, other = other, side
            found = [other]
        elif isinstance(part, exp.In) and not part.args.get("negate") and not part.args.get("query"):
            side, found = part.this, list(part.expressions)
        else:
            return None
        key = _key(side)
        if key is None or any(_key(c) is not None for c in found) or column not in (None, key):
            return None
        column, node_of_column = key, side
        constants += found
    assert node_of_column is not None
    return node_of_column, constants


def _like_domain(node: exp.Like | exp.ILike, policy: ColumnPolicy, escape: str | None) -> set[object] | None:
    """The declared text domain values ``LIKE``/``ILIKE`` keeps, or None (not evaluated here).

    The checked WHERE sends every pattern in canonical form with ``ESCAPE '\\'`` to both backends
    (:func:`dpsql.analyze.where.canonical_like_pattern`), so ``%`` and ``_`` are wildcards and a
    backslash makes the next character literal, everywhere alike; any other escape is not evaluated.
    ILIKE folds ASCII case only: a value or pattern outside ASCII is kept (a superset, never a lost group).
    """
    pattern = node.expression
    if policy.type != "text" or policy.domain is None or not isinstance(pattern, exp.Literal) or not pattern.is_string:
        return None
    if escape not in (None, "\\"):
        return None
    text = pattern.this
    parts: list[str] = []
    chars = iter(text)
    for char in chars:
        if char == "\\" and escape is not None:
            literal = next(chars, None)
            if literal is None:
                return None
            parts.append(re.escape(literal))
        else:
            parts.append(".*" if char == "%" else "." if char == "_" else re.escape(char))
    insensitive = isinstance(node, exp.ILike)
    regex = re.compile("".join(parts), re.DOTALL | (re.IGNORECASE if insensitive else 0))
    kept: set[object] = set()
    for value in policy.domain:
        if not isinstance(value, str):
            return None
        unsure = insensitive and not (value.isascii() and text.isascii())
        if unsure or regex.fullmatch(value):
            kept.add(value)
    return kept


def _bound_range(narrow: _Narrow, policy: ColumnPolicy, op: type[exp.Expression], value: Any) -> None:
    narrow.not_null = True
    if value is exp.Expression or value is None:
        return
    if op is exp.EQ:
        equal = _equal_to(value, policy)
        narrow.values = equal if narrow.values is None else narrow.values & equal
        return
    if op is exp.NEQ:
        narrow.excluded = (narrow.excluded or set()) | _equal_to(value, policy)
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
