"""Constant folding: constant date/time expressions become literals before analysis.

BI tools write filters such as ``visit_date >= NOW() - INTERVAL '30 days'``,
``TO_DATE('2022-01-01', 'YYYY-MM-DD')`` or ``DATE '2022-01-01' + INTERVAL '1 month'``. They are
evaluated here, in Python, with PostgreSQL's semantics (month arithmetic clamps the day to the
month's end, ``date ± interval`` is a timestamp), and replaced by the canonical literals the analyzer
already accepts: ``CAST('2022-01-01' AS DATE)``, ``CAST('2022-01-01 00:00:00' AS TIMESTAMP)``.

Privacy: the backend never evaluates such an expression, so it cannot fail on some rows only; an
invalid constant (``MAKE_DATE(2022, 13, 1)``, ``TO_DATE('2022-13-45', 'YYYY-MM-DD')``) raises
PostgreSQL's error (22008/22007) here, at analysis, before anything runs or is charged — the same
outcome whatever the data. ``NOW()`` and its synonyms are the statement's start time: the meaning
of the query text depends on the clock, which is public.
"""

from __future__ import annotations

import calendar
import datetime as dt
import re
from dataclasses import dataclass

from sqlglot import exp

from dpsql.errors import DatetimeFieldOverflow, InvalidDatetimeFormat

__all__ = ["fold_constants", "reads_clock"]

#: Nodes whose value is the statement's start time.
_CLOCK_NODES = (exp.CurrentTimestamp, exp.Localtimestamp, exp.CurrentDate)


def reads_clock(tree: exp.Expression) -> bool:
    """Whether the statement's meaning depends on when it runs (``NOW()``…): its plan must not be reused."""
    return tree.find(*_CLOCK_NODES) is not None


@dataclass(frozen=True, slots=True)
class Interval:
    """PostgreSQL's interval: months, days and microseconds are added separately, in that order."""

    months: int = 0
    days: int = 0
    micros: int = 0

    def __neg__(self) -> Interval:
        return Interval(-self.months, -self.days, -self.micros)


_UNITS = {
    "year": (12, 0, 0),
    "month": (1, 0, 0),
    "mon": (1, 0, 0),
    "week": (0, 7, 0),
    "day": (0, 1, 0),
    "hour": (0, 0, 3_600_000_000),
    "minute": (0, 0, 60_000_000),
    "min": (0, 0, 60_000_000),
    "second": (0, 0, 1_000_000),
    "sec": (0, 0, 1_000_000),
}
_PART = re.compile(r"([+-]?\d+(?:\.\d+)?)\s*([a-z]+)")
_CLOCK = re.compile(r"([+-]?)(\d+):(\d{2})(?::(\d{2}(?:\.\d+)?))?")


def parse_interval(text: str) -> Interval:
    """``'1 month 2 days'``, ``'7 days'``, ``'01:30:00'`` as PostgreSQL reads them (22007 otherwise)."""
    rest = text.strip().lower()
    months = days = micros = 0
    clock = _CLOCK.search(rest)
    if clock:
        sign = -1 if clock.group(1) == "-" else 1
        seconds = float(clock.group(4) or 0)
        micros += sign * (int(clock.group(2)) * 3_600_000_000 + int(clock.group(3)) * 60_000_000 + round(seconds * 1e6))
        rest = rest[: clock.start()] + rest[clock.end() :]
    position = 0
    for match in _PART.finditer(rest):
        if rest[position : match.start()].strip():
            break
        unit = match.group(2).rstrip("s") if match.group(2) not in ("s",) else "second"
        if unit not in _UNITS:
            raise InvalidDatetimeFormat(f'invalid input syntax for type interval: "{text}"')
        amount = float(match.group(1))
        m, d, us = _UNITS[unit]
        if m and not amount.is_integer():
            raise InvalidDatetimeFormat(f'invalid input syntax for type interval: "{text}"')
        months += int(amount) * m
        days += int(amount) * d if amount.is_integer() else 0
        micros += round(amount * (d * 86_400_000_000 + us)) if not amount.is_integer() else int(amount) * us
        position = match.end()
    if rest[position:].strip() or (position == 0 and not clock):
        raise InvalidDatetimeFormat(f'invalid input syntax for type interval: "{text}"')
    return Interval(months, days, micros)


