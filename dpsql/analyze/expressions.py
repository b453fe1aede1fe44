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

from dpsql.analyze.arith import evaluate, render
from dpsql.backends import cancellable
from dpsql.errors import DivisionByZero, FeatureNotSupported, InvalidParameterValue, UndefinedFunction
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
    # each argument copied once per use (``when`` would copy again what is built here)
    return (
        exp.Case()
        .when(exp.LT(this=value.copy(), expression=lower.copy()), lower.copy(), copy=False)
        .when(exp.GT(this=value.copy(), expression=upper.copy()), upper.copy(), copy=False)
        .else_(value.copy(), copy=False)
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


def _constant(node: exp.Expression) -> Bounded | None:
    """A numeric constant (``2``, ``2.0``, ``-0.5``, ``CAST(1 AS BIGINT)``), typed by its spelling as
    PostgreSQL types it: ``2.0`` is numeric, not an integer, so ``x / 2.0`` is exact division."""
    if not isinstance(node, exp.Literal | exp.Neg | exp.Paren | exp.Cast) or node.find(exp.Column):
        return None
    number = evaluate(node)
    if number is None:
        return None
    value = float(number.value)
    integer = number.kind in ("smallint", "integer", "bigint")
    return _checked(render(number), value, value, integer, False, _exponent(value))


def bound(node: exp.Expression, resolve: Resolve, check_predicate: CheckPredicate) -> Bounded:
    """The interval of ``node`` for every possible row, or a refusal naming what is unbounded."""
    constant = _constant(node)
    if constant is not None:
        return constant
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
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div | exp.Mod):
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
    if isinstance(node, exp.Cast):
        return _cast(node, resolve, check_predicate)
    raise FeatureNotSupported(
        f"{node.key.upper()} is not supported inside an aggregate",
        hint="Aggregates may contain + - * / %, ABS, COALESCE, CASE WHEN, EXTRACT and CAST to a number over "
        "bounded columns.",
    )


_FLOAT_TYPES = (exp.DataType.Type.DOUBLE, exp.DataType.Type.FLOAT, exp.DataType.Type.DECIMAL)
#: Integer cast targets and their ranges: a clamped value beyond one would fail on some rows only.
_INTEGER_TYPES = {
    exp.DataType.Type.SMALLINT: ("smallint", 2**15),
    exp.DataType.Type.INT: ("integer", 2**31),
    exp.DataType.Type.BIGINT: ("bigint", 2**63),
}
_CAST_HINT = "Inside an aggregate, cast bounded numbers (or a boolean) to DOUBLE PRECISION, NUMERIC, INTEGER or BIGINT."


