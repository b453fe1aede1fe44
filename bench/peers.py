"""Benchmark 5: dpsql side by side with SmartNoise SQL on the same PostgreSQL table.

SmartNoise lives in its own venv (bench/.venv-peers, created on first use) and runs as a
subprocess (bench/peers_smartnoise.py) so its pins never touch dpsql's environment. Both answer
the same queries over the same 10^5-row table; we compare wall time, RMSE against the exact
answer over ``runs`` repetitions, and the ε each system charges for one query.

SmartNoise's ``Privacy(epsilon=ε)`` is spent *per mechanism*, while dpsql's ε is per query (split
across its measurements), so SmartNoise is run twice: at the nominal setting (ε = 1, as a user
would write it) and with ε scaled so that the charge equals dpsql's — the fair accuracy comparison.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import ANALYST, Section, Stats, bench_policy, make_table, ms
from e2e import postgres_backend

from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.session import Session

BENCH = Path(__file__).resolve().parent
PEER_VENV = BENCH / ".venv-peers"
PEER_PYTHON = PEER_VENV / "bin" / "python"
PEER_PACKAGES = ["smartnoise-sql", "psycopg2-binary"]

EPSILON = 1.0
DELTA = 1e-6
ROWS = 10**5

QUERIES: dict[str, str] = {
    "COUNT": "SELECT COUNT(*) FROM {t} WHERE age > 30",
    "AVG": "SELECT AVG(age) FROM {t}",
    "grouped COUNT": "SELECT category, COUNT(*) FROM {t} GROUP BY category",
    "grouped SUM": "SELECT category, SUM(income) FROM {t} GROUP BY category",
}


def ensure_peer_venv() -> str | None:
    """Create the peers' venv if needed; returns why it is unusable, or None."""
    check = [str(PEER_PYTHON), "-c", "import snsql, psycopg2"]
    if PEER_PYTHON.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return None
    python = shutil.which("python3.11") or sys.executable  # smartnoise-sql's wheels pin older pythons
    steps = [
        [python, "-m", "venv", str(PEER_VENV)],
        [str(PEER_PYTHON), "-m", "pip", "install", "-q", *PEER_PACKAGES],
    ]
    for step in steps:
        print(f"  [peers] {' '.join(step)}", flush=True)
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"`{' '.join(step)}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return "smartnoise-sql installed but `import snsql` fails"
    return None


def _smartnoise(dsn: str, epsilons: dict[str, float], runs: int) -> dict[str, Any]:
    job = {
        "dsn": dsn,
        "delta": DELTA,
        "runs": runs,
        "queries": [
            {"label": label, "sql": sql.format(t="public.t"), "epsilon": epsilons[label]}
            for label, sql in QUERIES.items()
        ],
    }
    done = subprocess.run(
        [str(PEER_PYTHON), str(BENCH / "peers_smartnoise.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"smartnoise subprocess failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout)


def _answer(rows: list[tuple[Any, ...]]) -> Any:
    if len(rows) == 1 and len(rows[0]) == 1:
        return rows[0][0]
    return {str(r[0]): r[1] for r in rows}


def rmse(answers: list[Any], truth: Any) -> tuple[float, float]:
    """(RMSE over all cells and runs, mean number of true groups missing per run); missing counts as 0."""
    if not isinstance(truth, dict):
        return math.sqrt(statistics.fmean((float(a) - float(truth)) ** 2 for a in answers)), 0.0
    errors, missing = [], []
    for ans in answers:
        missing.append(sum(1 for k in truth if k not in ans))
        errors += [(float(ans.get(k) or 0.0) - float(v)) ** 2 for k, v in truth.items()]
    return math.sqrt(statistics.fmean(errors)), statistics.fmean(missing)


def run(quick: bool) -> Section:
    runs = 20 if quick else 50
    section = Section(
        "peers",
        f"dpsql vs SmartNoise SQL, PostgreSQL 10^5 rows, ε={EPSILON:g} δ={DELTA:g}, {runs} runs",
        [
            "query",
            "system",
            "ε setting",
            "ε charged",
            "p50 ms",
            "p99 ms",
            "RMSE",
            "RMSE/dpsql",
            "groups missing",
        ],
    )
    why = ensure_peer_venv()
    if why is not None:
        section.rows.append(["-", "SmartNoise skipped", None, None, None, None, None, None, why])
        section.data["skipped"] = why
        return section
    with postgres_backend() as (backend, info):
        make_table(backend, "t", ROWS)
        engine = Engine(bench_policy(), backend, Ledger.open("sqlite:///:memory:"))
        session = Session(ANALYST, epsilon=EPSILON, delta=DELTA)
        truth, dp = {}, {}
        for label, template in QUERIES.items():
            sql = template.format(t="t")
            truth[label] = _answer(backend.execute(sql)[1])
            times, answers, charged = [], [], 0.0
            for i in range(runs + 2):
                result = engine.execute(sql, session)
                if i >= 2:
                    answers.append(_answer(result.rows))
                    charged = result.epsilon_spent
            for _ in range(runs):  # timed separately so the answers' bookkeeping is not in the figure
                times.append(_timed(lambda sql=sql: engine.execute(sql, session)))
            dp[label] = {"epsilon_charged": charged, "times_ns": times, "answers": answers}
        nominal = _smartnoise(info["dsn"], dict.fromkeys(QUERIES, EPSILON), runs)
        matched_eps = {
            label: EPSILON * dp[label]["epsilon_charged"] / nominal["queries"][label]["epsilon_charged"]
            for label in QUERIES
        }
        matched = _smartnoise(info["dsn"], matched_eps, runs)
        engine.ledger.close()
    section.data["smartnoise_version"] = nominal["versions"]["smartnoise-sql"]
    for label in QUERIES:
        base_rmse, _ = rmse(dp[label]["answers"], truth[label])
        entries = [
            ("dpsql", EPSILON, dp[label]),
            ("SmartNoise nominal", EPSILON, nominal["queries"][label]),
            ("SmartNoise matched ε", matched_eps[label], matched["queries"][label]),
        ]
        record = {"truth": truth[label]}
        for i, (system, setting, res) in enumerate(entries):
            st = Stats.of(res["times_ns"])
            err, missing = rmse(res["answers"], truth[label])
            record[system] = {
                "epsilon_setting": setting,
                "epsilon_charged": res["epsilon_charged"],
                "delta_charged": res.get("delta_charged"),
                "time": st.as_dict(),
                "rmse": err,
                "groups_missing_mean": missing,
            }
            section.rows.append(
                [
                    label if i == 0 else "",
                    system,
                    setting,
                    res["epsilon_charged"],
                    ms(st.p50_us),
                    ms(st.p99_us),
                    err,
                    err / base_rmse if base_rmse else None,
                    missing if isinstance(truth[label], dict) else None,
                ]
            )
        section.data[label] = record
    section.notes += [
        "SmartNoise's ε is per mechanism; 'matched ε' scales it so one query charges what dpsql charges.",
        "grouped: RMSE over the 8 true groups; a group SmartNoise censors (τ-thresholding) counts as 0.",
        "dpsql releases the category's public domain, so it never drops a group.",
    ]
    return section


def _timed(fn: Any) -> int:
    import time

    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0
