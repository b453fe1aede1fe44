"""Wire-protocol fuzzing of a real ``dpsql serve`` process: it must survive anything a socket can send.

Each case opens a raw TCP connection and sends random or mutated protocol-v3 traffic: garbage before
the startup packet, mutated startup packets, a valid startup followed by mutated Parse/Bind/Describe/
Execute/Query/... frames (bit flips, truncations, wrong and huge lengths, random types, trailing
junk), binary Bind parameters of every supported type with random bytes, and nasty SQL. Meanwhile
slow-loris sockets hold partial frames open, and a burst opens hundreds of connections at once.

Afterwards the server process must be alive, still answer a DP query from a fresh psycopg
connection, have a bounded RSS, and its log must hold no Python traceback (an exception that
escaped the protocol/engine error handling). Frames come from a seeded PRNG (test input, not
noise), so a failing case is reproducible from its number: ``case_bytes(seed, n)``.
"""

from __future__ import annotations

import os
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.trust.serverproc import ServerProcess, start_server, write_policy

SEED = 20240611
DEFAULT_CASES = int(os.environ.get("DPSQL_FUZZ_CASES", "2000"))
HEAVY_CASES = 50_000
THREADS = 12
READ_TIMEOUT = 15.0  # no case may leave the server silent for this long after we half-close

#: Tracebacks of known open bugs to exclude from the scan, as (substring, ...) signatures. None are
#: open: the three this fuzzer found are fixed and pinned by the regression tests at the end.
KNOWN_BUG_SIGNATURES: tuple[tuple[str, ...], ...] = ()

SQLS = (
    "SELECT COUNT(*) FROM patients",
    "SELECT COUNT(*) FROM patients WHERE age > $1",
    "SELECT sex, AVG(bmi) FROM patients WHERE dob > $1 GROUP BY sex",
    "SELECT SUM(visits) FROM patients WHERE zip = $1 AND bmi < $2",
    "SELECT problem, COUNT(*) FROM patients WHERE age BETWEEN $1 AND $2 GROUP BY problem",
    "SELECT median(age) FROM patients WHERE sex = $1",
    "SELECT COUNT(*) FROM patients WHERE dob < $1 AND bmi > $2 AND visits = $3",
    "SELECT 1",
    "SELECT $1::int + 1",
    "SET dpsql.epsilon = 0.01",
    "SET dpsql.show_intervals = on",
    "SHOW dpsql.epsilon",
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "EXPLAIN SELECT AVG(age) FROM patients",
    "SELECT * FROM patients",
    "SELECT name FROM patients",
    "DROP TABLE patients",
    "SELECT relname FROM pg_class",
    "SELECT COUNT(*) FROM patients; SELECT 1",
    "",
    ";;",
)
#: Parameter type OIDs: every type the server decodes, plus unknown and absurd ones.
OIDS = (0, 16, 17, 19, 20, 21, 23, 25, 26, 700, 701, 705, 1042, 1043, 1082, 1114, 1184, 1700, 2950, 4294967295)
SIZES = {16: 1, 20: 8, 21: 2, 23: 4, 26: 4, 700: 4, 701: 8, 1082: 4, 1114: 8, 1184: 8}


# --- frame building ---------------------------------------------------------------------------------


def frame(type_: bytes, payload: bytes) -> bytes:
    return type_ + struct.pack("!i", len(payload) + 4) + payload


def cstr(text: str | bytes) -> bytes:
    return (text.encode() if isinstance(text, str) else text) + b"\0"


def startup(user: str = "analyst", **params: str) -> bytes:
    body = struct.pack("!i", 196608) + b"".join(cstr(k) + cstr(v) for k, v in {"user": user, **params}.items())
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


def _param_value(rng: random.Random, oid: int, fmt: int) -> bytes | None:
    roll = rng.random()
    if roll < 0.1:
        return None
    if fmt == 1:
        size = SIZES.get(oid, rng.randrange(0, 24))
        if roll < 0.2:
            size = rng.randrange(0, 12)  # wrong size for the type
        return rng.randbytes(size)
    texts = ["42", "-1", "1e308", "NaN", "Infinity", "2000-01-01", "99999-12-31", "true", "x", "", "1.5", "\u00e9"]
    return rng.choice(texts).encode() if roll < 0.9 else rng.randbytes(rng.randrange(0, 16))


