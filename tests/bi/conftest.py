"""Fixtures for BI-tool shapes: the health and clinic demos on DuckDB, fresh ledgers, a real server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.server import ThreadedServer


@pytest.fixture(scope="session")
def bi_health_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def bi_clinic_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    yield backend
    backend.close()


@pytest.fixture
def health(bi_health_backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("health")), bi_health_backend, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def clinic(bi_clinic_backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), bi_clinic_backend, Ledger.open("sqlite:///:memory:"))


@pytest.fixture(scope="module")
def clinic_server() -> Iterator[tuple[str, Engine]]:
    """A real ``dpsql serve`` over the clinic demo (trust auth, no shadow catalog); yields a DSN."""
    engine = Engine.open(demo_policy_path("clinic"), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["clinic"])
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        yield f"host={server.host} port={server.port} user=analyst dbname=clinic", engine
    finally:
        server.stop()
        engine.close()
