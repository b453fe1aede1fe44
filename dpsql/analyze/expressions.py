"""Bounds of expressions inside aggregates, by interval arithmetic over the policy's bounds.

``SUM(price * qty)`` is as safe as ``SUM(col)`` once the expression's range is known:
every operation maps the operands' intervals to a sound interval for the result, and the
result is clamped to it like a column. An expression is accepted only if it also cannot
fail on any row: no division by a range containing 0, no integer division (whose
truncation differs between engines), no value beyond 2^53 (overflow or lost precision),
and CASE conditions limited to the same safe predicates as WHERE. Anything else is
refused with the reason, before any budget is spent.

The proof is about the declared bounds, so it holds for stored rows only because every column is
clamped to its bounds *before* any arithmetic (:func:`clamp_sql`): a stored value outside them
(a cost of 4999 against [0, 2000], ±infinity, a huge integer) would otherwise make ``1 / (cost - 4999)``
or ``visits^4`` fail on some rows only, an error oracle. NaN orders above +infinity on PostgreSQL,
DuckDB and Spark alike, so it clamps to the upper bound everywhere. Float columns also read tiny
magnitudes (below 2^-128) as 0, and products and quotients are refused when they could still come
within reach of 0 without being 0: PostgreSQL raises "underflow" there, DuckDB does not.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass

from sqlglot import exp

from dpsql.backends import cancellable
from dpsql.errors import FeatureNotSupported, InvalidParameterValue, UndefinedFunction
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy

#: Largest magnitude an expression may reach: beyond it doubles lose integers and BIGINT products overflow.
MAX_MAGNITUDE = 2.0**53
#: Float column values with a magnitude below 2^SNAP_EXPONENT are read as 0 inside expressions.
SNAP_EXPONENT = -128
#: A product or quotient whose non-zero magnitude can fall below 2^UNDERFLOW_EXPONENT is refused
#: (doubles reach 0 below 2^-1074, where PostgreSQL raises "value out of range: underflow").
UNDERFLOW_EXPONENT = -1070


@dataclass(frozen=True, slots=True)
class Bounded:
    """A SQL expression (columns qualified) with a sound range for every row."""

    sql: exp.Expression
    lower: float
    upper: float
    integer: bool
    nullable: bool
    #: log2 of a lower bound on the magnitude of every non-zero value (floats: underflow tracking)
    tiny: int = 0

    def policy(self) -> ColumnPolicy:
        """A virtual column policy, so aggregates treat the expression like a declared column."""
        lower, upper = (int(self.lower), int(self.upper)) if self.integer else (self.lower, self.upper)
        return ColumnPolicy(type="int" if self.integer else "float", lower=lower, upper=upper, nullable=self.nullable)


Resolve = Callable[[exp.Column], tuple[exp.Column, ColumnPolicy]]
CheckPredicate = Callable[[exp.Expression], exp.Expression]

_DATE_PARTS: dict[str, tuple[int, int]] = {
    "month": (1, 12),
    "day": (1, 31),
    "dow": (0, 6),
    "isodow": (1, 7),
    "doy": (1, 366),
    "quarter": (1, 4),
    "week": (1, 53),
    "hour": (0, 23),
    "minute": (0, 59),
}


def _aliases(table: dict[str, str]) -> dict[str, str]:
    return {alias: unit for unit, aliases in table.items() for alias in aliases.split()}


#: PostgreSQL's date/time unit words (matched, as there, on their first 10 characters) and the unit each names.
_DATE_UNITS = _aliases(
    {
        "microseconds": "microsecon us usec usecs usecond useconds",
        "milliseconds": "millisecon ms msec msecs msecond mseconds",
        "second": "second seconds s sec secs",
        "minute": "minute minutes m min mins",
        "hour": "hour hours h hr hrs",
        "day": "day days d",
        "week": "week weeks w",
        "month": "month months mon mons",
        "quarter": "quarter qtr",
        "year": "year years y yr yrs",
        "decade": "decade decades dec decs",
        "century": "century centuries c cent",
        "millennium": "millennium millennia mil mils",
        "timezone": "timezone",
        "timezone_h": "timezone_h",
        "timezone_m": "timezone_m",
    }
)
#: Words EXTRACT knows besides (date_trunc does not): its own fields, sqlglot's spellings of dow/doy,
#: and reserved words it knows but refuses (0A000).
_EXTRACT_WORDS = _aliases(
    {
        "epoch": "epoch",
        "dow": "dow dayofweek",
        "doy": "doy dayofyear",
        "isodow": "isodow",
        "isoyear": "isoyear",
        "julian": "julian j jd",
        "reserved": "infinity -infinity now today tomorrow yesterday allballs",
    }
)


def date_unit(word: str, function: str, pg_type: str) -> str:
    """The unit ``word`` names for date_trunc or EXTRACT (``function``) over ``pg_type``, in dpsql's
    spelling (``'mon'`` is ``month``); a word PostgreSQL does not know is 22023, as there. PostgreSQL
    raises it only when a row reaches the call; here it is raised for every database alike."""
    key = word.lower()[:10]
    unit = _DATE_UNITS.get(key) or (_EXTRACT_WORDS.get(key) if function == "extract" else None)
    if unit is None:
        raise InvalidParameterValue(f'unit "{word.lower()}" not recognized for type {pg_type}')
    return unit


def _stays() -> None:
    """Nothing to cancel: analysis runs in Python, between statements."""


def checkpoint() -> None:
    """Stop here when the statement was cancelled or timed out (57014).

    The server interrupts a statement's job at its statement timeout, but only a database statement
    can be stopped from outside; loops whose work grows with the statement (one pass per CASE branch)
    call this so abandoned analysis stops too. An interrupted job refuses to start any statement,
    which is what entering :func:`~dpsql.backends.cancellable` here checks. Outside the server: a no-op.
    """
    with cancellable(_stays):
        pass


def clamp_sql(value: exp.Expression, lower: exp.Expression, upper: exp.Expression) -> exp.Case:
    """``value`` clamped to ``[lower, upper]``; NULL stays NULL, NaN (above +infinity on every
    backend) becomes ``upper``. CASE rather than GREATEST/LEAST: those treat NULL differently
    across engines (PostgreSQL ignores NULL arguments)."""
    return (
        exp.Case()
        .when(exp.LT(this=value, expression=lower), lower)
        .when(exp.GT(this=value.copy(), expression=upper), upper.copy())
        .else_(value.copy())
    )


def bound_literal(value: object, policy: ColumnPolicy) -> exp.Expression:
    """A declared bound as a literal of the column's type."""
    if isinstance(value, dt.datetime):
        return exp.cast(exp.Literal.string(value.isoformat(sep=" ")), exp.DataType.Type.TIMESTAMP)
    if isinstance(value, dt.date):
        kind = exp.DataType.Type.TIMESTAMP if policy.type == "timestamp" else exp.DataType.Type.DATE
        text = value.isoformat() + (" 00:00:00" if policy.type == "timestamp" else "")
        return exp.cast(exp.Literal.string(text), kind)
    number = float(value)  # type: ignore[arg-type]
    literal = exp.Literal.number(int(abs(number)) if number.is_integer() else abs(number))
    return exp.Neg(this=literal) if number < 0 else literal


