"""Quantile accuracy: mean absolute error of median / p90 / MIN / MAX on the health demo.

``.venv/bin/python bench/quantiles.py [--runs 200] [--epsilon 1] [--json out.json]``

Each query is prepared and measured once (one histogram query), then released ``--runs`` times:
the error distribution is the mechanism's alone, on fixed data (``Step.release_rows``, so no budget
is spent and the figures are comparable between versions of dpsql). Truth is DuckDB's exact
answer (``quantile_cont``/``min``/``max``). Peer figure for comparison (issue #17): PipelineDP's
quantile tree, median of age on [0, 100] at ε = 1: MAE 0.0006.

Also: MAX of a column whose data end at 60 on bounds [0, 100] at ε/3 (issue #17): how often the
answer lands above the data (beyond 61); and the clinic demo's person-level p90 of visit cost (issue
#40): the median of ``--runs`` releases against the exact p90 (885: three patients' 900 visits at 4,999
set it) and against the exact p90 of what the policy lets a query see (20 visits per patient, cost
clamped to [0, 2000]: ~590), and how often the released 95% value interval holds each; the same for
10 fresh releases (issue #40's bar protocol: ``Engine.execute``, each on its own ledger), for 10 fresh
releases at ``SET dpsql.max_rows_per_unit`` = 20, 5, 2, 1, and the exact p90 of a twin clinic that a
query under the cap cannot tell apart (its cut visits cost 10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from dpsql.backends import open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy, parse_policy
from dpsql.session import Session

#: (label, dpsql query, exact query) on the health demo's patients.
HEALTH = [
    (f"{name}({column})", dp.format(c=column), exact.format(c=column))
    for column in ("age", "bmi")
    for name, dp, exact in (
        ("median", "SELECT median({c}) FROM patients", "SELECT quantile_cont({c}, 0.5) FROM patients"),
        (
            "p90",
            "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY {c}) FROM patients",
            "SELECT quantile_cont({c}, 0.9) FROM patients",
        ),
        ("min", "SELECT MIN({c}) FROM patients", "SELECT min({c}) FROM patients"),
        ("max", "SELECT MAX({c}) FROM patients", "SELECT max({c}) FROM patients"),
    )
]

CLIPPED_POLICY = """
dataset: clipped
budget: {dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}
analysts: [{name: alice}]
tables:
  t:
    columns:
      x: {type: int, lower: 0, upper: 100, nullable: false}
      y: {type: float, lower: 0.0, upper: 100.0, nullable: false}
