"""Benchmark 5: dpsql side by side with SmartNoise SQL on the same PostgreSQL table.

SmartNoise lives in its own venv (bench/.venv-peers, created on first use) and runs as a
subprocess (bench/peers_smartnoise.py) so its pins never touch dpsql's environment. Both answer
the same queries over the same 10^5-row table; we compare wall time, the *DP layer's* time (wall
minus the time spent in the database calls of the same run), RMSE against the exact answer and the
ε each system charges for one query.

Database time is measured per run, inside the run, around the only calls that reach PostgreSQL:
dpsql's ``Backend.execute`` (the rewritten statement in one extended-protocol round trip, fetch) and
SmartNoise's reader ``execute`` (psycopg2 ``execute``, ``commit``, fetch). Subtracting per run is more
exact than subtracting medians of separately timed SQL: both terms see the same load.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import ANALYST, Section, Stats, bench_policy, make_table, ms
from e2e import postgres_backend

from dpsql.backends import Backend
from dpsql.cache import ResultCache
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
WARMUP = 2

#: Bars from the issue, against SmartNoise SQL on the same PostgreSQL at 10^5 rows.
BAR_OVERHEAD_RATIO = 50.0  # SmartNoise's DP-layer time / dpsql's, at least
BAR_E2E_RATIO = 5.0  # SmartNoise's wall time / dpsql's, at least
BAR_RMSE_RATIO = 1.0  # dpsql's RMSE / SmartNoise's at the same charged ε, at most

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
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"smartnoise subprocess failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout)


# --------------------------------------------------------------------------------------------------
# dpsql side
# --------------------------------------------------------------------------------------------------


class DbMeter:
    """Accumulates the time a backend spends in database calls, by shadowing its methods on the instance.

    ``proven_ranges`` (statistics lookups some backends answer while planning) counts as database time
    too, so a plan-cache miss is not charged to the DP layer for it.
    """

    METHODS = ("execute", "proven_ranges")

    def __init__(self, backend: Backend) -> None:
        self.ns = 0
        self.backend = backend
        self.installed: list[str] = []
        for name in self.METHODS:
            fn = getattr(backend, name, None)
            if fn is not None:
                setattr(backend, name, self._timed(fn))
                self.installed.append(name)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - t0

        return timed

    def close(self) -> None:
        for name in self.installed:
            delattr(self.backend, name)  # the class's method shows through again


def _drop_plans(engine: Engine) -> None:
    """Empty the plan cache so the next ``execute`` parses, analyzes and rewrites, as SmartNoise always does."""
    engine._plans.clear()


class Runs:
    """Per-run wall time, database time and answer of one system on one query."""

    def __init__(self) -> None:
        self.wall_ns: list[int] = []
        self.db_ns: list[int] = []
        self.answers: list[Any] = []

    def add(self, wall: int, db: int, answer: Any) -> None:
        self.wall_ns.append(wall)
        self.db_ns.append(db)
        self.answers.append(answer)

    def timing(self) -> dict[str, Stats]:
        return {
            "wall": Stats.of(self.wall_ns),
            "db": Stats.of(self.db_ns),
            "dp_layer": Stats.of([w - d for w, d in zip(self.wall_ns, self.db_ns, strict=True)]),
        }


def _dpsql_block(engine: Engine, meter: DbMeter, sql: str, session: Session, runs: int, out: dict[str, Runs]) -> float:
    """``runs`` iterations, each one run without caches and one with the plan cache (order alternating)."""
    charged = 0.0
    for i in range(runs + WARMUP):
        for mode in ("no caches", "plan cache") if i % 2 == 0 else ("plan cache", "no caches"):
            if mode == "no caches":
                _drop_plans(engine)
            meter.ns = 0
            t0 = time.perf_counter_ns()
            result = engine.execute(sql, session)
            wall = time.perf_counter_ns() - t0
            if i >= WARMUP:
                out[mode].add(wall, meter.ns, _answer(result.rows))
            charged = result.epsilon_spent
    return charged


def _result_cache_hits(backend: Backend, sql: str, session: Session, reps: int) -> Stats:
    """Wall time of an exactly repeated query answered from dpsql's result cache (no database call, no charge)."""
    engine = Engine(bench_policy(), backend, Ledger.open("sqlite:///:memory:"), ResultCache.open("memory"))
    try:
        engine.execute(sql, session)
        samples = []
        for _ in range(reps + WARMUP):
            t0 = time.perf_counter_ns()
            engine.execute(sql, session)
            samples.append(time.perf_counter_ns() - t0)
        return Stats.of(samples[WARMUP:])
    finally:
        engine.ledger.close()
        if engine.cache is not None:
            engine.cache.close()


