"""Benchmark ``reservation``: one reservation's time after 10 and after 100,000 past charges at distinct ε.

Issue #41 item 1's bar: under every accounting (``pure``, ``zcdp``, ``pld``), the p50 of
``Ledger.reserve`` with 100,000 past charges of the same analyst at *distinct* ε (1e-4 + i·1e-9, the
attack of the issue) is at most 2× its p50 with 10 past charges, on the embedded SQLite ledger (WAL,
``synchronous=FULL``: each reservation's commit is fsync'd, as in production).

The history is written in bulk (one transaction of rows carrying their running sums and totals,
exactly as ``reserve`` writes them, the ledger's triggers checking each), so that 100,000 charges
take seconds, not 100,000 fsyncs. Under ``pld`` the first reservation after it composes the whole
history into the ledger's state once (its time is reported as "first"); every later one composes
only its own charge. ``python bench/reservation.py [--quick]``.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from common import ANALYST, Section

from dpsql.accountant import Accounting, Allowance, Cost
from dpsql.ledger import Ledger

BUDGET = Allowance(1000.0, 1e-5)
HISTORIES = (10, 100_000)
BAR = 2.0
_INSERT = (
    "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta, "
    "sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries, "
    "ds_epsilon, ds_delta, ds_rho, ds_selection_delta, ds_queries) "
    "VALUES (?, ?, ?, 'bulk', ?, 0, ?, ?, 0, ?, 0, ?, 0, ?, ?, 0, ?, 0, ?)"
)


def _history(path: Path, charges: int, accounting: Accounting) -> None:
    """``charges`` past charges of the analyst at distinct ε, written as ``reserve`` writes them."""
    import sqlite3

    Ledger.open(f"sqlite://{path}").close()  # the schema
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    at = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
    eps_sum = rho_sum = 0.0
    rows = []
    for i in range(charges):
        epsilon = 1e-4 + i * 1e-9
        rho = epsilon * epsilon / 2
        eps_sum, rho_sum = eps_sum + epsilon, rho_sum + rho
        rows.append((at, "bench", ANALYST, epsilon, rho, accounting, eps_sum, rho_sum, i + 1, eps_sum, rho_sum, i + 1))
    conn.executemany(_INSERT, rows)
    conn.execute(
        "INSERT INTO dpsql_ledger_totals (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta) "
        "VALUES ('bench', ?, ?, 0, ?, ?, ?, 0)",
        (ANALYST, eps_sum, rho_sum, charges, at),
    )
    conn.execute("COMMIT")
    conn.close()


def _reserve(ledger: Ledger, accounting: Accounting, i: int) -> None:
    ledger.reserve(
        dataset="bench",
        analyst=ANALYST,
        cost=Cost(2e-4 + i * 1e-9),  # distinct again
        dataset_budget=BUDGET,
        analyst_budget=BUDGET,
        fingerprint="bench",
        accounting=accounting,
    )


def measure(accounting: Accounting, reps: int) -> dict[int, dict[str, float]]:
    """p50 of a reservation after each history of :data:`HISTORIES`, timed in turns (one reservation on each
    ledger in each round), so that the two see the same load on a shared machine."""
    with tempfile.TemporaryDirectory(prefix="dpsql-reservation-") as home:
        ledgers, first = {}, {}
        try:
            for charges in HISTORIES:
                path = Path(home) / f"ledger-{charges}.sqlite"
                _history(path, charges, accounting)
                ledgers[charges] = Ledger.open(f"sqlite://{path}")
                started = time.perf_counter()
                _reserve(ledgers[charges], accounting, 0)  # under pld: composes the bulk history, once
                first[charges] = time.perf_counter() - started
            samples: dict[int, list[float]] = {charges: [] for charges in HISTORIES}
            for i in range(1, reps + 1):
                for charges, ledger in ledgers.items():
                    started = time.perf_counter()
                    _reserve(ledger, accounting, i)
                    samples[charges].append(time.perf_counter() - started)
        finally:
            for ledger in ledgers.values():
                ledger.close()
    return {
        charges: {"first_ms": first[charges] * 1000, "p50_ms": statistics.median(samples[charges]) * 1000}
        for charges in HISTORIES
    }


def run(quick: bool = False) -> Section:
    reps = 40 if quick else 200
    section = Section(
        "reservation",
        f"one reservation after {HISTORIES[0]} and {HISTORIES[1]:,} past charges at distinct ε (bar: ≤ {BAR:g}×)",
        ["accounting", "p50 ms, 10", "p50 ms, 100k", "ratio", "first after bulk history ms", "verdict"],
    )
    for accounting in ("pure", "zcdp", "pld"):
        measured = measure(accounting, reps)  # type: ignore[arg-type]
        small, large = measured[HISTORIES[0]], measured[HISTORIES[1]]
        ratio = large["p50_ms"] / small["p50_ms"]
        verdict = "PASS" if ratio <= BAR else "FAIL"
        section.rows.append([accounting, small["p50_ms"], large["p50_ms"], ratio, large["first_ms"], verdict])
        section.data[accounting] = {"history_10": small, "history_100k": large, "ratio": ratio, "verdict": verdict}
    section.notes.append(
        "SQLite ledger, synchronous=FULL (every commit fsync'd); medians of "
        f"{reps} reservations, taken in turns on the two ledgers; under pld 'first' composes the whole "
        "bulk-written history into the state once"
    )
    return section


if __name__ == "__main__":
    run("--quick" in sys.argv).print()