def _exponent(value: float) -> int:
    """floor(log2 |value|) for a non-zero value (0 for 0: it cannot underflow)."""
    return math.frexp(value)[1] - 1 if value else 0


def _checked(node: exp.Expression, lower: float, upper: float, integer: bool, nullable: bool, tiny: int = 0) -> Bounded:
    if tiny < UNDERFLOW_EXPONENT:
        raise FeatureNotSupported(
            "an expression inside an aggregate can underflow",
            hint="A product or quotient of these bounds can come within 2^-1070 of 0 without being 0; scale it up.",
        )
    if not (math.isfinite(lower) and math.isfinite(upper)) or max(abs(lower), abs(upper)) > MAX_MAGNITUDE:
        raise FeatureNotSupported(
            "an expression inside an aggregate can exceed 2^53 in magnitude",
            hint="Its bounds, derived from the policy, are too wide to compute exactly; scale it down.",
        )
    return Bounded(node, lower, upper, integer, nullable, 0 if integer else tiny)


def _number(node: exp.Expression) -> float | None:
    if isinstance(node, exp.Neg):
        inner = _number(node.this)
        return None if inner is None else -inner
    if isinstance(node, exp.Paren):
        return _number(node.this)
    if isinstance(node, exp.Literal) and not node.is_string:
        return float(node.name)
    return None