"""


def _releases(engine: Engine, sql: str, epsilon: float, runs: int) -> tuple[list[float], float]:
    """``runs`` released values of one query over one measurement, and the ms one release takes."""
    prepared = engine.prepare(sql, Session("alice", epsilon=epsilon))
    rows = engine.step.query(prepared.sql)
    histograms = {i: engine.step.query(q) for i, q in prepared.histograms}
    start = time.perf_counter()
    values = [engine.step.release_rows(prepared, rows, 0.95, histograms).rows[0][0] for _ in range(runs)]
    per_release_ms = (time.perf_counter() - start) / runs * 1e3
    return [float(v) for v in values], per_release_ms


def health(runs: int, epsilon: float) -> list[dict[str, Any]]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    engine = Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:"))
    out = []
    for label, sql, exact in HEALTH:
        truth = float(backend.execute(exact)[1][0][0])
        values, ms = _releases(engine, sql, epsilon, runs)
        errors = [abs(v - truth) for v in values]
        out.append(
            {
                "query": label,
                "truth": truth,
                "mae": statistics.fmean(errors),
                "p95_error": sorted(errors)[int(0.95 * len(errors)) - 1],
                "exact_share": sum(e == 0 for e in errors) / len(errors),
                "release_ms": ms,
            }
        )
    backend.close()
    return out


def clipped_max(runs: int, epsilon: float, n: int = 1000) -> list[dict[str, Any]]:
    """MAX of data spread over [0, 60] on bounds [0, 100]: share of answers above the data."""
    backend = open_backend("duckdb://")
    backend.execute_script(f"CREATE TABLE t AS SELECT i % 61 AS x, (i * 6 % 6001) / 100.0 AS y FROM range({n}) r(i)")
    engine = Engine(parse_policy(CLIPPED_POLICY), backend, Ledger.open("sqlite:///:memory:"))
    out = []
    for column in ("x", "y"):
        truth = float(backend.execute(f"SELECT max({column}) FROM t")[1][0][0])
        values, _ = _releases(engine, f"SELECT MAX({column}) FROM t", epsilon, runs)
        out.append(
            {
                "query": f"max({column}) n={n} eps={epsilon:g}",
                "truth": truth,
                "mae": statistics.fmean(abs(v - truth) for v in values),
                "above_data": sum(v > 61 for v in values) / len(values),
            }
        )
    backend.close()
    return out


#: The clinic's p90: the released query, the exact one, and the exact one over what the policy keeps
#: (the heavy patients' visits all cost 4,999: any 20 of them are the same values).
CLINIC_P90 = (
    "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY cost) FROM visits",
    "SELECT quantile_cont(cost, 0.9) FROM visits",
    "SELECT quantile_cont(LEAST(GREATEST(cost, 0), 2000), 0.9) FROM (SELECT cost, row_number() OVER "
    "(PARTITION BY patient_id ORDER BY id) AS k FROM visits) WHERE k <= 20",
)
#: The exact p90 of the twin clinic whose visits beyond a heavy patient's 20 cost 10, not 4,999: a query
#: under the cap sees the same rows (tests/release/test_quantile_clinic_p90.py), so no release tells them apart.
TWIN_P90 = (
    "SELECT quantile_cont(CASE WHEN k > 20 THEN 10 ELSE cost END, 0.9) FROM (SELECT cost, row_number() OVER "
    "(PARTITION BY patient_id ORDER BY id) AS k FROM visits)"
)


def clinic_p90(runs: int, epsilon: float) -> dict[str, Any]:
    """Person-level p90 of visit cost on the clinic demo (20 visits per patient): released value and
    value interval against the exact p90 and the exact p90 of the capped, clamped rows."""
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    engine = _clinic_engine(backend)
    sql, exact_sql, capped_sql = CLINIC_P90
    exact, capped = (float(backend.execute(q)[1][0][0]) for q in (exact_sql, capped_sql))
    prepared = engine.prepare(sql, Session("alice", epsilon=epsilon))
    rows = engine.step.query(prepared.sql)
    histograms = {i: engine.step.query(q) for i, q in prepared.histograms}
    released = [engine.step.release_rows(prepared, rows, 0.95, histograms) for _ in range(runs)]
    fresh = [
        _clinic_engine(backend).execute(sql, Session.configure("alice", epsilon=epsilon * (1 + i / 1e6)))
        for i in range(10)
    ]  # 10 fresh releases, each on its own ledger (the analyst's budget is 20)
    caps = {cap: _clinic_cap(_clinic_engine(backend), cap, epsilon, exact, capped) for cap in (20, 5, 2, 1)}
    twin = float(backend.execute(TWIN_P90)[1][0][0])
    backend.close()
    return {
        "query": f"clinic p90(cost) eps={epsilon:g}",
        "exact": exact,
        "exact_capped": capped,
        "twin_exact": twin,
        "releases": runs,
        "one_measurement": _p90_figures([float(r.rows[0][0]) for r in released], released, exact, capped),
        "fresh10": _p90_figures([float(r.rows[0][0]) for r in fresh], fresh, exact, capped),
        "caps": caps,
    }


def _clinic_engine(backend: Any) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))


def _p90_figures(values: list[float], released: list[Any], exact: float, capped: float) -> dict[str, Any]:
    """Median release, its relative error against both truths, and how often the interval holds each."""
    ranges = [r.intervals[0][0] for r in released]
    value = statistics.median(values)
    return {
        "median_release": value,
        "error": abs(value - exact) / exact,
        "error_capped": abs(value - capped) / capped,
        "covered": sum(low <= exact <= high for low, high in ranges),
        "covered_capped": sum(low <= capped <= high for low, high in ranges),
        "n": len(values),
        "median_interval": (statistics.median(r[0] for r in ranges), statistics.median(r[1] for r in ranges)),
    }


def _clinic_cap(engine: Engine, cap: int, epsilon: float, exact: float, capped: float) -> dict[str, Any]:
    """10 fresh releases at ``SET dpsql.max_rows_per_unit = cap`` (the analyst's per-query lever): a
    smaller cap lowers the rank sensitivity (narrower interval) and cuts more rows (the target moves)."""
    sql = CLINIC_P90[0]
    fresh = [
        engine.execute(sql, Session.configure("alice", epsilon=epsilon * (1 + i / 1e6), max_rows_per_unit=cap))
        for i in range(10)
    ]
    visible = CLINIC_P90[2].replace("k <= 20", f"k <= {cap}")
    truth = float(engine.backend.execute(visible)[1][0][0])
    figures = _p90_figures([float(r.rows[0][0]) for r in fresh], fresh, exact, capped)
    return {**figures, "visible": truth, "error_visible": abs(figures["median_release"] - truth) / truth}


def run(quick: bool) -> Any:
    """``bench/run.py``'s section: the same figures (50 releases per query with ``--quick``, else 200)."""
    from common import Section  # bench/common.py: only when run from bench/run.py

    runs = 50 if quick else 200
    section = Section(
        "quantiles",
        f"quantile accuracy, health demo, ε=1, {runs} releases each: |released − exact|",
        ["query", "truth", "MAE", "p95 error", "exact share", "ms/release", "above data"],
    )
    found = health(runs, 1.0)
    clipped = clipped_max(runs, 1.0 / 3)
    section.rows += [
        [r["query"], r["truth"], r["mae"], r["p95_error"], r["exact_share"], r["release_ms"], None] for r in found
    ]
    section.rows += [[r["query"], r["truth"], r["mae"], None, None, None, r["above_data"]] for r in clipped]
    section.data.update({"runs": runs, "health": found, "clipped": clipped})
    section.notes.append(
        "released from one measurement (Step.release_rows: no budget spent); peer (issue #17): PipelineDP's"
        " median of age on [0, 100] at ε = 1 has MAE 0.0006. 'above data': share of MAX answers beyond 61."
    )
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {
        "health": health(args.runs, args.epsilon),
        "clipped": clipped_max(args.runs, args.epsilon / 3),
        "clinic": clinic_p90(args.runs, args.epsilon),
    }
    print(f"== health demo, ε={args.epsilon:g}, {args.runs} releases each: |released − exact| ==")
    print(f"{'query':<14}{'truth':>10}{'MAE':>10}{'p95':>10}{'exact':>8}{'ms':>8}")
    for r in report["health"]:
        print(
            f"{r['query']:<14}{r['truth']:>10.3f}{r['mae']:>10.4f}{r['p95_error']:>10.4f}"
            f"{r['exact_share']:>8.2f}{r['release_ms']:>8.2f}"
        )
    print("== MAX of data ending at 60 on [0, 100] ==")
    for r in report["clipped"]:
        print(f"{r['query']:<24}{r['truth']:>8.1f}{r['mae']:>10.4f}  above data: {r['above_data']:.2f}")
    c = report["clinic"]
    print(f"== {c['query']}: exact p90 {c['exact']:.1f}, exact p90 of what the cap and bounds let a query see "
          f"{c['exact_capped']:.1f} ==")  # fmt: skip
    for label, key in (
        ("10 fresh releases", "fresh10"),
        (f"{c['releases']} releases, one measurement", "one_measurement"),
    ):
        f = c[key]
        print(
            f"{label}: median {f['median_release']:.1f}: {f['error']:.1%} off the exact p90 (interval holds it "
            f"{f['covered']}/{f['n']}), {f['error_capped']:.1%} off the visible one (holds it {f['covered_capped']}/"
            f"{f['n']}); median interval {f['median_interval'][0]:.0f} to {f['median_interval'][1]:.0f}"
        )
    print(
        f"the twin clinic (each heavy patient's visits beyond 20 at cost 10) has exact p90 {c['twin_exact']:.1f} and "
        "gives a query under the 20-visit cap the same rows: no release is within 5% of both"
    )
    print("SET dpsql.max_rows_per_unit = k, 10 fresh releases each:")
    for cap, f in c["caps"].items():
        print(
            f"  k={cap:<3} visible p90 {f['visible']:.1f}: median {f['median_release']:.1f} ({f['error_visible']:.1%} "
            f"off it, {f['error']:.1%} off the exact p90); interval {f['median_interval'][0]:.0f} to "
            f"{f['median_interval'][1]:.0f}, holds the exact p90 {f['covered']}/{f['n']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
