"""Constant folding: constant date/time expressions become literals before analysis.

BI tools write filters such as ``visit_date >= NOW() - INTERVAL '30 days'``,
``TO_DATE('2022-01-01', 'YYYY-MM-DD')``, ``DATE '2022-01-01' + INTERVAL '1 month'`` or Metabase's
``DATE_TRUNC('year', NOW() + INTERVAL '-30 year')``. They are
evaluated here, in Python, with PostgreSQL's semantics (month arithmetic clamps the day to the
month's end, ``date ± interval`` is a timestamp), and replaced by the canonical literals the analyzer
already accepts: ``CAST('2022-01-01' AS DATE)``, ``CAST('2022-01-01 00:00:00' AS TIMESTAMP)``.

Privacy: the backend never evaluates such an expression, so it cannot fail on some rows only; an
invalid constant (``MAKE_DATE(2022, 13, 1)``, ``TO_DATE('2022-13-45', 'YYYY-MM-DD')``, an interval
field that overflows, a bigint where PostgreSQL takes an integer) raises PostgreSQL's error (22008,
22007, 22015, 42883) here, at analysis, before anything runs or is charged — the same outcome
whatever the data. Dates are Python's, years 1 to 9999: a later one PostgreSQL would accept is 22008.
``NOW()`` and its synonyms are the statement's start time: the meaning of the query text depends on
the clock, which is public. Numeric constants (``0.06 - 0.01``, ``7 / 2``) are folded by
:mod:`dpsql.analyze.arith`, whole subtrees at a time, before the date/time passes see them.
"""

from __future__ import annotations

import calendar
import datetime as dt
import math
import re
from dataclasses import dataclass
from fractions import Fraction

from sqlglot import exp

from dpsql.analyze.arith import ARITHMETIC, NUMERIC_CASTS, evaluate, render
from dpsql.analyze.expressions import date_unit
from dpsql.errors import (
    DatetimeFieldOverflow,
    IntervalFieldOverflow,
    InvalidDatetimeFormat,
    InvalidParameterValue,
    UndefinedFunction,
)

__all__ = ["fold_constants", "reads_clock", "truncate"]

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


#: Interval units as PostgreSQL spells them (words cut to its 10-character tokens) and what they are.
_UNIT_NAMES: dict[str, str] = {
    alias: unit
    for unit, aliases in {
        "millennium": "millennium millennia mil mils",
        "century": "century centuries cent c",
        "decade": "decade decades dec decs",
        "year": "year years y yr yrs",
        "month": "month months mon mons",
        "week": "week weeks w",
        "day": "day days d",
        "hour": "hour hours h hr hrs",
        "minute": "minute minutes m min mins",
        "second": "second seconds s sec secs",
        "millisecond": "millisecon ms msec msecs msecond mseconds",
        "microsecond": "microsecon us usec usecs usecond useconds",
    }.items()
    for alias in aliases.split()
}
_YEARS = {"millennium": 1000, "century": 100, "decade": 10, "year": 1}
_DAYS = {"month": 30, "week": 7, "day": 1}
_MICROS = {"hour": 3_600_000_000, "minute": 60_000_000, "second": 1_000_000, "millisecond": 1000, "microsecond": 1}
_DAY_MICROS = 86_400_000_000
_SUBSECONDS = frozenset({"second", "millisecond", "microsecond"})
_PART = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]+)")
_CLOCK = re.compile(r"([+-]?)(\d+):(\d+)(?::(\d+(?:\.\d*)?))?")


def _fits(value: int, bits: int) -> bool:
    return bool(-(2 ** (bits - 1)) <= value < 2 ** (bits - 1))


