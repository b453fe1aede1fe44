"""Benchmark ``attacks``: one analyst attacks ``dpsql serve``; does another analyst still get answers?

Issue #27's bar: under each attack run by one analyst, another analyst's DP COUNT p50 stays
within 3x its idle p50 measured in the same run, and the server's RSS stays under 1 GB.

Everything runs as separate processes, as in production: the server is ``dpsql serve`` on the
embedded demo (with its shadow catalog), the attacker is ``python bench/attacks.py attack NAME``
(its own process, so its client work never shares the server's GIL), and the victim is this
process. The victim's statement is a DP COUNT with a fresh constant each time (never a cached
repeat) at ε 0.001. For each attack: the victim's p50 idle (just before), its p50 and p99 during
the attack, the ratio, and the server's peak RSS sampled every 50 ms from /proc.

Attacks (issue #27's items): ``big-catalog`` (item 1: one analyst sends ~250 kB free catalog
statements on 8 connections), ``preauth`` (item 3: 210 idle unauthenticated sockets; the victim
opens a new connection per COUNT), ``unread`` (item 2: catalog statements producing 10 MB each,
pipelined on a socket that is never read), ``cursors`` (item 2: 20 cursors over big catalog
results per session, 4 sessions), ``sandbox`` (item 4: post-processing cross joins of released
rows on 4 connections).

Issue #41's attacks run against a second server: the clinic demo (schemas/clinic.yaml) under ``pld``
accounting, SCRAM passwords, its dashboard synopsis built: ``pld-distinct`` (one analyst's DP COUNTs at
distinct ε, 1e-4 + i·1e-9), ``free-in-list`` (a ~168 kB ``department IN (…12,000 constants…)`` as EXPLAIN,
as a LIMIT 0 probe and answered from the synopsis, and a 12,000-float IN list that no domain shrinks, on 4
connections), ``accuracy`` (EXPLAIN under a new ``dpsql.accuracy`` target each time, 4 connections),
``shared-pool`` (three other analysts fill the server's memory with WITH HOLD cursors and leave their
sessions idle; the victim also runs asyncpg's named prepared statements and a catalog query, and counts
refusals), ``shared-login`` (two threads of wrong passwords for the victim's account from its own
address, DPSQL_BENCH_GUESSERS to change; measured twice, alternately: the victim logging in afresh with
the right password per COUNT — every login must succeed, its delay is reported as p50 and max — and
another analyst, carol, doing the same from the same address — p50 ≤ 3× idle; the attacker reports the
guesses checked per minute) and
``preauth-churn`` (256 new silent sockets a second from the victim's address; fresh logins, failures
counted). The bar (issue #41): the victim's p50 ≤ 3× idle, no failed login, no refusal.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

VICTIM, ATTACKER = "alice", "analyst"
#: shared-login: another analyst at the victim's address (its logins must not wait behind the victim's guesser).
OTHER = "carol"
BIG_CATALOG_SQL = (
    "SELECT count(*) FROM pg_catalog.pg_class WHERE relname IN (" + ",".join(f"'r{i:07d}'" for i in range(22_000)) + ")"
)
ATTACKS = ("big-catalog", "preauth", "unread", "cursors", "sandbox")
#: Issue #41's attacks, on the clinic server (pld accounting, passwords, a synopsis).
ROUND3 = ("pld-distinct", "free-in-list", "accuracy", "shared-pool", "preauth-churn", "shared-login")
#: shared-login: the guessing threads (environment DPSQL_BENCH_GUESSERS, default 2).
GUESSERS = int(os.environ.get("DPSQL_BENCH_GUESSERS", "2"))
#: Every analyst of the clinic server logs in with this password.
PASSWORD = "attack-bench"
DEPARTMENTS_IN = ",".join(["'Cardiology'"] + [f"'dep{i:07d}'" for i in range(12_000)])
FLOATS_IN = ",".join(f"{i * 0.0137:.4f}" for i in range(12_000))
SANDBOX_SQL = (
    "SELECT count(*) FROM (SELECT a.n FROM (SELECT age, COUNT(*) AS n FROM patients GROUP BY age) a, "
    "(SELECT age, COUNT(*) AS n FROM patients GROUP BY age) b, "
    "(SELECT age, COUNT(*) AS n FROM patients GROUP BY age) c) x"
)


#: Set by :func:`_use_clinic`: the clinic server's database and password (the attacker process gets them too).
TARGET = {"database": "health", "password": ""}


def _use_clinic() -> None:
    TARGET.update(database="clinic", password=PASSWORD)


def _connect(port: int, user: str) -> Any:
    import psycopg

    password = f":{TARGET['password']}" if TARGET["password"] else ""
    url = f"postgresql://{user}{password}@127.0.0.1:{port}/{TARGET['database']}"
    return psycopg.connect(url, autocommit=True, connect_timeout=30)


def _rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def clinic_policy(home: str) -> str:
    """schemas/clinic.yaml under pld accounting, with SCRAM passwords and two more analysts: its path."""
    from dpsql.server.auth import make_verifier

    text = (ROOT / "schemas" / "clinic.yaml").read_text()
    text = text.replace("budget:\n", "budget:\n  accounting: pld\n", 1).replace(
        "auth: {trust: true}", "auth: {trust: false}"
    )
    verifier = make_verifier(PASSWORD)
    names = ("analyst", "alice", "root", "postgres", "bob", "carol")
    listed = "".join(f"  - name: {n}\n    password: '{verifier}'\n" for n in names)
    start = text.index("analysts:\n") + len("analysts:\n")
    end = text.index("\ntables:")
    path = Path(home) / "clinic.yaml"
    path.write_text(text[:start] + listed + text[end:])
    return str(path)


class Server:
    """``dpsql serve`` on the demo with its shadow catalog, in a throwaway DPSQL_HOME; with ``clinic``, the
    clinic demo under pld accounting with passwords and its synopsis built first."""

    def __init__(self, clinic: bool = False) -> None:
        self.home = tempfile.mkdtemp(prefix="dpsql-attacks-")
        self.port = 0  # the server binds port 0 and says which port it got
        env = {**os.environ, "DPSQL_HOME": self.home, "PYTHONPATH": str(ROOT)}
        policy: list[str] = []
        if clinic:
            policy = ["--policy", clinic_policy(self.home)]
            subprocess.run(
                [sys.executable, "-m", "dpsql.cli", "synopsis", "build", *policy],
                cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
            )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpsql.cli", "serve", "--port", "0", *policy],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if (serving := re.search(r"dpsql serving .* on \S+:(\d+) ", line)) is not None:
                self.port = int(serving.group(1))
                break
        else:
            raise RuntimeError("dpsql serve did not start")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def sampling_rss(pid: int) -> Iterator[list[int]]:
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kb(pid))
            stop.wait(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


_VICTIM_STATEMENTS = [0]


class Victim:
    def __init__(self, port: int, fresh_connection: bool = False, user: str = VICTIM) -> None:
        self.port = port
        self.fresh = fresh_connection
        self.user = user
        self.conn = _connect(port, user)
        self.conn.execute("SET dpsql.epsilon = 0.001")
        #: Continues across victims: a statement of an earlier attack's victim repeated would be a free cache hit.
        self.v = _VICTIM_STATEMENTS[0]
        #: Statements or logins of the victim that failed, by SQLSTATE (the bar: none).
        self.failed: dict[str, int] = {}

    def once(self) -> float:
        self.v += 1
        _VICTIM_STATEMENTS[0] = self.v
        if TARGET["database"] == "clinic":  # within the bounds: a new measurement every time, never reused
            sql = f"SELECT COUNT(*) FROM patients WHERE age > {self.v // 100 % 90} AND zip < {2100 + self.v % 100}"
        else:
            sql = f"SELECT COUNT(*) FROM patients WHERE age > {self.v % 90} AND bmi < {1000 + self.v}"
        started = time.monotonic()
        try:
            if self.fresh:
                with _connect(self.port, self.user) as conn:
                    conn.execute("SET dpsql.epsilon = 0.001")
                    conn.execute(sql).fetchall()
            else:
                self.conn.execute(sql).fetchall()
        except Exception as exc:  # a failed login or a refusal: counted, the bar is none
            state = str(getattr(exc, "sqlstate", None) or type(exc).__name__) + ": " + str(exc).strip()[:80]
            self.failed[state] = self.failed.get(state, 0) + 1
        return time.monotonic() - started

    def prepared_and_catalog(self) -> None:
        """What the shared pool starved in issue #41: asyncpg's named prepared statements and a catalog result."""
        import asyncio

        import asyncpg

        async def run() -> None:
            conn = await asyncpg.connect(
                host="127.0.0.1", port=self.port, user=VICTIM, password=TARGET["password"] or None,
                database=TARGET["database"], ssl=False,
            )  # fmt: skip
            try:
                await conn.execute("SET dpsql.epsilon = 0.001")
                for i in range(5):
                    await conn.fetchval("SELECT COUNT(*) FROM patients WHERE age > $1", i)
                await conn.fetch("SELECT oid, typname, typlen FROM pg_catalog.pg_type LIMIT 200")
            finally:
                await conn.close()

        try:
            asyncio.run(run())
        except Exception as exc:
            state = str(getattr(exc, "sqlstate", None) or type(exc).__name__)
            self.failed[state] = self.failed.get(state, 0) + 1

    def run(self, seconds: float, at_most: int = 400) -> list[float]:
        out: list[float] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(out) < at_most:
            out.append(self.once())
        return out


