"""Constant folding of numeric arithmetic: ``0.06 - 0.01``, ``1 + 10``, ``7 / 2``, ``'1.5'::numeric * 2``.

TPC-H writes ``l_discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01`` and ``l_quantity <= 1 + 10``; BI tools
write ``x > 100 * 1000``. Each maximal constant subtree is evaluated here, in Python, exactly as
PostgreSQL would — its types (a literal is ``integer``, ``bigint`` or ``numeric`` by its spelling;
``integer / integer`` truncates; ``numeric`` is exact, its division rounded to PostgreSQL's scale;
``double precision`` is IEEE) and its errors (22012 division by zero, 22003 integer and float overflow,
float underflow, 42883 for an operator it lacks) — and replaced by one literal of the same type and
value, which both backends then read alike (DuckDB would read ``1e3`` as a double and ``7 / 2`` as
3.5). ``tests/analyze/test_fold_postgres.py`` compares every case with PostgreSQL itself.

Privacy: a constant is the same whatever the data, so its error is raised here, at analysis, for every
database alike, before anything runs or is charged; the backend never evaluates it on some rows only.
What is not understood (``'NaN'::float8``, ``real``, functions) is left as written, for the analyzer.
"""

from __future__ import annotations

import decimal
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from sqlglot import exp

from dpsql.errors import DivisionByZero, FeatureNotSupported, NumericValueOutOfRange, UndefinedFunction

__all__ = ["ARITHMETIC", "NUMERIC_CASTS", "Num", "evaluate", "render"]

Kind = Literal["smallint", "integer", "bigint", "numeric", "double precision"]