def parse_interval(text: str, shown: str | None = None) -> Interval:
    """``'1 month 2 days'``, ``'1.5 years'``, ``'01:30:00'``, ``'3 days ago'`` as PostgreSQL 15 reads them.

    Its errors too, before anything runs: 22007 for what it cannot read (or a unit given twice),
    22015 when a field overflows (months and days are 32-bit, microseconds 64-bit), 22008 when the
    months in all overflow. ``shown`` is the text as written, for the messages.
    """
    shown = text if shown is None else shown

    def bad() -> InvalidDatetimeFormat:
        return InvalidDatetimeFormat(f'invalid input syntax for type interval: "{shown}"')

    def overflow() -> IntervalFieldOverflow:
        return IntervalFieldOverflow(f'interval field value out of range: "{shown}"')

    rest = f" {text.strip().lower()} "
    ago = " ago " in rest
    rest = rest.replace(" ago ", " ", 1).strip()
    years = months = days = micros = 0
    seen: set[str] = set()
    clock = _CLOCK.search(rest)
    if clock:
        sign = -1 if clock.group(1) == "-" else 1
        hours, minutes, seconds = int(clock.group(2)), int(clock.group(3)), Fraction(clock.group(4) or 0)
        if not _fits(hours, 64) or minutes > 59 or seconds > 60:
            raise overflow()
        micros = sign * (hours * _MICROS["hour"] + minutes * _MICROS["minute"] + round(seconds * 1_000_000))
        if not _fits(micros, 64):
            raise overflow()
        seen.update(_MICROS)
        rest = rest[: clock.start()] + rest[clock.end() :]
    position = 0
    for match in _PART.finditer(rest):
        if rest[position : match.start()].strip():
            break
        unit = _UNIT_NAMES.get(match.group(2)[:10])
        if unit is None:
            raise bad()
        number = Fraction(match.group(1))
        whole = int(number)  # toward zero; the fraction keeps the sign
        fraction = number - whole
        if not _fits(whole, 64):
            raise overflow()
        if unit in _YEARS:
            years += whole * _YEARS[unit]
            months += round(fraction * _YEARS[unit] * 12)
        elif unit in _DAYS:  # a fraction of a month is of 30 days; a fraction of a day is microseconds
            months, days = (months + whole, days) if unit == "month" else (months, days + whole * _DAYS[unit])
            extra = fraction * _DAYS[unit]
            days += int(extra)
            micros += round((extra - int(extra)) * _DAY_MICROS)
        else:
            micros += whole * _MICROS[unit] + round(fraction * _MICROS[unit])
        if not (_fits(years, 32) and _fits(months, 32) and _fits(days, 32) and _fits(micros, 64)):
            raise overflow()
        marks = _SUBSECONDS if unit == "second" and fraction else {unit}
        if seen & marks:
            raise bad()
        seen |= marks
        position = match.end()
    if rest[position:].strip() or (position == 0 and not clock):
        raise bad()
    total_months = years * 12 + months
    if not _fits(total_months, 32):
        raise DatetimeFieldOverflow("interval out of range")
    interval = Interval(total_months, days, micros)
    return -interval if ago else interval


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
#: make_timestamp's arguments, as sqlglot names them.
_PARTS = ("year", "month", "day", "hour", "min", "sec")


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
        unit = _interval_unit(node.args.get("unit"))
        if text is None or unit == "":
            return None
        return parse_interval(f"{text} {unit}" if unit is not None else text)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        return int(node.name) if node.name.isdigit() else float(node.name)
    return None


#: ``INTERVAL '90' DAY (3)`` (TPC-H Q1): the standard's leading-field precision, which changes no value.
_PRECISION_UNITS: dict[type[exp.Expression], str] = {exp.Year: "year", exp.Month: "month", exp.Day: "day"}


def _interval_unit(unit: exp.Expression | None) -> str | None:
    """The unit word of an interval literal (None: no unit; "": one not folded here, such as a
    ``SECOND (p)`` precision or a ``YEAR TO MONTH`` span, left for the analyzer)."""
    if unit is None:
        return None
    if isinstance(unit, exp.Var):
        return unit.name.lower()
    named = _PRECISION_UNITS.get(type(unit))
    if named is not None and isinstance(unit.this, exp.Literal) and not unit.this.is_string:
        return named
    return ""