def bound(node: exp.Expression, resolve: Resolve, check_predicate: CheckPredicate) -> Bounded:
    """The interval of ``node`` for every possible row, or a refusal naming what is unbounded."""
    constant = _number(node)
    if constant is not None:
        literal = exp.Literal.number(int(abs(constant)) if constant.is_integer() else abs(constant))
        sql = exp.Neg(this=literal) if constant < 0 else literal
        return _checked(sql, constant, constant, constant.is_integer(), False, _exponent(constant))
    if isinstance(node, exp.Paren):
        inner = bound(node.this, resolve, check_predicate)
        return dataclasses.replace(inner, sql=exp.paren(inner.sql, copy=False))
    if isinstance(node, exp.Column):
        column, policy = resolve(node)
        if not policy.numeric:
            raise UndefinedFunction(
                f"operator does not exist: arithmetic on {PG_TYPE_NAMES[policy.type]}",
                hint=f'"{node.name}" is not numeric.',
            )
        if not policy.bounded:
            raise FeatureNotSupported(
                f'column "{node.name}" has no declared bounds',
                hint=f'Declare lower/upper for "{node.name}" so expressions over it have a finite sensitivity.',
            )
        integer = policy.type == "int"
        # clamped in the stored type first: a stored value beyond BIGINT or ±infinity never reaches a cast
        clamped = clamp_sql(column, bound_literal(policy.lower, policy), bound_literal(policy.upper, policy))
        if not integer:
            snap = exp.Literal.number(2.0**SNAP_EXPONENT)
            near_zero = exp.and_(
                exp.GT(this=column.copy(), expression=exp.Neg(this=snap)),
                exp.LT(this=column.copy(), expression=snap.copy()),
            )
            clamped.set("default", None)
            assert isinstance(clamped, exp.Case)
            clamped = clamped.when(near_zero, exp.Literal.number(0)).else_(column.copy())
        typed = exp.cast(clamped, exp.DataType.Type.BIGINT if integer else exp.DataType.Type.DOUBLE)
        return _checked(typed, float(policy.lower), float(policy.upper), integer, policy.nullable, SNAP_EXPONENT)  # type: ignore[arg-type]
    if isinstance(node, exp.Neg):
        inner = bound(node.this, resolve, check_predicate)
        return _checked(exp.Neg(this=inner.sql), -inner.upper, -inner.lower, inner.integer, inner.nullable, inner.tiny)
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div):
        return _arithmetic(node, bound(node.this, resolve, check_predicate),
                           bound(node.expression, resolve, check_predicate))  # fmt: skip
    if isinstance(node, exp.Abs):
        inner = bound(node.this, resolve, check_predicate)
        low = 0.0 if inner.lower <= 0 <= inner.upper else min(abs(inner.lower), abs(inner.upper))
        high = max(abs(inner.lower), abs(inner.upper))
        return _checked(exp.Abs(this=inner.sql), low, high, inner.integer, inner.nullable, inner.tiny)
    if isinstance(node, exp.Coalesce):
        parts = [bound(a, resolve, check_predicate) for a in [node.this, *node.expressions]]
        return _checked(
            exp.Coalesce(this=parts[0].sql, expressions=[p.sql for p in parts[1:]]),
            min(p.lower for p in parts),
            max(p.upper for p in parts),
            all(p.integer for p in parts),
            all(p.nullable for p in parts),
            min(p.tiny for p in parts),
        )
    if isinstance(node, exp.Case):
        return _case(node, resolve, check_predicate)
    if isinstance(node, exp.Extract):
        return _extract(node, resolve)
    raise FeatureNotSupported(
        f"{node.key.upper()} is not supported inside an aggregate",
        hint="Aggregates may contain + - * /, ABS, COALESCE, CASE WHEN and EXTRACT over bounded columns.",
    )