def measure(server: Server, attack: str, seconds: float) -> dict[str, Any]:
    victim = Victim(server.port, fresh_connection=attack in ("preauth", "shared-login", "preauth-churn"))
    #: shared-login: another analyst logging in afresh from the same address, measured alternately with the victim.
    other = Victim(server.port, fresh_connection=True, user=OTHER) if attack == "shared-login" else None
    runners = [victim] if other is None else [victim, other]
    for who in runners:
        who.run(3.0)  # warm (the first statements after a start load caches)
    idle = {who.user: who.run(min(seconds, 5.0), at_most=60) for who in runners}
    for who in runners:
        who.failed.clear()
    attacker = subprocess.Popen(
        [sys.executable, str(Path(__file__)), "attack", attack, str(server.port), str(seconds + 5), TARGET["database"]],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(5.0 if attack == "shared-pool" else 2.0)  # the attack is under way
    busy: dict[str, list[float]] = {who.user: [] for who in runners}
    with sampling_rss(server.proc.pid) as peak:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(busy[victim.user]) < 400:
            for who in runners:
                busy[who.user].append(who.once())
        if attack == "shared-pool":
            victim.prepared_and_catalog()
    attacker.wait(120)
    out = attacker.stdout.read().strip() if attacker.stdout else ""
    result = {"attack": attack, "peak_rss_mb": round(peak[0] / 1024), "attacker": out[-300:]}
    for who in runners:
        who.conn.close()
        p50_idle, p50_busy, times = statistics.median(idle[who.user]), statistics.median(busy[who.user]), busy[who.user]
        result[who.user] = {
            "idle_p50_ms": round(p50_idle * 1000, 2),
            "busy_p50_ms": round(p50_busy * 1000, 2),
            "busy_p99_ms": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1000, 1),
            "busy_max_ms": round(max(times) * 1000, 1),
            "ratio": round(p50_busy / p50_idle, 2),
            "n": len(times),
            "failed": dict(who.failed),
        }
    result.update(result[victim.user])
    return result