def valid_frame(rng: random.Random) -> bytes:
    """One well-formed frontend message with random content."""
    kind = rng.choice("QQPPBBBDEESHCXdFp")
    sql = rng.choice(SQLS)
    name = rng.choice(["", "", "s1", "s2"])
    if kind == "Q":
        return frame(b"Q", cstr(sql))
    if kind == "P":
        oids = [rng.choice(OIDS) for _ in range(rng.randrange(0, 4))]
        return frame(
            b"P", cstr(name) + cstr(sql) + struct.pack("!h", len(oids)) + b"".join(struct.pack("!I", o) for o in oids)
        )
    if kind == "B":
        n = rng.randrange(0, 4)
        formats = [rng.choice((0, 1)) for _ in range(rng.choice((0, 1, n)))]
        body = cstr(rng.choice(["", "p1"])) + cstr(name) + struct.pack("!h", len(formats))
        body += b"".join(struct.pack("!h", f) for f in formats) + struct.pack("!h", n)
        for i in range(n):
            fmt = formats[0] if len(formats) == 1 else formats[i] if len(formats) == n and n else 0
            value = _param_value(rng, rng.choice(OIDS), fmt)
            body += struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value
        results = [rng.choice((0, 1)) for _ in range(rng.choice((0, 1, 2)))]
        body += struct.pack("!h", len(results)) + b"".join(struct.pack("!h", f) for f in results)
        return frame(b"B", body)
    if kind == "D":
        return frame(b"D", rng.choice([b"S", b"P"]) + cstr(rng.choice(["", "s1", "p1"])))
    if kind == "E":
        return frame(b"E", cstr(rng.choice(["", "p1"])) + struct.pack("!i", rng.choice([0, 1, -1, 2**31 - 1])))
    if kind == "C":
        return frame(b"C", rng.choice([b"S", b"P"]) + cstr(name))
    if kind in "SHX":
        return frame(kind.encode(), b"")
    return frame(kind.encode(), rng.randbytes(rng.randrange(0, 32)))  # CopyData, FunctionCall, password


def typed_bind_sequence(rng: random.Random) -> bytes:
    """Parse with declared parameter types, then Bind binary/text values of those types, Execute, Sync."""
    n = rng.randrange(1, 4)
    oids = [rng.choice(OIDS) for _ in range(n)]
    sql = "SELECT COUNT(*) FROM patients WHERE " + " AND ".join(
        f"{col} > ${i + 1}" for i, col in enumerate(rng.choice(["age", "bmi", "dob", "zip", "visits"]) for _ in oids)
    )
    out = frame(b"P", cstr("") + cstr(sql) + struct.pack("!h", n) + b"".join(struct.pack("!I", o) for o in oids))
    fmt = rng.choice((0, 1))
    body = cstr("") + cstr("") + struct.pack("!hh", 1, fmt) + struct.pack("!h", n)
    for oid in oids:
        value = _param_value(rng, oid, fmt)
        body += struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value
    body += struct.pack("!hh", 1, rng.choice((0, 1)))
    return out + frame(b"B", body) + frame(b"D", b"P\0") + frame(b"E", b"\0" + struct.pack("!i", 0)) + frame(b"S", b"")


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    op = rng.randrange(8)
    if op == 0 and buf:  # bit flips
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:  # truncation
        del buf[rng.randrange(len(buf)) :]
    elif op == 2 and len(buf) >= 5:  # wrong length field
        length = rng.choice([0, 1, 3, 4, -1, -(2**31), len(buf), len(buf) - 2, len(buf) + 7, 1 << 20, 2**31 - 1])
        buf[1:5] = struct.pack("!i", length)
    elif op == 3 and buf:  # random type byte
        buf[0] = rng.randrange(256)
    elif op == 4 and len(buf) >= 5:  # trailing junk counted in the length
        buf += rng.randbytes(rng.randrange(1, 20))
        buf[1:5] = struct.pack("!i", len(buf) - 1)
    elif op == 5:  # random bytes inserted
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randrange(1, 16))
    elif op == 6 and len(buf) > 5:  # random overwrite of the payload
        i = rng.randrange(5, len(buf))
        buf[i : i + 4] = rng.randbytes(4)
    else:  # duplicate
        buf += bytes(buf)
    return bytes(buf)


