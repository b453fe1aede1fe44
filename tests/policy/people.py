"""The ``people`` table the curator tests draft and check policies for (DuckDB and PostgreSQL)."""

from __future__ import annotations

from dpsql.backends import Backend

#: 200 people, one row each; dept has 4 values; 'rare' is held by person 7 only.
DEPTS = ["Cardiology", "Oncology", "Neurology", "Pediatrics"]
ROWS = [(i, f"p{i}", DEPTS[i % 4], 20 + i % 60, 1.5 * i) for i in range(200)]


def fill(backend: Backend, *, without: int | None = None, rare: bool = True) -> Backend:
    """The ``people`` table (``without``: one person absent, for neighbouring databases)."""
    rows = [r for r in ROWS if r[0] != without]
    if rare:
        rows = [(i, n, "Rare disease" if i == 7 else d, a, x) for i, n, d, a, x in rows]
    columns = [
        ("person_id", "BIGINT"),
        ("name", "VARCHAR"),
        ("dept", "VARCHAR"),
        ("age", "INTEGER"),
        ("income", "FLOAT"),
    ]
    backend.load_rows("people", columns, rows)
    return backend
