"""Benchmark 6: ``dpsql serve`` wire throughput vs the same psycopg clients querying PostgreSQL directly.

A simple DP COUNT (``SELECT COUNT(*) FROM t WHERE g100k > v``, 10^5 PostgreSQL rows) is sent by 1, 8
and 32 concurrent psycopg 3 clients through ``dpsql serve``; the same clients then send dpsql's
*rewritten* SQL for the same query straight to PostgreSQL. Server and clients are separate processes
(psycopg clients in the server's process would contend with it on the GIL): the server is
``python bench/wire.py serve`` (an Engine with a PostgreSQL ledger and result cache, the shadow
catalog off), each client is ``python bench/wire.py client`` holding one connection to each side.
The parent drives phases over the clients' stdin/stdout: warm up, a synchronised start, a fixed
duration, one JSON line of latencies back. The two sides run in A-B-B-A halves so load drift hits
both equally. The whole table is measured once per worker-process count in ``WORKERS`` (1 and 2
by default): N ``wire.py serve`` processes on one port with SO_REUSEPORT, as ``dpsql serve
--processes N`` runs them, sharing a PostgreSQL ledger and result cache.

dpsql answers an exactly repeated query from its result cache at no cost, so the measured runs give
every request its own constant ``v`` (a stream no two requests share, checked by counting the cache's
NOTICEs); a separate "cached repeat" row sends one fixed query over and over.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common import Section

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

ROWS = 10**5
QUERY = "SELECT COUNT(*) FROM t WHERE g100k > {v}"
#: Placeholder constant: dpsql's rewritten SQL for QUERY with it is a template for every ``v``.
MARK = 987654321
#: The "cached repeat" constant; the per-request stream only produces v >= 0, so it never collides.
CACHED_V = -1
CLIENTS = (1, 8, 32)
#: Worker processes behind the one port (``dpsql serve --processes N``); env WIRE_WORKERS="1,2".
WORKERS = tuple(int(w) for w in os.environ.get("WIRE_WORKERS", "1,2").split(","))
WARMUP = 3  # queries per client before each timed phase (connection, plan and page caches)
CACHE_NOTICE = "result cache"


# --------------------------------------------------------------------------------------------------
# Client process: ``python bench/wire.py client DPSQL_DSN PG_DSN INDEX`` (imports only psycopg)
# --------------------------------------------------------------------------------------------------


def _query(cur: Any, template: str, v: int) -> None:
    cur.execute(template.replace(str(MARK), str(v)))
    cur.fetchall()


def _client_main(dpsql_dsn: str, pg_dsn: str, index: int) -> int:
    """Serve phase commands from stdin until EOF or ``quit``; one reply line per command."""
    import psycopg

    hits = [0]

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if CACHE_NOTICE in (diag.message_primary or ""):
            hits[0] += 1

    conns = {
        "dpsql": psycopg.connect(dpsql_dsn, autocommit=True, connect_timeout=30),
        "direct": psycopg.connect(pg_dsn, autocommit=True, connect_timeout=30),
    }
    conns["dpsql"].add_notice_handler(on_notice)
    print("connected", flush=True)
    while True:
        line = sys.stdin.readline()
        cmd = json.loads(line) if line.strip() else {"op": "quit"}
        if cmd["op"] == "quit":
            break
        cur = conns[cmd["target"]].cursor()
        template: str = cmd["template"]
        stride: int = cmd["stride"]
        offset: int = cmd["offset"]
        repeat: bool = cmd["repeat"]
        j = 0
        for _ in range(WARMUP):
            _query(cur, template, CACHED_V if repeat else offset + index + stride * j)
            j += 1
        hits[0] = 0
        print("ready", flush=True)
        start_at = float(json.loads(sys.stdin.readline())["start_at"])
        time.sleep(max(0.0, start_at - time.time()))
        end_at = start_at + float(cmd["duration"])
        latencies: list[int] = []
        while time.time() < end_at:
            v = CACHED_V if repeat else offset + index + stride * j
            t0 = time.perf_counter_ns()
            _query(cur, template, v)
            latencies.append(time.perf_counter_ns() - t0)
            j += 1
        finished = time.time()
        cur.close()
        print(json.dumps({"lat_ns": latencies, "finished": finished, "issued": j, "cache_hits": hits[0]}), flush=True)
    for conn in conns.values():
        conn.close()
    return 0


# --------------------------------------------------------------------------------------------------
# Server process: ``python bench/wire.py serve PG_DSN PORT``
# --------------------------------------------------------------------------------------------------


def _serve_main(pg_dsn: str, port: int, ledger: str = "sqlite:///:memory:") -> int:
    """One ``dpsql serve`` worker as the CLI runs it (``--processes``: SO_REUSEPORT on a shared port), its
    ledger and result cache at ``ledger`` (a PostgreSQL URL shares both between workers), catalog off."""
    from common import bench_policy

    from dpsql.backends import open_backend
    from dpsql.cache import ResultCache, default_cache_url
    from dpsql.engine import Engine
    from dpsql.ledger import Ledger
    from dpsql.server import run

    cache = ResultCache.open(default_cache_url(ledger))
    # every Engine derives its salt and keys from the ledger's installation key: workers agree
    engine = Engine(bench_policy(), open_backend(pg_dsn), Ledger.open(ledger), cache)
    try:
        run(engine, host="127.0.0.1", port=port, catalog_dsn="", reuse_port=True)
    finally:
        engine.close()
    return 0


# --------------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    extra = os.pathsep.join([str(ROOT), str(BENCH)])
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{extra}{os.pathsep}{old}" if old else extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """One line from a child's stdout, or an error at ``deadline`` (children write one line, then wait)."""
    assert proc.stdout is not None
    remaining = deadline - time.time()
    if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
        raise TimeoutError(f"client pid {proc.pid} did not answer in time")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"client pid {proc.pid} exited (rc={proc.wait(5)})")
    return line