def add_interval(value: dt.datetime, interval: Interval) -> dt.datetime:
    """``timestamp + interval`` as PostgreSQL computes it (22008 beyond year 1..9999)."""
    try:
        if interval.months:
            index = value.year * 12 + value.month - 1 + interval.months
            year, month = divmod(index, 12)
            day = min(value.day, calendar.monthrange(year, month + 1)[1])
            value = value.replace(year=year, month=month + 1, day=day)
        return value + dt.timedelta(days=interval.days, microseconds=interval.micros)
    except (ValueError, OverflowError):
        raise DatetimeFieldOverflow("timestamp out of range") from None


def _date_literal(value: dt.date) -> exp.Expression:
    return exp.cast(exp.Literal.string(value.isoformat()), exp.DataType.Type.DATE)


def _timestamp_literal(value: dt.datetime) -> exp.Expression:
    return exp.cast(exp.Literal.string(value.isoformat(sep=" ")), exp.DataType.Type.TIMESTAMP)


def _sql(value: object) -> exp.Expression:
    if isinstance(value, dt.datetime):
        return _timestamp_literal(value)
    if isinstance(value, dt.date):
        return _date_literal(value)
    raise AssertionError(value)


_TEMPORAL = (exp.DataType.Type.DATE, exp.DataType.Type.TIMESTAMP)


def _parse_temporal(text: str, type_name: exp.DType) -> dt.date | None:
    """A ``CAST('…' AS DATE|TIMESTAMP)`` text, or None when it is not valid ISO (left for the analyzer)."""
    try:
        stamp = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if stamp.tzinfo is not None:
        return None
    return stamp.date() if type_name == exp.DataType.Type.DATE else stamp


def _value(node: exp.Expression) -> object:
    """The Python value of an already folded constant (None when ``node`` is not one)."""
    if isinstance(node, exp.Paren):
        return _value(node.this)
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal) and node.this.is_string:
        if node.to.this in _TEMPORAL:
            return _parse_temporal(node.this.name, node.to.this)
        return None
    if isinstance(node, exp.Interval):
        text = node.this.name if isinstance(node.this, exp.Literal) else None
        if text is None:
            return None
        unit = node.args.get("unit")
        return parse_interval(f"{text} {unit.name.lower()}" if unit is not None else text)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        return int(node.name) if node.name.isdigit() else float(node.name)
    return None


def _int_args(node: exp.Expression, names: tuple[str, ...]) -> list[int] | None:
    values = []
    for name in names:
        child = node.args.get(name)
        value = None if child is None else _value(child)
        if isinstance(child, exp.Neg):
            inner = _value(child.this)
            value = -inner if isinstance(inner, int) else None
        if not isinstance(value, int):
            return None
        values.append(value)
    return values


def _strptime(node: exp.Expression, type_name: str) -> dt.datetime | None:
    text, fmt = _value(node.this), _value(node.args["format"]) if node.args.get("format") else None
    if not isinstance(text, str) or not isinstance(fmt, str):
        return None
    try:
        return dt.datetime.strptime(text.strip(), fmt)
    except ValueError as exc:
        if "unconverted data" in str(exc) or "does not match" in str(exc):
            raise InvalidDatetimeFormat(f'invalid input syntax for type {type_name}: "{text}"') from None
        raise DatetimeFieldOverflow(f'date/time field value out of range: "{text}"') from None


