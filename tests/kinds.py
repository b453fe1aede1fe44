"""A fresh database of either backend kind for tests that run on both: in-memory DuckDB, or a new
PostgreSQL database from the ``pg_new_database`` fixture (so only the PostgreSQL cases start one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dpsql.backends import Backend, open_backend


def open_empty(kind: str, request: pytest.FixtureRequest | None) -> Backend:
    """An empty database: DuckDB in memory when ``kind`` starts with "duckdb", else PostgreSQL (from
    ``request``'s ``pg_new_database``)."""
    if kind.startswith("duckdb"):
        return open_backend("duckdb://")
    assert request is not None, "a PostgreSQL database needs the requesting fixture"
    make: Callable[[], str] = request.getfixturevalue("pg_new_database")
    return open_backend(make())


@contextmanager
def loaded(kind: str, request: pytest.FixtureRequest | None, script: str) -> Iterator[Backend]:
    """:func:`open_empty` with ``script`` run in it; closed on exit."""
    backend = open_empty(kind, request)
    try:
        backend.execute_script(script)
        yield backend
    finally:
        backend.close()


def new_database_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path, name: str = "ledger.sqlite") -> str:
    """A fresh database's URL: a SQLite (a ledger and cache store) or DuckDB file ``name`` in ``tmp_path``
    when ``kind`` is "sqlite" or "duckdb", else a fresh PostgreSQL database."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / name}"
    if kind == "duckdb":
        return f"duckdb://{tmp_path}/{name}"
    make: Callable[[], str] = request.getfixturevalue("pg_new_database")
    return make()
