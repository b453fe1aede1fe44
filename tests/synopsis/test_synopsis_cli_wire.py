"""Synopses through the front doors: ``dpsql synopsis build|list|refresh`` then ``dpsql query`` in other
processes (one ledger, the demo's pinned identity), and a real psycopg client over the wire."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dpsql.curator.synopsis_cli import build
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.policy import Analyst, Auth, load_policy
from dpsql.server import ThreadedServer

CLINIC = str(demo_policy_path("clinic"))


def dpsql(*args: str, ledger: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, "--policy", CLINIC, "--ledger", ledger],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_build_list_query_refresh_in_separate_processes(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    built = dpsql("synopsis", "build", ledger=ledger)
    assert built.returncode == 0, built.stderr
    assert 'synopsis "visits_dashboard" of dataset "clinic"' in built.stdout and "charged ε=1 once" in built.stdout
    again = dpsql("synopsis", "build", ledger=ledger)  # built already: nothing charged
    assert "already released" in again.stdout
    query = dpsql("query", "SELECT department, COUNT(*) FROM visits GROUP BY department", ledger=ledger)
    assert query.returncode == 0, query.stderr
    assert 'answered from synopsis "visits_dashboard"' in query.stdout + query.stderr
    refreshed = dpsql("synopsis", "refresh", "visits_dashboard", ledger=ledger)
    assert refreshed.returncode == 0 and "charged ε=1" in refreshed.stdout
    listed = dpsql("synopsis", "list", ledger=ledger)
    assert (
        listed.returncode == 0 and "visits_dashboard" in listed.stdout and "2 releases in the ledger" in listed.stdout
    )
    missing = subprocess.run(
        [sys.executable, "-m", "dpsql.cli", "synopsis", "build"], capture_output=True, text=True, check=False
    )
    assert missing.returncode == 1 and "needs --policy" in missing.stderr


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    policy = load_policy(CLINIC)
    policy = policy.model_copy(update={"analysts": (Analyst(name="alice"),), "auth": Auth(trust=True)})
    engine = Engine.open(policy, "duckdb://", ledger="memory")
    load_demo(engine.backend, ["clinic"])
    build(engine, "visits_dashboard")
    running = ThreadedServer(engine, catalog_dsn="")
    try:
        yield running.host, running.port
    finally:
        running.stop()
        engine.close()


def test_psycopg_sees_the_answer_free_with_its_notice(server: tuple[str, int]) -> None:
    host, port = server
    notices: list[str] = []
    with psycopg.connect(host=host, port=port, user="alice", dbname="clinic") as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        rows = conn.execute(
            "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) AS count FROM visits "
            "WHERE visit_date >= '2021-01-01' AND visit_date < '2022-01-01' GROUP BY 1 ORDER BY 1"
        ).fetchall()
        budget = conn.execute("SELECT epsilon_spent FROM dpsql_budget").fetchall()
    assert len(rows) == 12 and all(r[0].year == 2021 for r in rows)
    assert any('answered from synopsis "visits_dashboard"' in n for n in notices), notices
    assert budget == [(0.0,)]


def test_build_prints_the_noise_warning_where_it_is_typed(tmp_path: Path) -> None:
    """#40 item 4: a synopsis whose ε is shared by many marginals is warned about by ``synopsis build``
    itself (stderr), not only in a server's log."""
    text = Path(CLINIC).read_text(encoding="utf-8")
    month = "\"DATE_TRUNC('month', visit_date)\""
    two, three = f"[[department], [{month}]]", f"[[department], [{month}], [department, {month}]]"
    policy = tmp_path / "clinic.yaml"
    policy.write_text(text.replace(f"marginals: {two}", f"marginals: {three}"))
    built = subprocess.run(
        [sys.executable, "-m", "dpsql.cli", "synopsis", "build", "--policy", str(policy), "--ledger",
         f"sqlite:///{tmp_path / 'ledger.db'}"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert (
        'WARNING:  synopsis "visits_dashboard": 3 marginals × 1 measures: each is measured at 1/3 of ε=1, about 3× '
        "the noise of one query at that ε; declare only the marginals the dashboard needs"
    ) in built.stderr
