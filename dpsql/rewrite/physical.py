"""Physical choices: what the backend proves or prefers, decided per query after analysis.

These depend on the backend and its data, not on the query: the clamp proofs read from the
database's own statistics (``proven``) and whether grouped sums bound whole cells
(``hash``, ``top_rows``). They change the SQL the backend runs, never the released distribution.
"""

from __future__ import annotations

from typing import Any

from dpsql.backends import Backend, stored_type_mismatches
from dpsql.errors import DatatypeMismatch
from dpsql.plan import Measure, Physical, Plan


def choose_physical(plan: Plan, backend: Backend, salt: str) -> Physical:
    """The backend-dependent choices for ``plan``: the engine's salt, the clamps the backend's statistics
    prove redundant, and the backend's cheapest salted order and top-rows aggregation."""
    return Physical(salt, proven_in_bounds(plan, backend), backend.row_hash, backend.top_rows)


def data_version(backend: Backend) -> int:
    """A counter the backend bumps before every write (0 for backends that prove nothing)."""
    return backend.data_version


def proven_in_bounds(plan: Plan, backend: Backend) -> frozenset[int]:
    """Sum measures over a plain column whose every stored value the database's own statistics place
    inside the declared bounds. Clamping those is the identity, so releasing them unclamped gives the
    same numbers; only backends with exact (conservative) min/max statistics implement this."""
    wanted: dict[int, tuple[str, str]] = {}
    for i, m in enumerate(plan.measures):
        if m.clamped_sum and m.expr is None and m.column is not None and m.table is not None:
            source = next((s for s in plan.sources.sources if s.alias == m.table), None)
            if source is not None and source.derived is None:
                wanted[i] = (source.table.source or source.name, m.column)
    if not wanted:
        return frozenset()
    found = {
        (table, column): bounds
        for table in {t for t, _ in wanted.values()}
        for column, bounds in backend.proven_ranges(
            table, sorted({c for t, c in wanted.values() if t == table})
        ).items()
    }
    return frozenset(i for i, where in wanted.items() if _inside(found.get(where), plan.measures[i]))


def _inside(bounds: tuple[Any, Any] | None, measure: Measure) -> bool:
    """Whether proven (min, max) lie within the measure's bounds (NaN compares false: not inside)."""
    if bounds is None or measure.lower is None or measure.upper is None:
        return False
    return bool(measure.lower <= bounds[0] and bounds[1] <= measure.upper)


class StoredTypes:
    """Per-backend memo of stored-type mismatches, read once per (table, data version)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        #: (table, data version) → stored-type mismatches found (schema only).
        self._checked: dict[tuple[str, int], list[tuple[str, str]]] = {}

    def check(self, plan: Plan) -> None:
        """Refuse a query over a column the database stores as text while the policy declares a number,
        date or boolean: its cast would fail on some rows only (see ``stored_type_mismatches``)."""
        for source in plan.sources.tables:
            table = source.table.source or source.name
            key = (table, data_version(self._backend))
            if key not in self._checked:
                declared = {name: column.type for name, column in source.table.columns.items()}
                self._checked[key] = stored_type_mismatches(self._backend, table, declared)
            for column, stored in self._checked[key]:
                raise DatatypeMismatch(
                    f'column "{column}" of table "{source.name}" is stored as {stored}, '
                    f"but the policy declares {source.table.columns[column].type}",
                    hint="Fix the column's type in the policy or in the database: a cast of stored text "
                    "could fail on some rows only, so dpsql refuses the table's columns until they agree.",
                )
