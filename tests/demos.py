"""The demo databases tests open again and again: a backend with demos loaded, an engine over one
with a fresh in-memory ledger, and fixtures made of them (one line each in a conftest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from tests.kinds import open_empty


@contextmanager
def demo_backend(kind: str, request: pytest.FixtureRequest, *demos: str) -> Iterator[Backend]:
    """A fresh database of ``kind`` (see :func:`tests.kinds.open_empty`) with ``demos`` loaded."""
    backend = open_empty(kind, request)
    try:
        load_demo(backend, list(demos))
        yield backend
    finally:
        backend.close()


def demo_engine(demo: str, backend: Backend) -> Engine:
    """The ``demo`` policy's engine over ``backend`` with an empty in-memory ledger."""
    return Engine(load_policy(demo_policy_path(demo)), backend, Ledger.open("sqlite:///:memory:"))


def demo_fixture(*demos: str, kind: str = "duckdb", scope: str = "session") -> object:
    """A fixture: a ``kind`` database with ``demos`` loaded, for ``scope``; ``kind="both"`` makes it
    parametrized over DuckDB and PostgreSQL."""
    params = ["duckdb", "postgres"] if kind == "both" else None

    def fixture(request: pytest.FixtureRequest) -> Iterator[Backend]:
        with demo_backend(request.param if params else kind, request, *demos) as backend:
            yield backend

    def on_postgres(request: pytest.FixtureRequest, pg_new_database: Callable[[], str]) -> Iterator[Backend]:
        # names pg_new_database, so collection marks its tests ``postgres`` (tests/pg.py)
        yield from fixture(request)

    chosen = on_postgres if kind == "postgres" else fixture
    return pytest.fixture(scope=scope, params=params)(chosen)  # type: ignore[call-overload]


@contextmanager
def cached_engine(policy: Policy, backend: Backend) -> Iterator[Engine]:
    """An engine over ``backend`` (not closed here: a module's) with an empty in-memory ledger and a
    result cache; its audit log and ledger are closed on exit."""
    engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache())
    try:
        yield engine
    finally:
        engine.audit.close()
        engine.ledger.close()


def demo_engine_fixture(demo: str, backend_fixture: str) -> object:
    """A fixture: :func:`demo_engine` of ``demo`` over the backend the fixture ``backend_fixture`` gives."""

    def fixture(request: pytest.FixtureRequest) -> Engine:
        return demo_engine(demo, request.getfixturevalue(backend_fixture))

    return pytest.fixture(fixture)
