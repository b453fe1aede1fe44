"""Fixtures for engine tests: the health demo on DuckDB and on a real PostgreSQL."""

from __future__ import annotations

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.session import Session
from tests.demos import demo_fixture


@pytest.fixture(scope="session")
def health_policy() -> Policy:
    return load_policy(demo_policy_path("health"))


health_duckdb = demo_fixture("health")
health_pg = demo_fixture("health", kind="postgres")


@pytest.fixture
def engine(health_policy: Policy, health_duckdb: Backend) -> Engine:
    """The health engine over DuckDB with a fresh in-memory ledger."""
    return Engine(health_policy, health_duckdb, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def alice() -> Session:
    return Session(analyst="alice")
