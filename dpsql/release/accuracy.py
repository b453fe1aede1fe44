"""Accuracy: the half-width of each released cell's confidence interval, from the noise used.

Counts and sums read their spec's exact tail (``half_width``); AVG and VARIANCE combine their
measures' independent noises by the delta method. Intervals are post-processing of public
scales and released values: they cost nothing.
"""

from __future__ import annotations

import math
from typing import Any

from sqlglot import exp

from dpsql.errors import InvalidParameterValue
from dpsql.plan import OutputItem
from dpsql.policy import Policy
from dpsql.session import Session


def confidence(policy: Policy, session: Session) -> float:
    """The session's CI level (or the policy's), checked: a bad one fails before any charge."""
    level = session.confidence if session.confidence is not None else policy.defaults.confidence
    if not 0 < level < 1:  # NaN fails too
        raise InvalidParameterValue(
            f"dpsql.confidence must be between 0 and 1 (exclusive), got {level:g}",
            hint="For example SET dpsql.confidence = 0.95.",
        )
    return level


def accuracy(out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
    """Half-width of the confidence interval of one released cell, from the scales used."""
    if out.kind in ("count", "sum"):
        return widths[out.measures[0]]
    if out.kind == "avg":
        total_i, count_i = out.measures
        count = max(float(env[f"m{count_i}"]), 1.0)
        total = float(env[f"m{total_i}"])
        # delta method for (centre + S/N): independent noises on S and N
        total_w, count_w = widths[total_i], widths[count_i]
        assert total_w is not None and count_w is not None
        return math.hypot(total_w / count, count_w * abs(total) / count**2)
    if out.kind == "variance":
        return _variance_accuracy(out, env, widths)
    if isinstance(out.expr, exp.Var) and out.expr.name.startswith("m") and out.kind != "mode":
        return widths[int(out.expr.name[1:])]
    return None


def _variance_accuracy(out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
    """Delta method for var = S2/N − (S1/N)² (and its square root), from the three noises' half-widths."""
    squares_i, total_i, count_i = out.measures
    w2, w1, wn = widths[squares_i], widths[total_i], widths[count_i]
    sample = bool(out.expr.expressions[3].this)
    if w2 is None or w1 is None or wn is None or (sample and float(env[f"m{count_i}"]) < 2):
        return None
    n = max(float(env[f"m{count_i}"]), 1.0)
    s2, s1 = float(env[f"m{squares_i}"]), float(env[f"m{total_i}"])
    width = math.sqrt((w2 / n) ** 2 + (2 * s1 * w1 / n**2) ** 2 + (wn * (s2 / n**2 - 2 * s1 * s1 / n**3)) ** 2)
    root = bool(out.expr.expressions[4].this)
    variance = max(s2 / n - (s1 / n) ** 2, 0.0)
    if sample:
        width *= n / (n - 1)
        variance *= n / (n - 1)
    if not root:
        return width
    return width / (2 * math.sqrt(variance)) if variance > 0 else math.sqrt(width)