# --- the attacker process ---------------------------------------------------------------------


def _loop(seconds: float, fn: Callable[[], Any]) -> int:
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            fn()
        except Exception as exc:  # refusals are part of the attack's outcome
            errors[type(exc).__name__ + ":" + str(getattr(exc, "sqlstate", ""))] = (
                errors.get(type(exc).__name__ + ":" + str(getattr(exc, "sqlstate", "")), 0) + 1
            )
        done += 1
    return done


errors: dict[str, int] = {}


def _threads(n: int, target: Callable[[], Any]) -> None:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _startup(user: str) -> bytes:
    body = struct.pack("!I", 196608) + b"user\0" + user.encode() + b"\0database\0health\0\0"
    return struct.pack("!I", len(body) + 4) + body


def _query(sql: str) -> bytes:
    body = sql.encode() + b"\0"
    return b"Q" + struct.pack("!I", len(body) + 4) + body


def attack(name: str, port: int, seconds: float) -> None:
    if name == "big-catalog":

        def big() -> None:
            with _connect(port, ATTACKER) as conn:
                _loop(seconds, lambda: conn.execute(BIG_CATALOG_SQL).fetchall())

        _threads(8, big)
    elif name == "preauth":
        socks = []
        for _ in range(210):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(seconds)
        for s in socks:
            s.close()
    elif name == "unread":
        socks = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(socks) < 8:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(_startup(ATTACKER))
            s.settimeout(0.5)
            batch = _query(";".join(["SELECT lpad('x', 10000000, 'y')"] * 50))
            with contextlib.suppress(OSError):
                for _ in range(40):  # pipelined, never read
                    s.sendall(batch)
            socks.append(s)
        time.sleep(max(0.0, deadline - time.monotonic()))
        for s in socks:
            s.close()
    elif name == "cursors":

        def cursors() -> None:
            with _connect(port, ATTACKER) as conn:

                def fill() -> None:
                    conn.execute("BEGIN")
                    for i in range(20):
                        conn.execute(
                            f"DECLARE c{i} CURSOR FOR SELECT lpad('x', 1000000, 'y') FROM generate_series(1, 30)"
                        )
                    time.sleep(1.0)
                    conn.execute("ROLLBACK")

                _loop(seconds, fill)

        _threads(4, cursors)
    elif name in ROUND3:
        round3(name, port, seconds)
    elif name == "sandbox":

        def sandbox() -> None:
            with _connect(port, ATTACKER) as conn:
                conn.execute("SET statement_timeout = '20s'")
                _loop(seconds, lambda: conn.execute(SANDBOX_SQL).fetchall())

        _threads(4, sandbox)
    else:
        raise SystemExit(f"unknown attack {name}")
    print(f"errors {errors}")


