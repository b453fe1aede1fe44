"""``date_bin(stride, column, origin)`` keys (Grafana, Superset time grains).

Stride and origin must be constants, so the bins follow from the query and the policy's
(WHERE-narrowed) bounds alone, never from data. Refusals match PostgreSQL's where it refuses.
"""

from __future__ import annotations

import datetime as dt

from sqlglot import exp

from dpsql.analyze.fold import Interval, parse_interval
from dpsql.analyze.keys.base import MAX_DERIVED_GROUPS, KeyContext, KeyExpr, finite_domain, too_many
from dpsql.analyze.keys.dates import clamped_date, date_bounds, date_values, opened_by_bound, time_column
from dpsql.errors import DatetimeFieldOverflow, FeatureNotSupported, UndefinedFunction
from dpsql.pgtypes import PgType
from dpsql.policy import PG_TYPE_NAMES

#: A day in microseconds: a date column's bins of at most a day hold its whole day.
_DAY = 86_400_000_000


def _bin_stride(stride: exp.Expression) -> int:
    """date_bin's stride in microseconds, refused as PostgreSQL refuses it (months: 0A000, ≤ 0: 22008)."""
    value: object = None
    if isinstance(stride, exp.Interval) and isinstance(stride.this, exp.Literal):
        unit = stride.args.get("unit")
        value = parse_interval(f"{stride.this.name} {unit.name.lower()}" if unit is not None else stride.this.name)
    elif isinstance(stride, exp.Literal) and stride.is_string:
        value = parse_interval(stride.name)
    elif (
        isinstance(stride, exp.Cast)
        and isinstance(stride.this, exp.Literal)
        and stride.to.this == exp.DataType.Type.INTERVAL
    ):
        value = parse_interval(stride.this.name)
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


def _bin_origin(given: exp.Expression | None) -> tuple[dt.datetime, str]:
    """date_bin's origin and how PostgreSQL types it: ``timestamp``, ``date`` or ``unknown`` (a bare string,
    which sqlglot reads as a Var). Anything but a constant is refused: the bins must follow from the query."""
    if given is None:
        raise UndefinedFunction("function date_bin(unknown, timestamp without time zone) does not exist")
    text, kind = None, "unknown"
    if isinstance(given, exp.Var) or (isinstance(given, exp.Literal) and given.is_string):
        text = given.name
    elif (
        isinstance(given, exp.Cast)
        and isinstance(given.this, exp.Literal)
        and given.this.is_string
        and given.to.this in (exp.DataType.Type.DATE, exp.DataType.Type.TIMESTAMP)
    ):
        text, kind = given.this.name, "date" if given.to.this == exp.DataType.Type.DATE else "timestamp"
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


def date_bin_key(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``date_bin(stride, column, origin)`` over a clamped date/timestamp column.

    Computed as DATE_BIN on PostgreSQL and TIME_BUCKET on DuckDB over timestamps, with the stride in
    microseconds (both floor toward −∞ from the origin, as PostgreSQL ≥ 14.2 does); the domain is every
    bin from bin(lower) to bin(upper), from the policy's (WHERE-narrowed) bounds: no data; but not a last
    bin starting at the upper bound (:func:`~dpsql.analyze.keys.dates.opened_by_bound`). Typed as
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
    column, policy = time_column("date_bin", target, keys.resolve)
    if policy.type not in ("date", "timestamp"):
        raise UndefinedFunction(f"function date_bin(unknown, {PG_TYPE_NAMES[policy.type]}, unknown) does not exist")
    source_date = policy.type == "date" and not cast_to_timestamp
    pg_type: PgType = "timestamp with time zone" if source_date and origin_kind != "timestamp" else "timestamp"
    stamp = exp.DataType.Type.TIMESTAMP
    binned = exp.DateBin(
        this=exp.cast(exp.Literal.string(f"{stride} microseconds"), exp.DataType.Type.INTERVAL),
        expression=exp.cast(clamped_date(column, policy), stamp),
        origin=exp.cast(exp.Literal.string(origin.isoformat(sep=" ")), stamp),
    )
    sql = exp.cast(binned, stamp)
    pinned = date_values(policy)
    try:
        if pinned is not None:
            bins = (date_bin(stride, v, origin) for v in pinned)
            return KeyExpr(sql, pg_type, finite_domain(node, bins, policy.nullable), policy.nullable)
        low, high = date_bounds(policy)
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
    if opened_by_bound(policy, first, last, stride <= _DAY):
        count -= 1  # the last bin starts at the upper bound: only its instant could fall there
    if count > MAX_DERIVED_GROUPS:
        raise too_many(node, count)
    bins = (first + dt.timedelta(microseconds=stride * i) for i in range(count))
    return KeyExpr(sql, pg_type, finite_domain(node, bins, policy.nullable), policy.nullable)
