"""Fixtures for the adversarial suite: the health and clinic demos on DuckDB, fresh ledgers per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy


@pytest.fixture(scope="session")
def adv_health_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def adv_clinic_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    yield backend
    backend.close()


@pytest.fixture
def health(adv_health_backend: Backend) -> Engine:
    """The health engine (alice: ε budget 10, bob: 5, dataset: 50) with an empty in-memory ledger."""
    return Engine(load_policy(demo_policy_path("health")), adv_health_backend, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def clinic(adv_clinic_backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), adv_clinic_backend, Ledger.open("sqlite:///:memory:"))
