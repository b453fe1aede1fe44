"""dpsql's own CPU per release of a TPC-H query (issue #37): what Python adds to the backend's statement.

    .venv/bin/python bench/release_cpu.py [--sf 0.1] [--only Q1] [--runs 15]

The main thread's CPU time (``time.thread_time``) of ``Engine.execute`` less the same thread's CPU inside
the backend's ``execute``: planning, pricing, reserving, noise, bias figures and post-processing. CPU time,
not wall time, so the figure carries over from a loaded machine (the wall-clock DP/raw of ``tpch.py`` does
not). Two modes: a new ε every release (a statement planned once, priced again: ``tpch.py``'s runs) and
the same ε (the plan cache's hit). Medians of ``--runs`` releases after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tpch  # noqa: E402

from dpsql.engine import Engine  # noqa: E402
from dpsql.ledger import Ledger  # noqa: E402
from dpsql.session import Session  # noqa: E402


def own_cpu_ms(engine: Engine, sql: str, runs: int, new_epsilon: bool) -> list[float]:
    """Per release, the main thread's CPU (ms) outside the backend's ``execute``."""
    backend = engine.backend
    real = backend.execute
    inside = [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] += time.thread_time() - started

    backend.execute = timed  # type: ignore[method-assign]
    try:
        own = []
        for run in range(runs + 2):
            epsilon = 1 + run * 1e-6 if new_epsilon else 1.0
            session = Session.configure("analyst", epsilon=epsilon, max_rows_per_unit=None, bias=True)
            inside[0] = 0.0
            started = time.thread_time()
            engine.execute(sql, session)
            if run >= 2:
                own.append((time.thread_time() - started - inside[0]) * 1e3)
        return own
    finally:
        backend.execute = real  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args(argv)
    backend = tpch.load_duckdb(tpch.generate(args.sf, ROOT / "bench" / "results"))
    engine = Engine(tpch.policy(), backend, Ledger.open("memory"), cache=None)
    print(f"TPC-H SF{args.sf:g}: dpsql's own main-thread CPU per release (ms, median of {args.runs})")
    print(f"{'query':6} {'new ε':>8} {'same ε':>8}")
    for name, sql in tpch.queries():
        if name not in (args.only or ["Q1"]):
            continue
        fresh = statistics.median(own_cpu_ms(engine, sql, args.runs, new_epsilon=True))
        cached = statistics.median(own_cpu_ms(engine, sql, args.runs, new_epsilon=False))
        print(f"{name:6} {fresh:>8.1f} {cached:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
