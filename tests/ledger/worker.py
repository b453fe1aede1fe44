"""Subprocess helper for tests/ledger/test_store.py: races for budget, or spends until SIGKILLed.

Usage:
  python worker.py race URL DATASET ANALYST COST BUDGET THREADS ATTEMPTS GO_FILE
      waits for GO_FILE to exist, then THREADS threads each try ATTEMPTS reserves;
      prints {"ok": n, "refused": m} as JSON.
  python worker.py loop URL DATASET ANALYST LOG_FILE
      reserves forever under a huge budget, appending one line to LOG_FILE after each
      *committed* charge, so a SIGKILL shows how many charges the worker knew of.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Cost, Ledger, PostgresLedger


@dataclass(frozen=True)
class _Budget:
    epsilon: float
    delta: float = 0.0


def _open(url: str) -> Ledger:
    return Ledger.open(url) if url.startswith("sqlite:") else PostgresLedger(url)


def race(
    url: str, dataset: str, analyst: str, cost: float, budget: float, threads: int, attempts: int, go: str
) -> None:
    ledger = _open(url)
    total = _Budget(budget)
    ok = refused = 0
    lock = threading.Lock()

    def run() -> None:
        nonlocal ok, refused
        for _ in range(attempts):
            try:
                ledger.reserve(
                    dataset=dataset,
                    analyst=analyst,
                    cost=Cost(cost),
                    dataset_budget=total,
                    analyst_budget=total,
                    fingerprint="race",
                )
                with lock:
                    ok += 1
            except PrivacyBudgetExhausted:
                with lock:
                    refused += 1

    workers = [threading.Thread(target=run) for _ in range(threads)]
    ledger.spent(dataset)  # warm this thread's connection before the start line
    while not os.path.exists(go):
        time.sleep(0.001)
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    ledger.close()
    print(json.dumps({"ok": ok, "refused": refused}), flush=True)


def loop(url: str, dataset: str, analyst: str, log_file: str) -> None:
    ledger = _open(url)
    huge = _Budget(1e12)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        ledger.reserve(
            dataset=dataset,
            analyst=analyst,
            cost=Cost(0.01),
            dataset_budget=huge,
            analyst_budget=huge,
            fingerprint="loop",
        )
        os.write(fd, b"1\n")  # the OS keeps it even if this process is SIGKILLed


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "race":
        url, dataset, analyst, cost, budget, threads, attempts, go = args
        race(url, dataset, analyst, float(cost), float(budget), int(threads), int(attempts), go)
    elif mode == "loop":
        loop(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
