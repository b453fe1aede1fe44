"""Post-processing expressions: the interpreter for output expressions, HAVING and ORDER BY terms.

Everything here reads only noisy measures and released keys, so by the post-processing
theorem it costs no privacy. Expressions are evaluated with PostgreSQL semantics
(NULL propagation, integer division) by a small interpreter over sqlglot nodes.
"""

from __future__ import annotations

import datetime as dt
import math
import operator
from collections.abc import Callable, Mapping
from functools import cmp_to_key
from typing import Any

from sqlglot import exp

from dpsql.aggregates import RELEASE_FUNCTIONS
from dpsql.errors import DivisionByZero, FeatureNotSupported, InvalidParameterValue

Env = Mapping[str, Any]

_ARITHMETIC: dict[type[exp.Expression], Callable[[Any, Any], Any]] = {
    exp.Add: operator.add,
    exp.Sub: operator.sub,
    exp.Mul: operator.mul,
}
_COMPARISONS: dict[type[exp.Expression], Callable[[Any, Any], bool]] = {
    exp.EQ: operator.eq,
    exp.NEQ: operator.ne,
    exp.GT: operator.gt,
    exp.GTE: operator.ge,
    exp.LT: operator.lt,
    exp.LTE: operator.le,
}


def _divide(left: Any, right: Any) -> Any:
    if right == 0:
        raise DivisionByZero("division by zero")
    if isinstance(left, int) and isinstance(right, int):
        quotient = abs(left) // abs(right)
        return quotient if (left >= 0) == (right >= 0) else -quotient
    return left / right


def _literal(node: exp.Literal) -> Any:
    if node.is_string:
        return node.name
    text = node.name
    return float(text) if any(c in text for c in ".eE") else int(text)


def _release_function(node: exp.Expression) -> Callable[..., Any] | None:
    """The function an aggregate registered for combining its measures (``dp_avg``, ``dp_variance``…)."""
    if not isinstance(node, exp.Anonymous):
        return None
    return RELEASE_FUNCTIONS.get(node.name.lower())


def evaluate(node: exp.Expression, env: Env) -> Any:
    """Evaluate a post-processing expression; ``exp.Var`` names look up ``env``."""
    if isinstance(node, exp.Var):
        return env[node.name]
    if isinstance(node, exp.Literal):
        return _literal(node)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Paren):
        return evaluate(node.this, env)
    if isinstance(node, exp.Neg):
        value = evaluate(node.this, env)
        return None if value is None else -value
    if isinstance(node, exp.Not):
        value = evaluate(node.this, env)
        return None if value is None else not value
    if isinstance(node, exp.And | exp.Or):
        return _logic(node, env)
    if isinstance(node, exp.Div | exp.Mod | exp.DPipe) or type(node) in _ARITHMETIC or type(node) in _COMPARISONS:
        left, right = evaluate(node.this, env), evaluate(node.expression, env)
        if left is None or right is None:
            return None
        if isinstance(node, exp.Div):
            return _divide(left, right)
        if isinstance(node, exp.Mod):
            if right == 0:
                raise DivisionByZero("division by zero")
            return math.fmod(left, right) if isinstance(left, float) or isinstance(right, float) else left % right
        if isinstance(node, exp.DPipe):
            return f"{left}{right}"
        fn = _ARITHMETIC.get(type(node)) or _COMPARISONS[type(node)]
        return fn(left, right)
    combine = _release_function(node)
    if combine is not None:
        return combine(*(evaluate(a, env) for a in node.expressions))
    return _function(node, env)


def compile_expression(node: exp.Expression) -> Callable[[Env], Any]:
    """A closure computing ``evaluate(node, env)``: the tree is walked once per plan, not once per row.

    The shapes released outputs take (names, literals, arithmetic, comparisons, AVG and variance) are
    compiled; anything else falls back to the interpreter, so both always agree.
    """
    if isinstance(node, exp.Var):
        name = node.name
        return lambda env: env[name]
    if isinstance(node, exp.Literal):
        value = _literal(node)
        return lambda env: value
    if isinstance(node, exp.Paren):
        return compile_expression(node.this)
    if isinstance(node, exp.Neg):
        inner = compile_expression(node.this)
        return lambda env: None if (v := inner(env)) is None else -v
    fn = _ARITHMETIC.get(type(node)) or _COMPARISONS.get(type(node))
    if fn is not None:
        left, right = compile_expression(node.this), compile_expression(node.expression)

        def binary(env: Env) -> Any:
            a, b = left(env), right(env)
            return None if a is None or b is None else fn(a, b)

        return binary
    if isinstance(node, exp.Div):
        left, right = compile_expression(node.this), compile_expression(node.expression)

        def divide(env: Env) -> Any:
            a, b = left(env), right(env)
            return None if a is None or b is None else _divide(a, b)

        return divide
    helper = _release_function(node)
    if helper is not None:
        args = [compile_expression(a) for a in node.expressions]
        return lambda env: helper(*(arg(env) for arg in args))
    return lambda env: evaluate(node, env)


