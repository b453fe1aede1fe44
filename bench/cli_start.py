"""How fast the ``dpsql`` command starts (issue #37 item 4), against the bare interpreter, in one run.

Each command is run as a fresh process (``python -m dpsql.cli …``, as the console script does), round-robin
with ``python -c pass`` so machine load hits all alike; the table gives p50 wall seconds and the ratio
to the interpreter's own start. ``serve --processes 2`` is timed from the process start to the first
successful login (psycopg, ``SELECT 1``), shadow catalog included. ``--against PATH`` (``bench/run.py``:
env ``DPSQL_BENCH_AGAINST``) also times a second source tree (e.g. ``git archive`` of the previous
release, unpacked) interleaved with this one, for a before/after ratio from the same run.

Bars (an idle 2-core machine): ``--version`` ≤ 0.3 s; ``budget``/``audit``/``budget grant`` ≤ 0.6 s;
``serve --processes 2`` to its first login ≤ 5 s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from common import Section

ROOT = Path(__file__).resolve().parent.parent
POLICY = str(ROOT / "schemas" / "health.yaml")
BARS_S = {"--version": 0.3, "budget": 0.6, "audit": 0.6, "budget grant": 0.6, "serve --processes 2": 5.0}


def _commands(ledger: str) -> dict[str, list[str]]:
    common = ["--policy", POLICY, "--ledger", ledger]
    return {
        "--version": ["--version"],
        "budget": ["budget", *common],
        "audit": ["audit", *common],
        "budget grant": ["budget", "grant", "--analyst", "alice", "--epsilon", "0.001", "--reason", "bench", *common],
    }


def _env(tree: Path, home: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "DPSQL_HOME": home}


def _run(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()  # in the tree (``-m`` puts the working directory first on the path)
    cwd = env["PYTHONPATH"]
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def time_commands(trees: dict[str, Path], reps: int) -> dict[str, dict[str, float]]:
    """p50 seconds of every command per tree, and of ``python -c pass``, interleaved."""
    samples: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dpsql-bench-cli-") as home:
        ledger = f"sqlite:///{home}/ledger.db"
        runs = [("interpreter", "python -c pass", [sys.executable, "-c", "pass"], _env(ROOT, home))]
        for label, tree in trees.items():
            for name, args in _commands(ledger).items():
                runs.append((label, name, [sys.executable, "-m", "dpsql.cli", *args], _env(tree, home)))
        for _, _, argv, env in runs:  # warm the file cache and create the ledger
            _run(argv, env)
        for i in range(reps):
            for j in range(len(runs)):
                label, name, argv, env = runs[(i + j) % len(runs)]
                samples.setdefault((label, name), []).append(_run(argv, env))
    out: dict[str, dict[str, float]] = {}
    for (label, name), values in samples.items():
        out.setdefault(label, {})[name] = statistics.median(values)
    return out


def _tree_cpu(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants (their reaped children included)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = sum(int(f) for f in fields[11:15]) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


def time_serve(tree: Path, processes: int = 2, timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from starting ``dpsql serve --processes N --port 0`` (demo, shadow catalog started) to the
    first login that answers ``SELECT 1``, and the CPU seconds its processes had used by then (a figure
    a busy machine inflates less than the wall time)."""
    with tempfile.TemporaryDirectory(prefix="dpsql-bench-serve-") as home:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpsql.cli", "serve", "--port", "0", "--processes", str(processes)],
            env=_env(tree, home),
            cwd=tree,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            port = _port(proc, started + timeout)
            while time.perf_counter() - started < timeout:
                try:
                    dsn = f"host=127.0.0.1 port={port} user=analyst dbname=health connect_timeout=5"
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute("SELECT 1").fetchall()
                    return time.perf_counter() - started, _tree_cpu(proc.pid)
                except psycopg.OperationalError:
                    time.sleep(0.02)
            raise TimeoutError("dpsql serve did not accept a login in time")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _port(proc: subprocess.Popen[str], deadline: float) -> int:
    """The port the supervisor chose (its first log line names it)."""
    assert proc.stderr is not None
    while time.perf_counter() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"dpsql serve exited with {proc.wait()}")
        found = re.search(r"worker processes on [^:]*:(\d+)", line)
        if found:
            return int(found.group(1))
    raise TimeoutError("no port announced")


def run(quick: bool, against: Path | None = None) -> Section:
    """``against`` (or env ``DPSQL_BENCH_AGAINST``, for ``bench/run.py``): another source tree, timed alike."""
    if against is None and os.environ.get("DPSQL_BENCH_AGAINST"):
        against = Path(os.environ["DPSQL_BENCH_AGAINST"])
    trees = {"this tree": ROOT, **({"against": against} if against else {})}
    reps = 5 if quick else 11
    section = Section(
        "cli",
        "dpsql command start: p50 wall seconds, and the ratio to `python -c pass` (same run)",
        ["command", *[f"{t} s" for t in trees], *[f"{t} / python" for t in trees], "bar s"],
    )
    timed = time_commands(trees, reps)
    floor = timed["interpreter"]["python -c pass"]
    serves = 1 if quick else 3
    serve_runs = {label: [time_serve(tree) for _ in range(serves)] for label, tree in trees.items()}
    serve = {label: statistics.median(wall for wall, _ in runs) for label, runs in serve_runs.items()}
    serve_cpu = {label: statistics.median(cpu for _, cpu in runs) for label, runs in serve_runs.items()}
    results: list[dict[str, Any]] = []
    for name in [*BARS_S][:-1]:
        values = {label: timed[label][name] for label in trees}
        over = {k: v / floor for k, v in values.items()}
        results.append({"command": name, "seconds": values, "over_python": over, "bar": BARS_S[name]})
    over = {k: v / floor for k, v in serve.items()}
    results.append(
        {"command": "serve --processes 2", "seconds": serve, "over_python": over, "bar": BARS_S["serve --processes 2"]}
    )
    for r in results:
        section.rows.append(
            [
                r["command"],
                *[r["seconds"][t] for t in trees],
                *[r["over_python"][t] for t in trees],
                BARS_S[r["command"]],
            ]
        )
    section.data.update({"python_s": floor, "results": results, "trees": {k: str(v) for k, v in trees.items()}})
    section.data["serve_cpu_s"] = serve_cpu
    section.notes.append(
        "serve --processes 2: CPU seconds of its processes by the first login: "
        + ", ".join(f"{label} {cpu:.2f}" for label, cpu in serve_cpu.items())
    )
    section.notes.append(f"`python -c pass` p50 {floor:.3f} s in this run (the interpreter's own start)")
    return section


def bars(section: dict[str, Any] | None) -> list[tuple[str, float | None, float]]:
    """Issue #37's start bars for this tree: (name, p50 seconds or None, limit). The limits are for an idle
    machine: on a busy one compare the ratio to ``python -c pass`` and to ``--against``."""
    found = {r["command"]: r for r in (section or {}).get("results", [])}
    return [
        (f"dpsql {name} start s (issue #37)", found[name]["seconds"]["this tree"] if name in found else None, limit)
        for name, limit in BARS_S.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--against", type=Path, help="another source tree to time interleaved with this one")
    args = parser.parse_args()
    run(args.quick, args.against).print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
