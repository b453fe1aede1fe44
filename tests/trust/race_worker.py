"""Subprocess for test_budget_races: one engine of its own, racing for ε in a shared SQLite ledger.

Usage: python -m tests.trust.race_worker LEDGER_URL GO_FILE ATTEMPTS  → prints {"ok": n, "refused": m}.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dpsql.engine import Engine
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.trust.conftest import health_backend, health_policy_text, small_health_rows

ANALYST_EPSILON = 8.0
QUERY_EPSILON = 0.25


def main(ledger_url: str, go: str, attempts: int) -> None:
    policy = parse_policy(health_policy_text(analyst_epsilon=ANALYST_EPSILON, dataset_epsilon=1000.0))
    engine = Engine(policy, health_backend(small_health_rows(50)), Ledger.open(ledger_url))
    engine.prepare("SELECT COUNT(*) FROM patients", Session("alice", epsilon=QUERY_EPSILON))
    ok = refused = 0
    while not os.path.exists(go):
        time.sleep(0.001)
    for _ in range(attempts):
        try:
            engine.execute("SELECT COUNT(*) FROM patients", Session("alice", epsilon=QUERY_EPSILON))
            ok += 1
        except PrivacyBudgetExhausted:
            refused += 1
    engine.close()
    print(json.dumps({"ok": ok, "refused": refused}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
