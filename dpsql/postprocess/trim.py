"""Time series trimmed to where the data are (``SET dpsql.trim_time = on``).

A time key's domain comes from the policy's bounds, not from the data (the data's first and last dates
are not public): a weekly chart with no time filter over a column bounded 1930–2021 releases ~4,750
buckets, most of them noise around zero. With ``dpsql.trim_time`` on, the leading and trailing time
buckets in which no noisy value stands out of its interval (|value| ≤ its half-width widened for the
number of buckets: indistinguishable from 0 at the session's confidence) are dropped; the buckets
between the first and the last one that does stand out are all kept, zeros included. A time filter
(``WHERE d >= …``) is the exact alternative.

Privacy: a function of the released values and their public half-widths only (post-processing): it
costs nothing. Applied per session after the result cache, like rounding (:mod:`dpsql.release.rounding`).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import replace
from typing import Any

from dpsql.pgtypes import parse_bool
from dpsql.session import Result, Session

#: The setting; off by default (every bucket of the domain is released, as PostgreSQL's generate_series would).
SETTING = "dpsql.trim_time"
_TIME_TYPES = frozenset({"date", "timestamp", "timestamp with time zone"})


def trimming_on(session: Session) -> bool:
    return parse_bool(session.settings.get(SETTING, "off"))


def _stands_out(value: Any, width: float | None, factor: float) -> bool:
    if value is None or width is None or isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) > width * factor


def _factor(buckets: int, confidence: float) -> float:
    """How much wider than the session's interval a value must be to stand out among ``buckets`` empty
    ones: the half-width at confidence 1 − (1 − c)/buckets (Bonferroni), as a Laplace tail scales
    (ln(1/α)), which is the heavier tail, so a Gaussian's is covered too. Without it, 5 % of empty
    buckets would stand out by chance."""
    alpha = 1.0 - confidence
    return math.log(max(buckets, 1) / alpha) / math.log(1.0 / alpha)


def trim_time(result: Result, confidence: float = 0.95) -> Result:
    """The result without the leading and trailing time buckets where nothing stands out (a new Result);
    unchanged without exactly one time key column, or when no bucket stands out. ``confidence`` is the
    level the result's half-widths are at."""
    times = [i for i, c in enumerate(result.columns) if c.type in _TIME_TYPES and c.noisy is False]
    noisy = [i for i, c in enumerate(result.columns) if c.noisy]
    if len(times) != 1 or not noisy or not result.rows:
        return result
    key = times[0]
    factor = _factor(len(result.rows), confidence)
    signal: list[Any] = []
    for j, row in enumerate(result.rows):
        widths = result.accuracy[j] if j < len(result.accuracy) else ()
        if row[key] is not None and any(
            _stands_out(row[i], widths[i] if i < len(widths) else None, factor) for i in noisy
        ):
            signal.append(row[key])
    if not signal:
        return result
    first, last = min(signal, key=_order), max(signal, key=_order)
    kept = [
        j for j, row in enumerate(result.rows) if row[key] is None or _order(first) <= _order(row[key]) <= _order(last)
    ]
    if len(kept) == len(result.rows):
        return result
    accuracy = [result.accuracy[j] for j in kept] if len(result.accuracy) == len(result.rows) else result.accuracy
    dropped = len(result.rows) - len(kept)
    note = (
        f"dpsql: {dropped} leading or trailing {result.columns[key].name} buckets dropped: no value in them stands "
        "out of its interval (dpsql.trim_time; SET dpsql.trim_time = off shows the whole domain)"
    )
    return replace(result, rows=[result.rows[j] for j in kept], accuracy=accuracy, notices=[*result.notices, note])


def _order(value: Any) -> Any:
    """Dates and timestamps compared alike (naive, midnight for a date)."""
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=None)
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day)
    return value
