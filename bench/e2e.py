"""Benchmarks 2 and 4: end-to-end DP answer vs the raw query on the same backend.

"Raw" is the analyst's SQL as written, run through the same backend object (same read-only
transaction wrapper, same result conversion), so the ratio isolates what dpsql adds: rewriting
(clamping CASE expressions, COALESCE), the ledger reservation, noise and post-processing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from common import ANALYST, Section, bench_policy, make_table, ms, time_interleaved

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.session import Session

E2E_QUERIES: dict[str, str] = {
    "COUNT": "SELECT COUNT(*) FROM t WHERE age > 30",
    "SUM": "SELECT SUM(income) FROM t",
    "AVG": "SELECT AVG(age) FROM t",
    "SUM, data outside bounds": "SELECT SUM(spend) FROM t",
    "grouped COUNT": "SELECT category, COUNT(*) FROM t GROUP BY category",
}

GROUP_QUERIES: dict[str, str] = {
    "10^3 groups, partition selection": "SELECT g1k, COUNT(*) FROM t GROUP BY g1k",
    "10^3 groups, public domain": "SELECT g1k_pub, COUNT(*) FROM t GROUP BY g1k_pub",
    "10^5 groups, partition selection": "SELECT g100k, COUNT(*) FROM t GROUP BY g100k",
    "10^5 groups, public domain": "SELECT g100k_pub, COUNT(*) FROM t GROUP BY g100k_pub",
}


def _reps(n: int, quick: bool) -> tuple[int, float]:
    """(max repetitions, time budget in seconds per query pair) for a table of ``n`` rows."""
    if quick:
        return (25, 1.0) if n <= 10**5 else (10, 1.2)
    return {10**5: (100, 4.0), 10**6: (40, 6.0)}.get(n, (12, 10.0))


@contextmanager
def duckdb_backend() -> Iterator[tuple[Backend, dict[str, Any]]]:
    backend = open_backend("duckdb://")
    try:
        yield backend, {"backend": "duckdb"}
    finally:
        backend.close()


@contextmanager
def postgres_backend() -> Iterator[tuple[Backend, dict[str, Any]]]:
    from dpsql.backends.local_postgres import start_local_postgres

    pg = start_local_postgres()
    backend = open_backend(pg.dsn)
    try:
        yield backend, {"backend": "postgresql", "dsn": pg.dsn}
    finally:
        backend.close()
        pg.stop()


def _compare(
    engine: Engine,
    queries: dict[str, str],
    n: int,
    quick: bool,
    *,
    reps: tuple[int, float] | None = None,
    warmup: int = 2,
    floors: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """DP, raw and rewritten SQL timed round-robin per query; ``reps`` = (max repetitions, seconds budget).

    With ``floors`` (label → SQL), each query's floor runs in the same round-robin, so DP/floor is a
    ratio of medians measured side by side (``dp_over_floor_p50``).
    """
    session = Session(ANALYST)
    reps_, budget = reps or _reps(n, quick)
    out = []
    for label, sql in queries.items():
        released = engine.execute(sql, session)
        rewritten = engine.prepare(sql, session).sql
        calls = [
            lambda sql=sql: engine.execute(sql, session),
            lambda sql=sql: engine.backend.execute(sql),
            lambda rewritten=rewritten: engine.backend.execute(rewritten),
        ]
        if floors is not None:
            calls.append(lambda floor=floors[label]: engine.backend.execute(floor))
        dp, raw, rw, *floor = time_interleaved(calls, reps=reps_, warmup=warmup, budget_s=budget)
        extra: dict[str, Any] = {}
        if floor:
            extra = {
                "floor": floor[0].as_dict(),
                "floor_over_raw_p50": floor[0].p50_us / raw.p50_us,
                "dp_over_floor_p50": dp.p50_us / floor[0].p50_us,
            }
        out.append(
            {
                **extra,
                "query": label,
                "sql": sql,
                "rows": n,
                "dp": dp.as_dict(),
                "raw": raw.as_dict(),
                "rewritten_sql": rw.as_dict(),
                "rewritten_over_raw_p50": rw.p50_us / raw.p50_us,
                "engine_p50_ms": ms(dp.p50_us - rw.p50_us),
                "ratio_p50": dp.p50_us / raw.p50_us,
                "added_p50_ms": ms(dp.p50_us - raw.p50_us),
                "released_rows": len(released.rows),
            }
        )
    return out


def _rows(results: list[dict[str, Any]], backend: str) -> list[list[Any]]:
    return [
        [
            backend,
            f"10^{len(str(r['rows'])) - 1}",
            r["query"],
            ms(r["raw"]["p50_us"]),
            ms(r["rewritten_sql"]["p50_us"]),
            ms(r["dp"]["p50_us"]),
            ms(r["dp"]["p99_us"]),
            r["added_p50_ms"],
            r["engine_p50_ms"],
            r["ratio_p50"],
            r["released_rows"],
        ]
        for r in results
    ]


HEADERS = [
    "backend",
    "rows",
    "query",
    "raw p50",
    "rewritten p50",
    "DP p50",
    "DP p99",
    "added p50",
    "engine p50",
    "DP/raw",
    "out rows",
]


NOTES = [
    "raw = the analyst's SQL as written; rewritten = dpsql's generated SQL (clamping, COALESCE), both on the",
    "same backend object; DP = Engine.execute; added = DP - raw; engine = DP - rewritten (dpsql's Python).",
    "ledger: in-memory SQLite (a file ledger adds one fsync per query, see 'overhead').",
]


def run_end_to_end(quick: bool, with_postgres: bool = True) -> Section:
    section = Section("e2e", "end-to-end DP vs raw query wall time (ms)", list(HEADERS))
    sizes = {"duckdb": [10**5, 10**6] + ([] if quick else [10**7]), "postgresql": [10**5, 10**6]}
    backends = [("duckdb", duckdb_backend)] + ([("postgresql", postgres_backend)] if with_postgres else [])
    for name, opener in backends:
        try:
            with opener() as (backend, info):
                engine = Engine(bench_policy(), backend, Ledger.open("sqlite:///:memory:"))
                results = []
                for n in sizes[name]:
                    took = make_table(backend, "t", n)
                    print(f"  [{name}] generated 10^{len(str(n)) - 1} rows in {took:.1f} s", flush=True)
                    results += _compare(engine, E2E_QUERIES, n, quick)
                engine.ledger.close()
                section.data[name] = {
                    "info": {k: v for k, v in info.items() if k != "dsn"},
                    "results": results,
                }
                section.rows += _rows(results, name)
        except Exception as exc:  # report and go on: one missing backend must not lose the other's figures
            section.data[name] = {"error": f"{type(exc).__name__}: {exc}"}
            section.notes.append(f"{name} skipped: {type(exc).__name__}: {exc}")
    section.notes += NOTES
    return section


def run_groups(quick: bool) -> Section:
    n = 10**6
    section = Section("groups", f"grouped queries, DuckDB 10^{len(str(n)) - 1} rows (ms)", list(HEADERS))
    with duckdb_backend() as (backend, _):
        t0 = time.perf_counter()
        policy = bench_policy(public_group_domains=True)
        section.data["policy_build_s"] = time.perf_counter() - t0
        engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
        make_table(backend, "t", n)
        results = _compare(engine, GROUP_QUERIES, n, quick)
        engine.ledger.close()
    section.data["duckdb"] = {"results": results}
    section.rows += _rows(results, "duckdb")
    section.notes += [
        *NOTES,
        "partition selection drops groups whose noisy count is below the δ-threshold: 'out rows' < groups.",
        "public domain releases every declared key (absent ones as noisy zeros).",
    ]
    return section