def _cast(node: exp.Cast, resolve: Resolve, check_predicate: CheckPredicate) -> Bounded:
    """``CAST(x AS DOUBLE PRECISION | NUMERIC | REAL | INTEGER | BIGINT | SMALLINT)`` of a bounded number, and
    ``CAST(flag AS INTEGER)`` of a boolean (1, 0 or NULL). Computed in double precision (NUMERIC and REAL
    too: no declared precision to overflow, and DuckDB's bare DECIMAL would be DECIMAL(18,3)); a double
    to an integer rounds half to even on both backends (rint), within the declared bounds so it cannot
    overflow. Text is never cast: it could fail on some rows only."""
    target = node.to.this
    if isinstance(node.this, exp.Column):
        column, policy = resolve(node.this)
        if policy.type == "boolean" and target in _INTEGER_TYPES:
            flag = (
                exp.Case().when(column, exp.Literal.number(1)).when(exp.Not(this=column.copy()), exp.Literal.number(0))
            )
            return _checked(exp.cast(flag, exp.DataType.Type.BIGINT), 0.0, 1.0, True, policy.nullable)
        if not policy.numeric:
            raise FeatureNotSupported(
                f'CAST of {PG_TYPE_NAMES[policy.type]} column "{node.this.name}" to {node.to.sql("postgres").lower()} '
                "is not supported inside an aggregate",
                hint=f"A cast of stored {PG_TYPE_NAMES[policy.type]} could fail on some rows only. " + _CAST_HINT,
            )
    if target in _FLOAT_TYPES and not node.to.expressions:
        inner = bound(node.this, resolve, check_predicate)
        return _checked(exp.cast(inner.sql, exp.DataType.Type.DOUBLE), inner.lower, inner.upper, False,
                        inner.nullable, inner.tiny if not inner.integer else 0)  # fmt: skip
    if target in _INTEGER_TYPES:
        name, limit = _INTEGER_TYPES[target]
        inner = bound(node.this, resolve, check_predicate)
        lower, upper = float(round(inner.lower)), float(round(inner.upper))  # half to even, as rint
        if lower < -limit or upper >= limit:
            raise FeatureNotSupported(
                f"CAST to {name} inside an aggregate could overflow",
                hint=f"The expression's bounds, [{inner.lower:g}, {inner.upper:g}], exceed the {name} range.",
            )
        sql = inner.sql if inner.integer else exp.cast(inner.sql, exp.DataType.Type.BIGINT)
        return _checked(sql, lower, upper, True, inner.nullable)
    raise FeatureNotSupported(
        f"CAST to {node.to.sql('postgres').lower()} is not supported inside an aggregate", hint=_CAST_HINT
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
    if isinstance(node, exp.Mod):
        return _remainder(left, right)
    return _quotient(left, right)


def _remainder(left: Bounded, right: Bounded) -> Bounded:
    """``left % right`` of integers: the remainder has the dividend's sign and is smaller than the
    divisor in magnitude (PostgreSQL, DuckDB and Spark alike); a divisor that can be 0 is read through
    NULLIF (NULL, not an error on that row only). PostgreSQL has no ``%`` on doubles: refused."""
    if not (left.integer and right.integer):
        raise UndefinedFunction(
            "operator does not exist: double precision % double precision",
            hint="% takes integers; round first (CAST(x AS INTEGER)).",
        )
    divisor = right.sql
    if right.lower <= 0 <= right.upper:
        if right.lower == right.upper == 0:
            raise DivisionByZero("division by zero")
        divisor = exp.Nullif(this=right.sql, expression=exp.Literal.number(0))
    reach = max(abs(right.lower), abs(right.upper)) - 1
    lower = 0.0 if left.lower >= 0 else -min(reach, abs(left.lower))
    upper = 0.0 if left.upper <= 0 else min(reach, left.upper)
    nullable = left.nullable or right.nullable or divisor is not right.sql
    return _checked(exp.Mod(this=left.sql, expression=divisor), lower, upper, True, nullable)


def _quotient(left: Bounded, right: Bounded) -> Bounded:
    """``left / right``, never failing: a divisor whose bounds include 0 is read through ``NULLIF(d, 0)``
    (a row dividing by zero gives NULL, which aggregates skip and WHERE does not match, rather than an
    error on that row only); then, being an integer, its magnitude is at least 1. A float divisor near 0
    would make the quotient unbounded: refused. Integer by integer truncates toward zero, as
    PostgreSQL's ``/`` does (DuckDB's would not): computed as the double quotient, truncated, which is
    exact while the dividend stays below 2^53 in magnitude."""
    divisor = right.sql
    pieces = [(right.lower, right.upper)]
    nullable = left.nullable or right.nullable
    if right.lower <= 0 <= right.upper:
        if right.lower == right.upper == 0:
            raise DivisionByZero("division by zero")
        if not right.integer:
            raise FeatureNotSupported(
                "division by an expression that can be zero",
                hint="Its bounds include 0 and it is not an integer, so the quotient is unbounded; divide by "
                "an expression whose bounds exclude 0, or by an integer one (a row dividing by 0 then gives NULL).",
            )
        divisor = exp.Nullif(this=right.sql, expression=exp.Literal.number(0))
        pieces = [p for p in ((right.lower, -1.0), (1.0, right.upper)) if p[0] <= p[1]]
        nullable = True
    corners = [a / b for a in (left.lower, left.upper) for piece in pieces for b in piece]
    quotient = exp.Div(this=exp.cast(left.sql, exp.DataType.Type.DOUBLE), expression=divisor)
    if left.integer and right.integer:
        if max(abs(left.lower), abs(left.upper)) >= MAX_MAGNITUDE:
            raise FeatureNotSupported(
                "integer division of values reaching 2^53 is not supported",
                hint="Scale the dividend down, or divide by a decimal (x / 2.0) for exact division.",
            )
        # toward zero: FLOOR above 0, CEIL below (TRUNC is a date function on Spark)
        truncated = (
            exp.Case()
            .when(exp.GTE(this=quotient, expression=exp.Literal.number(0)), exp.Floor(this=quotient.copy()))
            .else_(exp.Ceil(this=quotient.copy()))
        )
        low, high = float(math.trunc(min(corners))), float(math.trunc(max(corners)))
        return _checked(exp.cast(truncated, exp.DataType.Type.BIGINT), low, high, True, nullable)
    reach = max(abs(b) for piece in pieces for b in piece)
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
