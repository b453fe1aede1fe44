"""dpsql benchmarks: ``.venv/bin/python bench/run.py [--quick] [--only NAME ...]``.

Prints one table per benchmark and writes everything to ``bench/results/latest.json``.
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

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package

import common  # noqa: E402
import e2e  # noqa: E402
import noise  # noqa: E402
import overhead  # noqa: E402
import peers  # noqa: E402
import wire  # noqa: E402

BENCHMARKS: dict[str, Callable[[bool], common.Section]] = {
    "overhead": overhead.run,
    "e2e": e2e.run_end_to_end,
    "noise": noise.run,
    "groups": e2e.run_groups,
    "peers": peers.run,
    "wire": wire.run,
}

#: Left out of --quick unless named with --only: the peer comparison installs a venv and runs 50×.
QUICK_SKIPS = {"peers"}


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
            **section.data,
        }
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    print(f"\ntotal {report['seconds']} s; results in {args.output}")
    return 1 if failed else 0


def _json_default(value: object) -> object:
    if hasattr(value, "as_dict"):
        return value.as_dict()  # type: ignore[attr-defined]
    if hasattr(value, "item"):
        return value.item()  # type: ignore[attr-defined]
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
