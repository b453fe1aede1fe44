"""SmartNoise SQL side of the peer comparison; runs under bench/.venv-peers, never under .venv.

Reads a JSON job on stdin ({dsn, delta, runs, queries: [{label, sql, epsilon}]}) and writes JSON
results on stdout: per query the wall time and the database time of every run, the answers of every
run, the SQL SmartNoise sent and the ε/δ charged for one run (``get_privacy_cost``). Kept free of
dpsql imports so that the two environments never mix.

Database time is measured around the reader's ``execute`` (psycopg2 ``cursor.execute``, ``commit`` and
fetching the rows), the only place SmartNoise talks to PostgreSQL: wall − database time is its DP layer
(parsing, rewriting, noise, censoring, post-processing), measured within the same run.
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

WARMUP = 2


class DbTimer:
    """Wraps a SmartNoise SQL reader's ``execute`` (an instance attribute shadows the method) to time it."""

    def __init__(self, sql_reader: Any) -> None:
        self.ns = 0
        self.sent: list[str] = []
        inner = sql_reader.execute

        def timed(query: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return inner(query, *args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - t0
                self.sent.append(str(query))

        sql_reader.execute = timed

    def reset(self) -> None:
        self.ns = 0
        self.sent = []


def _answer(rows: list[Any]) -> Any:
    """Scalar for one-cell results, else {key: value} (first row of ``execute`` is the header)."""
    body = rows[1:]
    if len(body) == 1 and len(body[0]) == 1:
        return body[0][0]
    return {str(r[0]): r[1] for r in body}


def main() -> None:
    job = json.load(sys.stdin)
    conn = psycopg2.connect(job["dsn"])
    out: dict[str, Any] = {"versions": {"smartnoise-sql": _version()}, "queries": {}}
    for q in job["queries"]:
        privacy = Privacy(epsilon=q["epsilon"], delta=job["delta"])
        reader = snsql.from_connection(conn, privacy=privacy, metadata=METADATA, engine="postgres")
        eps, delta = reader.get_privacy_cost(q["sql"])
        timer = DbTimer(reader.reader)
        times, db_times, answers = [], [], []
        sent: list[str] = []
        for i in range(job["runs"] + WARMUP):
            timer.reset()
            t0 = time.perf_counter_ns()
            rows = reader.execute(q["sql"])
            took = time.perf_counter_ns() - t0
            if i >= WARMUP:
                times.append(took)
                db_times.append(timer.ns)
                answers.append(_answer(rows))
                sent = timer.sent
        out["queries"][q["label"]] = {
            "epsilon_setting": q["epsilon"],
            "epsilon_charged": float(eps),
            "delta_charged": float(delta),
            "times_ns": times,
            "db_ns": db_times,
            "sql_sent": sent,
            "answers": answers,
        }
    conn.close()
    json.dump(out, sys.stdout, default=float)


def _version() -> str:
    from importlib.metadata import version

    return version("smartnoise-sql")


if __name__ == "__main__":
    main()
