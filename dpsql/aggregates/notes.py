"""Shared pieces of the accuracy notes (NOTICE texts) the aggregates and the release stage write.

Every figure in a note is public (ε, the policy's bounds and domains, the grid, the confidence) or a
released value: notes are post-processing, free.
"""

from __future__ import annotations

import math
from typing import Any

from dpsql.noise.exponential import nice

#: A note starting with this is a warning (the server sends it with severity WARNING).
WARNING = "dpsql: WARNING: "
#: Rows named in one note before "…".
NOTE_ROWS = 5
#: Each released group's key, noisy count and the count's half-width.
Counts = list[tuple[tuple[Any, ...], float, float]]
#: A released value interval (low, high): a quantile's, at the policy's confidence.
Interval = tuple[float, float]


def number(x: float, width: float | None = None) -> str:
    """A released number as notes show it: rounded like result cells (two significant digits of
    ``width``, else six significant digits), without exponent or trailing zeros."""
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    if width is not None and width > 0 and math.isfinite(width):
        x = nice(x, width)
    text = f"{x:.6g}" if width is None or "e" in repr(x) else repr(x)
    return text.removesuffix(".0")


def null_note(name: str, values: list[Any]) -> list[str]:
    """Say why an AVG/variance is NULL: its noisy count was ≤ 0 (decided from released values only)."""
    nulls = sum(1 for v in values if v is None)
    if not nulls:
        return []
    where = "" if len(values) == 1 else f" in {nulls} of {len(values)} rows"
    return [f"dpsql: {name} is NULL{where}: its noisy count is <= 0 (the group looks empty)"]
