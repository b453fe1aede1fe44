"""Fixtures for BI-tool shapes: the health and clinic demos on DuckDB, fresh ledgers, a real server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.server import ThreadedServer
from tests.demos import demo_engine_fixture, demo_fixture

bi_health_backend = demo_fixture("health")
bi_clinic_backend = demo_fixture("clinic")
health = demo_engine_fixture("health", "bi_health_backend")
clinic = demo_engine_fixture("clinic", "bi_clinic_backend")


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
