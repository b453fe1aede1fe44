"""Person-level grouped SUM with the bias estimate on and off (issue #37), against the per-user floor.

    .venv/bin/python bench/person_bias.py [--rows-exp 7] [--reps 3]

``bench/person.py``'s events table and its grouped-SUM query (public domain of ``kind``) on DuckDB, timed
round-robin in one run: DP with ``dpsql.bias`` on (the default: its totals folded into the measurement's
statement) and off, the floor (the rows grouped by user and key, nothing else) and the raw query. The
bar (issue #37): DP/floor ≤ 1.8 at 10^7 rows. ``bench/person.py`` times every query and size at the default.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import person
from e2e import duckdb_backend

from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.session import Session

LABEL = "grouped SUM (public domain)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-exp", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sql, floor = person.QUERIES[LABEL], person.FLOORS[LABEL]
    with duckdb_backend() as (backend, _):
        engine = Engine(person.person_policy(), backend, Ledger.open("sqlite:///:memory:"))
        person.make_events(backend, 10**args.rows_exp)
        on, off = Session(person.ANALYST), Session.configure(person.ANALYST, bias=False)
        calls: dict[str, Callable[[], object]] = {
            "DP bias on": lambda: engine.execute(sql, on),
            "DP bias off": lambda: engine.execute(sql, off),
            "floor": lambda: backend.execute(floor),
            "raw": lambda: backend.execute(sql),
        }
        for call in calls.values():  # warm-up (and the plan cache)
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        p50 = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"{LABEL}, 10^{args.rows_exp} rows (DuckDB), p50 ms: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p50.items())
        )
        print(
            f"DP/floor: bias on {p50['DP bias on'] / p50['floor']:.2f}, "
            f"bias off {p50['DP bias off'] / p50['floor']:.2f} (bar ≤ 1.8)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
