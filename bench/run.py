"""dpsql benchmarks: ``.venv/bin/python bench/run.py [--quick] [--only NAME ...]``.

Prints one table per benchmark, writes everything to ``bench/results/latest.json`` and, when matplotlib
is installed (``.venv/bin/pip install -e '.[bench]'``), PNG plots of it to ``bench/results/``.
See bench/README.md for what each figure means and the target bars.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package

import accounting  # noqa: E402
import attacks  # noqa: E402
import cli_start  # noqa: E402
import common  # noqa: E402
import derived  # noqa: E402
import e2e  # noqa: E402
import noise  # noqa: E402
import outer  # noqa: E402
import overhead  # noqa: E402
import peers  # noqa: E402
import person  # noqa: E402
import quantiles  # noqa: E402
import reservation  # noqa: E402
import wire  # noqa: E402

SPARK_ROWS = 10**7
SPARK_ROWS_QUICK = 10**6


def run_spark(quick: bool) -> common.Section:
    """The Spark backend's own benchmark (bench/spark.py), imported lazily: pyspark and Java are optional."""
    section = common.Section("spark", "dpsql on Spark (local session): DP vs raw", ["status", "reason"])
    if not (BENCH / "spark.py").exists():
        return _skipped(section, "bench/spark.py is not present in this checkout")
    try:
        import pyspark  # noqa: F401
    except ImportError as exc:
        return _skipped(section, f"pyspark is not installed ({exc}); install the 'spark' extra")
    import spark  # bench/spark.py (its module name, not pyspark's)

    rows = SPARK_ROWS_QUICK if quick else SPARK_ROWS
    results: list[dict[str, object]] = spark.run(rows=rows)
    section.title = f"dpsql on Spark (local session), 10^{len(str(rows)) - 1} rows: DP vs raw"
    section.headers = list(dict.fromkeys(k for r in results for k in r if not isinstance(r[k], dict | list)))
    section.rows = [[r.get(h) for h in section.headers] for r in results]
    section.data.update({"rows": rows, "results": results})
    return section


def _skipped(section: common.Section, why: str) -> common.Section:
    section.rows.append(["skipped", why])
    section.data["skipped"] = why
    return section


BENCHMARKS: dict[str, Callable[[bool], common.Section]] = {
    "overhead": overhead.run,
    "e2e": e2e.run_end_to_end,
    "person": person.run,
    "noise": noise.run,
    "quantiles": quantiles.run,
    "groups": e2e.run_groups,
    "peers": peers.run,
    "wire": wire.run,
    "attacks": attacks.run,
    "accounting": accounting.run,
    "reservation": reservation.run,
    "outer": outer.run,
    "cli": cli_start.run,
    "derived": derived.run,
    "spark": run_spark,
}

#: Left out of --quick unless named with --only: the peer comparison installs a venv and runs 200×, and
#: Spark starts a JVM over 10^7 rows.
QUICK_SKIPS = {"peers", "spark"}


#: Issue #19's out-of-bounds bar: DP/raw of a SUM whose data lie half outside the declared bounds.
OUT_OF_BOUNDS_QUERY = "SUM, data outside bounds"
OUT_OF_BOUNDS_BAR = 1.3

#: Issue #19's bars that are properties, not timings: checked by tests (run them with pytest).
TESTED_BARS: list[tuple[str, str]] = [
    (
        "scale-out: processes sharing one ledger spend exactly the budget, share the result cache and salt",
        "tests/trust/test_scale_out.py",
    ),
    (
        "Spark Connect: same pre-noise numbers as DuckDB/PostgreSQL, core checks through a standalone server",
        "tests/backends/test_spark.py::test_spark_connect tests/backends/test_spark.py -k standalone_connect",
    ),
]


