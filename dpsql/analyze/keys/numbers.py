"""Numeric keys: FLOOR/CEIL, width_bucket, unary minus and ``+ - * /`` over bounded numbers.

Each is evaluated on its operands' finite domains (as the backend computes it: BIGINT or IEEE
double) or on the corners of their bounds. A key that could exceed 2^53, underflow, divide by zero
or overflow its integer type is refused up front: otherwise whether a row fails would depend on data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from sqlglot import exp

from dpsql.analyze.expressions import MAX_MAGNITUDE, UNDERFLOW_EXPONENT, _exponent
from dpsql.analyze.keys.base import (
    MAX_DERIVED_GROUPS,
    KeyContext,
    KeyExpr,
    finite_domain,
    fits,
    int_range,
    is_integral,
    key_high,
    key_low,
    literal_value,
    magnitude_error,
    number_sql,
    numeric_key,
    promote,
)
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType


def only_null(key: KeyExpr) -> bool:
    """Whether every row WHERE keeps has NULL for ``key`` (``WHERE x IS NULL``: x's domain is empty)."""
    return key.values is not None and all(v is None for v in key.values)


def _pointwise(node: exp.Expression, left: KeyExpr, right: KeyExpr, op: Callable[[float, float], float]) -> KeyExpr:
    """Combine two numeric keys: finite × finite → finite (each pair evaluated as the backend would,
    in BIGINT or IEEE double), else an interval over the corners.

    An operand that is NULL on every row WHERE keeps makes the result NULL on those rows: the backend
    never applies the operator (``+ - * /`` are strict), so nothing can overflow or divide by zero,
    whatever the other operand's bounds; the domain is NULL alone (or empty when no row can pass)."""
    integral = is_integral(left) and is_integral(right) and not isinstance(node, exp.Div)
    nullable = left.nullable or right.nullable
    pg_type = promote(left.type, right.type)
    sql_left = left.sql if integral else exp.cast(left.sql, exp.DataType.Type.DOUBLE)
    sql = node.__class__(this=sql_left, expression=right.sql)
    if only_null(left) or only_null(right):
        nullable = (only_null(left) and left.nullable) or (only_null(right) and right.nullable)
        return KeyExpr(sql, pg_type, finite_domain(node, (), nullable), nullable)
    tiny = _tiny(node, left, right, integral)
    if left.values is not None and right.values is not None:
        lv = [v for v in left.values if v is not None]
        rv = [v for v in right.values if v is not None]
        if len(lv) * len(rv) <= 4 * MAX_DERIVED_GROUPS:
            results = []
            for a, b in itertools.product(lv, rv):
                value = op(a, b) if integral else op(float(a), float(b))  # type: ignore[arg-type]
                if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
                    raise magnitude_error()
                results.append(int(value) if integral else float(value))
            return fits(node, KeyExpr(sql, pg_type, finite_domain(node, results, nullable), nullable, tiny=tiny))
    lows = [key_low(left), key_high(left)]
    highs = [key_low(right), key_high(right)]
    corners = [op(a, b) for a in lows for b in highs]
    lower, upper = min(corners), max(corners)
    if not (math.isfinite(lower) and math.isfinite(upper)) or max(abs(lower), abs(upper)) > MAX_MAGNITUDE:
        raise magnitude_error()
    return fits(node, KeyExpr(sql, pg_type, None, nullable, lower, upper, tiny))


def _tiny(node: exp.Expression, left: KeyExpr, right: KeyExpr, integral: bool) -> int:
    """The underflow bound of ``left op right`` (expressions.py's rule), refused below 2^-1070."""
    if integral:
        return 0
    if isinstance(node, exp.Mul):
        tiny = left.tiny + right.tiny
    elif isinstance(node, exp.Div):
        tiny = left.tiny - _exponent(max(abs(key_low(right)), abs(key_high(right)))) - 1
    else:
        tiny = min(left.tiny, right.tiny) - 53
    if tiny < UNDERFLOW_EXPONENT:
        raise FeatureNotSupported(
            "a GROUP BY expression can underflow",
            hint="A product or quotient of these bounds can come within 2^-1070 of 0 without being 0; scale it up.",
        )
    return tiny


def arithmetic(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``a + b``, ``a - b``, ``a * b``, ``a / b`` (integer division truncating toward zero, as PostgreSQL)."""
    left, right = numeric_key(node.this, keys), numeric_key(node.expression, keys)
    if isinstance(node, exp.Div):
        divisor_zero = not (only_null(left) or only_null(right)) and (  # NULL / 0 is NULL, never an error
            key_low(right) <= 0 <= key_high(right) or (right.values is not None and 0 in right.values)
        )
        if divisor_zero:
            raise FeatureNotSupported(
                "division by an expression that can be zero",
                hint="The divisor's bounds include 0, so some row could fail; divide by a range that excludes 0.",
            )
        if is_integral(left) and is_integral(right):
            # PostgreSQL's integer division truncates toward zero: computed as such on every backend
            quotient = _pointwise(node, left, right, lambda a, b: float(math.trunc(a / b)))
            sql = exp.cast(exp.Anonymous(this="TRUNC", expressions=[quotient.sql]), exp.DataType.Type.BIGINT)
            values = None if quotient.values is None else tuple(None if v is None else int(v) for v in quotient.values)  # type: ignore[arg-type]
            quotient_type = promote(left.type, right.type)
            return fits(node, KeyExpr(sql, quotient_type, values, quotient.nullable, quotient.lower, quotient.upper))
        return _pointwise(node, left, right, lambda a, b: a / b)
    ops: dict[type, Callable[[float, float], float]] = {
        exp.Add: lambda a, b: a + b,
        exp.Sub: lambda a, b: a - b,
        exp.Mul: lambda a, b: a * b,
    }
    return _pointwise(node, left, right, ops[type(node)])


def negate(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``-a``: computed as ``0 - a`` for its domain and bounds, written ``-a``."""
    inner = numeric_key(node.this, keys)
    zero = KeyExpr(exp.Literal.number(0), "integer", (0,), False)
    negated = _pointwise(exp.Sub(), zero, inner, lambda a, b: a - b)
    return KeyExpr(exp.Neg(this=inner.sql), negated.type, negated.values, negated.nullable, negated.lower,
                   negated.upper, inner.tiny)  # fmt: skip


def rounded(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``FLOOR(a)`` / ``CEIL(a)``: every whole number between the rounded bounds when few enough."""
    if node.args.get("decimals") is not None:
        raise FeatureNotSupported(f"{node.key.upper()} with a scale is not supported in GROUP BY")
    inner = numeric_key(node.this, keys)
    fn = math.floor if isinstance(node, exp.Floor) else math.ceil
    # PostgreSQL has floor(double precision) and floor(numeric): integers resolve to the double one
    pg_type: PgType = "numeric" if inner.type == "numeric" else "double precision"
    double = exp.DataType.Type.DOUBLE
    sql = exp.cast(node.__class__(this=exp.cast(inner.sql, double)), double)
    if inner.values is not None:
        values = (float(fn(v)) for v in inner.values if v is not None)  # type: ignore[arg-type]
        return KeyExpr(sql, pg_type, finite_domain(node, values, inner.nullable), inner.nullable)
    low, high = fn(key_low(inner)), fn(key_high(inner))
    if high - low + 1 > MAX_DERIVED_GROUPS:
        return KeyExpr(sql, pg_type, None, inner.nullable, float(low), float(high))
    every = int_range(node, low, high, inner.nullable)
    return KeyExpr(sql, pg_type, tuple(None if v is None else float(v) for v in every), inner.nullable)  # type: ignore[arg-type]


def width_bucket(value: float, low: float, high: float, count: int) -> int:
    """The bucket dpsql computes (the same formula, in IEEE doubles, as its generated SQL)."""
    if value < low:
        return 0
    if value >= high:
        return count + 1
    return math.floor((value - low) * count / (high - low)) + 1


def width_bucket_key(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``width_bucket(a, low, high, count)`` with constant bounds: buckets 0..count+1 the operand can reach."""
    low, high, count = (literal_value(node.args[k]) for k in ("min_value", "max_value", "num_buckets"))
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high, count)):
        raise FeatureNotSupported("width_bucket bounds and count must be numeric constants")
    assert isinstance(low, int | float) and isinstance(high, int | float) and isinstance(count, int | float)
    if not isinstance(count, int) or count <= 0:
        raise FeatureNotSupported("count must be greater than zero")  # PostgreSQL's 2201G text
    if low >= high:
        raise FeatureNotSupported(
            "lower bound cannot equal upper bound"
            if low == high
            else "width_bucket with descending bounds is not supported"
        )
    if not all(v == 0 or 2.0**-500 <= abs(v) <= 2.0**500 for v in (low, high, high - low)):
        raise FeatureNotSupported(
            "width_bucket bounds must be 0 or between 2^-500 and 2^500 in magnitude",
            hint="Extreme bounds could overflow or underflow differently on each backend.",
        )
    inner = numeric_key(node.this, keys)
    value = exp.cast(inner.sql, exp.DataType.Type.DOUBLE)
    span = exp.Div(
        this=exp.paren(
            exp.Mul(
                this=exp.paren(exp.Sub(this=value.copy(), expression=number_sql(low))), expression=number_sql(count)
            )
        ),
        expression=number_sql(high - low),
    )
    inside = exp.Add(this=exp.cast(exp.Floor(this=span), exp.DataType.Type.BIGINT), expression=exp.Literal.number(1))
    sql = (
        exp.Case()
        .when(exp.LT(this=value.copy(), expression=number_sql(low)), exp.Literal.number(0))
        .when(exp.GTE(this=value.copy(), expression=number_sql(high)), exp.Literal.number(count + 1))
        .else_(inside)
    )
    if inner.values is not None:
        buckets = (width_bucket(float(v), low, high, count) for v in inner.values if v is not None)  # type: ignore[arg-type]
        return fits(node, KeyExpr(sql, "integer", finite_domain(node, buckets, inner.nullable), inner.nullable))
    first, last = width_bucket(key_low(inner), low, high, count), width_bucket(key_high(inner), low, high, count)
    return fits(node, KeyExpr(sql, "integer", int_range(node, first, last, inner.nullable), inner.nullable))
