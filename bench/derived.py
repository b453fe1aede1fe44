"""Derived answers (issue #37 item 1): a free coarsened or synopsis answer in milliseconds.

On the clinic demo (DuckDB, in process), each scenario times statements that are *new* texts (no plan,
no result-cache entry, no filter mask cached), so what is measured is the cold path of a free answer:
analysis, the candidates' index, the estimate, post-processing. Per statement: wall time, the process's
CPU time (every thread: what the server spends), and the cube estimates computed (``solve`` calls,
:data:`dpsql.synopsis.solve.SOLVES`). Beside them, the fresh, charged answer of the same shape, timed the
same way, and the Superset "Last year" monthly line.

``python bench/derived.py`` alone, or ``bench/run.py --only derived``. Bars: a free answer ≤ 20 ms CPU
and ≤ 50 ms wall (p50); "Last year" ≤ 2× its 0.12 s before coarsening (issue #37).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

from dpsql.backends import open_backend
from dpsql.cache import ResultCache
from dpsql.curator.synopsis_cli import build
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from dpsql.synopsis.solve import SOLVES

#: A second synopsis over the clinic's visits: department × day, COUNT and SUM(cost) (10,962 cells).
CUBE = """
  visits_days:
    table: visits
    keys: [department, "DATE_TRUNC('day', visit_date)"]
    measures: ["COUNT(*)", "SUM(cost)"]
    marginals: [[department, "DATE_TRUNC('day', visit_date)"], [department]]
    epsilon: 2.0
