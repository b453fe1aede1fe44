"""COUNT(DISTINCT col) of any readable column: one unit adds at most ``max_rows`` new values.

After contribution bounding a unit keeps at most ``max_rows`` rows, so it can add (or remove)
at most that many distinct values over all groups it touches: the L1 sensitivity is
``max_rows``, as for COUNT(*). Per-unit distinct counts do not add up to the total, so the
ungrouped per-unit shortcut of the bounding pass is not used (``decomposable = False``).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.aggregates.base import Aggregate
from dpsql.plan import Measure


class CountDistinct(Aggregate):
    kind = "count_distinct"
    decomposable = False

    def label(self, measure: Measure) -> str:
        return f"COUNT(DISTINCT {measure.column})"

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Count(this=exp.Distinct(expressions=[value()]), big_int=True)
