"""Issue #41 item 8: the curator's levers racing with load.

Four connections of one analyst spend at full speed through a real server while the curator grants,
revokes, freezes and unfreezes and reloads the policy (its analyst budget alternating between 1.0 and
1.2; on SQLite and PostgreSQL ledgers). Each lever is read inside each
reservation, under the dataset's lock, so: nothing is charged between a freeze and the next unfreeze (the
spending the curator sees right after a freeze does not move until it unfreezes), a revoke never takes back
what was spent and the spending never exceeds the larger policy budget plus what was granted, every
reload is applied, the clients see only 53P01 (budget) and 42501 (frozen) refusals, and ``ledger verify``
finds the ledger consistent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from dpsql.backends import open_backend
from dpsql.curator.reload import make_reloader
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import InvalidParameterValue
from dpsql.ledger import Ledger
from dpsql.policy import Budget, load_policy
from dpsql.server import ThreadedServer
from tests.server.conftest import Running

ANALYST = "alice"
BUDGET = Budget(epsilon=1.0, delta=1e-5)
HEALTH = demo_policy_path("health").read_text()
#: The policy file's two versions the curator reloads in turn (the analyst budget 1.0 or 1.2).
VERSIONS = [
    HEALTH.replace("analyst: {epsilon: 10.0, delta: 1.0e-5}", f"analyst: {{epsilon: {eps}, delta: 1.0e-5}}", 1).replace(
        "dataset: {epsilon: 50.0, delta: 1.0e-4}", "dataset: {epsilon: 1000.0, delta: 0.5}", 1
    )
    for eps in (1.0, 1.2)
]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def policy_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, Engine]]:
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'ledger.sqlite'}"
    else:
        new_database: Callable[[], str] = request.getfixturevalue("pg_new_database")
        url = new_database()
    path = tmp_path / "health.yaml"
    path.write_text(VERSIONS[0])
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    engine = Engine(load_policy(path), backend, Ledger.open(url))
    try:
        yield path, engine
    finally:
        engine.close()


def test_levers_racing_with_four_spending_connections(policy_file: tuple[Path, Engine]) -> None:
    path, engine = policy_file
    server = ThreadedServer(engine, catalog_dsn="")
    server.server.reloader = make_reloader(path)
    running = Running(server.host, server.port, engine)
    ledger, dataset = engine.ledger, engine.policy.dataset
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def spend(n: int) -> None:
        with psycopg.connect(running.dsn(ANALYST, connect_timeout="20"), autocommit=True) as conn:
            conn.execute("SET dpsql.epsilon = 0.01")
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    conn.execute(f"SELECT COUNT(*) FROM patients WHERE age > {(n * 1000 + i) % 90}").fetchall()
                    state = "ok"
                except psycopg.Error as exc:
                    state = str(exc.sqlstate)
                with lock:
                    outcomes[state] = outcomes.get(state, 0) + 1

    spenders = [threading.Thread(target=spend, args=(n,)) for n in range(4)]
    for thread in spenders:
        thread.start()
    granted, still_while_frozen, applied, reloads = 0.0, [], [], 0
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            ledger.grant(dataset=dataset, analyst=ANALYST, epsilon=0.2, by="curator", reason="race")
            granted += 0.2
            time.sleep(0.3)
            try:
                ledger.revoke(
                    dataset=dataset,
                    analyst=ANALYST,
                    epsilon=0.1,
                    by="curator",
                    reason="race",
                    analyst_budget=server.server.ctx.policy.analyst_budget(ANALYST),
                )
                granted -= 0.1
            except InvalidParameterValue:
                pass  # it would take back spent budget: refused, as it must be
            ledger.freeze(dataset=dataset, analyst=ANALYST, by="curator", reason="race")
            frozen_at = ledger.spent(dataset, ANALYST)
            time.sleep(0.4)
            still_while_frozen.append(ledger.spent(dataset, ANALYST) == frozen_at)
            ledger.unfreeze(dataset=dataset, analyst=ANALYST, by="curator", reason="race")
            reloads += 1
            path.write_text(VERSIONS[reloads % 2])
            applied.append(asyncio.run_coroutine_threadsafe(server.server.reload(), server.loop).result(60))
            time.sleep(0.3)
    finally:
        stop.set()
        for thread in spenders:
            thread.join(60)
        server.stop()
    spent = ledger.spent(dataset, ANALYST)
    print(f"\noutcomes {outcomes}; spent ε={spent.epsilon:.3f} of {BUDGET.epsilon} + {granted:.1f} granted")
    assert all(still_while_frozen) and len(still_while_frozen) >= 5
    assert set(outcomes) <= {"ok", "53P01", "42501"}
    assert outcomes.get("ok", 0) > 10 and outcomes.get("42501", 0) > 0
    assert all(applied) and len(applied) >= 5
    assert spent.epsilon <= 1.2 + granted + 1e-9
    assert ledger.verify(dataset) == []