def bars(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every bar of issue #19 with its measured value and PASS/FAIL (or where a test checks it).

    A bar whose section was not run (``--only``/``--skip``) or failed is ``not measured``, never PASS.
    """
    sections: dict[str, Any] = report["benchmarks"]  # type: ignore[assignment]
    out: list[dict[str, Any]] = []

    def measured(name: str, value: float | None, bar: float, where: str) -> None:
        verdict = "not measured" if value is None else ("PASS" if value <= bar else "FAIL")
        out.append({"bar": name, "value": value, "limit": bar, "verdict": verdict, "where": where})

    person_data = sections.get("person", {})
    for backend in ("duckdb", "postgresql"):
        data = person_data.get(backend, {})
        largest = data.get("bar_rows")
        found = {r["query"]: r for r in data.get("results", []) if r["rows"] == largest}
        size = f"10^{len(str(largest)) - 1}" if largest else "?"
        for label in person.QUERIES:
            r = found.get(label)
            measured(
                f"person-level DP/floor, {label}, {backend} {size}",
                r["dp_over_floor_p50"] if r else None,
                person.BAR_RATIO,
                "bench person",
            )
    e2e_data = sections.get("e2e", {})
    for backend in ("duckdb", "postgresql"):
        results = [r for r in e2e_data.get(backend, {}).get("results", []) if r["query"] == OUT_OF_BOUNDS_QUERY]
        r = max(results, key=lambda r: r["rows"]) if results else None
        size = f"10^{len(str(r['rows'])) - 1}" if r else "?"
        measured(
            f"out-of-bounds SUM, DP/raw, {backend} {size}",
            r["ratio_p50"] if r else None,
            OUT_OF_BOUNDS_BAR,
            "bench e2e",
        )
    for name, test in TESTED_BARS:
        out.append({"bar": name, "value": None, "limit": None, "verdict": "test", "where": test})
    for bar, value, limit in [*outer.bars(sections.get("outer")), *cli_start.bars(sections.get("cli"))]:
        measured(bar, value, limit, "bench outer" if "outer" in bar or "Q15" in bar else "bench cli")
    return out


def _print_bars(rows: list[dict[str, Any]]) -> None:
    print("\n== bars (issue #19) ==")
    common.print_table(
        ["bar", "value", "limit", "verdict", "checked by"],
        [[b["bar"], b["value"], b["limit"], b["verdict"], b["where"]] for b in rows],
    )


def _versions() -> dict[str, str]:
    import duckdb
    import numpy
    import sqlglot

    return {
        "python": platform.python_version(),
        "duckdb": duckdb.__version__,
        "numpy": numpy.__version__,
        "sqlglot": sqlglot.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (< 60 s)")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--skip",
        action="append",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        default=[],
        help="skip this benchmark (repeatable)",
    )
    parser.add_argument("--output", type=Path, default=BENCH / "results" / "latest.json")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    args = parser.parse_args(argv)
    default = [n for n in BENCHMARKS if not (args.quick and n in QUICK_SKIPS)]
    names = [n for n in (args.only or default) if n not in args.skip]
    started = time.perf_counter()
    report: dict[str, object] = {
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **_versions()},
        "benchmarks": {},
    }
    failed = False
    for name in names:
        t0 = time.perf_counter()
        print(f"-- running {name} ...", flush=True)
        try:
            section = BENCHMARKS[name](args.quick)
        except Exception as exc:  # keep the other benchmarks' figures
            failed = True
            print(f"   {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
            report["benchmarks"][name] = {"error": f"{type(exc).__name__}: {exc}"}  # type: ignore[index]
            continue
        section.data["seconds"] = round(time.perf_counter() - t0, 2)
        section.print()
        report["benchmarks"][name] = {
            "title": section.title,
            "headers": section.headers,  # type: ignore[index]
            "table": section.rows,
            "notes": section.notes,
            "extra_tables": section.extra_tables,
            **section.data,
        }
    report["bars"] = bars(report)
    _print_bars(report["bars"])  # type: ignore[arg-type]
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    print(f"\ntotal {report['seconds']} s; results in {args.output}")
    if not args.no_plots:
        _plots(args.output)
    return 1 if failed else 0


def _plots(report_path: Path) -> None:
    """PNG plots next to the JSON; a missing matplotlib is a hint, not a failure (it is an optional extra)."""
    import plots

    try:
        written = plots.write_plots(report_path, report_path.parent)
    except plots.MissingMatplotlib:
        print("plots skipped: matplotlib is not installed; `.venv/bin/pip install -e '.[bench]'` adds it")
        return
    shown = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in written]
    print(f"plots: {', '.join(shown) or 'none (no plottable section)'}")


def _json_default(value: object) -> object:
    if hasattr(value, "as_dict"):
        return value.as_dict()  # type: ignore[attr-defined]
    if hasattr(value, "item"):
        return value.item()  # type: ignore[attr-defined]
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