def nasty_sql(rng: random.Random) -> bytes:
    choice = rng.randrange(5)
    if choice == 0:
        depth = rng.choice([200, 1000, 3000])
        sql = "SELECT COUNT(*) FROM patients WHERE " + "(" * depth + "age > 1" + ")" * depth
    elif choice == 1:
        sql = "SELECT COUNT(*) FROM patients WHERE zip IN (" + ",".join(str(i) for i in range(5000)) + ")"
    elif choice == 2:
        sql = "SELECT COUNT(*) FROM patients WHERE name = '" + "x" * 300_000 + "'"
    elif choice == 3:
        sql = "SELECT " + " + ".join(["COUNT(*)"] * 500) + " FROM patients"
    else:
        sql = "SELECT COUNT(*) FROM patients WHERE " + " OR ".join(f"age = {i}" for i in range(2000))
    return frame(b"Q", cstr(sql))


def case_bytes(seed: int, n: int) -> tuple[str, bytes]:
    """The (kind, bytes) of case ``n``: deterministic, so any failure can be replayed alone."""
    rng = random.Random(seed * 1_000_003 + n)
    roll = rng.random()
    if roll < 0.08:
        return "garbage", rng.randbytes(rng.randrange(0, 300))
    if roll < 0.16:
        packet = rng.choice([startup(), struct.pack("!ii", 8, 80877103), struct.pack("!iiii", 16, 80877102, 1001, 5)])
        return "startup", mutate(rng, packet) + rng.choice([b"", valid_frame(rng)])
    if roll < 0.20:
        length = rng.choice([(1 << 20) - 8, (1 << 20) + 1, 2**31 - 1, -5, 1 << 30])
        return "huge", startup() + rng.choice(b"QPBX").to_bytes(1, "big") + struct.pack("!i", length) + rng.randbytes(
            rng.randrange(0, 4096)
        )
    if roll < 0.22:
        return "nasty_sql", startup() + nasty_sql(rng)
    if roll < 0.35:
        return "typed_bind", startup() + typed_bind_sequence(rng)
    if roll < 0.45:
        return "valid", startup() + b"".join(valid_frame(rng) for _ in range(rng.randrange(1, 8)))
    frames = [valid_frame(rng) for _ in range(rng.randrange(1, 7))]
    frames = [mutate(rng, f) if rng.random() < 0.5 else f for f in frames]
    return "mutated", startup() + b"".join(frames) + frame(b"S", b"")


# --- running cases ----------------------------------------------------------------------------------


@dataclass
class Stats:
    cases: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    sqlstates: Counter[str] = field(default_factory=Counter)
    hangs: list[int] = field(default_factory=list)
    malformed_replies: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def parse_reply(data: bytes) -> list[str] | None:
    """SQLSTATEs of the ErrorResponses in a server reply; None when the reply is not well-framed.

    Single-byte 'N'/'S' answers to SSLRequest/GSSENCRequest packets may precede the framed messages
    (one per request: the fuzzer sometimes repeats them).
    """
    pos, states, framed = 0, [], False
    while pos < len(data):
        type_ = data[pos : pos + 1]
        length = struct.unpack("!i", data[pos + 1 : pos + 5])[0] if len(data) - pos >= 5 else -1
        if length < 4 or pos + 1 + length > len(data):
            if not framed and type_ in (b"N", b"S"):
                pos += 1
                continue
            return None
        framed = True
        if type_ == b"E":
            match = re.search(rb"C([0-9A-Z]{5})\0", data[pos + 5 : pos + 1 + length])
            states.append(match.group(1).decode() if match else "?????")
        pos += 1 + length
    return states