def round3(name: str, port: int, seconds: float) -> None:
    """Issue #41's attacks (the clinic server)."""
    if name == "pld-distinct":

        def distinct(n: int) -> None:
            with _connect(port, ATTACKER) as conn:
                i = [0]

                def once() -> None:
                    i[0] += 1
                    conn.execute(f"SET dpsql.epsilon = {1e-4 + (n * 100_000 + i[0]) * 1e-9!r}")
                    conn.execute(f"SELECT COUNT(*) FROM visits WHERE cost > {i[0] % 1000}").fetchall()

                _loop(seconds, once)

        _threads(2, lambda: distinct(threading.get_ident() % 97))
    elif name == "free-in-list":
        statements = [
            f"EXPLAIN SELECT COUNT(*) FROM visits WHERE department IN ({DEPARTMENTS_IN})",
            f"SELECT COUNT(*) FROM visits WHERE department IN ({DEPARTMENTS_IN}) LIMIT 0",
            f"SELECT department, COUNT(*) FROM visits WHERE department IN ({DEPARTMENTS_IN}) GROUP BY department",
            f"EXPLAIN SELECT COUNT(*) FROM visits WHERE cost IN ({FLOATS_IN})",
        ]

        def free() -> None:
            with _connect(port, ATTACKER) as conn:
                i = [0]

                def once() -> None:
                    i[0] += 1
                    conn.execute(statements[i[0] % len(statements)]).fetchall()

                _loop(seconds, once)

        _threads(4, free)
    elif name == "accuracy":

        def bisect() -> None:
            with _connect(port, ATTACKER) as conn:
                i = [threading.get_ident() % 1000 * 1000]

                def once() -> None:
                    i[0] += 1
                    conn.execute(f"SET dpsql.accuracy = '±{10000 + i[0]}'")
                    conn.execute("EXPLAIN SELECT department, COUNT(*), SUM(cost) FROM visits GROUP BY department")

                _loop(seconds, once)

        _threads(4, bisect)
    elif name == "shared-pool":

        def hold(user: str) -> None:
            with _connect(port, user) as conn:
                with contextlib.suppress(Exception):
                    for i in range(400):  # WITH HOLD: kept after the transaction, in an idle session
                        conn.execute(
                            f"DECLARE h{i} CURSOR WITH HOLD FOR SELECT lpad('x', 1000000, 'y') "
                            "FROM generate_series(1, 30)"
                        )
                time.sleep(seconds)

        threads = [threading.Thread(target=hold, args=(u,), daemon=True) for u in ("analyst", "bob", "carol")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif name == "shared-login":
        import psycopg

        started = time.monotonic()

        def guess() -> None:
            n = [0]

            def once() -> None:
                n[0] += 1
                try:
                    psycopg.connect(
                        f"postgresql://{VICTIM}:wrong-{n[0]}@127.0.0.1:{port}/clinic", connect_timeout=30
                    ).close()
                except psycopg.Error as exc:  # a checked guess says so; anything else was refused unchecked
                    outcome = "checked" if "password authentication failed" in str(exc) else "refused"
                    errors[outcome] = errors.get(outcome, 0) + 1

            _loop(seconds, once)

        _threads(GUESSERS, guess)
        minutes = (time.monotonic() - started) / 60
        print(f"{GUESSERS} guessers: {errors.get('checked', 0) / minutes:.0f} guesses checked per minute; ", end="")
    elif name == "preauth-churn":
        opened: list[socket.socket] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for _ in range(16):
                with contextlib.suppress(OSError):
                    opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            while len(opened) > 300:
                opened.pop(0).close()
            time.sleep(1 / 16)
        for s in opened:
            s.close()


def run(quick: bool = False, attacks: tuple[str, ...] = ATTACKS + ROUND3) -> Any:
    from common import Section

    seconds = 10.0 if quick else 20.0
    section = Section(
        "attacks",
        "one analyst attacks, another's DP COUNT p50 (bar: within 3x idle; server RSS under 1 GB)",
        ["attack", "idle p50 ms", "attacked p50 ms", "p99 ms", "max ms", "ratio", "peak RSS MB", "n", "failed"],
    )
    for clinic, names in ((False, [a for a in attacks if a in ATTACKS]), (True, [a for a in attacks if a in ROUND3])):
        if not names:
            continue
        if clinic:
            _use_clinic()
        server = Server(clinic=clinic)
        try:
            for name in names:
                result = measure(server, name, seconds)
                for user in (VICTIM, OTHER):
                    if user not in result:
                        continue
                    who = result[user]
                    label = name if user == VICTIM else f"{name} ({OTHER}, same address)"
                    if name == "shared-login" and user == VICTIM:
                        label = f"{name} (the guessed {VICTIM}'s own logins)"
                    section.rows.append(
                        [label, who["idle_p50_ms"], who["busy_p50_ms"], who["busy_p99_ms"], who["busy_max_ms"],
                         who["ratio"], result["peak_rss_mb"], who["n"], sum(who["failed"].values())]
                    )  # fmt: skip
                    if who["failed"]:
                        section.notes.append(f"{label}: failed {who['failed']}")
                section.data[name] = result
                section.notes.append(f"{name}: attacker {result['attacker']}")
        finally:
            server.stop()
    return section


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        if len(sys.argv) > 5 and sys.argv[5] == "clinic":
            _use_clinic()
        attack(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        chosen = tuple(a for a in sys.argv[1:] if a in ATTACKS + ROUND3) or ATTACKS + ROUND3
        run("--quick" in sys.argv, chosen).print()
