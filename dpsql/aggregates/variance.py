"""VAR_POP/VAR_SAMP/STDDEV: from noisy Σ(x−c)², Σ(x−c) and N (three measures), post-processed."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dpsql.aggregates.base import Aggregate

if TYPE_CHECKING:
    from dpsql.plan import OutputItem
    from dpsql.session import PgType


class Variance(Aggregate):
    kind = "variance"

    def output_type(self, scope: Any, measures: tuple[int, ...]) -> PgType | None:
        return "double precision"

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
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