def run_case(port: int, seed: int, n: int, stats: Stats) -> None:
    kind, payload = case_bytes(seed, n)
    reply = bytearray()
    hung = False
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may close first (FATAL on an early bad frame): that is fine
            deadline = time.monotonic() + READ_TIMEOUT
            while True:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    hung = True
                    break
                except OSError:
                    break
                if not chunk:
                    break
                reply += chunk
                if time.monotonic() > deadline:
                    hung = True
                    break
    except OSError:
        pass
    states = parse_reply(bytes(reply))
    with stats.lock:
        stats.cases += 1
        stats.kinds[kind] += 1
        if hung:
            stats.hangs.append(n)
        if states is None:
            stats.malformed_replies.append(n)
        else:
            stats.sqlstates.update(states)


def hold_slow_loris(port: int, count: int) -> list[socket.socket]:
    """Sockets that stop mid-frame: partial startup packets and, after startup, partial messages."""
    socks = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 3 == 0:
            sock.sendall(startup()[:3])
        elif i % 3 == 1:
            sock.sendall(startup()[:11])
        else:
            sock.sendall(startup() + frame(b"Q", cstr("SELECT COUNT(*) FROM patients"))[:9])
        socks.append(sock)
    return socks


def drip_startup(port: int, delay: float) -> bool:
    """A legitimate but very slow client (one byte per ``delay``) still gets served."""
    data = startup() + frame(b"Q", cstr("SELECT 1")) + frame(b"X", b"")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for i in range(len(data)):
            sock.sendall(data[i : i + 1])
            time.sleep(delay)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return b"Z" in reply and b"T" in reply and parse_reply(reply) == []


