"""Fixtures for the curator's tools: a small clinic-like table on DuckDB and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend

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


@pytest.fixture(params=["duckdb", "postgres"])
def make_db(request: pytest.FixtureRequest) -> Iterator[Callable[..., tuple[str, Backend]]]:
    """Factory: a fresh database of the parametrised kind holding ``people``; returns (url, backend)."""
    opened: list[Backend] = []
    tmp = request.getfixturevalue("tmp_path")

    def make(**kwargs: object) -> tuple[str, Backend]:
        if request.param == "duckdb":
            url = f"duckdb://{tmp}/db{len(opened)}.duckdb"
        else:
            url = request.getfixturevalue("pg_new_database")()
        backend = fill(open_backend(url), **kwargs)  # type: ignore[arg-type]
        opened.append(backend)
        return url, backend

    yield make
    for backend in opened:
        backend.close()
