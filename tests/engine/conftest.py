"""Fixtures for engine tests: the health demo on DuckDB and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.session import Session


@pytest.fixture(scope="session")
def health_policy() -> Policy:
    return load_policy(demo_policy_path("health"))


@pytest.fixture(scope="session")
def health_duckdb() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def health_pg(pg_new_database: Callable[[], str]) -> Iterator[Backend]:
    backend = open_backend(pg_new_database())
    load_demo(backend, ["health"])
    yield backend
    backend.close()


@pytest.fixture
def engine(health_policy: Policy, health_duckdb: Backend) -> Engine:
    """The health engine over DuckDB with a fresh in-memory ledger."""
    return Engine(health_policy, health_duckdb, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def alice() -> Session:
    return Session(analyst="alice")