def _fold(node: exp.Expression, now: dt.datetime) -> exp.Expression | None:
    """The literal ``node`` folds to, or None when it is not a foldable constant."""
    if isinstance(node, exp.CurrentTimestamp | exp.Localtimestamp):
        return _timestamp_literal(now)
    if isinstance(node, exp.CurrentDate):
        return _date_literal(now.date())
    if isinstance(node, exp.StrToDate):
        parsed = _strptime(node, "date")
        return None if parsed is None else _date_literal(parsed.date())
    if isinstance(node, exp.StrToTime):
        parsed = _strptime(node, "timestamp")
        return None if parsed is None else _timestamp_literal(parsed)
    if isinstance(node, exp.UnixToTime) and node.args.get("scale") is None:
        seconds = _value(node.this)
        if not isinstance(seconds, int | float):
            return None
        try:
            return _timestamp_literal(dt.datetime(1970, 1, 1) + dt.timedelta(seconds=seconds))
        except OverflowError:
            raise DatetimeFieldOverflow("timestamp out of range") from None
    if isinstance(node, exp.Anonymous) and node.name.lower() == "make_date":
        parts = [_value(a) for a in node.expressions]
        if len(parts) != 3 or not all(isinstance(p, int) for p in parts):
            return None
        try:
            return _date_literal(dt.date(*parts))  # type: ignore[arg-type]
        except ValueError:
            raise DatetimeFieldOverflow(
                f"date field value out of range: {parts[0]:04d}-{parts[1]:02d}-{parts[2]:02d}"
            ) from None
    if isinstance(node, exp.TimestampFromParts):
        fields = _int_args(node, ("year", "month", "day", "hour", "min"))
        second = _value(node.args["sec"]) if node.args.get("sec") is not None else None
        if fields is None or not isinstance(second, int | float):
            return None
        try:
            base = dt.datetime(fields[0], fields[1], fields[2], fields[3], fields[4])
            return _timestamp_literal(base + dt.timedelta(seconds=second))
        except (ValueError, OverflowError):
            raise DatetimeFieldOverflow("date/time field value out of range") from None
    if isinstance(node, exp.Add | exp.Sub):
        left, right = _value(node.this), _value(node.expression)
        if isinstance(node, exp.Add) and isinstance(left, Interval) and isinstance(right, dt.date):
            left, right = right, left
        if isinstance(left, dt.date) and isinstance(right, Interval):
            stamp = left if isinstance(left, dt.datetime) else dt.datetime(left.year, left.month, left.day)
            return _timestamp_literal(add_interval(stamp, right if isinstance(node, exp.Add) else -right))
        if type(left) is dt.date and isinstance(right, int) and not isinstance(right, bool):
            try:
                return _date_literal(left + dt.timedelta(days=right if isinstance(node, exp.Add) else -right))
            except OverflowError:
                raise DatetimeFieldOverflow("date out of range") from None
        return None
    if isinstance(node, exp.Cast) and node.to.this in _TEMPORAL:
        value = _value(node.this)
        if isinstance(node.this, exp.Literal) and node.this.is_string:
            canonical = _parse_temporal(node.this.name, node.to.this)
            return None if canonical is None else _sql(canonical)  # canonical spelling; invalid: the analyzer's error
        if isinstance(value, dt.datetime):
            return _sql(value.date() if node.to.this == exp.DataType.Type.DATE else value)
        if isinstance(value, dt.date):
            if node.to.this == exp.DataType.Type.DATE:
                return _date_literal(value)
            return _timestamp_literal(dt.datetime(value.year, value.month, value.day))
    return None


def fold_constants(tree: exp.Expression, now: dt.datetime | None = None) -> exp.Expression:
    """``tree`` with every constant date/time expression replaced by its literal (post-order, in place).

    ``now`` is the statement's start time (UTC, without time zone, as the session's TimeZone is UTC).
    """
    moment = now or dt.datetime.now(dt.UTC).replace(tzinfo=None)

    def visit(node: exp.Expression) -> exp.Expression:
        for child in list(node.iter_expressions()):
            visit(child)
        folded = _fold(node, moment)
        if folded is not None and node is not tree:
            node.replace(folded)
            return folded
        return folded if folded is not None else node

    return visit(tree)
