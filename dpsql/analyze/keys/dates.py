"""DATE_TRUNC and EXTRACT keys over a clamped date/timestamp column.

The domain is every bucket (or field value) between the column's declared, WHERE-narrowed bounds:
60 months for 2020-01-01..2024-12-31, from the policy alone. The column is clamped to those bounds
(year 1..9999 when it has none) before the function, so ±infinity or an out-of-bounds value lands
in an edge bucket instead of creating a group. A last bucket that starts exactly at the upper bound
is not released (:func:`opened_by_bound`): only the bound's own instant (a date column's day) and
values clamped to it could fall there, so an upper bound of 2026-01-01, or ``WHERE ts < '2025-12-29'``
with weekly buckets, adds no phantom January, 2026 or week of 2025-12-29.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from sqlglot import exp

from dpsql.analyze.expressions import _exponent, bound_literal, clamp_sql, date_unit
from dpsql.analyze.fold import truncate
from dpsql.analyze.keys.base import (
    MAX_DERIVED_GROUPS,
    KeyContext,
    KeyExpr,
    Resolve,
    as_datetime,
    finite_domain,
    int_range,
    too_many,
)
from dpsql.errors import FeatureNotSupported, UndefinedFunction
from dpsql.pgtypes import PgType
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy

#: Earliest and latest dates an unbounded date column is clamped to (so ±infinity never reaches a function).
_MIN_DATE, _MAX_DATE = dt.date(1, 1, 1), dt.date(9999, 12, 31)
_TRUNC_UNITS = ("year", "quarter", "month", "week", "day", "hour")


def _next(unit: str, value: dt.datetime) -> dt.datetime:
    if unit in ("year", "quarter", "month"):
        months = {"year": 12, "quarter": 3, "month": 1}[unit]
        index = value.year * 12 + value.month - 1 + months
        return dt.datetime(index // 12, index % 12 + 1, 1) if index // 12 <= 9999 else dt.datetime.max
    step = {"week": dt.timedelta(days=7), "day": dt.timedelta(days=1), "hour": dt.timedelta(hours=1)}[unit]
    return value + step if value <= dt.datetime.max - step else dt.datetime.max


def opened_by_bound(policy: ColumnPolicy, first: dt.datetime, last: dt.datetime, day_or_finer: bool) -> bool:
    """Whether the last bucket (starting at ``last``; the first at ``first``) is one only the upper bound's
    last instant opens: it starts at the bound, it is not the only bucket, and it spans more than the
    bound itself holds (a date column's bound is a whole day: its day or hour bucket is a real one).
    Public: the policy's (WHERE-narrowed) bounds and the bucket size only."""
    if not policy.bounded or last <= first or last != as_datetime(policy.upper):
        return False
    return not (policy.type == "date" and day_or_finer)


def date_bounds(policy: ColumnPolicy) -> tuple[dt.datetime, dt.datetime]:
    if policy.bounded:
        return as_datetime(policy.lower), as_datetime(policy.upper)
    return as_datetime(_MIN_DATE), dt.datetime(9999, 12, 31, 23, 59, 59)


def clamped_date(column: exp.Column, policy: ColumnPolicy) -> exp.Expression:
    """A date/timestamp column clamped to its bounds (year 1..9999 when it has none): ±infinity never
    reaches DATE_TRUNC or EXTRACT, whose results on it differ between backends."""
    low, high = (policy.lower, policy.upper) if policy.bounded else (_MIN_DATE, _MAX_DATE)
    return clamp_sql(column, bound_literal(low, policy), bound_literal(high, policy))


def date_values(policy: ColumnPolicy) -> list[dt.datetime] | None:
    """The column's possible values when WHERE pinned them to a finite set (``narrow_policies``)."""
    if policy.domain is None:
        return None
    return [as_datetime(v) for v in policy.domain if v is not None]


def to_timestamp(target: exp.Expression) -> bool:
    return isinstance(target, exp.Cast) and target.to.this == exp.DataType.Type.TIMESTAMP


def time_column(function: str, target: exp.Expression, resolve: Resolve) -> tuple[exp.Column, ColumnPolicy]:
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


def date_trunc(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``DATE_TRUNC(unit, column)`` (TimestampTrunc, DateTrunc): every bucket between the bounds."""
    unit_arg = node.args.get("unit")
    word = unit_arg.name.lower() if isinstance(unit_arg, exp.Expression) else str(unit_arg).lower()
    target = node.this
    cast_to_timestamp = to_timestamp(target)
    column, policy = time_column("DATE_TRUNC", target, keys.resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function date_trunc(unknown, {PG_TYPE_NAMES[policy.type]}) does not exist")
    # PostgreSQL resolves date_trunc(text, date) to its timestamptz form (midnight UTC in dpsql's UTC session)
    pg_type: PgType = "timestamp with time zone" if policy.type == "date" and not cast_to_timestamp else "timestamp"
    unit = date_unit(word, "date_trunc", "timestamp without time zone" if pg_type == "timestamp" else pg_type)
    if unit not in _TRUNC_UNITS:
        raise FeatureNotSupported(
            f'DATE_TRUNC("{word}") is not supported in GROUP BY', hint="Use year, quarter, month, week, day or hour."
        )
    truncated = exp.TimestampTrunc(this=clamped_date(column, policy), unit=exp.var(unit.upper()))
    sql = exp.cast(truncated, exp.DataType.Type.TIMESTAMP)
    pinned = date_values(policy)
    if pinned is not None:
        truncated_values = finite_domain(node, (truncate(unit, v) for v in pinned), policy.nullable)
        return KeyExpr(sql, pg_type, truncated_values, policy.nullable)
    if not policy.bounded:
        return KeyExpr(sql, pg_type, None, policy.nullable)
    low, high = date_bounds(policy)
    values: list[dt.datetime] = []
    current, last = truncate(unit, low), truncate(unit, high)
    while current <= last:
        values.append(current)
        if len(values) > MAX_DERIVED_GROUPS:
            raise too_many(node, _count_buckets(unit, current, last, len(values)))
        current = _next(unit, current)
    if opened_by_bound(policy, values[0], values[-1], unit in ("day", "hour")):
        values.pop()
    return KeyExpr(sql, pg_type, finite_domain(node, values, policy.nullable), policy.nullable)


def _count_buckets(unit: str, current: dt.datetime, last: dt.datetime, seen: int) -> int:
    """How many buckets remain (for the refusal's message), without enumerating them all."""
    span = last - current
    per = {"week": 7 * 86400, "day": 86400, "hour": 3600}.get(unit)
    if per is not None:
        return seen + int(span.total_seconds() // per)
    months = (last.year - current.year) * 12 + last.month - current.month
    return seen + months // {"year": 12, "quarter": 3, "month": 1}[unit]


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


def extract(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``EXTRACT(field FROM column)`` / ``date_part``: the field's range (years from the bounds), or
    for epoch every day of a bounded date column, else bounds only."""
    word = node.this.name.lower() if isinstance(node.this, exp.Var | exp.Identifier) else str(node.this).lower()
    column, policy = time_column("EXTRACT", node.expression, keys.resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function extract(unknown, {PG_TYPE_NAMES[policy.type]}) does not exist")
    as_date = policy.type == "date" and not to_timestamp(node.expression)
    part = date_unit(word, "extract", "date" if as_date else "timestamp without time zone")
    clamped = clamped_date(column, policy)
    pinned = date_values(policy)
    if part == "epoch":
        # computed as a double on every backend (exact below 2^53), typed numeric as PostgreSQL ≥ 14 types EXTRACT
        sql = exp.cast(exp.Extract(this=exp.var("EPOCH"), expression=clamped), exp.DataType.Type.DOUBLE)
        epoch = dt.datetime(1970, 1, 1)
        if pinned is not None:
            return KeyExpr(sql, "numeric", finite_domain(node, ((v - epoch).total_seconds() for v in pinned),
                                                                 policy.nullable), policy.nullable)  # fmt: skip
        low, high = date_bounds(policy)
        lower, upper = (low - epoch).total_seconds(), (high - epoch).total_seconds()
        if policy.type == "date" and policy.bounded:
            days = (high - low).days
            if days + 1 > MAX_DERIVED_GROUPS:
                return KeyExpr(sql, "numeric", None, policy.nullable, lower, upper, _exponent(1e-6))
            values = (lower + 86400.0 * i for i in range(days + 1))
            return KeyExpr(sql, "numeric", finite_domain(node, values, policy.nullable), policy.nullable)
        return KeyExpr(sql, "numeric", None, policy.nullable, lower, upper, _exponent(1e-6))
    if part not in _FIELDS:
        raise FeatureNotSupported(f'EXTRACT("{word}") is not supported in GROUP BY')
    field, low_value, high_value = _FIELDS[part]
    sql = exp.cast(exp.Extract(this=exp.var(part.upper()), expression=clamped), exp.DataType.Type.BIGINT)
    if pinned is not None:
        return KeyExpr(sql, "numeric", finite_domain(node, map(field, pinned), policy.nullable), policy.nullable)
    if part == "year":
        low, high = date_bounds(policy)
        low_value, high_value = low.year, high.year
        if opened_by_bound(policy, dt.datetime(low.year, 1, 1), dt.datetime(high.year, 1, 1), False):
            high_value -= 1  # a bound on 1 January opens no year
    elif part in ("hour", "minute") and policy.type == "date":
        low_value = high_value = 0
    return KeyExpr(
        sql, "numeric", int_range(node, low_value, high_value, policy.nullable), policy.nullable, low_value, high_value
    )