#: The operators folded (a unary minus too, when its operand is not a bare literal).
ARITHMETIC = (exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Mod)
_BITS: dict[str, int] = {"smallint": 16, "integer": 32, "bigint": 64}
_INTEGERS: tuple[Kind, ...] = ("smallint", "integer", "bigint")
#: Digits a folded numeric may have (PostgreSQL's own limits are 131072 before the point, 16383 after):
#: beyond, analysis would spend its time on the statement's own constants.
_MAX_DIGITS = 1000
_CONTEXT = decimal.Context(prec=4 * _MAX_DIGITS, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
_NUMERIC_TEXT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")
_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+\s*")
NUMERIC_CASTS: dict[exp.DType, Kind] = {
    exp.DataType.Type.SMALLINT: "smallint",
    exp.DataType.Type.INT: "integer",
    exp.DataType.Type.BIGINT: "bigint",
    exp.DataType.Type.DECIMAL: "numeric",
    exp.DataType.Type.DOUBLE: "double precision",
}
_SQL_TYPES: dict[str, exp.DType] = {kind: dtype for dtype, kind in NUMERIC_CASTS.items()}


@dataclass(frozen=True, slots=True)
class Num:
    """A typed constant: ``value`` is an int (integer kinds), a Decimal (numeric) or a float."""

    kind: Kind
    value: int | Decimal | float
    #: numeric's display scale (digits after the point PostgreSQL keeps and shows)
    scale: int = 0


def _out_of_range(kind: Kind) -> NumericValueOutOfRange:
    return NumericValueOutOfRange(f"{kind} out of range")


def _integer(kind: Kind, value: int) -> Num:
    bits = _BITS[kind]
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise _out_of_range(kind)
    return Num(kind, value)


def _numeric(value: Decimal, scale: int) -> Num:
    if (value and value.adjusted() >= _MAX_DIGITS) or scale > _MAX_DIGITS:
        raise FeatureNotSupported(
            "a constant expression has too many digits to fold",
            hint=f"dpsql folds numeric constants of up to {_MAX_DIGITS} digits.",
        )
    return Num("numeric", value, scale)


def _float_sum(value: float) -> Num:
    """A double sum or difference of finite doubles: 22003 when it overflows (float8pl)."""
    if math.isinf(value):
        raise NumericValueOutOfRange("value out of range: overflow")
    return Num("double precision", value)


def literal(text: str, negative: bool = False) -> Num:
    """A numeric literal as PostgreSQL types it: integer, bigint when beyond 32 bits, else numeric.
    ``negative``: written after a minus sign, which PostgreSQL's parser applies to the literal itself
    (``-2147483648`` is an integer)."""
    if text.isdigit():
        value = -int(text) if negative else int(text)
        kind = _natural(value)
        return Num(kind, value) if kind != "numeric" else _numeric(Decimal(value), 0)
    number = -Decimal(text) if negative else Decimal(text)
    exponent = number.as_tuple().exponent
    assert isinstance(exponent, int)
    return _numeric(number, max(0, -exponent))


def _text(node: exp.Expression) -> str | None:
    return node.name if isinstance(node, exp.Literal) and node.is_string else None


def evaluate(node: exp.Expression) -> Num | None:
    """The typed value of a constant numeric expression (None: not one, or not one folded here)."""
    if isinstance(node, exp.Paren):
        return evaluate(node.this)
    if isinstance(node, exp.Literal):
        return None if node.is_string else literal(node.name)
    if isinstance(node, exp.Neg):
        if isinstance(node.this, exp.Literal) and not node.this.is_string:
            return literal(node.this.name, negative=True)
        inner = evaluate(node.this)
        return None if inner is None else _negate(inner)
    if isinstance(node, exp.Cast):
        return _cast_node(node)
    if isinstance(node, ARITHMETIC):
        left, right = evaluate(node.this), evaluate(node.expression)
        if left is None or right is None:
            return None
        return _binary(type(node), left, right)
    return None


def _cast_node(node: exp.Cast) -> Num | None:
    kind = NUMERIC_CASTS.get(node.to.this)
    if kind is None:
        return None
    params = node.to.expressions
    text = _text(node.this)
    if text is not None:  # '1.5'::numeric: the type's input function, for finite decimal texts only
        if kind in _INTEGERS:
            if not _INTEGER_TEXT.fullmatch(text):
                return None
            value: Num = _integer(kind, int(text.strip()))
        elif _NUMERIC_TEXT.fullmatch(text):
            value = cast(literal_signed(text.strip().lstrip("+")), "numeric")
        else:
            return None
    else:
        inner = evaluate(node.this)
        if inner is None:
            return None
        value = inner
    if kind == "numeric" and params:
        return _numeric_typmod(value, params)
    return cast(value, kind)


def _numeric_typmod(value: Num, params: list[exp.Expression]) -> Num | None:
    """``CAST(x AS numeric(p, s))``: rounded to s digits (half away from zero), 22003 beyond p digits."""
    numbers = [p.this.name if isinstance(p.this, exp.Literal) else "" for p in params]
    if not all(n.isdigit() for n in numbers):
        return None
    precision, scale = int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
    if not 1 <= precision <= 1000 or scale > precision:
        return None
    number = cast(value, "numeric")
    assert isinstance(number.value, Decimal)
    rounded = number.value.quantize(Decimal(1).scaleb(-scale), rounding=decimal.ROUND_HALF_UP, context=_CONTEXT)
    if rounded and rounded.adjusted() >= precision - scale:
        raise NumericValueOutOfRange("numeric field overflow")
    return Num("numeric", rounded, scale)


def cast(value: Num, kind: Kind) -> Num:
    """``value::kind`` as PostgreSQL converts: numeric to integers rounds half away from zero, double to
    integers half to even (rint), double to numeric through 15 significant digits (float8_numeric)."""
    if value.kind == kind:
        return value
    if kind in _INTEGERS:
        if value.kind in _INTEGERS:
            return _integer(kind, int(value.value))
        if value.kind == "numeric":
            assert isinstance(value.value, Decimal)
            return _integer(kind, int(value.value.to_integral_value(rounding=decimal.ROUND_HALF_UP)))
        return _integer(kind, round(value.value))  # Python rounds floats half to even, as rint
    if kind == "numeric":
        if value.kind == "double precision":
            return literal_signed(format(value.value, ".15g"))
        return _numeric(Decimal(value.value), value.scale)
    converted = float(value.value)
    if math.isinf(converted):
        raise NumericValueOutOfRange("value out of range: overflow")
    return Num("double precision", converted)


def literal_signed(text: str) -> Num:
    return literal(text[1:], negative=True) if text.startswith("-") else literal(text)


def _negate(value: Num) -> Num:
    if value.kind in _INTEGERS:
        return _integer(value.kind, -int(value.value))
    return Num(value.kind, -value.value, value.scale)


def _common(left: Num, right: Num) -> Kind:
    """The type both operands are converted to: double over numeric over the wider integer."""
    kinds: tuple[Kind, ...] = ("double precision", "numeric")
    for kind in kinds:
        if kind in (left.kind, right.kind):
            return kind
    return max(left.kind, right.kind, key=_INTEGERS.index)


def _binary(op: type[exp.Expression], left: Num, right: Num) -> Num:
    kind = _common(left, right)
    a, b = cast(left, kind), cast(right, kind)
    if kind in _INTEGERS:
        return _integer_op(op, kind, int(a.value), int(b.value))
    if kind == "numeric":
        assert isinstance(a.value, Decimal) and isinstance(b.value, Decimal)
        return _numeric_op(op, a, b)
    x, y = float(a.value), float(b.value)
    if op is exp.Mod:
        raise UndefinedFunction(
            "operator does not exist: double precision % double precision",
            hint="No operator matches the given name and argument types. You might need to add explicit type casts.",
        )
    if op is exp.Add:
        return _float_sum(x + y)
    if op is exp.Sub:
        return _float_sum(x - y)
    if op is exp.Mul:
        return _float_product(x * y, x, y)
    if y == 0:
        raise DivisionByZero("division by zero")
    return _float_quotient(x / y, x)


def _float_product(value: float, x: float, y: float) -> Num:
    if math.isinf(value):
        raise NumericValueOutOfRange("value out of range: overflow")
    if value == 0 and x != 0 and y != 0:
        raise NumericValueOutOfRange("value out of range: underflow")
    return Num("double precision", value)


def _float_quotient(value: float, x: float) -> Num:
    if math.isinf(value):
        raise NumericValueOutOfRange("value out of range: overflow")
    if value == 0 and x != 0:
        raise NumericValueOutOfRange("value out of range: underflow")
    return Num("double precision", value)


def _integer_op(op: type[exp.Expression], kind: Kind, a: int, b: int) -> Num:
    if op is exp.Add:
        return _integer(kind, a + b)
    if op is exp.Sub:
        return _integer(kind, a - b)
    if op is exp.Mul:
        return _integer(kind, a * b)
    if b == 0:
        raise DivisionByZero("division by zero")
    quotient = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)  # C: toward zero
    if op is exp.Div:
        return _integer(kind, quotient)
    return _integer(kind, a - quotient * b)  # the remainder has the dividend's sign