"""
LAST_YEAR = (
    "SELECT DATE_TRUNC('month', visit_date) AS visit_date, COUNT(*) AS count FROM public.visits "
    "WHERE visit_date >= TO_DATE('2025-11-29', 'YYYY-MM-DD') AND visit_date < TO_DATE('2026-11-29', 'YYYY-MM-DD') "
    "GROUP BY DATE_TRUNC('month', visit_date) LIMIT 10000"
)
#: The bars (issue #37 item 1).
CPU_BAR_MS, WALL_BAR_MS, LAST_YEAR_BEFORE_S = 20.0, 50.0, 0.12
DEPARTMENTS = ["Cardiology", "Oncology", "Pediatrics", "Emergency", "Dermatology", "Neurology"]


def _months() -> Iterator[tuple[str, str]]:
    for year in range(2020, 2025):
        for month in range(1, 13):
            following = (year + month // 12, month % 12 + 1)
            yield f"{year}-{month:02d}-01", f"{following[0]}-{following[1]:02d}-01"


def _engine(extra: str = "") -> Engine:
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    path = demo_policy_path("clinic")
    policy = parse_policy(path.read_text() + extra, str(path))
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache())


def _timed(engine: Engine, sqls: list[str], epsilon: float, *, free: bool) -> dict[str, Any]:
    walls, cpus, solves = [], [], []
    for sql in sqls:
        before, wall, cpu = SOLVES.value, time.perf_counter(), time.process_time()
        result = engine.execute(sql, Session("alice", epsilon=epsilon))
        walls.append((time.perf_counter() - wall) * 1000)
        cpus.append((time.process_time() - cpu) * 1000)
        solves.append(SOLVES.value - before)
        if free and result.epsilon_spent != 0:
            raise AssertionError(f"expected a free answer: {sql}")
    return {
        "n": len(sqls),
        "wall_p50_ms": statistics.median(walls),
        "cpu_p50_ms": statistics.median(cpus),
        "wall_max_ms": max(walls),
        "solves_max": max(solves),
    }


def _scenarios() -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    def coarsened() -> dict[str, Any]:
        engine = _engine()
        engine.execute(
            "SELECT DATE_TRUNC('day', visit_date), COUNT(*) FROM visits GROUP BY 1", Session("alice", epsilon=10.0)
        )
        sqls = [
            f"SELECT DATE_TRUNC('day', visit_date) AS d, COUNT(*) FROM visits WHERE visit_date >= '{lo}' "
            f"AND visit_date < '{hi}' GROUP BY 1"
            for lo, hi in _months()
        ]
        return _timed(engine, sqls[:40], 1.0, free=True)

    def fresh() -> dict[str, Any]:
        engine = _engine()
        sqls = [
            f"SELECT DATE_TRUNC('day', visit_date) AS d, COUNT(*) FROM visits WHERE visit_date >= '{lo}' "
            f"AND visit_date < '{hi}' GROUP BY 1"
            for lo, hi in _months()
        ]
        return _timed(engine, sqls[:40], 0.1, free=False)

    def synopsis() -> dict[str, Any]:
        engine = _engine(CUBE)
        build(engine, "visits_days")
        sqls = []
        for i, (lo, hi) in enumerate(_months()):
            department = DEPARTMENTS[i % len(DEPARTMENTS)]
            sqls.append(
                f"SELECT DATE_TRUNC('day', visit_date) AS d, COUNT(*), AVG(cost) FROM visits WHERE department = "
                f"'{department}' AND visit_date >= '{lo}' AND visit_date < '{hi}' GROUP BY 1"
            )
        return _timed(engine, sqls[:40], 1.0, free=True)

    def combined() -> dict[str, Any]:
        engine = _engine()
        for grouping in ("department, urgent", "department", "DATE_TRUNC('month', visit_date)", "urgent"):
            for epsilon in (1.0, 2.0):
                engine.execute(
                    f"SELECT {grouping}, COUNT(*) FROM visits GROUP BY {grouping}", Session("alice", epsilon=epsilon)
                )
        sqls = []
        for i in range(1, 2 ** len(DEPARTMENTS)):
            chosen = ", ".join(f"'{d}'" for j, d in enumerate(DEPARTMENTS) if i >> j & 1)
            sqls.append(f"SELECT department, COUNT(*) FROM visits WHERE department IN ({chosen}) GROUP BY 1")
        return _timed(engine, sqls[:40], 1.0, free=True)

    def last_year() -> dict[str, Any]:
        engine = _engine()
        for grouping in ("DATE_TRUNC('day', visit_date)", "DATE_TRUNC('month', visit_date)"):
            engine.execute(f"SELECT {grouping}, COUNT(*) FROM visits GROUP BY 1", Session("alice", epsilon=1.0))
        first = _timed(engine, [LAST_YEAR], 1.0, free=False)
        repeat = _timed(engine, [LAST_YEAR] * 5, 1.0, free=True)
        return {**first, "repeat_wall_p50_ms": repeat["wall_p50_ms"], "repeat_cpu_p50_ms": repeat["cpu_p50_ms"]}

    return [
        ("coarsened: a month of days from a 1,827-cell release", coarsened),
        ("fresh, charged: the same statements", fresh),
        ("synopsis: a department's days, COUNT and AVG (10,962 cells)", synopsis),
        ("combined: department filters over 8 releases", combined),
        ('Superset "Last year" monthly line (first run; then repeats)', last_year),
    ]


def run(quick: bool = False) -> common.Section:
    headers = ["scenario", "n", "wall p50 ms", "cpu p50 ms", "wall max ms", "solves/stmt max", "bar"]
    section = common.Section("derived", "derived answers: free coarsened and synopsis answers (issue #37)", headers)
    results = []
    for name, scenario in _scenarios():
        found = scenario()
        if name.startswith("Superset"):
            verdict = "PASS" if found["wall_p50_ms"] <= 2000 * LAST_YEAR_BEFORE_S else "FAIL"
        elif name.startswith("fresh"):
            verdict = ""
        else:
            ok = found["cpu_p50_ms"] <= CPU_BAR_MS and found["wall_p50_ms"] <= WALL_BAR_MS
            verdict = "PASS" if ok else "FAIL"
        found.update(scenario=name, verdict=verdict)
        results.append(found)
        section.rows.append(
            [
                name,
                found["n"],
                found["wall_p50_ms"],
                found["cpu_p50_ms"],
                found["wall_max_ms"],
                found["solves_max"],
                verdict,
            ]
        )
    section.data["results"] = results
    return section


if __name__ == "__main__":
    run().print()
