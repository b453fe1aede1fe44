"""WHERE: only predicates that cannot fail on data, with columns resolved and constants typed.

A predicate the backend could reject (a failing cast, a bad LIKE pattern, an overflowing number) is
evaluated only when some row reaches it, so its error would tell whether anyone matches the rest of
the clause: an exact, un-noised oracle. Every such check is done here, before anything runs,
whatever the data; the backend then receives a WHERE that can only be true, false or NULL. Row
arithmetic (``age + 1 > 40``) is bounded as inside an aggregate (:func:`dpsql.analyze.expressions.bound`):
columns clamped first, divisors that can be 0 read through NULLIF, so it cannot fail either.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import NamedTuple

from sqlglot import exp

from dpsql.aggregates import AGGREGATE_NODES
from dpsql.analyze.expressions import bound
from dpsql.analyze.scope import CHECKED, Scope
from dpsql.errors import (
    DatatypeMismatch,
    FeatureNotSupported,
    GroupingError,
    InvalidEscapeSequence,
    NumericValueOutOfRange,
    SyntaxError_,
    UndefinedFunction,
)
from dpsql.plan.sources import qualified, resolve_ref
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy

_PREDICATES = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)


def resolve_column(column: exp.Column, scope: Scope) -> tuple[str, ColumnPolicy]:
    """A column reference → (name, policy); identifiers are never readable."""
    return scope.resolve(column)


def literal_type(node: exp.Expression) -> str | None:
    """The policy type family of a constant, or None if it is not a constant."""
    if isinstance(node, exp.Neg):
        return literal_type(node.this)
    if isinstance(node, exp.Paren):
        return literal_type(node.this)
    if isinstance(node, exp.Null):
        return "null"
    if isinstance(node, exp.Boolean):
        return "boolean"
    if isinstance(node, exp.Literal):
        return "text" if node.is_string else "number"
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        to = node.to.this
        if to in exp.DataType.TEMPORAL_TYPES:
            return "timestamp" if to != exp.DataType.Type.DATE else "date"
        if to in exp.DataType.NUMERIC_TYPES:
            return "number"
        if to in exp.DataType.TEXT_TYPES:
            return "text"
    return None


def _require_finite(literal: exp.Expression) -> None:
    """Numbers too large for a double would overflow differently on each backend: refuse them."""
    node = literal.this if isinstance(literal, exp.Neg) else literal
    if isinstance(node, exp.Literal) and not math.isfinite(float(node.name)):
        raise NumericValueOutOfRange(f'value out of range: "{node.name}"')


def canonical_cast(cast: exp.Cast, family: str) -> exp.Expression:
    """Validate ``CAST('<text>' AS <type>)`` here, so the backend never evaluates a cast that could fail.

    A failing cast is only evaluated when some row reaches it, so its error would tell whether
    anyone matches the rest of the predicate: an exact, un-noised oracle.
    """
    text = cast.this.name
    try:
        if family == "number":
            number = float(text)
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError(text)
            return exp.Literal.number(text.strip())
        if family == "date":
            return exp.cast(exp.Literal.string(dt.date.fromisoformat(text.strip()).isoformat()), exp.DataType.Type.DATE)
        if family == "timestamp":
            value = dt.datetime.fromisoformat(text.strip()).isoformat(sep=" ")
            return exp.cast(exp.Literal.string(value), exp.DataType.Type.TIMESTAMP)
    except ValueError:
        shown = {"number": "numeric"}.get(family, family)
        raise DatatypeMismatch(f'invalid input syntax for type {shown}: "{text}"') from None
    return cast.this.copy() if family == "text" else cast


def _check_literal_for(column: str, policy: ColumnPolicy, literal: exp.Expression) -> exp.Expression:
    """Type-check a constant against a column, so no comparison can fail on a data value."""
    family = literal_type(literal)
    if family is None:
        raise FeatureNotSupported(
            "only comparisons between a column and constants are supported in WHERE",
            hint=f'Compare "{column}" with a literal value.',
        )
    if family == "null":
        return literal
    if isinstance(literal, exp.Cast):
        literal = canonical_cast(literal, family)
    if policy.type in ("int", "float"):
        if family == "number":
            _require_finite(literal)
            return literal
        if family == "text":
            try:
                if not math.isfinite(float(literal.name)):
                    raise ValueError(literal.name)
            except ValueError:
                raise DatatypeMismatch(
                    f'invalid input syntax for type {PG_TYPE_NAMES[policy.type]}: "{literal.name}"',
                    hint=f'"{column}" is numeric; compare it with a number.',
                ) from None
            return exp.Literal.number(literal.name)
    elif policy.type in ("date", "timestamp"):
        if family in ("date", "timestamp"):
            return literal
        if family == "text":
            try:
                value = dt.datetime.fromisoformat(literal.name)
            except ValueError:
                raise DatatypeMismatch(
                    f'invalid input syntax for type {policy.type}: "{literal.name}"',
                    hint="Write dates as 'YYYY-MM-DD'.",
                ) from None
            text = value.date().isoformat() if policy.type == "date" else value.isoformat(sep=" ")
            return exp.cast(exp.Literal.string(text), policy.type)
    elif policy.type == "text":
        if family == "text":
            return literal
    elif policy.type == "boolean":
        if family == "boolean":
            return literal
        if family == "text" and literal.name.lower() in ("true", "false", "t", "f"):
            return exp.Boolean(this=literal.name.lower() in ("true", "t"))
    raise DatatypeMismatch(
        f"operator does not exist: {PG_TYPE_NAMES[policy.type]} compared with {family}",
        hint=f'"{column}" is of type {PG_TYPE_NAMES[policy.type]}; compare it with a value of that type.',
    )


#: The escape character of every LIKE dpsql sends, spelled out: DuckDB has no default escape,
#: PostgreSQL's is backslash, so an implicit one would match differently on each backend.
LIKE_ESCAPE = "\\"


def canonical_like_pattern(pattern: str) -> str:
    """A LIKE pattern, read with PostgreSQL's default escape (backslash), rewritten so that no backend
    can fail on it when sent with ``ESCAPE '\\'``.

    A pattern is evaluated only when some row reaches the predicate, so a pattern the backend rejects
    (PostgreSQL: a trailing escape character, 22025) would tell whether anyone matches the rest of the
    WHERE clause: an exact oracle. It is refused here instead, before anything runs, whatever the data.
    In the canonical form only ``%``, ``_`` and the backslash itself are ever escaped.
    """
    out: list[str] = []
    chars = iter(pattern)
    for char in chars:
        if char == LIKE_ESCAPE:
            literal = next(chars, None)
            if literal is None:
                raise InvalidEscapeSequence("LIKE pattern must not end with escape character")
            out.append(LIKE_ESCAPE + literal if literal in "%_" + LIKE_ESCAPE else literal)
        else:
            out.append(char)
    return "".join(out)


class _Side(NamedTuple):
    """One side of a predicate that reads a row: what it is called, its policy, and the SQL sent."""

    name: str
    policy: ColumnPolicy
    sql: exp.Expression


#: Row arithmetic a predicate may compare (``age + 1 > 40``), bounded like an aggregate's argument.
_ARITHMETIC = (
    exp.Add,
    exp.Sub,
    exp.Mul,
    exp.Div,
    exp.Mod,
    exp.Neg,
    exp.Abs,
    exp.Cast,
    exp.Coalesce,
    exp.Case,
    exp.Extract,
)


def _operand(node: exp.Expression, scope: Scope) -> _Side | None:
    """The column (or ``LOWER``/``UPPER`` of one, or arithmetic over columns) an operand reads,
    unwrapping parentheses; None for constants."""
    inner = node
    while isinstance(inner, exp.Paren):
        inner = inner.this
    if isinstance(inner, exp.Column):
        name, policy = resolve_column(inner, scope)
        return _Side(name, policy, _normalise_column(inner, scope))
    if isinstance(inner, exp.Lower | exp.Upper) and isinstance(inner.this, exp.Column):
        name, policy = resolve_column(inner.this, scope)
        if policy.type != "text":
            raise UndefinedFunction(f"function {inner.key}({PG_TYPE_NAMES[policy.type]}) does not exist")
        return _Side(name, policy, _normalise_column(inner, scope))
    if isinstance(inner, _ARITHMETIC) and inner.find(exp.Column):
        return _arithmetic(inner, scope)
    return None


def _arithmetic(node: exp.Expression, scope: Scope) -> _Side:
    """Arithmetic over columns in a predicate, as inside an aggregate (:func:`bound`): every column is
    clamped to its declared bounds *before* any operation, divisors that can be 0 are read through
    NULLIF, and the result's bounds stay within 2^53. So the predicate cannot fail, overflow or read
    NaN on any stored value (out of bounds, ±infinity, NaN, huge): its outcome is true, false or NULL,
    never an error that only some rows would raise — the same on every backend."""

    def resolve(column: exp.Column) -> tuple[exp.Column, ColumnPolicy]:
        source, name, policy = resolve_ref(column, scope.sources)
        return qualified(source, name), policy

    try:
        bounded = bound(node, resolve, lambda p: check_where(p, scope))
    except FeatureNotSupported as exc:  # the same reasons, said of WHERE
        raise FeatureNotSupported(
            exc.message.replace("inside an aggregate", "in WHERE"),
            hint=(exc.hint or "").replace("Inside an aggregate", "In WHERE") or None,
        ) from None
    return _Side(node.sql(dialect="postgres"), bounded.policy(), bounded.sql)


def _normalise_column(node: exp.Expression, scope: Scope) -> exp.Expression:
    """Rewrite column references to the bare, quoted policy name (the rewrite has one table)."""
    if isinstance(node, exp.Column):
        source, name, _ = resolve_ref(node, scope.sources)
        return qualified(source, name)
    node = node.copy()
    for column in list(node.find_all(exp.Column)):
        source, name, _ = resolve_ref(column, scope.sources)
        column.replace(qualified(source, name))
    return node


def check_where(node: exp.Expression, scope: Scope) -> exp.Expression:
    """Validate a predicate tree; return it with columns normalised and literals typed."""
    if node.meta.get(CHECKED):  # a subquery predicate, checked and rendered by dpsql.analyze.subqueries
        return node
    if isinstance(node, exp.Paren):
        return exp.Paren(this=check_where(node.this, scope))
    if isinstance(node, exp.And | exp.Or):
        return node.__class__(this=check_where(node.this, scope), expression=check_where(node.expression, scope))
    if isinstance(node, exp.Not):
        return exp.Not(this=check_where(node.this, scope))
    if isinstance(node, exp.Boolean):
        return node.copy()
    if isinstance(node, AGGREGATE_NODES) or node.find(*AGGREGATE_NODES):
        raise GroupingError("aggregate functions are not allowed in WHERE", hint="Use HAVING to filter groups.")
    if isinstance(node, exp.Column):
        _, policy = resolve_column(node, scope)
        if policy.type != "boolean":
            raise DatatypeMismatch(f"argument of WHERE must be type boolean, not type {PG_TYPE_NAMES[policy.type]}")
        return _normalise_column(node, scope)
    if isinstance(node, _PREDICATES):
        return _check_comparison(node, scope)
    if isinstance(node, exp.Is):
        bare = node.this.unnest() if isinstance(node.this, exp.Paren) else node.this
        if isinstance(bare, exp.Column) and isinstance(node.expression, exp.Null):
            # whether a row's identifier is NULL (a loan without co-signer) is a value of that row like
            # any other: an identifier may be tested for NULL, never compared or grouped
            source, name, _ = resolve_ref(bare, scope.sources, identifiers=True)
            return exp.Is(this=qualified(source, name), expression=exp.Null(), negate=node.args.get("negate"))
        tested = _operand(node.this, scope)
        if tested is None or not isinstance(node.expression, exp.Null | exp.Boolean):
            raise FeatureNotSupported("IS must test a column for NULL, TRUE or FALSE")
        tested_node = node.copy()  # keeps IS NOT (sqlglot's negate)
        tested_node.set("this", tested.sql)
        return tested_node
    if isinstance(node, exp.In):
        return _check_in(node, scope)
    if isinstance(node, exp.Between):
        target = _required_operand(node.this, scope)
        low = _check_literal_for(target.name, target.policy, node.args["low"])
        high = _check_literal_for(target.name, target.policy, node.args["high"])
        return exp.Between(this=target.sql, low=low, high=high, symmetric=node.args.get("symmetric"))
    if isinstance(node, exp.Like | exp.ILike):
        name, policy, _ = _required_operand(node.this, scope)
        if policy.type != "text":
            raise UndefinedFunction(
                f"operator does not exist: {PG_TYPE_NAMES[policy.type]} ~~ unknown",
                hint=f'LIKE needs a text column; "{name}" is {PG_TYPE_NAMES[policy.type]}.',
            )
        pattern = node.expression
        if isinstance(pattern, exp.Cast) and literal_type(pattern) == "text":
            pattern = pattern.this
        if not (isinstance(pattern, exp.Literal) and pattern.is_string):
            raise FeatureNotSupported("LIKE patterns must be string constants")
        if node.args.get("escape") is not None:
            raise FeatureNotSupported("LIKE ... ESCAPE is not supported")
        checked = exp.Escape(
            this=node.__class__(
                this=_normalise_column(node.this, scope),
                expression=exp.Literal.string(canonical_like_pattern(pattern.name)),
            ),
            expression=exp.Literal.string(LIKE_ESCAPE),
        )
        return exp.Not(this=checked) if node.args.get("negate") else checked
    if isinstance(node, exp.Escape):
        raise FeatureNotSupported("LIKE ... ESCAPE is not supported")
    raise FeatureNotSupported(
        f"{node.key.upper()} expressions are not supported in WHERE",
        hint="WHERE may use comparisons of columns or arithmetic over them with constants, AND/OR/NOT, IN, "
        "BETWEEN, LIKE and IS NULL.",
    )


def _required_operand(node: exp.Expression, scope: Scope) -> _Side:
    operand = _operand(node, scope)
    if operand is None:
        raise FeatureNotSupported(
            "the left side of this predicate must be a column",
            hint="Write predicates as <column> <operator> <constant>.",
        )
    return operand


def _check_comparison(node: exp.Expression, scope: Scope) -> exp.Expression:
    left, right = _operand(node.this, scope), _operand(node.expression, scope)
    if left and right:
        numeric = ("int", "float")
        if (left.policy.type in numeric) != (right.policy.type in numeric) or (
            left.policy.type not in numeric and left.policy.type != right.policy.type
        ):
            raise DatatypeMismatch(
                f"operator does not exist: {PG_TYPE_NAMES[left.policy.type]} {node.key} "
                f"{PG_TYPE_NAMES[right.policy.type]}",
                hint="Compare columns of the same type.",
            )
        return node.__class__(this=left.sql, expression=right.sql)
    if left:
        return node.__class__(this=left.sql, expression=_check_literal_for(left.name, left.policy, node.expression))
    if right:
        return node.__class__(this=_check_literal_for(right.name, right.policy, node.this), expression=right.sql)
    raise FeatureNotSupported(
        "comparisons in WHERE must involve a column",
        hint="Write predicates as <column or arithmetic over columns> <operator> <constant>.",
    )


def _check_in(node: exp.In, scope: Scope) -> exp.Expression:
    target = _required_operand(node.this, scope)
    if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
        raise FeatureNotSupported("IN (subquery) is not supported", hint="List constant values inside IN (...).")
    if not node.expressions:
        raise SyntaxError_('syntax error at or near ")"', hint="IN needs at least one value.")
    values = [_check_literal_for(target.name, target.policy, v) for v in node.expressions]
    return exp.In(this=target.sql, expressions=values)