def _numeric_op(op: type[exp.Expression], a: Num, b: Num) -> Num:
    x, y = a.value, b.value
    assert isinstance(x, Decimal) and isinstance(y, Decimal)
    if op is exp.Add:
        return _numeric(_CONTEXT.add(x, y), max(a.scale, b.scale))
    if op is exp.Sub:
        return _numeric(_CONTEXT.subtract(x, y), max(a.scale, b.scale))
    if op is exp.Mul:
        return _numeric(_CONTEXT.multiply(x, y), a.scale + b.scale)
    if not y:
        raise DivisionByZero("division by zero")
    if op is exp.Mod:
        return _numeric(_CONTEXT.remainder(x, y), max(a.scale, b.scale))  # sign of the dividend, as mod_var
    scale = _division_scale(a, b)
    return _numeric(_rounded_quotient(x, y, scale), scale)


def _weight(value: Decimal) -> tuple[int, int]:
    """PostgreSQL's (weight, first digit) of a non-zero numeric in base 10000 (``NumericVar``)."""
    weight = value.copy_abs().adjusted() // 4
    first = int(value.copy_abs().scaleb(-4 * weight, context=_CONTEXT))
    return weight, first


def _division_scale(a: Num, b: Num) -> int:
    """``select_div_scale``: at least 16 significant digits, and no fewer decimals than either operand."""
    assert isinstance(a.value, Decimal) and isinstance(b.value, Decimal)
    w1, d1 = _weight(a.value) if a.value else (0, 0)
    w2, d2 = _weight(b.value)
    qweight = w1 - w2 - (1 if d1 <= d2 else 0)
    return min(max(16 - qweight * 4, a.scale, b.scale, 0), 1000)


def _rounded_quotient(x: Decimal, y: Decimal, scale: int) -> Decimal:
    """x / y rounded to ``scale`` decimals, half away from zero, computed exactly on integers."""
    nx, ex = _integral(x)
    ny, ey = _integral(y)
    # x / y = nx·10^ex / (ny·10^ey); scaled by 10^scale: nx·10^(ex - ey + scale) / ny
    shift = ex - ey + scale
    numerator, denominator = (nx * 10**shift, ny) if shift >= 0 else (nx, ny * 10**-shift)
    negative = (numerator < 0) != (denominator < 0)
    q, r = divmod(abs(numerator), abs(denominator))
    if 2 * r >= abs(denominator):
        q += 1
    return Decimal(-q if negative else q).scaleb(-scale, context=_CONTEXT)


def _integral(value: Decimal) -> tuple[int, int]:
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    number = int("".join(map(str, digits)) or "0")
    return (-number if sign else number), exponent


def _natural(value: int) -> Kind:
    """The type PostgreSQL gives the integer literal spelling ``value`` (with its minus sign)."""
    return "integer" if -(2**31) <= value < 2**31 else "bigint" if -(2**63) <= value < 2**63 else "numeric"


def render(value: Num) -> exp.Expression:
    """One literal of ``value``'s type and value, in both backends' SQL: integers bare (cast when the
    spelling alone would be typed otherwise), numerics with their scale (``1001.`` is numeric too),
    doubles as the shortest text that reads back exactly, cast to double precision."""
    if value.kind in _INTEGERS:
        number = int(value.value)
        node: exp.Expression = exp.Literal.number(abs(number))
        node = exp.Neg(this=node) if number < 0 else node
        return node if _natural(number) == value.kind else exp.cast(node, _SQL_TYPES[value.kind])
    if value.kind == "numeric":
        assert isinstance(value.value, Decimal)
        quantized = value.value.quantize(Decimal(1).scaleb(-value.scale), context=_CONTEXT)
        text = format(quantized.copy_abs(), "f")
        if value.scale == 0:
            text += "."
        node = exp.Literal.number(text)
        return exp.Neg(this=node) if quantized.is_signed() and quantized else node
    number_text = repr(abs(float(value.value)))
    node = exp.Literal.number(number_text)
    node = exp.Neg(this=node) if math.copysign(1.0, float(value.value)) < 0 else node
    return exp.cast(node, exp.DataType.Type.DOUBLE)