def _signed(node: exp.Expression | None) -> int | float | None:
    """A numeric literal, through parentheses and unary minus (None when ``node`` is not one)."""
    if isinstance(node, exp.Paren | exp.Neg):
        inner = _signed(node.this)
        return None if inner is None else -inner if isinstance(node, exp.Neg) else inner
    value = None if node is None else _value(node)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _number_type(value: int | float) -> str:
    """How PostgreSQL types a numeric literal: integer, bigint when beyond 32 bits, else numeric."""
    if isinstance(value, float):
        return "numeric"
    return "integer" if _fits(value, 32) else "bigint" if _fits(value, 64) else "numeric"


_NO_CAST_HINT = "No {} matches the given name and argument types. You might need to add explicit type casts."
#: Folded dates and timestamps are Python's: years 1 to 9999 (PostgreSQL's reach further).
_YEARS_HINT = "dpsql computes date/time constants in years 1 to 9999."


def _integer_args(function: str, values: list[int | float], count: int) -> list[int]:
    """The first ``count`` arguments of ``function(integer, …)``: 42883 as PostgreSQL when one is
    a bigint or numeric literal (there is no implicit cast down to integer)."""
    types = [_number_type(v) for v in values]
    if any(t != "integer" for t in types[:count]):
        raise UndefinedFunction(
            f"function {function}({', '.join(types)}) does not exist", hint=_NO_CAST_HINT.format("function")
        )
    return [int(v) for v in values[:count]]


