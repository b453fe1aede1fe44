"""What ``dpsql policy check`` reports, and the whole-table counts its data checks read.

The counts are exact figures over all rows: they go to the curator's terminal or the server's log only,
never to an analyst.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from dpsql.backends import quote_ident


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Literal["error", "warning"]
    path: tuple[str, ...]
    message: str

    def render(self, where: str, line_of: Callable[[tuple[str, ...]], int]) -> str:
        key = ".".join(self.path) or "<top>"
        label = "" if self.severity == "error" else "warning: "
        return f"{where}:{line_of(self.path)}: {key}: {label}{self.message}"


@dataclass(frozen=True, slots=True)
class Counts:
    """Whole-table counts of one table (one aggregate query): rows, non-NULL values per column, and
    distinct non-NULL values per identifier. Exact, for the curator's terminal or the server's log only."""

    rows: int
    filled: dict[str, int]
    distinct: dict[str, int]

    def nulls(self, column: str) -> int:
        return self.rows - self.filled[column]

    def repeats(self, column: str) -> bool:
        return self.distinct[column] < self.filled[column]

    def unique(self, column: str) -> bool:
        return self.filled[column] > 1 and self.distinct[column] == self.filled[column]


def count_table(backend: Any, source: str, plain: list[str], ids: list[str]) -> Counts:
    """:class:`Counts` of ``source`` over all its rows: one scan, cheap on DuckDB and PostgreSQL, so a
    NULL or a repeat on the last row is seen as surely as on the first."""
    columns = [*plain, *ids]
    items = ["COUNT(*)", *(f"COUNT({quote_ident(c)})" for c in columns)]
    items += [f"COUNT(DISTINCT {quote_ident(c)})" for c in ids]
    _, rows = backend.execute(f"SELECT {', '.join(items)} FROM {quote_ident(source)}")
    values = [int(v or 0) for v in rows[0]]
    filled = dict(zip(columns, values[1 : 1 + len(columns)], strict=True))
    distinct = dict(zip(ids, values[1 + len(columns) :], strict=True))
    return Counts(values[0], filled, distinct)


def unmatched(backend: Any, source: str, column: str, target: str, to: str) -> tuple[int, int]:
    """(distinct non-NULL values of ``source.column``, how many of them ``target.to`` does not hold):
    one anti-join of the two distinct sets, whole tables."""
    _, rows = backend.execute(
        f"SELECT COUNT(*), COUNT(q.k) FROM (SELECT DISTINCT {quote_ident(column)} AS c FROM {quote_ident(source)} "
        f"WHERE {quote_ident(column)} IS NOT NULL) AS r LEFT JOIN (SELECT DISTINCT {quote_ident(to)} AS k FROM "
        f"{quote_ident(target)}) AS q ON r.c = q.k"
    )
    distinct, matched = int(rows[0][0] or 0), int(rows[0][1] or 0)
    return distinct, distinct - matched