# --------------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------------


def _answer(rows: list[tuple[Any, ...]]) -> Any:
    if len(rows) == 1 and len(rows[0]) == 1:
        return rows[0][0]
    return {str(r[0]): r[1] for r in rows}


def squared_errors(answers: list[Any], truth: Any) -> tuple[list[float], float]:
    """(squared error of every cell of every run, mean number of true groups missing per run).

    For grouped answers the cells are the true groups; a group a system censors counts as 0.
    """
    if not isinstance(truth, dict):
        return [(float(a) - float(truth)) ** 2 for a in answers], 0.0
    errors, missing = [], []
    for ans in answers:
        missing.append(sum(1 for k in truth if k not in ans))
        errors += [(float(ans.get(k) or 0.0) - float(v)) ** 2 for k, v in truth.items()]
    return errors, statistics.fmean(missing)


def rmse(answers: list[Any], truth: Any) -> tuple[float, float]:
    """(RMSE over all cells and runs, mean number of true groups missing per run); missing counts as 0."""
    errors, missing = squared_errors(answers, truth)
    return math.sqrt(statistics.fmean(errors)), missing


def rmse_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """RMSE(a) / RMSE(b) and the standard error of its logarithm (delta method on the mean squared errors)."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    se_a = statistics.stdev(a) / math.sqrt(len(a)) / (2 * ma) if ma > 0 and len(a) > 1 else 0.0
    se_b = statistics.stdev(b) / math.sqrt(len(b)) / (2 * mb) if mb > 0 and len(b) > 1 else 0.0
    ratio = math.sqrt(ma / mb) if mb > 0 else math.inf
    return ratio, math.hypot(se_a, se_b)


def _rmse_verdict(ratio: float, se_log: float) -> str:
    """'yes' at or below the bar, 'tie' when above it by less than two standard errors, else 'NO'."""
    if ratio <= BAR_RMSE_RATIO:
        return "yes"
    if math.log(ratio / BAR_RMSE_RATIO) <= 2 * se_log:
        return "tie"
    return "NO"


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------

HEADERS = [
    "query",
    "system",
    "ε setting",
    "ε charged",
    "wall p50",
    "DB p50",
    "DP layer p50",
    "DP layer p99",
    "RMSE",
    "RMSE/dpsql",
    "groups missing",
]

BAR_HEADERS = [
    "query",
    "DP layer dpsql",
    "DP layer SN",
    f"SN/dpsql (≥{BAR_OVERHEAD_RATIO:g})",
    "ok",
    "same, plan cache",
    f"e2e SN/dpsql (≥{BAR_E2E_RATIO:g})",
    "ok",
    "same, plan cache",
    "e2e ceiling",
    f"RMSE dpsql/SN same ε (≤{BAR_RMSE_RATIO:g})",
    "±2σ",
    "ok",
    "ε dpsql",
    "ε SN",
]


def run(quick: bool) -> Section:
    runs = 30 if quick else 200
    section = Section(
        "peers",
        f"dpsql vs SmartNoise SQL, PostgreSQL 10^5 rows, ε={EPSILON:g} δ={DELTA:g}, {runs} runs (ms)",
        list(HEADERS),
    )
    why = ensure_peer_venv()
    if why is not None:
        section.rows.append(["-", "SmartNoise skipped", *([None] * (len(HEADERS) - 3)), why])
        section.data["skipped"] = why
        return section
    with postgres_backend() as (backend, info):
        make_table(backend, "t", ROWS)
        engine = Engine(bench_policy(), backend, Ledger.open("sqlite:///:memory:"))  # no result cache
        meter = DbMeter(backend)
        session = Session(ANALYST, epsilon=EPSILON, delta=DELTA)
        truth: dict[str, Any] = {}
        dp: dict[str, dict[str, Runs]] = {label: {"no caches": Runs(), "plan cache": Runs()} for label in QUERIES}
        charged: dict[str, float] = {}
        sql_sent: dict[str, str] = {}
        # dpsql runs in two halves, before and after SmartNoise, so load drift on the shared machine hits both.
        for label, template in QUERIES.items():
            sql = template.format(t="t")
            truth[label] = _answer(backend.execute(sql)[1])
            sql_sent[label] = engine.prepare(sql, session).sql
            charged[label] = _dpsql_block(engine, meter, sql, session, runs // 2, dp[label])
        print("  [peers] SmartNoise, nominal ε ...", flush=True)
        nominal = _smartnoise(info["dsn"], dict.fromkeys(QUERIES, EPSILON), runs)
        matched_eps = {
            label: EPSILON * charged[label] / nominal["queries"][label]["epsilon_charged"] for label in QUERIES
        }
        print("  [peers] SmartNoise, matched ε ...", flush=True)
        matched = _smartnoise(info["dsn"], matched_eps, runs)
        for label, template in QUERIES.items():
            _dpsql_block(engine, meter, template.format(t="t"), session, runs - runs // 2, dp[label])
        meter.close()
        cache_hits = {
            label: _result_cache_hits(backend, template.format(t="t"), session, 50 if quick else 200)
            for label, template in QUERIES.items()
        }
        engine.ledger.close()
    section.data["smartnoise_version"] = nominal["versions"]["smartnoise-sql"]
    section.data["runs"] = runs
    bar_rows: list[list[Any]] = []
    verdicts: dict[str, list[bool]] = {"overhead": [], "e2e": [], "rmse": []}
    for label in QUERIES:
        record: dict[str, Any] = {"truth": truth[label], "dpsql_sql": sql_sent[label]}
        sn: dict[str, Runs] = {}
        for name, res in (("SmartNoise nominal ε", nominal), ("SmartNoise matched ε", matched)):
            q = res["queries"][label]
            sn[name] = Runs()
            for wall, db, answer in zip(q["times_ns"], q["db_ns"], q["answers"], strict=True):
                sn[name].add(wall, db, answer)
        record["smartnoise_sql"] = nominal["queries"][label]["sql_sent"]
        # dpsql's accuracy pools both of its modes: every run is a fresh release (result cache off).
        dp_all = dp[label]["no caches"].answers + dp[label]["plan cache"].answers
        dp_err, dp_missing = squared_errors(dp_all, truth[label])
        base_rmse = math.sqrt(statistics.fmean(dp_err))
        entries: list[tuple[str, float | None, float, Runs | None]] = [
            ("dpsql, no caches", EPSILON, charged[label], dp[label]["no caches"]),
            ("dpsql, plan cache", EPSILON, charged[label], dp[label]["plan cache"]),
            ("dpsql, result-cache hit", EPSILON, 0.0, None),
            ("SmartNoise nominal ε", EPSILON, nominal["queries"][label]["epsilon_charged"], sn["SmartNoise nominal ε"]),
            (
                "SmartNoise matched ε",
                matched_eps[label],
                matched["queries"][label]["epsilon_charged"],
                sn["SmartNoise matched ε"],
            ),
        ]
        timings: dict[str, dict[str, Stats]] = {}
        for i, (system, setting, eps, runs_of) in enumerate(entries):
            if runs_of is None:  # result-cache hit: no database call, nothing charged, same answer as before
                st = cache_hits[label]
                record[system] = {"epsilon_charged": 0.0, "wall": st.as_dict()}
                section.rows.append(
                    [
                        "",
                        system,
                        setting,
                        0.0,
                        ms(st.p50_us),
                        0.0,
                        ms(st.p50_us),
                        ms(st.p99_us),
                        None,
                        None,
                        None,
                    ]
                )
                continue
            timing = runs_of.timing()
            timings[system] = timing
            if system.startswith("dpsql"):
                err, missing = base_rmse, dp_missing
            else:
                err, missing = rmse(runs_of.answers, truth[label])
            record[system] = {
                "epsilon_setting": setting,
                "epsilon_charged": eps,
                **{k: v.as_dict() for k, v in timing.items()},
                "rmse": err,
                "groups_missing_mean": missing,
            }
            section.rows.append(
                [
                    label if i == 0 else "",
                    system,
                    setting,
                    eps,
                    ms(timing["wall"].p50_us),
                    ms(timing["db"].p50_us),
                    ms(timing["dp_layer"].p50_us),
                    ms(timing["dp_layer"].p99_us),
                    err,
                    err / base_rmse if base_rmse else None,
                    missing if isinstance(truth[label], dict) else None,
                ]
            )
        ours, cached = timings["dpsql, no caches"], timings["dpsql, plan cache"]
        theirs = timings["SmartNoise nominal ε"]
        overhead_ratio = theirs["dp_layer"].p50_us / ours["dp_layer"].p50_us
        overhead_ratio_cached = theirs["dp_layer"].p50_us / cached["dp_layer"].p50_us
        e2e_ratio = theirs["wall"].p50_us / ours["wall"].p50_us
        e2e_ratio_cached = theirs["wall"].p50_us / cached["wall"].p50_us
        # What e2e would be if dpsql's own layer cost nothing: SmartNoise's wall over dpsql's database time.
        e2e_ceiling = theirs["wall"].p50_us / ours["db"].p50_us
        sn_err, _ = squared_errors(sn["SmartNoise matched ε"].answers, truth[label])
        acc_ratio, se_log = rmse_ratio(dp_err, sn_err)
        acc_ok = _rmse_verdict(acc_ratio, se_log)
        verdicts["overhead"].append(overhead_ratio >= BAR_OVERHEAD_RATIO)
        verdicts["e2e"].append(e2e_ratio >= BAR_E2E_RATIO)
        verdicts["rmse"].append(acc_ok != "NO")
        record["bars"] = {
            "dp_layer_ratio": overhead_ratio,
            "dp_layer_ratio_plan_cache": overhead_ratio_cached,
            "dp_layer_ratio_met": overhead_ratio >= BAR_OVERHEAD_RATIO,
            "e2e_ratio": e2e_ratio,
            "e2e_ratio_met": e2e_ratio >= BAR_E2E_RATIO,
            "e2e_ratio_plan_cache": e2e_ratio_cached,
            "e2e_ceiling": e2e_ceiling,
            "rmse_ratio_same_epsilon": acc_ratio,
            "rmse_ratio_se_log": se_log,
            "rmse_verdict": acc_ok,
        }
        section.data[label] = record
        band = (acc_ratio * math.exp(-2 * se_log), acc_ratio * math.exp(2 * se_log))
        bar_rows.append(
            [
                label,
                ms(ours["dp_layer"].p50_us),
                ms(theirs["dp_layer"].p50_us),
                overhead_ratio,
                "yes" if overhead_ratio >= BAR_OVERHEAD_RATIO else "NO",
                overhead_ratio_cached,
                e2e_ratio,
                "yes" if e2e_ratio >= BAR_E2E_RATIO else "NO",
                e2e_ratio_cached,
                e2e_ceiling,
                acc_ratio,
                f"{band[0]:.2f}-{band[1]:.2f}",
                acc_ok,
                charged[label],
                nominal["queries"][label]["epsilon_charged"],
            ]
        )
    section.data["bars_met"] = {k: all(v) for k, v in verdicts.items()}
    section.extra_tables.append(
        {
            "title": "bars vs SmartNoise (DP layer = wall − database time of the same run, p50 ms)",
            "headers": list(BAR_HEADERS),
            "rows": bar_rows,
        }
    )
    section.notes += [
        "DP layer = wall time − time inside the database calls of the same run (dpsql: Backend.execute, one"
        " round trip on a read-only session; SmartNoise: its reader's execute incl. commit); p50/p99 over runs.",
        "dpsql, no caches: plan cache emptied before each run (parse + analyze + rewrite every time, as SmartNoise"
        " does); plan cache: warm plan cache; neither has a result cache. Bars use 'no caches' and SmartNoise"
        " nominal ε; 'same, plan cache' is the overhead ratio with the warm plan cache.",
        "e2e ceiling: SmartNoise's wall time over dpsql's database time alone, i.e. the end-to-end ratio"
        " if dpsql's layer took no time at all; below 5, the e2e bar cannot be met on this PostgreSQL.",
        "result-cache hit: an exactly repeated query answered from dpsql's cache (no database call, no ε charged).",
        "SmartNoise's ε is per mechanism; 'matched ε' scales it so one query charges what dpsql charges;"
        " the RMSE bar compares dpsql with it (the same charged ε). dpsql's RMSE pools its two modes' runs.",
        "RMSE ok: 'yes' ≤ 1; 'tie' above 1 by less than 2 standard errors (sampling noise of the RMSE"
        " estimates, delta method); 'NO' otherwise. ±2σ is that band around the ratio.",
        "grouped: RMSE over the 8 true groups; a group SmartNoise censors (τ-thresholding) counts as 0;"
        " dpsql releases the category's public domain, so it never drops a group.",
        "dpsql runs in two halves, before and after SmartNoise's, so load drift on the shared machine hits both.",
    ]
    return section