def _valid_date(year: int, month: int, day: int) -> bool:
    """PostgreSQL's field check (AD years; any year, leap years proleptic Gregorian)."""
    if year < 1 or not 1 <= month <= 12:
        return False
    days = (31, 29 if calendar.isleap(year) else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[month - 1]
    return 1 <= day <= days


def make_date(year: int, month: int, day: int) -> dt.date | None:
    """PostgreSQL's ``make_date``: 22008 for impossible fields, and beyond year 9999 (PostgreSQL's own
    limit is year 5874897); None for a BC year (negative), which is left unfolded."""
    if year < 0:
        return None
    shown = f"{year}-{month:02d}-{day:02d}"
    if not _valid_date(year, month, day):
        raise DatetimeFieldOverflow(f"date field value out of range: {shown}")
    if year > 9999:
        raise DatetimeFieldOverflow(f"date out of range: {shown}", hint=_YEARS_HINT)
    return dt.date(year, month, day)


def make_timestamp(year: int, month: int, day: int, hour: int, minute: int, sec: float) -> dt.datetime | None:
    """PostgreSQL's ``make_timestamp`` (hour 24 and second 60 roll over, as there): 22008 for
    impossible date or time fields and beyond year 9999; None for a BC year (left unfolded)."""
    if year < 0:
        return None
    if not _valid_date(year, month, day):
        raise DatetimeFieldOverflow(f"date field value out of range: {year}-{month:02d}-{day:02d}")
    clock = f"{hour}:{minute:02d}:{sec:02g}"
    micros = round(sec * 1_000_000) if abs(sec) <= 61 else -1  # out of range, NaN too
    time = (hour * 60 + minute) * 60_000_000 + micros
    if not (0 <= hour <= 24 and 0 <= minute <= 59 and 0 <= micros <= 60_000_000 and time <= _DAY_MICROS):
        raise DatetimeFieldOverflow(f"time field value out of range: {clock}")
    try:
        return dt.datetime(year, month, day) + dt.timedelta(microseconds=time)
    except (ValueError, OverflowError):
        raise DatetimeFieldOverflow(
            f"timestamp out of range: {year}-{month:02d}-{day:02d} {clock}", hint=_YEARS_HINT
        ) from None


def to_timestamp(seconds: float) -> dt.datetime:
    """PostgreSQL's ``to_timestamp(double precision)`` in dpsql's UTC session (22008 out of range)."""
    if math.isnan(seconds):
        raise DatetimeFieldOverflow("timestamp cannot be NaN")
    try:
        return dt.datetime(1970, 1, 1) + dt.timedelta(seconds=seconds)
    except (ValueError, OverflowError):
        raise DatetimeFieldOverflow(f'timestamp out of range: "{seconds:g}"', hint=_YEARS_HINT) from None


def truncate(unit: str, value: dt.datetime) -> dt.datetime:
    """PostgreSQL's ``date_trunc(unit, value)`` of a timestamp without time zone, for every unit it has.

    Weeks start on Monday (ISO); decades, centuries and millennia as PostgreSQL counts them (the 21st
    century and the 3rd millennium begin in 2001). The decade of years 1..9 begins in 1 BC, which
    Python's dates cannot hold: 22008, as for other dates outside years 1..9999.
    """
    if unit in ("millennium", "century", "decade"):
        size = {"millennium": 1000, "century": 100, "decade": 10}[unit]
        first = value.year // 10 * 10 if unit == "decade" else (value.year - 1) // size * size + 1
        if first < 1:  # the decade of years 1..9 starts in 1 BC
            raise DatetimeFieldOverflow("timestamp out of range", hint=_YEARS_HINT)
        return dt.datetime(first, 1, 1)
    if unit == "year":
        return dt.datetime(value.year, 1, 1)
    if unit == "quarter":
        return dt.datetime(value.year, 3 * ((value.month - 1) // 3) + 1, 1)
    if unit == "month":
        return dt.datetime(value.year, value.month, 1)
    if unit == "week":
        day = value.date() - dt.timedelta(days=value.weekday())
        return dt.datetime(day.year, day.month, day.day)
    if unit == "day":
        return dt.datetime(value.year, value.month, value.day)
    if unit == "hour":
        return value.replace(minute=0, second=0, microsecond=0)
    if unit == "minute":
        return value.replace(second=0, microsecond=0)
    if unit == "second":
        return value.replace(microsecond=0)
    if unit == "milliseconds":
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    return value  # microseconds: a timestamp has no finer digits


def _date_trunc(node: exp.TimestampTrunc | exp.DateTrunc) -> exp.Expression | None:
    """``DATE_TRUNC('<unit>', <constant>)`` as a timestamp literal (Metabase's relative filters:
    ``DATE_TRUNC('year', NOW() + INTERVAL '-30 year')``). PostgreSQL truncates a date as a
    timestamptz at midnight, which in dpsql's UTC session is the same instant. A word that is no unit
    (sqlglot reads a bare column name there as a unit too) and a time-zone argument are left alone,
    for the analyzer to judge as before."""
    value = _value(node.this)
    unit_arg = node.args.get("unit")
    if not isinstance(value, dt.date) or not isinstance(unit_arg, exp.Var | exp.Literal) or node.args.get("zone"):
        return None
    stamp = value if isinstance(value, dt.datetime) else dt.datetime(value.year, value.month, value.day)
    try:
        unit = date_unit(unit_arg.name, "date_trunc", "timestamp")
    except InvalidParameterValue:
        return None
    if unit.startswith("timezone"):  # PostgreSQL: recognised but not supported for date_trunc
        return None
    return _timestamp_literal(truncate(unit, stamp))


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
    if isinstance(node, exp.TimestampTrunc | exp.DateTrunc):
        return _date_trunc(node)
    if isinstance(node, exp.UnixToTime) and node.args.get("scale") is None:
        seconds = _signed(node.this)
        return None if seconds is None else _timestamp_literal(to_timestamp(float(seconds)))
    if isinstance(node, exp.Anonymous) and node.name.lower() == "make_date":
        parts = [_signed(a) for a in node.expressions]
        if len(parts) != 3 or any(p is None for p in parts):
            return None
        date = make_date(*_integer_args("make_date", parts, 3))  # type: ignore[arg-type]
        return None if date is None else _date_literal(date)
    if isinstance(node, exp.TimestampFromParts):
        if any(v is not None for k, v in node.args.items() if k not in _PARTS):
            return None
        values = [_signed(node.args.get(k)) for k in _PARTS]
        if any(v is None for v in values):
            return None
        year, month, day, hour, minute = _integer_args("make_timestamp", values, 5)  # type: ignore[arg-type]
        stamp = make_timestamp(year, month, day, hour, minute, float(values[5]))  # type: ignore[arg-type]
        return None if stamp is None else _timestamp_literal(stamp)
    if isinstance(node, exp.Add | exp.Sub):
        left, right = _value(node.this), _value(node.expression)
        if isinstance(node, exp.Add) and isinstance(left, Interval) and isinstance(right, dt.date):
            left, right = right, left
        if isinstance(left, dt.date) and isinstance(right, Interval):
            stamp = left if isinstance(left, dt.datetime) else dt.datetime(left.year, left.month, left.day)
            return _timestamp_literal(add_interval(stamp, right if isinstance(node, exp.Add) else -right))
        if isinstance(node, exp.Sub) and type(left) is dt.date and type(right) is dt.date:
            return exp.Literal.number((left - right).days)  # date - date: integer days
        days = _signed(node.expression)
        if type(left) is dt.date and days is not None:
            sign = "+" if isinstance(node, exp.Add) else "-"
            if _number_type(days) != "integer":  # date ± bigint or numeric: no such operator
                raise UndefinedFunction(
                    f"operator does not exist: date {sign} {_number_type(days)}", hint=_NO_CAST_HINT.format("operator")
                )
            try:
                return _date_literal(left + dt.timedelta(days=days if sign == "+" else -days))
            except OverflowError:
                raise DatetimeFieldOverflow("date out of range", hint=_YEARS_HINT) from None
        return None
    if isinstance(node, exp.Mul):
        return _scaled_interval(node)
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


def _scaled_interval(node: exp.Mul) -> exp.Expression | None:
    """``INTERVAL '1 day' * 7`` (either side) by an integer: each field multiplied, as PostgreSQL's
    interval_mul does exactly for integer factors (a fraction spills into smaller fields: not folded)."""
    left, right = _value(node.this), _signed(node.expression)
    if not isinstance(left, Interval):
        left, right = _value(node.expression), _signed(node.this)
    if not isinstance(left, Interval) or not isinstance(right, int):
        return None
    scaled = Interval(left.months * right, left.days * right, left.micros * right)
    if not (_fits(scaled.months, 32) and _fits(scaled.days, 32) and _fits(scaled.micros, 64)):
        raise DatetimeFieldOverflow("interval out of range")
    text = f"{scaled.months} months {scaled.days} days {scaled.micros} microseconds"
    return exp.Interval(this=exp.Literal.string(text))


def _numeric_root(node: exp.Expression) -> bool:
    """Whether ``node`` is an arithmetic operator folded whole by :mod:`dpsql.analyze.arith` — not a
    bare GROUP BY or ORDER BY item (``GROUP BY 2 - 1`` groups by a constant; folded, it would become
    the ordinal ``1``). Casts of constants to numeric types too (``CAST(2.5 AS INT)`` is 3)."""
    parent = node.parent
    if isinstance(parent, exp.Group | exp.Ordered):
        return False
    if isinstance(node, exp.Cast):  # a select item keeps its name ("int4"): cast constants elsewhere only
        return node.to.this in NUMERIC_CASTS and not isinstance(parent, exp.Select | exp.Alias)
    return isinstance(node, ARITHMETIC) or (isinstance(node, exp.Neg) and not isinstance(node.this, exp.Literal))


def fold_constants(tree: exp.Expression, now: dt.datetime | None = None) -> exp.Expression:
    """``tree`` with every constant date/time expression replaced by its literal (post-order, in place),
    and every constant numeric expression by its value (:mod:`dpsql.analyze.arith`, whole subtrees).

    ``now`` is the statement's start time (UTC, without time zone, as the session's TimeZone is UTC).
    """
    moment = now or dt.datetime.now(dt.UTC).replace(tzinfo=None)

    def visit(node: exp.Expression) -> exp.Expression:
        if _numeric_root(node) and node is not tree:
            number = evaluate(node)
            if number is not None:
                literal = render(number)
                node.replace(literal)
                return literal
        for child in list(node.iter_expressions()):
            visit(child)
        folded = _fold(node, moment)
        if folded is not None and node is not tree:
            node.replace(folded)
            return folded
        return folded if folded is not None else node

    return visit(tree)
