"""Fixtures for the curator's tools: a small clinic-like table on DuckDB and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend

from .people import fill


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
