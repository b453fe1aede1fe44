"""The ledger never overspends when many threads or processes race for the last ε."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from dpsql.engine import Engine
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.trust.conftest import health_backend, health_policy_text, small_health_rows
from tests.trust.race_worker import ANALYST_EPSILON, QUERY_EPSILON

ROOT = Path(__file__).resolve().parents[2]
SLOTS = round(ANALYST_EPSILON / QUERY_EPSILON)  # 32 queries fit exactly


def test_64_threads_one_engine_spend_exactly_the_budget(tmp_path: Path) -> None:
    policy = parse_policy(health_policy_text(analyst_epsilon=ANALYST_EPSILON, dataset_epsilon=1000.0))
    backend = health_backend(small_health_rows(50))
    engine = Engine(policy, backend, Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}"))
    sql = "SELECT COUNT(*) FROM patients WHERE age > 20"
    barrier = threading.Barrier(64)
    outcomes: list[str] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        for _ in range(2):  # 128 attempts for 32 slots
            try:
                engine.execute(sql, Session("alice", epsilon=QUERY_EPSILON))
                outcome = "ok"
            except PrivacyBudgetExhausted:
                outcome = "refused"
            except Exception as exc:  # anything else is a failure of the test
                outcome = f"error {type(exc).__name__}: {exc}"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=run) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(set(outcomes)) == ["ok", "refused"], set(outcomes)
    assert outcomes.count("ok") == SLOTS
    spent = engine.ledger.spent("health", "alice")
    assert spent.epsilon == QUERY_EPSILON * SLOTS and spent.queries == SLOTS
    engine.close()


def test_8_processes_sharing_one_sqlite_ledger(tmp_path: Path) -> None:
    ledger_url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    Ledger.open(ledger_url).close()  # create the schema once, before the race
    go = tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.trust.race_worker", ledger_url, str(go), "10"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    go.touch()
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["ok"] for r in results) == SLOTS
    assert sum(r["ok"] + r["refused"] for r in results) == 80
    ledger = Ledger.open(ledger_url)
    spent = ledger.spent("health", "alice")
    assert spent.epsilon == QUERY_EPSILON * SLOTS and spent.queries == SLOTS
    ledger.close()
