"""Issue #41 item 3: wrong passwords from the analyst's own address never lock the analyst out.

The round-2 limiter locked the (account, address) pair: two threads of wrong passwords for the analyst from
127.0.0.1 (another local user, a NAT, every client behind a TCP load balancer) made 29 of the analyst's 30
logins fail in 30 s. Now the pair is slowed down instead: its exchanges take turns, each answered no sooner
than the pair's delay, success or failure alike; a correct SCRAM exchange is never refused. The guesser
still gets few answers: at most one per delay from that address.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import asyncpg
import pytest

from dpsql.engine import Engine
from dpsql.server import ThreadedServer
from tests.server.conftest import PASSWORD, Running, open_engine


@pytest.fixture(scope="module")
def scram_engine() -> Iterator[Engine]:
    engine = open_engine(trust=False)
    try:
        yield engine
    finally:
        engine.close()


def _login(running: Running, password: str) -> str | None:
    async def attempt() -> str | None:
        try:
            conn = await asyncpg.connect(
                host=running.host, port=running.port, user="scram", password=password, database="health", ssl=False,
                timeout=60,
            )  # fmt: skip
        except asyncpg.PostgresError as exc:
            return str(exc.sqlstate)
        await conn.close()
        return None

    return asyncio.run(attempt())


def test_two_guessing_threads_on_the_same_address_lock_nobody_out(scram_engine: Engine) -> None:
    server = ThreadedServer(scram_engine, catalog_dsn="")
    running = Running(server.host, server.port, scram_engine)
    stop = threading.Event()
    guesses: list[str | None] = []

    def guess() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            guesses.append(_login(running, f"wrong-{threading.get_ident()}-{n}"))

    attackers = [threading.Thread(target=guess) for _ in range(2)]
    for thread in attackers:
        thread.start()
    real: list[tuple[str | None, float]] = []
    try:
        time.sleep(3.0)  # the pair is slowed down by now
        deadline = time.monotonic() + 15  # turns of the longest delay (4 s); the lockout failed 29 of 30 in 30 s
        while time.monotonic() < deadline:
            started = time.monotonic()
            real.append((_login(running, PASSWORD), time.monotonic() - started))
    finally:
        stop.set()
        for thread in attackers:
            thread.join(60)
        server.stop()
    states = [state for state, _ in real]
    print(f"\nreal logins: {len(real)}, slowest {max(t for _, t in real):.1f} s; guesses answered: {len(guesses)}")
    assert states and all(state is None for state in states), states  # never refused
    assert max(t for _, t in real) < 20  # a short delay: the guesses queued before it, a few seconds each
    assert set(guesses) <= {"28P01"}
    assert len(guesses) <= 5 + 35  # at most one answer per delay (1, 2, then 4 s) once slowed down