def _wait_for_server(proc: subprocess.Popen[bytes], dsn: str, timeout_s: float = 90.0) -> None:
    import psycopg

    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dpsql server exited with rc={proc.returncode}")
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(QUERY.format(v=-2)).fetchall()
            return
        except psycopg.Error:
            if time.time() > deadline:
                raise
            time.sleep(0.25)


@dataclass
class Phase:
    """Merged figures of one side (dpsql or direct) over its halves."""

    latencies_ns: list[int]
    elapsed_s: float
    cache_hits: int

    @property
    def qps(self) -> float:
        return len(self.latencies_ns) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Clients:
    """Up to ``max(CLIENTS)`` client processes, spawned once; a phase uses the first ``n``."""

    def __init__(self, n: int, dpsql_dsn: str, pg_dsn: str) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.offset = 0  # next unused constant of the per-request stream (shared across phases)
        for i in range(n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "client", dpsql_dsn, pg_dsn, str(i)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=_env(),
                )
            )
        deadline = time.time() + 120
        for proc in self.procs:
            if _read_line(proc, deadline).strip() != "connected":
                raise RuntimeError("unexpected client greeting")

    def _send(self, proc: subprocess.Popen[str], msg: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()

    def phase(self, n: int, target: str, template: str, duration: float, repeat: bool) -> Phase:
        procs = self.procs[:n]
        cmd = {
            "op": "run",
            "target": target,
            "template": template,
            "stride": n,
            "offset": self.offset,
            "repeat": repeat,
            "duration": duration,
        }
        for proc in procs:
            self._send(proc, cmd)
        deadline = time.time() + 120
        for proc in procs:
            if _read_line(proc, deadline).strip() != "ready":
                raise RuntimeError("unexpected client reply")
        start_at = time.time() + 0.05
        for proc in procs:
            self._send(proc, {"start_at": start_at})
        deadline = start_at + duration + 120
        replies = [json.loads(_read_line(proc, deadline)) for proc in procs]
        if not repeat:
            self.offset += n * (max(r["issued"] for r in replies) + 1)
        return Phase(
            [x for r in replies for x in r["lat_ns"]],
            max(r["finished"] for r in replies) - start_at,
            sum(r["cache_hits"] for r in replies),
        )

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                self._send(proc, {"op": "quit"})
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _measure(clients: Clients, n: int, templates: dict[str, str], duration: float, repeat: bool) -> tuple[Phase, Phase]:
    """dpsql and direct, A-B-B-A in halves of ``duration / 2``, merged per side."""
    halves: dict[str, list[Phase]] = {"dpsql": [], "direct": []}
    for target in ("dpsql", "direct", "direct", "dpsql"):
        halves[target].append(clients.phase(n, target, templates[target], duration / 2, repeat))
    merged = {
        k: Phase([x for p in v for x in p.latencies_ns], sum(p.elapsed_s for p in v), sum(p.cache_hits for p in v))
        for k, v in halves.items()
    }
    return merged["dpsql"], merged["direct"]


def _row(n: int, label: str, dp: Phase, direct: Phase) -> tuple[list[Any], dict[str, Any]]:
    from common import Stats, ms

    a, b = Stats.of(dp.latencies_ns), Stats.of(direct.latencies_ns)
    record = {
        "clients": n,
        "query": label,
        "dpsql": {**a.as_dict(), "qps": dp.qps, "seconds": dp.elapsed_s, "cache_hits": dp.cache_hits},
        "direct": {**b.as_dict(), "qps": direct.qps, "seconds": direct.elapsed_s},
        "qps_ratio": dp.qps / direct.qps,
        "p50_ratio": a.p50_us / b.p50_us,
    }
    row = [
        n,
        label,
        dp.qps,
        ms(a.p50_us),
        ms(a.p99_us),
        direct.qps,
        ms(b.p50_us),
        ms(b.p99_us),
        record["qps_ratio"],
        record["p50_ratio"],
    ]
    return row, record


HEADERS = [
    "clients",
    "query",
    "dpsql q/s",
    "p50 ms",
    "p99 ms",
    "direct q/s",
    "p50 ms",
    "p99 ms",
    "q/s dpsql/direct",
    "p50 dpsql/direct",
]


def _templates(pg_dsn: str) -> dict[str, str]:
    """The analyst's SQL and dpsql's rewritten SQL, each with MARK where the constant goes (checked)."""
    from common import ANALYST, bench_policy

    from dpsql.backends import open_backend
    from dpsql.engine import Engine
    from dpsql.ledger import Ledger
    from dpsql.session import Session

    engine = Engine(bench_policy(), open_backend(pg_dsn), Ledger.open("sqlite:///:memory:"))
    try:
        session = Session(ANALYST)
        rewritten = engine.prepare(QUERY.format(v=MARK), session).sql
        for v in (0, 4321, CACHED_V):
            expected = engine.prepare(QUERY.format(v=v), session).sql
            if rewritten.replace(str(MARK), str(v)) != expected or rewritten.count(str(MARK)) != 1:
                raise RuntimeError(f"rewritten SQL is not a template in the constant: {rewritten!r}")
    finally:
        engine.close()
    return {"dpsql": QUERY.format(v=MARK), "direct": rewritten}


def _run(quick: bool, log: Any) -> Section:
    import psycopg
    from common import ANALYST, Section, make_table

    from dpsql.backends import open_backend
    from dpsql.backends.local_postgres import start_local_postgres

    duration = 2.0 if quick else 5.0
    cached_at = (8,) if quick else CLIENTS
    title = f"dpsql serve vs direct PostgreSQL, psycopg 3 clients, 10^{len(str(ROWS)) - 1} rows"
    section = Section("wire", title, list(HEADERS))
    pg = start_local_postgres()
    ledger_pg = start_local_postgres()
    servers: list[subprocess.Popen[bytes]] = []
    clients: Clients | None = None
    try:
        backend = open_backend(pg.dsn)
        try:
            took = make_table(backend, "t", ROWS)
        finally:
            backend.close()
        print(f"  [postgresql] generated 10^{len(str(ROWS)) - 1} rows in {took:.1f} s", flush=True)
        templates = _templates(pg.dsn)
        records = []
        for workers in WORKERS:
            # a fresh PostgreSQL ledger + result cache per configuration, on its own cluster (in the
            # data's cluster every charge would move the data stamp and no repeat would be a hit)
            name = f"ledger_{workers}"
            with psycopg.connect(ledger_pg.dsn, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name}")  # type: ignore[arg-type]
                admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
            ledger_url = ledger_pg.dsn_for(name)
            port = _free_port()
            servers = [
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "serve", pg.dsn, str(port), ledger_url],
                    stdout=log,
                    stderr=log,
                    env=_env(),
                )
                for _ in range(workers)
            ]
            dpsql_dsn = f"postgresql://{ANALYST}@127.0.0.1:{port}/bench?sslmode=disable"
            for server in servers:
                _wait_for_server(server, dpsql_dsn)
            time.sleep(1.0)  # every worker listening, not only the first that answered
            clients = Clients(max(CLIENTS), dpsql_dsn, pg.dsn + ("&" if "?" in pg.dsn else "?") + "sslmode=disable")
            plan = [(n, False) for n in CLIENTS] + [(n, True) for n in cached_at]
            for n, repeat in plan:
                label = ("cached repeat" if repeat else "COUNT, new constant each") + f", {workers} worker(s)"
                dp, direct = _measure(clients, n, templates, duration, repeat)
                row, record = _row(n, label, dp, direct)
                record.update(workers=workers, repeat=repeat)
                print(f"  [{n} clients, {label}] dpsql {dp.qps:,.0f} q/s, direct {direct.qps:,.0f} q/s", flush=True)
                section.rows.append(row)
                records.append(record)
            clients.close()
            clients = None
            _stop_servers(servers, log, section)
            servers = []
        misses = [r for r in records if r["repeat"] and r["dpsql"]["cache_hits"] != r["dpsql"]["n"]]
        hits = sum(r["dpsql"]["cache_hits"] for r in records if not r["repeat"])
        section.data.update(
            {
                "rows": ROWS,
                "sql": QUERY,
                "rewritten_sql": templates["direct"].replace(str(MARK), "{v}"),
                "seconds_per_side": duration,
                "cpus": os.cpu_count(),
                "results": records,
                "cache_hits_in_varied_runs": hits,
            }
        )
        section.notes += [
            f"each side runs {duration:g} s per row (A-B-B-A halves); q/s = completed queries / wall time;"
            " p50/p99 per query, over all clients.",
            f"dpsql: `{QUERY.format(v='v')}` with a new v per request (result-cache hits seen: {hits});"
            " direct: dpsql's rewritten SQL for the same v, same psycopg clients, autocommit.",
            "dpsql's backend sends each query in one round trip on a read-only session;"
            " server defaults: 8 query threads, 8 PostgreSQL connections per worker process; ledger and result"
            " cache in a second PostgreSQL cluster (shared by the workers);"
            f" worker processes: {', '.join(map(str, WORKERS))}"
            " (SO_REUSEPORT on one port, as `dpsql serve --processes N`).",
            "cached repeat: one fixed query sent over and over, answered from dpsql's result cache at no"
            " privacy cost; direct still executes it"
            + ("" if not misses else f" (WARNING: {len(misses)} row(s) with cache misses)")
            + ".",
            f"client processes, the dpsql server and PostgreSQL all share this machine's {os.cpu_count()} cores,"
            " so at 8+ clients the figures are CPU-bound for both sides.",
        ]
    finally:
        if clients is not None:
            clients.close()
        _stop_servers(servers, log, section)
        ledger_pg.stop()
        pg.stop()
    return section


def _stop_servers(servers: list[subprocess.Popen[bytes]], log: Any, section: Section) -> None:
    for server in servers:
        server.terminate()
    for server in servers:
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        if server.returncode not in (0, -15):
            log.seek(0)
            section.notes.append(f"server exit {server.returncode}: {log.read()[-500:].decode(errors='replace')}")


def run(quick: bool) -> Section:
    """The ``wire`` section; the server's log (a temp file) is quoted only if it exits abnormally."""
    with tempfile.TemporaryFile() as log:
        return _run(quick, log)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "client":
        sys.exit(_client_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        sys.exit(_serve_main(sys.argv[2], int(sys.argv[3]), *sys.argv[4:5]))
    sys.exit("usage: wire.py client DPSQL_DSN PG_DSN INDEX | wire.py serve PG_DSN PORT  (run via bench/run.py)")