def burst(port: int, count: int) -> int:
    """Open ``count`` connections at once, then run SELECT 1 on all; returns how many got their answer."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(startup() + frame(b"Q", cstr("SELECT 1")) + frame(b"X", b""))
        ok = 0
        for sock in socks:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            ok += reply.count(b"Z\0\0\0\x05I") == 2
        return ok
    finally:
        for sock in socks:
            sock.close()


def fuzz(server: ServerProcess, cases: int, seed: int = SEED) -> Stats:
    stats = Stats()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda n: run_case(server.port, seed, n, stats), range(cases)))
    return stats


# --- fixtures and checks ----------------------------------------------------------------------------


@pytest.fixture
def fuzz_server(tmp_path: Path) -> Iterator[ServerProcess]:
    # the burst opens 300 sessions of one analyst at once: above the default connection caps
    caps = ("--max-connections", "400", "--max-connections-per-analyst", "400")
    server = start_server(write_policy(tmp_path), tmp_path / "ledger.sqlite", tmp_path / "server.log", extra_args=caps)
    try:
        yield server
    finally:
        server.stop()


def baseline_rss(server: ServerProcess) -> int:
    with server.connect() as conn:  # warm up: first engine query, first noise draws
        conn.execute("SELECT COUNT(*) FROM patients WHERE age > 30").fetchall()
    return server.rss_kib()


def tracebacks(log: str) -> tuple[list[str], int]:
    """(tracebacks of unknown cause, number of tracebacks of known pinned bugs) in a server log."""
    blocks = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*.*", log)
    known = [b for b in blocks if any(all(part in b for part in sig) for sig in KNOWN_BUG_SIGNATURES)]
    return [b for b in blocks if b not in known], len(known)


def assert_healthy(server: ServerProcess, rss_before: int) -> tuple[int, int]:
    assert server.alive(), f"server died:\n{server.log_text()[-4000:]}"
    with server.connect() as conn:
        rows = conn.execute("SELECT COUNT(*) FROM patients WHERE visits > 7").fetchall()
    assert len(rows) == 1 and isinstance(rows[0][0], int)
    rss = server.rss_kib()
    assert rss < 2 * rss_before + 100 * 1024, f"RSS grew from {rss_before} KiB to {rss} KiB"
    escaped, known = tracebacks(server.log_text())
    assert not escaped, f"{len(escaped)} exception(s) escaped; first:\n{escaped[0][:3000]}"
    return rss, known


def _run_campaign(server: ServerProcess, cases: int) -> None:
    rss_before = baseline_rss(server)
    loris = hold_slow_loris(server.port, 60)
    started = time.monotonic()
    try:
        drip = ThreadPoolExecutor(1).submit(drip_startup, server.port, 0.02)
        stats = fuzz(server, cases)
        answered = burst(server.port, 300)
        assert drip.result(timeout=60), "a slow (one byte at a time) client was not served"
    finally:
        for sock in loris:
            sock.close()
    elapsed = time.monotonic() - started
    rss_after, known = assert_healthy(server, rss_before)
    print(
        f"\nwire fuzz: {stats.cases} cases in {elapsed:.1f}s {dict(stats.kinds)}; 60 slow-loris sockets; "
        f"burst of 300 connections, {answered} answered; RSS {rss_before} -> {rss_after} KiB; "
        f"SQLSTATEs {dict(stats.sqlstates.most_common(12))}; {known} internal errors of known pinned bugs"
    )
    assert stats.cases == cases
    assert answered == 300
    assert not stats.hangs, f"cases left hanging (no reply/EOF in {READ_TIMEOUT}s): {stats.hangs[:20]}"
    assert not stats.malformed_replies, f"malformed server replies for cases {stats.malformed_replies[:20]}"
    assert stats.sqlstates["XX000"] <= known, "internal errors (XX000) other than the known bugs reached clients"


@pytest.mark.exclusive
def test_wire_fuzz(fuzz_server: ServerProcess) -> None:
    _run_campaign(fuzz_server, DEFAULT_CASES)


@pytest.mark.exclusive
@pytest.mark.heavy
def test_wire_fuzz_heavy(fuzz_server: ServerProcess) -> None:
    _run_campaign(fuzz_server, HEAVY_CASES)


# --- pinned bugs found by this fuzzer --------------------------------------------------------------


def _extended_reply(port: int, sql: str, oid: int, value: bytes) -> list[str] | None:
    msg = startup() + frame(b"P", cstr("") + cstr(sql) + struct.pack("!hI", 1, oid))
    binary_param = struct.pack("!hh", 1, 1) + struct.pack("!hi", 1, len(value)) + value + struct.pack("!h", 0)
    msg += frame(b"B", cstr("") + cstr("") + binary_param)
    msg += frame(b"E", cstr("") + struct.pack("!i", 0)) + frame(b"S", b"") + frame(b"X", b"")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(msg)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return parse_reply(reply)


def test_binary_date_parameter_out_of_range_is_a_data_error(fuzz_server: ServerProcess) -> None:
    sql = "SELECT COUNT(*) FROM patients WHERE dob > $1"
    for oid, value in (
        (1082, struct.pack("!i", 2**31 - 1)),
        (1082, struct.pack("!i", 3_000_000)),
        (1114, struct.pack("!q", 2**62)),
    ):
        assert _extended_reply(fuzz_server.port, sql, oid, value) in (["22008"], ["22P03"]), oid


def test_deeply_nested_sql_is_refused_as_too_complex(fuzz_server: ServerProcess) -> None:
    import psycopg

    sql = "SELECT COUNT(*) FROM patients WHERE " + "(" * 1000 + "age > 1" + ")" * 1000
    with fuzz_server.connect() as conn, pytest.raises(psycopg.Error) as info:
        conn.execute(sql)
    assert info.value.sqlstate == "54001"


def test_numeric_nan_parameter_is_a_data_error(fuzz_server: ServerProcess) -> None:
    sql = "SELECT COUNT(*) FROM patients WHERE bmi > $1"
    msg = startup() + frame(b"P", cstr("") + cstr(sql) + struct.pack("!hI", 1, 1700))
    msg += frame(b"B", cstr("") + cstr("") + struct.pack("!hhi", 0, 1, 3) + b"NaN" + struct.pack("!h", 0))
    msg += frame(b"E", cstr("") + struct.pack("!i", 0)) + frame(b"S", b"") + frame(b"X", b"")
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=30) as sock:
        sock.sendall(msg)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    states = parse_reply(reply)
    assert states is not None and len(states) == 1 and states[0].startswith("22"), states