def _arithmetic(node: exp.Expression, left: Bounded, right: Bounded) -> Bounded:
    nullable = left.nullable or right.nullable
    # doubles of magnitude >= 2^t are multiples of 2^(t-52): a non-zero sum or difference is at least that
    summed = min(left.tiny, right.tiny) - 53
    if isinstance(node, exp.Add):
        return _checked(exp.Add(this=left.sql, expression=right.sql), left.lower + right.lower,
                        left.upper + right.upper, left.integer and right.integer, nullable, summed)  # fmt: skip
    if isinstance(node, exp.Sub):
        return _checked(exp.Sub(this=left.sql, expression=right.sql), left.lower - right.upper,
                        left.upper - right.lower, left.integer and right.integer, nullable, summed)  # fmt: skip
    if isinstance(node, exp.Mul):
        corners = [a * b for a in (left.lower, left.upper) for b in (right.lower, right.upper)]
        return _checked(exp.Mul(this=left.sql, expression=right.sql), min(corners), max(corners),
                        left.integer and right.integer, nullable, left.tiny + right.tiny)  # fmt: skip
    if right.lower <= 0 <= right.upper:
        raise FeatureNotSupported(
            "division by an expression that can be zero",
            hint="The divisor's bounds include 0, so some row could fail; divide by a range that excludes 0.",
        )
    if left.integer and right.integer:
        raise FeatureNotSupported(
            "integer division inside an aggregate is not supported",
            hint="Write a decimal divisor (x / 2.0) for exact division.",
        )
    corners = [a / b for a in (left.lower, left.upper) for b in (right.lower, right.upper)]
    quotient = exp.Div(this=exp.cast(left.sql, exp.DataType.Type.DOUBLE), expression=right.sql)
    reach = max(abs(right.lower), abs(right.upper))
    return _checked(quotient, min(corners), max(corners), False, nullable, left.tiny - _exponent(reach) - 1)


def _case(node: exp.Case, resolve: Resolve, check_predicate: CheckPredicate) -> Bounded:
    if node.this is not None:
        raise FeatureNotSupported(
            "CASE <value> WHEN ... is not supported inside an aggregate", hint="Write CASE WHEN <condition> THEN ..."
        )
    branches = []
    result = exp.Case()
    for when in node.args.get("ifs") or []:
        checkpoint()
        value = bound(when.args["true"], resolve, check_predicate)
        # in place (Case.when copies the whole CASE by default: quadratic in the branches)
        result.when(check_predicate(when.this).copy(), value.sql.copy(), copy=False)
        branches.append(value)
    default = node.args.get("default")
    if default is not None:
        value = bound(default, resolve, check_predicate)
        result.else_(value.sql.copy(), copy=False)
        branches.append(value)
    return _checked(
        result,
        min(b.lower for b in branches),
        max(b.upper for b in branches),
        all(b.integer for b in branches),
        default is None or any(b.nullable for b in branches),
        min(b.tiny for b in branches),
    )


def _extract(node: exp.Extract, resolve: Resolve) -> Bounded:
    word = node.this.name.lower() if isinstance(node.this, exp.Var | exp.Identifier) else str(node.this).lower()
    if not isinstance(node.expression, exp.Column):
        raise FeatureNotSupported("EXTRACT needs a date or timestamp column")
    column, policy = resolve(node.expression)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function extract(unknown, {PG_TYPE_NAMES[policy.type]}) does not exist")
    part = date_unit(word, "extract", "date" if policy.type == "date" else "timestamp without time zone")
    if part == "year":
        if not policy.bounded:
            raise FeatureNotSupported(f'column "{node.expression.name}" has no declared bounds')
        low, high = policy.lower, policy.upper
        assert isinstance(low, dt.date) and isinstance(high, dt.date)
        bounds = (low.year, high.year)
    elif part in _DATE_PARTS:
        bounds = _DATE_PARTS[part]
    else:
        raise FeatureNotSupported(f'EXTRACT("{word}") is not supported inside an aggregate')
    # clamped first: EXTRACT(year FROM 'infinity') is infinite on PostgreSQL (and fails as BIGINT), NULL on DuckDB
    low_date, high_date = (policy.lower, policy.upper) if policy.bounded else (dt.date(1, 1, 1), dt.date(9999, 12, 31))
    clamped = clamp_sql(column, bound_literal(low_date, policy), bound_literal(high_date, policy))
    sql = exp.cast(exp.Extract(this=exp.var(part.upper()), expression=clamped), exp.DataType.Type.BIGINT)
    return _checked(sql, float(bounds[0]), float(bounds[1]), True, policy.nullable)
