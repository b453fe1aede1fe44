"""COUNT(*) and COUNT(column): sensitivity 1 per row, released as non-negative integers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlglot import exp

from dpsql.aggregates.base import Aggregate

if TYPE_CHECKING:
    from dpsql.plan import Measure, OutputItem
    from dpsql.session import PgType


class CountStar(Aggregate):
    kind = "count_star"

    def label(self, measure: Measure) -> str:
        return "COUNT(*)"


class Count(Aggregate):
    """COUNT(column) measures, and every count output (COUNT(*) included)."""

    kind = "count"
    direct = True
    explain_ci = True

    def label(self, measure: Measure) -> str:
        return f"COUNT({measure.column})"

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Count(this=value(), big_int=True)

    def output_type(self, scope: Any, measures: tuple[int, ...]) -> PgType | None:
        return "bigint"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        return value if value is None else max(round(value), 0)

    def direct_values(self, values: list[Any], convert: Callable[[Any], Any]) -> list[Any]:
        return [max(round(v), 0) for v in values]

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return widths[out.measures[0]]
