"""GROUP BY expressions: their SQL over clamped columns and, when it is finite, their derived domain.

A key such as ``DATE_TRUNC('month', visit_date)`` has a finite set of possible values that follows
from the policy alone (the column's declared bounds): 60 months for 2020-01-01..2024-12-31. Such a
key is released exactly like a declared ``domain``: every value of the derived domain gets a row
(a noisy zero when nobody is in it), values outside it never appear, and no partition selection
(no δ) is needed. The domain is computed here, in Python, from the policy and the SQL text only,
never from data, so which rows are released cannot depend on any person.

The key is computed by the backend on columns **clamped to their bounds first** (as inside
aggregates, :mod:`dpsql.analyze.expressions`): a stored value outside the bounds (±infinity, NaN,
a huge number) lands in an edge bucket of the domain instead of creating a new group or failing.

Constant constraints of WHERE narrow the domain (:func:`narrow_policies`): ``WHERE problem =
'Asthma' GROUP BY problem`` releases one row, ``IS NOT NULL`` drops the NULL group, a date range
keeps only the months inside it. Narrowing reads only the query's constants: still no data.

Keys whose domain is infinite or unknown (a float expression, an unbounded column) are computed
the same way and go through DP partition selection like undeclared columns. A derived domain larger
than :data:`MAX_DERIVED_GROUPS` is refused (54000): coarsen the key or narrow it with WHERE.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.analyze.expressions import (
    MAX_MAGNITUDE,
    UNDERFLOW_EXPONENT,
    _bound_literal,
    _exponent,
    bound,
    checkpoint,
    clamp_sql,
    date_unit,
)
from dpsql.analyze.fold import Interval, parse_interval
from dpsql.errors import (
    DatatypeMismatch,
    DatetimeFieldOverflow,
    FeatureNotSupported,
    ProgramLimitExceeded,
    UndefinedFunction,
)
from dpsql.pgtypes import PgType
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, Scalar

#: Largest derived domain one GROUP BY key may release (documented in the README).
MAX_DERIVED_GROUPS = 10_000

Resolve = Callable[[exp.Column], tuple[exp.Column, ColumnPolicy]]
CheckPredicate = Callable[[exp.Expression], exp.Expression]

#: Earliest and latest dates an unbounded date column is clamped to (so ±infinity never reaches a function).
_MIN_DATE, _MAX_DATE = dt.date(1, 1, 1), dt.date(9999, 12, 31)
_TRUNC_UNITS = ("year", "quarter", "month", "week", "day", "hour")


@dataclass(frozen=True, slots=True)
class KeyExpr:
    """A GROUP BY expression: its SQL (columns qualified and clamped) and what it can take.

    ``values`` is the finite derived domain (``None`` included when the key can be NULL) or
    ``None`` when the domain is infinite or unknown; then ``lower``/``upper`` bound a numeric key.
    """

    sql: exp.Expression
    type: PgType
    values: tuple[Scalar, ...] | None
    nullable: bool
    lower: float | None = None
    upper: float | None = None
    #: log2 of a lower bound on every non-zero magnitude (doubles): products that could underflow are
    #: refused, as inside aggregates (PostgreSQL raises "underflow" where DuckDB returns 0).
    tiny: int = 0

    @property
    def numeric(self) -> bool:
        return self.type in ("bigint", "integer", "smallint", "double precision", "numeric")


def _too_many(node: exp.Expression, size: int) -> ProgramLimitExceeded:
    return ProgramLimitExceeded(
        f'GROUP BY key "{node.sql(dialect="postgres")}" would release {size} groups (more than {MAX_DERIVED_GROUPS})',
        hint="Coarsen the key (a wider DATE_TRUNC unit, a larger FLOOR step, fewer buckets) or narrow it with WHERE.",
    )


def _finite(node: exp.Expression, values: Iterable[Scalar | None], nullable: bool) -> tuple[Scalar, ...]:
    """Distinct non-NULL values in order, NULL last when nullable; refuses more than the cap."""
    out: list[Scalar] = []
    for value in dict.fromkeys(v for v in values if v is not None):
        out.append(value)
        if len(out) > MAX_DERIVED_GROUPS:
            raise _too_many(node, len(out))
    out.sort(key=_order)
    return (*out, None) if nullable else tuple(out)


def _order(value: Scalar) -> tuple[bool, Any]:
    """Domain order: numbers, dates and booleans ascending, then text."""
    return isinstance(value, str), value


def _range(node: exp.Expression, low: int, high: int, nullable: bool) -> tuple[Scalar, ...]:
    if high - low + 1 > MAX_DERIVED_GROUPS:
        raise _too_many(node, high - low + 1)
    return _finite(node, range(low, high + 1), nullable)


# --- dates ---------------------------------------------------------------------------


def _as_datetime(value: object) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value
    assert isinstance(value, dt.date)
    return dt.datetime(value.year, value.month, value.day)


def truncate(unit: str, value: dt.datetime) -> dt.datetime:
    """PostgreSQL's ``date_trunc(unit, value)`` for a timestamp without time zone."""
    if unit == "year":
        return dt.datetime(value.year, 1, 1)
    if unit == "quarter":
        return dt.datetime(value.year, 3 * ((value.month - 1) // 3) + 1, 1)
    if unit == "month":
        return dt.datetime(value.year, value.month, 1)
    if unit == "week":  # ISO weeks start on Monday
        day = value.date() - dt.timedelta(days=value.weekday())
        return dt.datetime(day.year, day.month, day.day)
    if unit == "day":
        return dt.datetime(value.year, value.month, value.day)
    return value.replace(minute=0, second=0, microsecond=0)


def _next(unit: str, value: dt.datetime) -> dt.datetime:
    if unit in ("year", "quarter", "month"):
        months = {"year": 12, "quarter": 3, "month": 1}[unit]
        index = value.year * 12 + value.month - 1 + months
        return dt.datetime(index // 12, index % 12 + 1, 1) if index // 12 <= 9999 else dt.datetime.max
    step = {"week": dt.timedelta(days=7), "day": dt.timedelta(days=1), "hour": dt.timedelta(hours=1)}[unit]
    return value + step if value <= dt.datetime.max - step else dt.datetime.max


def _date_bounds(policy: ColumnPolicy) -> tuple[dt.datetime, dt.datetime]:
    if policy.bounded:
        return _as_datetime(policy.lower), _as_datetime(policy.upper)
    return _as_datetime(_MIN_DATE), dt.datetime(9999, 12, 31, 23, 59, 59)


def _clamped_date(column: exp.Column, policy: ColumnPolicy) -> exp.Expression:
    """A date/timestamp column clamped to its bounds (year 1..9999 when it has none): ±infinity never
    reaches DATE_TRUNC or EXTRACT, whose results on it differ between backends."""
    low, high = (policy.lower, policy.upper) if policy.bounded else (_MIN_DATE, _MAX_DATE)
    return clamp_sql(column, _bound_literal(low, policy), _bound_literal(high, policy))


def _date_values(policy: ColumnPolicy) -> list[dt.datetime] | None:
    """The column's possible values when WHERE pinned them to a finite set (``narrow_policies``)."""
    if policy.domain is None:
        return None
    return [_as_datetime(v) for v in policy.domain if v is not None]


def _to_timestamp(target: exp.Expression) -> bool:
    return isinstance(target, exp.Cast) and target.to.this == exp.DataType.Type.TIMESTAMP


def _trunc(node: exp.Expression, word: str, target: exp.Expression, resolve: Resolve) -> KeyExpr:
    cast_to_timestamp = _to_timestamp(target)
    column, policy = _time_column("DATE_TRUNC", target, resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function date_trunc(unknown, {PG_TYPE_NAMES[policy.type]}) does not exist")
    # PostgreSQL resolves date_trunc(text, date) to its timestamptz form (midnight UTC in dpsql's UTC session)
    pg_type: PgType = "timestamp with time zone" if policy.type == "date" and not cast_to_timestamp else "timestamp"
    unit = date_unit(word, "date_trunc", "timestamp without time zone" if pg_type == "timestamp" else pg_type)
    if unit not in _TRUNC_UNITS:
        raise FeatureNotSupported(
            f'DATE_TRUNC("{word}") is not supported in GROUP BY', hint="Use year, quarter, month, week, day or hour."
        )
    truncated = exp.TimestampTrunc(this=_clamped_date(column, policy), unit=exp.var(unit.upper()))
    sql = exp.cast(truncated, exp.DataType.Type.TIMESTAMP)
    pinned = _date_values(policy)
    if pinned is not None:
        return KeyExpr(sql, pg_type, _finite(node, (truncate(unit, v) for v in pinned), policy.nullable), False)
    if not policy.bounded:
        return KeyExpr(sql, pg_type, None, policy.nullable)
    low, high = _date_bounds(policy)
    values: list[dt.datetime] = []
    current, last = truncate(unit, low), truncate(unit, high)
    while current <= last:
        values.append(current)
        if len(values) > MAX_DERIVED_GROUPS:
            raise _too_many(node, _count_buckets(unit, current, last, len(values)))
        current = _next(unit, current)
    return KeyExpr(sql, pg_type, _finite(node, values, policy.nullable), policy.nullable)


def _time_column(function: str, target: exp.Expression, resolve: Resolve) -> tuple[exp.Column, ColumnPolicy]:
    """The column under DATE_TRUNC or EXTRACT, through a cast that keeps every value (Tableau's
    ``CAST(visit_date AS DATE)`` of a date column, a date or timestamp cast to timestamp): the key is
    computed on the clamped column itself, so the cast cannot fail on some rows only."""
    cast_to = None
    if isinstance(target, exp.Cast) and isinstance(target.this, exp.Column) and not target.to.expressions:
        cast_to, target = target.to.this, target.this
    if not isinstance(target, exp.Column):
        raise FeatureNotSupported(f"{function} in GROUP BY needs a date or timestamp column")
    column, policy = resolve(target)
    keeps = cast_to is None or (
        policy.type in ("date", "timestamp")
        and (cast_to == exp.DataType.Type.TIMESTAMP or (cast_to == exp.DataType.Type.DATE and policy.type == "date"))
    )
    if not keeps:
        raise FeatureNotSupported(f"{function} in GROUP BY needs a date or timestamp column")
    return column, policy


def _count_buckets(unit: str, current: dt.datetime, last: dt.datetime, seen: int) -> int:
    """How many buckets remain (for the refusal's message), without enumerating them all."""
    span = last - current
    per = {"week": 7 * 86400, "day": 86400, "hour": 3600}.get(unit)
    if per is not None:
        return seen + int(span.total_seconds() // per)
    months = (last.year - current.year) * 12 + last.month - current.month
    return seen + months // {"year": 12, "quarter": 3, "month": 1}[unit]


def _bin_stride(node: exp.Expression) -> int:
    """date_bin's stride in microseconds, refused as PostgreSQL refuses it (months: 0A000, ≤ 0: 22008)."""
    value: object = None
    if isinstance(node, exp.Interval) and isinstance(node.this, exp.Literal):
        unit = node.args.get("unit")
        value = parse_interval(f"{node.this.name} {unit.name.lower()}" if unit is not None else node.this.name)
    elif isinstance(node, exp.Literal) and node.is_string:
        value = parse_interval(node.name)
    elif (
        isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal) and node.to.this == exp.DataType.Type.INTERVAL
    ):
        value = parse_interval(node.this.name)
    if not isinstance(value, Interval):
        raise FeatureNotSupported(
            "date_bin in GROUP BY needs a constant stride", hint="Write date_bin('15 minutes', column, origin)."
        )
    if value.months:
        raise FeatureNotSupported("timestamps cannot be binned into intervals containing months or years")
    micros = value.days * 86_400_000_000 + value.micros
    if not -(2**63) <= micros < 2**63:  # PostgreSQL computes the stride in 64-bit microseconds
        raise DatetimeFieldOverflow("interval out of range")
    if micros <= 0:
        raise DatetimeFieldOverflow("stride must be greater than zero")
    return micros


def _bin_origin(node: exp.Expression | None) -> tuple[dt.datetime, str]:
    """date_bin's origin and how PostgreSQL types it: ``timestamp``, ``date`` or ``unknown`` (a bare string,
    which sqlglot reads as a Var). Anything but a constant is refused: the bins must follow from the query."""
    if node is None:
        raise UndefinedFunction("function date_bin(unknown, timestamp without time zone) does not exist")
    text, kind = None, "unknown"
    if isinstance(node, exp.Var) or (isinstance(node, exp.Literal) and node.is_string):
        text = node.name
    elif (
        isinstance(node, exp.Cast)
        and isinstance(node.this, exp.Literal)
        and node.this.is_string
        and node.to.this in (exp.DataType.Type.DATE, exp.DataType.Type.TIMESTAMP)
    ):
        text, kind = node.this.name, "date" if node.to.this == exp.DataType.Type.DATE else "timestamp"
    try:
        origin = dt.datetime.fromisoformat(text.strip()) if text is not None else None
    except ValueError:
        origin = None
    if origin is None or origin.tzinfo is not None:
        raise FeatureNotSupported(
            "date_bin in GROUP BY needs a constant origin without time zone",
            hint="Write date_bin('15 minutes', column, TIMESTAMP '2000-01-01').",
        )
    return origin, kind


def date_bin(stride: int, value: dt.datetime, origin: dt.datetime) -> dt.datetime:
    """PostgreSQL's ``date_bin(stride, value, origin)`` (stride in µs): floors toward −∞, before the origin too."""
    diff = (value - origin) // dt.timedelta(microseconds=1)
    return origin + dt.timedelta(microseconds=diff - diff % stride)


def _date_bin(node: exp.DateBin, resolve: Resolve) -> KeyExpr:
    """``date_bin(stride, column, origin)`` over a clamped date/timestamp column (Grafana, Superset time grains).

    Computed as DATE_BIN on PostgreSQL and TIME_BUCKET on DuckDB over timestamps, with the stride in
    microseconds (both floor toward −∞ from the origin, as PostgreSQL ≥ 14.2 does); the domain is every
    bin from bin(lower) to bin(upper), from the policy's (WHERE-narrowed) bounds: no data. Typed as
    PostgreSQL types it: ``timestamp with time zone`` for a date column and an untyped or date origin
    (PostgreSQL then resolves ``date_bin(interval, timestamptz, timestamptz)``; the session is UTC, so
    the bins are the same instants), ``timestamp`` otherwise.
    """
    stride = _bin_stride(node.this)
    given = node.args.get("origin") or node.args.get("unit")  # sqlglot reads the third argument as a unit
    origin, origin_kind = _bin_origin(given)
    if isinstance(given, exp.Var):  # shown as written ('2001-01-01') in messages
        node = node.copy()
        node.set("unit", None)
        node.set("origin", exp.Literal.string(given.name))
    target = node.expression
    cast_to_timestamp = isinstance(target, exp.Cast) and target.to.this == exp.DataType.Type.TIMESTAMP
    column, policy = _time_column("date_bin", target, resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function date_bin(unknown, {PG_TYPE_NAMES[policy.type]}, unknown) does not exist")
    source_date = policy.type == "date" and not cast_to_timestamp
    pg_type: PgType = "timestamp with time zone" if source_date and origin_kind != "timestamp" else "timestamp"
    stamp = exp.DataType.Type.TIMESTAMP
    binned = exp.DateBin(
        this=exp.cast(exp.Literal.string(f"{stride} microseconds"), exp.DataType.Type.INTERVAL),
        expression=exp.cast(_clamped_date(column, policy), stamp),
        origin=exp.cast(exp.Literal.string(origin.isoformat(sep=" ")), stamp),
    )
    sql = exp.cast(binned, stamp)
    pinned = _date_values(policy)
    try:
        if pinned is not None:
            bins = (date_bin(stride, v, origin) for v in pinned)
            return KeyExpr(sql, pg_type, _finite(node, bins, policy.nullable), False)
        low, high = _date_bounds(policy)
        first, last = date_bin(stride, low, origin), date_bin(stride, high, origin)
    except OverflowError:
        raise FeatureNotSupported(
            "date_bin in GROUP BY would produce bins outside years 1 to 9999",
            hint="Bound the column or move the origin closer to its values.",
        ) from None
    if not policy.bounded:
        return KeyExpr(sql, pg_type, None, policy.nullable)
    # in integer microseconds: a stride wider than Python's timedelta (~2.7 million years) is one bin
    count = (last - first) // dt.timedelta(microseconds=1) // stride + 1
    if count > MAX_DERIVED_GROUPS:
        raise _too_many(node, count)
    bins = (first + dt.timedelta(microseconds=stride * i) for i in range(count))
    return KeyExpr(sql, pg_type, _finite(node, bins, policy.nullable), policy.nullable)


#: EXTRACT fields, PostgreSQL's value for a timestamp, and their range.
_FIELDS: dict[str, tuple[Callable[[dt.datetime], int], int, int]] = {
    "month": (lambda v: v.month, 1, 12),
    "day": (lambda v: v.day, 1, 31),
    "dow": (lambda v: v.isoweekday() % 7, 0, 6),
    "isodow": (lambda v: v.isoweekday(), 1, 7),
    "doy": (lambda v: v.timetuple().tm_yday, 1, 366),
    "quarter": (lambda v: (v.month - 1) // 3 + 1, 1, 4),
    "week": (lambda v: v.isocalendar()[1], 1, 53),
    "hour": (lambda v: v.hour, 0, 23),
    "minute": (lambda v: v.minute, 0, 59),
    "year": (lambda v: v.year, 1, 9999),
}


def _extract(node: exp.Extract, resolve: Resolve) -> KeyExpr:
    word = node.this.name.lower() if isinstance(node.this, exp.Var | exp.Identifier) else str(node.this).lower()
    column, policy = _time_column("EXTRACT", node.expression, resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function extract(unknown, {PG_TYPE_NAMES[policy.type]}) does not exist")
    as_date = policy.type == "date" and not _to_timestamp(node.expression)
    part = date_unit(word, "extract", "date" if as_date else "timestamp without time zone")
    clamped = _clamped_date(column, policy)
    pinned = _date_values(policy)
    if part == "epoch":
        # computed as a double on every backend (exact below 2^53), typed numeric as PostgreSQL ≥ 14 types EXTRACT
        sql = exp.cast(exp.Extract(this=exp.var("EPOCH"), expression=clamped), exp.DataType.Type.DOUBLE)
        epoch = dt.datetime(1970, 1, 1)
        if pinned is not None:
            return KeyExpr(sql, "numeric", _finite(node, ((v - epoch).total_seconds() for v in pinned),
                                                            policy.nullable), False)  # fmt: skip
        low, high = _date_bounds(policy)
        lower, upper = (low - epoch).total_seconds(), (high - epoch).total_seconds()
        if policy.type == "date" and policy.bounded:
            days = (high - low).days
            if days + 1 > MAX_DERIVED_GROUPS:
                return KeyExpr(sql, "numeric", None, policy.nullable, lower, upper, _exponent(1e-6))
            values = (lower + 86400.0 * i for i in range(days + 1))
            return KeyExpr(sql, "numeric", _finite(node, values, policy.nullable), policy.nullable)
        return KeyExpr(sql, "numeric", None, policy.nullable, lower, upper, _exponent(1e-6))
    if part not in _FIELDS:
        raise FeatureNotSupported(f'EXTRACT("{word}") is not supported in GROUP BY')
    field, low_value, high_value = _FIELDS[part]
    sql = exp.cast(exp.Extract(this=exp.var(part.upper()), expression=clamped), exp.DataType.Type.BIGINT)
    if pinned is not None:
        return KeyExpr(sql, "numeric", _finite(node, map(field, pinned), policy.nullable), False)
    if part == "year":
        low, high = _date_bounds(policy)
        low_value, high_value = low.year, high.year
    elif part in ("hour", "minute") and policy.type == "date":
        low_value = high_value = 0
    return KeyExpr(
        sql, "numeric", _range(node, low_value, high_value, policy.nullable), policy.nullable, low_value, high_value
    )


# --- numbers -------------------------------------------------------------------------


def _literal(node: exp.Expression) -> Scalar | type[exp.Expression] | None:
    """The Python value of a literal (``exp.Expression`` as a marker when ``node`` is none)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Neg):
        inner = _literal(node.this)
        return -inner if isinstance(inner, int | float) and not isinstance(inner, bool) else exp.Expression
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        number = float(node.name)
        if not math.isfinite(number):
            raise FeatureNotSupported("GROUP BY constants must be finite")
        return int(node.name) if node.name.lstrip("-").isdigit() else number
    return exp.Expression


def _number_sql(value: float | int) -> exp.Expression:
    literal = exp.Literal.number(abs(value))
    return exp.Neg(this=literal) if value < 0 else literal


#: PostgreSQL's integer types, narrowest first, with their ranges.
_INTEGERS: dict[str, tuple[int, int]] = {
    "smallint": (-(2**15), 2**15 - 1),
    "integer": (-(2**31), 2**31 - 1),
    "bigint": (-(2**63), 2**63 - 1),
}


def _literal_type(value: int | float) -> PgType:
    """How PostgreSQL types a numeric literal: integer when it fits in 32 bits, bigint, else numeric (``2.5``)."""
    if isinstance(value, float):
        return "numeric"
    return "integer" if _INTEGERS["integer"][0] <= value <= _INTEGERS["integer"][1] else "bigint"


def _promote(left: PgType, right: PgType) -> PgType:
    """PostgreSQL's result type of ``left op right``: the wider integer, numeric over integers, double over all."""
    if "double precision" in (left, right):
        return "double precision"
    if left in _INTEGERS and right in _INTEGERS:
        return max(left, right, key=list(_INTEGERS).index)
    return "numeric"


def _fits(node: exp.Expression, key: KeyExpr) -> KeyExpr:
    """Refuses a smallint/integer key whose derived range exceeds its type (PostgreSQL raises 22003 on the rows
    that overflow, which would depend on data; the key is computed in bigint, so it is refused up front)."""
    if key.type not in ("smallint", "integer"):
        return key
    low, high = _INTEGERS[key.type]
    values = [v for v in key.values if v is not None] if key.values is not None else [key.lower, key.upper]
    if any(v is None or not low <= v <= high for v in values):  # type: ignore[operator]
        raise FeatureNotSupported(
            f'GROUP BY key "{node.sql(dialect="postgres")}" can exceed the {key.type} range',
            hint="Cast it to bigint, or narrow the column's bounds.",
        )
    return key


def _numeric(node: exp.Expression, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    constant = _literal(node)
    if isinstance(constant, int | float) and not isinstance(constant, bool):
        pg_type = _literal_type(constant)
        return KeyExpr(_number_sql(constant), pg_type, (constant,), False, tiny=_exponent(float(constant)))
    key = derive(node, resolve, check_predicate)
    if not key.numeric:
        raise UndefinedFunction(f"operator does not exist: arithmetic on {key.type}")
    return key


def _integral(key: KeyExpr) -> bool:
    return key.type in _INTEGERS


def _pointwise(node: exp.Expression, left: KeyExpr, right: KeyExpr, op: Callable[[float, float], float]) -> KeyExpr:
    """Combine two numeric keys: finite × finite → finite (each pair evaluated as the backend would,
    in BIGINT or IEEE double), else an interval over the corners."""
    integral = _integral(left) and _integral(right) and not isinstance(node, exp.Div)
    nullable = left.nullable or right.nullable
    tiny = _tiny(node, left, right, integral)
    pg_type = _promote(left.type, right.type)
    sql_left = left.sql if integral else exp.cast(left.sql, exp.DataType.Type.DOUBLE)
    sql = node.__class__(this=sql_left, expression=right.sql)
    if left.values is not None and right.values is not None:
        lv = [v for v in left.values if v is not None]
        rv = [v for v in right.values if v is not None]
        if len(lv) * len(rv) <= 4 * MAX_DERIVED_GROUPS:
            results = []
            for a, b in itertools.product(lv, rv):
                value = op(a, b) if integral else op(float(a), float(b))  # type: ignore[arg-type]
                if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
                    raise _magnitude()
                results.append(int(value) if integral else float(value))
            return _fits(node, KeyExpr(sql, pg_type, _finite(node, results, nullable), nullable, tiny=tiny))
    lows = [_low(left), _high(left)]
    highs = [_low(right), _high(right)]
    corners = [op(a, b) for a in lows for b in highs]
    lower, upper = min(corners), max(corners)
    if not (math.isfinite(lower) and math.isfinite(upper)) or max(abs(lower), abs(upper)) > MAX_MAGNITUDE:
        raise _magnitude()
    return _fits(node, KeyExpr(sql, pg_type, None, nullable, lower, upper, tiny))


def _tiny(node: exp.Expression, left: KeyExpr, right: KeyExpr, integral: bool) -> int:
    """The underflow bound of ``left op right`` (expressions.py's rule), refused below 2^-1070."""
    if integral:
        return 0
    if isinstance(node, exp.Mul):
        tiny = left.tiny + right.tiny
    elif isinstance(node, exp.Div):
        tiny = left.tiny - _exponent(max(abs(_low(right)), abs(_high(right)))) - 1
    else:
        tiny = min(left.tiny, right.tiny) - 53
    if tiny < UNDERFLOW_EXPONENT:
        raise FeatureNotSupported(
            "a GROUP BY expression can underflow",
            hint="A product or quotient of these bounds can come within 2^-1070 of 0 without being 0; scale it up.",
        )
    return tiny


def _magnitude() -> FeatureNotSupported:
    return FeatureNotSupported(
        "a GROUP BY expression can exceed 2^53 in magnitude", hint="Its bounds, derived from the policy, are too wide."
    )


def _as_float(value: Scalar) -> float:
    if not isinstance(value, int | float):
        raise UndefinedFunction("operator does not exist: arithmetic on a non-numeric key")
    return float(value)


def _low(key: KeyExpr) -> float:
    if key.values is not None:
        return min(_as_float(v) for v in key.values if v is not None)
    if key.lower is None:
        raise FeatureNotSupported("a GROUP BY expression needs bounded columns", hint="Declare lower/upper bounds.")
    return key.lower


def _high(key: KeyExpr) -> float:
    if key.values is not None:
        return max(_as_float(v) for v in key.values if v is not None)
    if key.upper is None:
        raise FeatureNotSupported("a GROUP BY expression needs bounded columns", hint="Declare lower/upper bounds.")
    return key.upper


def _empty(key: KeyExpr) -> bool:
    return key.values is not None and all(v is None for v in key.values)


def _rounded(node: exp.Floor | exp.Ceil, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    if node.args.get("decimals") is not None:
        raise FeatureNotSupported(f"{node.key.upper()} with a scale is not supported in GROUP BY")
    inner = _numeric(node.this, resolve, check_predicate)
    fn = math.floor if isinstance(node, exp.Floor) else math.ceil
    # PostgreSQL has floor(double precision) and floor(numeric): integers resolve to the double one
    pg_type: PgType = "numeric" if inner.type == "numeric" else "double precision"
    double = exp.DataType.Type.DOUBLE
    sql = exp.cast(node.__class__(this=exp.cast(inner.sql, double)), double)
    if inner.values is not None:
        values = (float(fn(v)) for v in inner.values if v is not None)  # type: ignore[arg-type]
        return KeyExpr(sql, pg_type, _finite(node, values, inner.nullable), inner.nullable)
    low, high = fn(_low(inner)), fn(_high(inner))
    if high - low + 1 > MAX_DERIVED_GROUPS:
        return KeyExpr(sql, pg_type, None, inner.nullable, float(low), float(high))
    every = _range(node, low, high, inner.nullable)
    return KeyExpr(sql, pg_type, tuple(None if v is None else float(v) for v in every), inner.nullable)  # type: ignore[arg-type]


def width_bucket(value: float, low: float, high: float, count: int) -> int:
    """The bucket dpsql computes (the same formula, in IEEE doubles, as its generated SQL)."""
    if value < low:
        return 0
    if value >= high:
        return count + 1
    return math.floor((value - low) * count / (high - low)) + 1


def _width_bucket(node: exp.WidthBucket, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    low, high, count = (_literal(node.args[k]) for k in ("min_value", "max_value", "num_buckets"))
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
    inner = _numeric(node.this, resolve, check_predicate)
    value = exp.cast(inner.sql, exp.DataType.Type.DOUBLE)
    span = exp.Div(
        this=exp.paren(
            exp.Mul(
                this=exp.paren(exp.Sub(this=value.copy(), expression=_number_sql(low))), expression=_number_sql(count)
            )
        ),
        expression=_number_sql(high - low),
    )
    inside = exp.Add(this=exp.cast(exp.Floor(this=span), exp.DataType.Type.BIGINT), expression=exp.Literal.number(1))
    sql = (
        exp.Case()
        .when(exp.LT(this=value.copy(), expression=_number_sql(low)), exp.Literal.number(0))
        .when(exp.GTE(this=value.copy(), expression=_number_sql(high)), exp.Literal.number(count + 1))
        .else_(inside)
    )
    if inner.values is not None:
        buckets = (width_bucket(float(v), low, high, count) for v in inner.values if v is not None)  # type: ignore[arg-type]
        return _fits(node, KeyExpr(sql, "integer", _finite(node, buckets, inner.nullable), inner.nullable))
    first, last = width_bucket(_low(inner), low, high, count), width_bucket(_high(inner), low, high, count)
    return _fits(node, KeyExpr(sql, "integer", _range(node, first, last, inner.nullable), inner.nullable))


def _column(node: exp.Column, resolve: Resolve) -> KeyExpr:
    column, policy = resolve(node)
    domain = policy.release_domain()
    if policy.type in ("text", "boolean"):
        pg_type: PgType = PG_TYPE_NAMES[policy.type]
        return KeyExpr(
            column, pg_type, None if domain is None else _finite(node, domain, policy.nullable), policy.nullable
        )
    if policy.type in ("date", "timestamp"):
        raise FeatureNotSupported(
            f"a bare {policy.type} column cannot be used inside a GROUP BY expression",
            hint="Wrap it in DATE_TRUNC or EXTRACT.",
        )
    if not policy.bounded and domain is None:
        raise FeatureNotSupported(
            f'column "{node.name}" has no declared bounds',
            hint=f'Declare lower/upper for "{node.name}" so expressions over it have a finite range.',
        )
    clamped = bound(node, resolve, lambda p: p)
    pg_type = "bigint" if policy.type == "int" else "double precision"
    if domain is not None:
        values = [v for v in domain if v is not None]
        return KeyExpr(clamped.sql, pg_type, _finite(node, values, policy.nullable), policy.nullable, tiny=clamped.tiny)
    if policy.type == "int" and clamped.upper - clamped.lower + 1 <= MAX_DERIVED_GROUPS:
        every = range(int(clamped.lower), int(clamped.upper) + 1)
        return KeyExpr(clamped.sql, pg_type, _finite(node, every, policy.nullable), policy.nullable)
    return KeyExpr(clamped.sql, pg_type, None, policy.nullable, clamped.lower, clamped.upper, clamped.tiny)


#: Integer casts a key may take, and the PostgreSQL type each gives (computed in bigint, range-checked).
_INTEGER_CASTS: dict[exp.DType, PgType] = {
    exp.DataType.Type.BIGINT: "bigint",
    exp.DataType.Type.INT: "integer",
    exp.DataType.Type.SMALLINT: "smallint",
}

#: Casts of a key to its own type (no length modifier): the identity on every backend.
_SAME_TYPE: dict[PgType, tuple[exp.DType, ...]] = {
    "text": (exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR),
    "boolean": (exp.DataType.Type.BOOLEAN,),
}


def _cast(node: exp.Cast, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    """Casts that cannot fail and mean the same on every backend: time buckets to date/timestamp,
    numbers to bigint (integers only), double precision or numeric."""
    inner = derive(node.this, resolve, check_predicate)
    target = node.to.this
    values = inner.values
    if inner.type in ("timestamp", "timestamp with time zone", "date") and target in (
        exp.DataType.Type.DATE,
        exp.DataType.Type.TIMESTAMP,
    ):
        to_date = target == exp.DataType.Type.DATE
        pg_type: PgType = "date" if to_date else "timestamp"
        if values is not None:
            values = _finite(node, (_to_day(v) if to_date else _as_datetime(v) for v in values), inner.nullable)
        return KeyExpr(exp.cast(inner.sql, target), pg_type, values, inner.nullable)
    if inner.numeric and target in _INTEGER_CASTS and (_integral(inner) or _whole(node.this, inner)):
        # whole numbers (EXTRACT's numeric, FLOOR/CEIL's double: ibis's CAST(FLOOR(x) AS BIGINT)) cast exactly
        sql = inner.sql if _integral(inner) else exp.cast(inner.sql, exp.DataType.Type.BIGINT)
        if values is not None:
            values = tuple(None if v is None else int(v) for v in values)  # type: ignore[arg-type]
        cast = KeyExpr(sql, _INTEGER_CASTS[target], values, inner.nullable, inner.lower, inner.upper)
        return _fits(node, cast)
    if target in _SAME_TYPE.get(inner.type, ()) and not node.to.expressions:  # Tableau's CAST(text_col AS TEXT)
        return inner
    if inner.numeric and (target in exp.DataType.REAL_TYPES or target == exp.DataType.Type.DECIMAL):
        pg_type = "numeric" if target == exp.DataType.Type.DECIMAL else "double precision"
        if values is not None:
            values = _finite(node, (float(v) for v in values if v is not None), inner.nullable)  # type: ignore[arg-type]
        return KeyExpr(exp.cast(inner.sql, exp.DataType.Type.DOUBLE), pg_type, values, inner.nullable, inner.lower,
                       inner.upper, inner.tiny)  # fmt: skip
    raise FeatureNotSupported(
        f"CAST of a {inner.type} key to {node.to.sql(dialect='postgres')} is not supported in GROUP BY",
        hint="Cast time buckets to date or timestamp, numbers to double precision or numeric.",
    )


def _whole(node: exp.Expression, key: KeyExpr) -> bool:
    """Whether every value of a numeric key is a whole number: a finite domain of them, or FLOOR/CEIL."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Floor | exp.Ceil):
        return True
    return key.values is not None and all(float(v).is_integer() for v in key.values if v is not None)  # type: ignore[arg-type]


def _to_day(value: object) -> dt.date:
    return value.date() if isinstance(value, dt.datetime) else value  # type: ignore[return-value]


def _case(node: exp.Case, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    subject = node.this
    result = exp.Case()
    values: list[Scalar | None] = []
    for when in node.args.get("ifs") or []:
        checkpoint()
        condition = when.this if subject is None else exp.EQ(this=subject.copy(), expression=when.this.copy())
        values.append(_case_literal(when.args["true"]))
        # in place (Case.when copies the whole CASE by default: quadratic in the branches)
        result.when(check_predicate(condition).copy(), when.args["true"].copy(), copy=False)
    default = node.args.get("default")
    values.append(None if default is None else _case_literal(default))
    if default is not None:
        result.else_(default.copy(), copy=False)
    present = [v for v in values if v is not None]
    pg_types = {type(v) for v in present}
    if pg_types <= {str}:
        pg_type: PgType = "text"
    elif pg_types <= {bool}:
        pg_type = "boolean"
    elif pg_types <= {int}:
        pg_type = "integer" if all(_literal_type(v) == "integer" for v in present) else "bigint"  # type: ignore[arg-type]
    elif pg_types <= {int, float}:
        pg_type = "numeric"  # PostgreSQL types 2.5 as numeric; computed as a double
        present = [float(v) for v in present]  # type: ignore[arg-type]
        result = exp.cast(result, exp.DataType.Type.DOUBLE)  # type: ignore[assignment]
    else:
        raise DatatypeMismatch("CASE types text and numeric cannot be matched")
    nullable = None in values
    tiny = min((_exponent(float(v)) for v in present if isinstance(v, float)), default=0)
    return KeyExpr(result, pg_type, _finite(node, present, nullable), nullable, tiny=tiny)


def _case_literal(node: exp.Expression) -> Scalar | None:
    value = _literal(node)
    if value is exp.Expression:
        raise FeatureNotSupported(
            "CASE results in GROUP BY must be constants", hint="Write CASE WHEN <condition> THEN '<label>' ... END."
        )
    return value  # type: ignore[return-value]


def _coalesce(node: exp.Coalesce, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    parts: list[KeyExpr] = []
    for argument in [node.this, *node.expressions]:
        constant = _literal(argument)
        if constant is exp.Expression:
            parts.append(derive(argument, resolve, check_predicate))
        elif constant is None:
            parts.append(KeyExpr(exp.Null(), "text", (None,), True))
        else:
            pg_type: PgType = "text" if isinstance(constant, str) else "boolean" if isinstance(constant, bool) else (
                _literal_type(constant))  # type: ignore[arg-type]  # fmt: skip
            tiny = _exponent(constant) if isinstance(constant, float) else 0
            parts.append(KeyExpr(argument.copy(), pg_type, (constant,), False, tiny=tiny))  # type: ignore[arg-type]
    pg_types = {p.type for p in parts if p.values != (None,)}
    numeric = pg_types <= {"bigint", "integer", "smallint", "double precision", "numeric"}
    if len(pg_types) > 1 and not numeric:
        raise DatatypeMismatch(f"COALESCE types {' and '.join(sorted(pg_types))} cannot be matched")
    pg_type = functools.reduce(_promote, sorted(pg_types)) if len(pg_types) > 1 else (
        next(iter(pg_types)) if pg_types else "text")  # fmt: skip
    values: list[Scalar] = []
    finite = True
    nullable = True
    for part in parts:
        if part.values is None:
            finite = False
        else:
            values.extend(float(v) if pg_type == "double precision" else v for v in part.values if v is not None)  # type: ignore[arg-type]
        if not part.nullable:
            nullable = False
            break
    sql = exp.Coalesce(this=parts[0].sql, expressions=[p.sql for p in parts[1:]])
    tiny = min(p.tiny for p in parts)
    if not finite:
        return KeyExpr(sql, pg_type, None, nullable, tiny=tiny)
    return KeyExpr(sql, pg_type, _finite(node, values, nullable), nullable, tiny=tiny)


_PREDICATES = (exp.Predicate, exp.Connector, exp.Not)


def derive(node: exp.Expression, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    """The SQL and derived domain of a GROUP BY expression, or a refusal naming what is not supported.

    Supported: DATE_TRUNC, EXTRACT/date_part, CASE with constant results, width_bucket, FLOOR/CEIL,
    ``+ - * /`` over bounded numbers, COALESCE, predicates (boolean keys) and declared columns.
    """
    if isinstance(node, exp.Paren):
        inner = derive(node.this, resolve, check_predicate)
        return KeyExpr(exp.paren(inner.sql), inner.type, inner.values, inner.nullable, inner.lower, inner.upper,
                       inner.tiny)  # fmt: skip
    constant = _literal(node)
    if constant is not exp.Expression:
        raise FeatureNotSupported("GROUP BY a constant is not supported", hint="Remove the constant from GROUP BY.")
    if isinstance(node, exp.Column):
        return _column(node, resolve)
    if isinstance(node, exp.TimestampTrunc | exp.DateTrunc):
        unit = node.args.get("unit")
        name = unit.name.lower() if isinstance(unit, exp.Expression) else str(unit).lower()
        return _trunc(node, name, node.this, resolve)
    if isinstance(node, exp.Extract):
        return _extract(node, resolve)
    if isinstance(node, exp.DateBin):
        return _date_bin(node, resolve)
    if isinstance(node, exp.Floor | exp.Ceil):
        return _rounded(node, resolve, check_predicate)
    if isinstance(node, exp.WidthBucket):
        return _width_bucket(node, resolve, check_predicate)
    if isinstance(node, exp.Neg):
        inner = _numeric(node.this, resolve, check_predicate)
        zero = KeyExpr(exp.Literal.number(0), "integer", (0,), False)
        negated = _pointwise(exp.Sub(), zero, inner, lambda a, b: a - b)
        return KeyExpr(exp.Neg(this=inner.sql), negated.type, negated.values, negated.nullable, negated.lower,
                       negated.upper, inner.tiny)  # fmt: skip
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div):
        return _arithmetic(node, resolve, check_predicate)
    if isinstance(node, exp.Cast):
        return _cast(node, resolve, check_predicate)
    if isinstance(node, exp.Case):
        return _case(node, resolve, check_predicate)
    if isinstance(node, exp.Coalesce):
        return _coalesce(node, resolve, check_predicate)
    if isinstance(node, _PREDICATES):
        checked = check_predicate(node)
        columns = [resolve(c)[1] for c in node.find_all(exp.Column)]
        nullable = any(p.nullable for p in columns) and not isinstance(node, exp.Is)
        return KeyExpr(checked, "boolean", (False, True, None) if nullable else (False, True), nullable)
    raise FeatureNotSupported(
        f"{node.key.upper()} is not supported in GROUP BY",
        hint="GROUP BY may use columns, DATE_TRUNC, EXTRACT, CASE with constant results, width_bucket, "
        "FLOOR/CEIL, arithmetic over bounded columns, COALESCE and predicates.",
    )


def _arithmetic(node: exp.Add | exp.Sub | exp.Mul | exp.Div, resolve: Resolve, check: CheckPredicate) -> KeyExpr:
    left, right = _numeric(node.this, resolve, check), _numeric(node.expression, resolve, check)
    if isinstance(node, exp.Div):
        if _low(right) <= 0 <= _high(right) or (right.values is not None and 0 in right.values):
            raise FeatureNotSupported(
                "division by an expression that can be zero",
                hint="The divisor's bounds include 0, so some row could fail; divide by a range that excludes 0.",
            )
        if _integral(left) and _integral(right):
            # PostgreSQL's integer division truncates toward zero: computed as such on every backend
            quotient = _pointwise(node, left, right, lambda a, b: float(math.trunc(a / b)))
            sql = exp.cast(exp.Anonymous(this="TRUNC", expressions=[quotient.sql]), exp.DataType.Type.BIGINT)
            values = None if quotient.values is None else tuple(None if v is None else int(v) for v in quotient.values)  # type: ignore[arg-type]
            quotient_type = _promote(left.type, right.type)
            return _fits(node, KeyExpr(sql, quotient_type, values, quotient.nullable, quotient.lower, quotient.upper))
        return _pointwise(node, left, right, lambda a, b: a / b)
    ops: dict[type, Callable[[float, float], float]] = {
        exp.Add: lambda a, b: a + b,
        exp.Sub: lambda a, b: a - b,
        exp.Mul: lambda a, b: a * b,
    }
    return _pointwise(node, left, right, ops[type(node)])


# --- WHERE constants narrow the domain -------------------------------------------------


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
            return _as_datetime(value)
        return value
    value = _literal(node)
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
        lower = None if lower is None else _as_datetime(lower)
        upper = None if upper is None else _as_datetime(upper)
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
