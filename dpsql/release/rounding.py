"""Result cells rounded to their interval's resolution: no 17-digit noise (``SET dpsql.round = off``).

A noisy float cell ``57.48083…`` with a 95% half-width ``0.664992`` shows as ``57.48 ±0.67``: the value
is rounded to two significant digits of its half-width (the resolution r = 10^(⌊log10 h⌋ − 1), at most
h/10), and the half-width is rounded *up* to a multiple of r (never narrower than computed). A noisy
float without an interval (a ratio, a correlation) keeps six significant digits. Integer cells
(counts, integer sums), keys, NULLs and exact cells (half-width 0) are left as they are; quantile
values are already grid values (:meth:`dpsql.noise.exponential.QuantileGrid.value`).

Privacy: a deterministic function of released values and public half-widths (post-processing): it
costs nothing and reveals nothing more. Applied by the engine to the answer a session receives,
after the result cache (which keeps the unrounded answer, so another session may ask for it raw).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from dpsql.pgtypes import parse_bool
from dpsql.session import Result, Session

#: The setting that turns rounding off (``SET dpsql.round = off``); on by default.
SETTING = "dpsql.round"
#: Significant digits kept of a noisy float that has no interval.
_PLAIN_DIGITS = 6


def rounding_on(session: Session) -> bool:
    """Whether the session wants rounded cells (the default) or the raw noisy values."""
    return parse_bool(session.settings.get(SETTING, "on"))


def resolution(width: float) -> float | None:
    """Two significant digits of a half-width: 0.664992 → 0.01; None for 0, NaN or ∞ (nothing to round to)."""
    if not (isinstance(width, int | float) and math.isfinite(width) and width > 0):
        return None
    return 10.0 ** (math.floor(math.log10(width)) - 1)


def _digits(step: float) -> int:
    """Decimal places of a power of ten (negative: tens, hundreds…), for ``round``."""
    return -round(math.log10(step))


def round_value(value: Any, width: float | None) -> Any:
    """A noisy float rounded to its half-width's resolution (six significant digits without one)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    step = resolution(width) if width is not None else None
    if step is None:
        if width is not None or value == 0:  # an exact cell (width 0): shown as is
            return value
        return round(value, _PLAIN_DIGITS - 1 - math.floor(math.log10(abs(value))))
    return round(value, _digits(step))


def round_width(width: float | None) -> float | None:
    """A half-width rounded up to its own resolution (two significant digits, never narrower)."""
    step = resolution(width) if width is not None else None
    if step is None or width is None:
        return width
    digits = _digits(step)
    up = math.ceil(round(width / step, 9)) * step
    return round(up, digits)


def round_result(result: Result) -> Result:
    """The result with its noisy float cells and their half-widths rounded (a new Result)."""
    noisy = [bool(c.noisy) for c in result.columns]
    if not any(noisy) or not result.rows:
        return result
    rows, accuracy = [], []
    for j, row in enumerate(result.rows):
        widths = result.accuracy[j] if j < len(result.accuracy) else ()
        cells, kept = [], []
        for i, value in enumerate(row):
            width = widths[i] if i < len(widths) else None
            cells.append(round_value(value, width) if noisy[i] else value)
            kept.append(round_width(width) if noisy[i] and isinstance(value, float) else width)
        rows.append(tuple(cells))
        accuracy.append(tuple(kept) if j < len(result.accuracy) else widths)
    return replace(result, rows=rows, accuracy=accuracy)
