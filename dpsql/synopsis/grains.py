"""Time grains of released keys: which grain is a union of which, a bucket's start and its last value.

Pure calendar arithmetic on public key values (bucket starts of a declared or derived domain, or the
constants of a query), never on data. The calendar's end is a value like any other: the last bucket of
year 9999 ends at 9999-12-31 (23:59:59.999999), not with an error (issue #38 item 6).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import sqlglot
from sqlglot import exp

from dpsql.analyze.expressions import date_unit
from dpsql.analyze.fold import truncate as fold_truncate
from dpsql.analyze.parse import dialect
from dpsql.policy import Scalar

#: Time grains in nesting order: a grain is a union of cells of every finer one (weeks only of days).
GRAINS = ("MICROSECOND", "MILLISECOND", "SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "QUARTER", "YEAR")
_DAY_OR_FINER = frozenset(GRAINS[: GRAINS.index("DAY") + 1])
_MONTHS = {"YEAR": 12, "QUARTER": 3, "MONTH": 1}
_STEPS = {"WEEK": dt.timedelta(weeks=1), "DAY": dt.timedelta(days=1), "HOUR": dt.timedelta(hours=1)}
_STEPS |= {"MINUTE": dt.timedelta(minutes=1), "SECOND": dt.timedelta(seconds=1)}
_STEPS |= {"MILLISECOND": dt.timedelta(milliseconds=1), "MICROSECOND": dt.timedelta(microseconds=1)}


def coarsens(fine: str, coarse: str) -> bool:
    """Whether every ``coarse`` time bucket is a union of ``fine`` buckets."""
    if coarse == "WEEK":
        return fine == "WEEK" or fine in _DAY_OR_FINER
    if fine not in GRAINS or coarse not in GRAINS:
        return fine == coarse
    return GRAINS.index(fine) <= GRAINS.index(coarse)


def truncate(value: Scalar, unit: str) -> Scalar:
    """``value`` (a bucket start) truncated to ``unit`` as PostgreSQL's ``date_trunc`` does
    (:func:`dpsql.analyze.fold.truncate`), its type kept (a date stays a date)."""
    if not isinstance(value, dt.date):
        return value
    stamp = value if isinstance(value, dt.datetime) else dt.datetime(value.year, value.month, value.day)
    canonical = date_unit(unit, "date_trunc", "timestamp")
    truncated = fold_truncate(canonical, stamp.replace(tzinfo=None)).replace(tzinfo=stamp.tzinfo)
    return truncated if isinstance(value, dt.datetime) else truncated.date()


def bucket_end(start: Scalar, unit: str, column_type: str) -> Scalar:
    """The last value of ``column_type`` inside the bucket starting at ``start``; the calendar's last
    value (9999-12-31, or its last microsecond) for a bucket that reaches it."""
    if not isinstance(start, dt.date):
        return start
    stamp = start if isinstance(start, dt.datetime) else dt.datetime(start.year, start.month, start.day)
    try:
        months = _MONTHS.get(unit)
        if months is not None:
            total = stamp.year * 12 + stamp.month - 1 + months
            following = stamp.replace(year=total // 12, month=total % 12 + 1)
        else:
            following = stamp + _STEPS.get(unit, dt.timedelta(microseconds=1))
    except (OverflowError, ValueError):  # past year 9999: the bucket ends with the calendar
        last = dt.datetime.max.replace(tzinfo=stamp.tzinfo)
        return last.date() if column_type == "date" else last
    if column_type == "date":
        return (following - dt.timedelta(days=1)).date()
    return following - dt.timedelta(microseconds=1)


def normal(value: Scalar) -> Any:
    """A comparable form of a key value (a date and the timestamp of its midnight are one bucket)."""
    if isinstance(value, dt.datetime):
        return ("t", value if value.tzinfo is None else value.replace(tzinfo=None))
    if isinstance(value, dt.date):
        return ("t", dt.datetime(value.year, value.month, value.day))
    return ("v", value)


def time_columns(keys: Sequence[str]) -> list[str]:
    """The columns of the time grains (``DATE_TRUNC(unit, column)``) among declared key texts."""
    return [column for text in keys if (column := _trunc_column(text)) is not None]


@lru_cache(maxsize=1024)
def _trunc_column(text: str) -> str | None:
    try:
        tree = sqlglot.parse_one(text, dialect=dialect("postgres"))
    except sqlglot.errors.SqlglotError:
        return None
    if isinstance(tree, exp.TimestampTrunc | exp.DateTrunc) and isinstance(tree.this, exp.Column):
        return str(tree.this.name)
    return None
