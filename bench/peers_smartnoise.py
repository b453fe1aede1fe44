"""SmartNoise SQL side of the peer comparison; runs under bench/.venv-peers, never under .venv.

Reads a JSON job on stdin ({dsn, delta, runs, queries: [{label, sql, epsilon}]}) and writes JSON
results on stdout: per query the wall times, the answers of every run and the ε/δ charged for one
run (``get_privacy_cost``). Kept free of dpsql imports so that the two environments never mix.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import psycopg2
import snsql
from snsql import Privacy

# Mirrors bench/common.py's POLICY_YAML for the columns the comparison queries touch.
METADATA: dict[str, Any] = {
    "bench": {
        "public": {
            "t": {
                "row_privacy": True,
                "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
                "income": {"type": "float", "lower": 0.0, "upper": 200000.0, "nullable": False},
                "category": {"type": "string", "nullable": False},
            }
        },
    },
    "engine": "postgres",
}


def _answer(rows: list[Any]) -> Any:
    """Scalar for one-cell results, else {key: value} (first row of ``execute`` is the header)."""
    body = rows[1:]
    if len(body) == 1 and len(body[0]) == 1:
        return body[0][0]
    return {str(r[0]): r[1] for r in body}


def main() -> None:
    job = json.load(sys.stdin)
    conn = psycopg2.connect(job["dsn"])
    out = {"versions": {"smartnoise-sql": _version()}, "queries": {}}
    for q in job["queries"]:
        privacy = Privacy(epsilon=q["epsilon"], delta=job["delta"])
        reader = snsql.from_connection(conn, privacy=privacy, metadata=METADATA, engine="postgres")
        eps, delta = reader.get_privacy_cost(q["sql"])
        times, answers = [], []
        for i in range(job["runs"] + 2):
            t0 = time.perf_counter_ns()
            rows = reader.execute(q["sql"])
            took = time.perf_counter_ns() - t0
            if i >= 2:  # two warm-up runs
                times.append(took)
                answers.append(_answer(rows))
        out["queries"][q["label"]] = {
            "epsilon_setting": q["epsilon"],
            "epsilon_charged": float(eps),
            "delta_charged": float(delta),
            "times_ns": times,
            "answers": answers,
        }
    conn.close()
    json.dump(out, sys.stdout, default=float)


def _version() -> str:
    from importlib.metadata import version

    return version("smartnoise-sql")


if __name__ == "__main__":
    main()
