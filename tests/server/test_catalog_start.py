"""The shadow catalog started in the background (issue #37: ``dpsql serve`` listened only after initdb).

``dpsql serve`` listens at once; its local shadow PostgreSQL comes up in a thread. Catalog queries
wait for it; a start that fails refuses them (0A000) as a failed synchronous start did; a stop during
the start leaves no cluster behind.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from dpsql.backends.local_postgres import LocalPostgresError, local_server_version
from dpsql.dev.demo import demo_policy_path
from dpsql.errors import CatalogUnavailable
from dpsql.policy import load_policy
from dpsql.server import catalog
from dpsql.server.catalog import CatalogShadow

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (the shadow catalog)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_version_is_known_before_the_server_runs() -> None:
    version = local_server_version()
    assert re.match(r"\d+(\.\d+)?\b", version), version


def test_catalog_queries_wait_for_a_background_start() -> None:
    shadow = CatalogShadow(load_policy(demo_policy_path("health")))
    started = time.monotonic()
    shadow.start(background=True)
    try:
        assert time.monotonic() - started < 5, "start(background=True) waited for the server"
        assert shadow.available and shadow.server_version == local_server_version()
        session = shadow.connect("analyst")  # waits for the start
        try:
            rows = session.execute("SELECT relname FROM pg_catalog.pg_class WHERE relname = 'patients'")
            assert rows is not None
        finally:
            session.close()
        assert shadow.local is not None and shadow.local.alive()
    finally:
        shadow.stop()


def test_stop_during_a_background_start_leaves_no_cluster() -> None:
    shadow = CatalogShadow(load_policy(demo_policy_path("health")))
    shadow.start(background=True)
    time.sleep(0.3)  # initdb under way (or not yet begun: both must end with nothing running)
    local = shadow.local
    shadow.stop()
    assert shadow.local is None and not shadow.available
    if local is not None and local.process is not None:
        assert not _alive(local.process.pid)
    assert local is None or not os.path.exists(local.datadir)


def test_a_failed_background_start_refuses_catalog_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise LocalPostgresError("initdb exited with 1: no space left on device")

    monkeypatch.setattr(catalog, "start_local_postgres", broken)
    shadow = CatalogShadow(load_policy(demo_policy_path("health")))
    shadow.start(background=True)
    try:
        with pytest.raises(CatalogUnavailable) as caught:
            shadow.connect("analyst")
        assert caught.value.sqlstate == "0A000"
        assert not shadow.available
    finally:
        shadow.stop()
