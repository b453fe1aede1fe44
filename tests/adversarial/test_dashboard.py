"""The curator's dashboard on neighbouring databases: every page must be the same whoever is in the data.

The dashboard reads the ledger and the policy only, so what it shows can depend on one person only
through what the ledger holds. The same statements run on DuckDB and PostgreSQL over the
error-oracle neighbours (one person absent, ordinary, out of bounds, NaN), each run on its own copy
of one ledger (one installation key: equal fingerprints); the dashboard's pages (analysts, spend
plot, audit trail, policy), fetched over HTTP after a real login, must be equal once times,
latencies and the session's CSRF token are masked (latency is data-dependent and kept on purpose:
see tests/adversarial/test_audit.py).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.test_audit import NEIGHBOURS, STATEMENTS
from tests.adversarial.test_error_oracles import POLICY, _script
from tests.adversarial.worlds import kind_backends
from tests.dashboard.conftest import start_live

PAGES = ("/", "/spend", "/audit", "/audit?outcome=refused", "/policy")
_MASKS = (
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d(:\d\d)?( UTC)?"), "<time>"),
    (re.compile(r'<span class="latency">[^<]*</span>'), "<latency>"),
    (re.compile(r'name="csrf" value="[^"]*"'), "<csrf>"),
    (re.compile(r'points="[^"]*"'), "<x-by-time>"),  # the plot's x axis is time; its y values stay in the legend
)


def _masked(page: str) -> str:
    for pattern, replacement in _MASKS:
        page = pattern.sub(replacement, page)
    return page


@pytest.fixture(scope="module")
def dashboard_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    with kind_backends(pg_new_database) as backends:
        yield backends


def test_dashboard_pages_do_not_depend_on_one_person(dashboard_backends: dict[str, Backend], tmp_path: Path) -> None:
    policy = parse_policy(POLICY)
    template = tmp_path / "template.sqlite"
    with Ledger.open(f"sqlite:///{template}") as first:  # one installation key for every copy
        first.installation_key()
    pages: dict[tuple[str, str], list[str]] = {}
    for variant in NEIGHBOURS:
        for name, backend in dashboard_backends.items():
            backend.execute_script(_script(variant))
            path = tmp_path / f"{variant}-{name}.sqlite"
            shutil.copy(template, path)
            ledger = Ledger.open(f"sqlite:///{path}")
            engine = Engine(policy, backend, ledger)
            for sql in STATEMENTS:
                with contextlib.suppress(Error):
                    engine.execute(sql, Session("alice", epsilon=1.0, delta=1e-6))
            engine.audit.close()
            live = start_live(policy, ledger)
            try:
                _, _, cookies = live.login()
                fetched = []
                for page in PAGES:
                    response, body = live.request("GET", page, cookies=cookies)
                    assert response.status == 200, page
                    fetched.append(_masked(body))
            finally:
                live.server.shutdown()
                live.server.server_close()
                ledger.close()
            pages[(variant, name)] = fetched
    reference = pages[(NEIGHBOURS[0], "duckdb")]
    assert 'class="eps-spent">3</span>' in reference[0]  # three answered statements at ε = 1
    assert reference[3].count('<span class="event">refused</span>') == 3
    for run, fetched in pages.items():
        for page, body, expected in zip(PAGES, fetched, reference, strict=True):
            assert body == expected, f"dashboard page {page} differs on {run}"
