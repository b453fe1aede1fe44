"""Spark local mode: raw vs DP wall time through the real Engine, at 10^7 rows by default.

``.venv/bin/python bench/spark.py [--rows N] [--reps K] [--json PATH]`` (needs the ``spark`` extra
and Java 17+). Mirrors bench/e2e.py: *raw* is the analyst's SQL run straight on the same backend
object, *DP* is ``Engine.execute`` with no result cache and an in-memory ledger, so DP/raw is what
dpsql adds on Spark (clamping CASEs, contribution bounding, ledger, noise, post-processing). The
table is generated inside Spark with ``range()`` and written as Parquet; no row crosses Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.session import Session

ANALYST = "bench"
URL = "spark://local[*]/dpsql_bench?spark.driver.memory=6g"

#: Deterministic hash-like columns of the row number (the same constants as bench/common.py), in Spark SQL.
TABLE_SQL = """
CREATE TABLE t USING parquet AS
SELECT id,
       CAST(((id * 2654435761 + 97) % 1000003) % 101 AS BIGINT) AS age,
       CAST((id * 2246822519 + 13) % 2000001 AS DOUBLE) / 10.0 AS income,
       CAST((id * 1103515245 + 12345) % 100001 AS DOUBLE) / 100.0 AS spend,
       CHR(CAST(97 + ((id * 668265263 + 5) % 1000037) % 8 AS INT)) AS category,
       CAST(id % {persons} AS BIGINT) AS person
FROM range({rows})
"""

#: ``t`` protects rows; ``p`` is the same backend table (``source: t``) protecting persons of ~10 rows each.
POLICY_YAML = """
dataset: bench_spark
defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}
budget:
  dataset: {epsilon: 1.0e+15, delta: 0.5}
  analyst: {epsilon: 1.0e+15, delta: 0.5}
auth: {trust: true}
analysts: [{name: bench}]
tables:
  t:
    columns: &columns
      id: {type: int, identifier: true}
      person: {type: int, identifier: true}
      age: {type: int, lower: 0, upper: 100, nullable: false}
      income: {type: float, lower: 0.0, upper: 200000.0, nullable: false}
      spend: {type: float, lower: 0.0, upper: 500.0, nullable: false}
      category: {type: text, domain: [a, b, c, d, e, f, g, h], nullable: false}
  p:
    source: t
    privacy_unit: person
    max_rows_per_unit: 5
    columns: *columns
"""

#: label → (DP query, raw query: the same SQL on the backend table).
QUERIES: dict[str, tuple[str, str]] = {
    "COUNT": ("SELECT COUNT(*) FROM t WHERE age > 30", "SELECT COUNT(*) FROM t WHERE age > 30"),
    "SUM": ("SELECT SUM(income) FROM t", "SELECT SUM(income) FROM t"),
    "AVG": ("SELECT AVG(age) FROM t", "SELECT AVG(age) FROM t"),
    "person-level grouped COUNT, SUM": (
        "SELECT category, COUNT(*), SUM(spend) FROM p GROUP BY category",
        "SELECT category, COUNT(*), SUM(spend) FROM t GROUP BY category",
    ),
}


def bench_policy() -> Policy:
    return parse_policy(POLICY_YAML, "<bench/spark.py policy>")


def make_table(backend: Backend, rows: int) -> float:
    """Generate the table in Spark (``range()``, written as Parquet); returns seconds taken."""
    started = time.perf_counter()
    backend.execute_script("DROP TABLE IF EXISTS t")
    backend.execute_script(TABLE_SQL.format(rows=int(rows), persons=max(1, int(rows) // 10)))
    return time.perf_counter() - started


def _median_ms(calls: list[Callable[[], Any]], reps: int) -> list[float]:
    """Median wall time (ms) of each call, run round-robin with the order rotated so drift hits all alike."""
    for call in calls:  # warm-up: code generation, file listing, caches
        call()
    samples: list[list[float]] = [[] for _ in calls]
    for i in range(reps):
        for j in range(len(calls)):
            k = (i + j) % len(calls)
            started = time.perf_counter()
            calls[k]()
            samples[k].append((time.perf_counter() - started) * 1000)
    return [statistics.median(s) for s in samples]


def run(rows: int = 10**7, reps: int = 5, url: str = URL) -> list[dict[str, Any]]:
    """Raw vs DP median wall time for each query of :data:`QUERIES` on a ``rows``-row table."""
    backend = open_backend(url)
    try:
        took = make_table(backend, rows)
        print(f"  [spark] generated {rows:,} rows in {took:.1f} s", flush=True)
        engine = Engine(bench_policy(), backend, Ledger.open("sqlite:///:memory:"))
        session = Session(ANALYST)
        results = []
        for label, (dp_sql, raw_sql) in QUERIES.items():
            released = engine.execute(dp_sql, session)
            dp, raw = _median_ms(
                [lambda q=dp_sql: engine.execute(q, session), lambda q=raw_sql: backend.execute(q)],
                reps,
            )
            results.append(
                {
                    "query": label,
                    "sql": dp_sql,
                    "rows": rows,
                    "raw_p50_ms": raw,
                    "dp_p50_ms": dp,
                    "ratio": dp / raw,
                    "released_rows": len(released.rows),
                }
            )
            print(f"  [spark] {label}: raw {raw:.0f} ms, DP {dp:.0f} ms", flush=True)
        engine.ledger.close()
        backend.execute_script("DROP TABLE IF EXISTS t")
        return results
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10**7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--url", default=URL, help="a spark:// or sc:// URL")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = run(args.rows, args.reps, args.url)
    print(f"\n== Spark local mode, {args.rows:,} rows: median wall time (ms) ==")
    print(f"  {'query':<34} {'raw p50':>9} {'DP p50':>9} {'DP/raw':>7} {'out rows':>8}")
    for r in results:
        print(
            f"  {r['query']:<34} {r['raw_p50_ms']:>9.0f} {r['dp_p50_ms']:>9.0f} "
            f"{r['ratio']:>7.2f} {r['released_rows']:>8}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