def _logic(node: exp.Expression, env: Env) -> bool | None:
    left, right = evaluate(node.this, env), evaluate(node.expression, env)
    if isinstance(node, exp.And):
        if left is False or right is False:
            return False
        return None if left is None or right is None else True
    if left is True or right is True:
        return True
    return None if left is None or right is None else False


def _function(node: exp.Expression, env: Env) -> Any:
    if isinstance(node, exp.Coalesce):
        for arg in [node.this, *node.expressions]:
            value = evaluate(arg, env)
            if value is not None:
                return value
        return None
    if isinstance(node, exp.Greatest | exp.Least):
        values = [v for v in (evaluate(a, env) for a in [node.this, *node.expressions]) if v is not None]
        if not values:
            return None
        return max(values) if isinstance(node, exp.Greatest) else min(values)
    value = evaluate(node.this, env)
    if value is None:
        return None
    if isinstance(node, exp.Abs):
        return abs(value)
    if isinstance(node, exp.Floor | exp.Ceil):
        rounded = math.floor(value) if isinstance(node, exp.Floor) else math.ceil(value)
        return float(rounded) if isinstance(value, float) else rounded
    if isinstance(node, exp.Round):
        digits = evaluate(node.args["decimals"], env) if node.args.get("decimals") else 0
        if not isinstance(digits, int):
            raise InvalidParameterValue("round() needs an integer number of digits")
        if abs(digits) > 15:  # beyond a double's precision: nothing left to round, or everything
            return float(round(float(value), digits)) if isinstance(value, float) or digits < 0 else value
        scaled = value * 10**digits
        rounded = math.floor(abs(scaled) + 0.5) * (1 if scaled >= 0 else -1)  # half away from zero, like PG
        return rounded / 10**digits if digits else (float(rounded) if isinstance(value, float) else rounded)
    if isinstance(node, exp.Cast):
        return _cast(value, node.to)
    raise FeatureNotSupported(f"{node.key} is not supported in post-processing")


def _cast(value: Any, to: exp.DataType) -> Any:
    target = to.this
    if target in exp.DataType.INTEGER_TYPES:
        return math.floor(value + 0.5) if isinstance(value, float) else int(value)
    if target in exp.DataType.REAL_TYPES or target in (exp.DataType.Type.DECIMAL,):
        return float(value)
    if target in exp.DataType.TEXT_TYPES:
        return str(value)
    if target == exp.DataType.Type.DATE and isinstance(value, dt.datetime):  # a time-bucket key as a date
        return value.date()
    if target == exp.DataType.Type.TIMESTAMP and type(value) is dt.date:
        return dt.datetime(value.year, value.month, value.day)
    return value


def _sort_key_compare(a: tuple[Any, ...], b: tuple[Any, ...], spec: list[tuple[bool, bool | None]]) -> int:
    for x, y, (desc, nulls_first) in zip(a, b, spec, strict=True):
        if x == y:
            continue
        first_null = nulls_first if nulls_first is not None else desc  # PostgreSQL: NULLs sort as largest
        if x is None or y is None:
            return (-1 if x is None else 1) * (1 if first_null else -1)
        result = -1 if x < y else 1
        return -result if desc else result
    return 0


def order_rows(rows: list[tuple[tuple[Any, ...], Any]], spec: list[tuple[bool, bool | None]]) -> list[Any]:
    """Sort ``(sort_key, row)`` pairs by PostgreSQL's ORDER BY rules; return the rows."""

    def compare(a: tuple[tuple[Any, ...], Any], b: tuple[tuple[Any, ...], Any]) -> int:
        return _sort_key_compare(a[0], b[0], spec)

    ordered = sorted(rows, key=cmp_to_key(compare))
    return [row for _, row in ordered]
