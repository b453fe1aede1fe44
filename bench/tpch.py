"""TPC-H as written through dpsql (issues #35, #36): what is answered, how accurate, how fast.

    .venv/bin/python bench/tpch.py [--sf 0.1] [--runs 5] [--backend duckdb|postgres] [--only Q5 --only Q9]

The data come from ``tpchgen-cli`` (the Rust port of dbgen, a PyPI wheel: ``pip install tpchgen-cli``),
the policy is ``bench/tpch/policy.yaml`` (the customer the unit, lineitem two hops away), the queries
``bench/tpch/queries.sql`` exactly as the specification writes them. For each query: dpsql's outcome
(answered with rows, answered empty, or its SQLSTATE and message), and for answered ones the median
relative error of the released cells against the exact answer at ε = 1 over ``--runs`` fresh releases,
under three caps: the policy's (a join by foreign key multiplies none), ``auto`` (chosen under DP per
query) and a fixed τ = 8 (the issue's reference), and dpsql's time over the raw query's (DuckDB; medians of
``--runs``), with ``dpsql.bias`` on (the default) and off at the policy's cap (issue #37: the estimate's
totals are folded into the measurement's statement on DuckDB).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpsql.backends import Backend, open_backend  # noqa: E402
from dpsql.engine import Engine  # noqa: E402
from dpsql.errors import Error  # noqa: E402
from dpsql.ledger import Ledger  # noqa: E402
from dpsql.policy import Policy, load_policy  # noqa: E402
from dpsql.session import Result, Session  # noqa: E402

HERE = Path(__file__).resolve().parent / "tpch"
TABLES = ["region", "nation", "part", "supplier", "partsupp", "customer", "orders", "lineitem"]
CAPS: list[int | str | None] = [None, "auto", 8]


def queries(path: Path = HERE / "queries.sql") -> list[tuple[str, str]]:
    """(name, SQL) of each ``-- Qn`` section of the file."""
    text = path.read_text(encoding="utf-8")
    parts = re.split(r"^-- (Q\d+)\s*$", text, flags=re.MULTILINE)
    return [(parts[i], parts[i + 1].strip().rstrip(";")) for i in range(1, len(parts), 2)]


def policy() -> Policy:
    return load_policy(HERE / "policy.yaml")


def generate(sf: float, cache: Path) -> Path:
    """Parquet files of every table at scale factor ``sf`` (generated once into ``cache``)."""
    out = cache / f"tpch-sf{sf:g}"
    if all((out / f"{t}.parquet").exists() for t in TABLES):
        return out
    tool = shutil.which("tpchgen-cli") or str(Path(sys.executable).parent / "tpchgen-cli")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([tool, "parquet", "-s", f"{sf:g}", f"--output-dir={out}"], check=True, capture_output=True)
    return out


def load_duckdb(parquet: Path, url: str = "duckdb://") -> Backend:
    backend = open_backend(url)
    backend.execute_script(
        "\n".join(f"CREATE TABLE {t} AS SELECT * FROM read_parquet('{parquet / (t + '.parquet')}');" for t in TABLES)
    )
    return backend


def _numeric(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def relative_errors(result: Result, exact: list[tuple[Any, ...]]) -> list[float]:
    """|released − exact| / |exact| of each noisy numeric cell, rows matched by their exact columns."""
    noisy = [i for i, c in enumerate(result.columns) if c.noisy]
    keys = [i for i, c in enumerate(result.columns) if not c.noisy]
    truth = {tuple(row[i] for i in keys): row for row in exact}
    errors = []
    for row in result.rows:
        match = truth.get(tuple(row[i] for i in keys))
        if match is None:
            continue
        for i in noisy:
            released, true = _numeric(row[i]), _numeric(match[i])
            if released is not None and true:
                errors.append(abs(released - true) / abs(true))
    return errors


def run_query(
    engine: Engine, sql: str, cap: int | str | None, runs: int, exact: list[tuple[Any, ...]], bias: bool = True
) -> dict[str, Any]:
    """dpsql's outcome for one query under one cap (and ``dpsql.bias``): rows, errors (median over runs),
    time per release."""
    medians, rows, seconds = [], 0, []
    for run in range(runs):
        # fresh releases (each its own plan, as a new ε is)
        session = Session.configure("analyst", epsilon=1 + run * 1e-6, max_rows_per_unit=cap, bias=bias)
        started = time.perf_counter()
        try:
            result = engine.execute(sql, session)
        except Error as exc:
            return {"status": "refused", "sqlstate": exc.sqlstate, "message": exc.message, "hint": exc.hint}
        seconds.append(time.perf_counter() - started)
        rows = len(result.rows)
        errors = relative_errors(result, exact)
        if errors:
            medians.append(statistics.median(errors))
    return {
        "status": "answered" if rows else "empty",
        "rows": rows,
        "median_relative_error": statistics.median(medians) if medians else None,
        "seconds": statistics.median(seconds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tpch.json")
    args = parser.parse_args(argv)
    parquet = generate(args.sf, ROOT / "bench" / "results")
    backend = load_duckdb(parquet)
    engine = Engine(policy(), backend, Ledger.open("memory"), cache=None)
    report: dict[str, Any] = {"sf": args.sf, "runs": args.runs, "queries": {}}
    answered = 0
    print(f"TPC-H SF{args.sf:g}, customer the unit, ε = 1, {args.runs} releases each (DuckDB)")
    print(
        f"{'query':6} {'outcome':10} {'rows':>5} {'err policy':>11} {'err auto':>9} {'err τ=8':>8} {'DP/raw':>7} "
        f"{'bias off':>8}"
    )
    for name, sql in queries():
        if args.only and name not in args.only:
            continue
        raws = []
        for _ in range(max(3, args.runs)):  # the raw query's median, as dpsql's (not one cold run)
            started = time.perf_counter()
            _, exact = backend.execute(sql)
            raws.append(time.perf_counter() - started)
        raw = statistics.median(raws)
        outcomes = {str(cap): run_query(engine, sql, cap, args.runs, exact) for cap in CAPS}
        outcomes["bias off"] = run_query(engine, sql, None, args.runs, exact, bias=False)
        report["queries"][name] = {"raw_seconds": raw, **outcomes}
        first = outcomes["None"]
        if first["status"] == "refused":
            print(f"{name:6} {'refused':10} {first['sqlstate']}: {first['message']}")
            continue
        answered += first["status"] == "answered"

        def err(outcome: dict[str, Any]) -> str:
            value = outcome.get("median_relative_error")
            return "—" if value is None else f"{value:.3g}"

        ratio = first["seconds"] / raw if raw else float("nan")
        off = outcomes["bias off"].get("seconds", float("nan")) / raw if raw else float("nan")
        print(
            f"{name:6} {first['status']:10} {first['rows']:>5} {err(first):>11} {err(outcomes['auto']):>9} "
            f"{err(outcomes['8']):>8} {ratio:>7.2f} {off:>8.2f}"
        )
    print(f"answered with rows: {answered} of {len(report['queries'])}")
    report["answered"] = answered
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
