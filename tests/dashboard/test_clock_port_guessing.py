"""Round 3 of the dashboard audit: a hand-written time without offset, a taken port, and the account's
slow-down against guesses from rotating addresses (doubling up to a minute, never a queue).

Timing assertions are lower bounds or generous upper bounds only (a shared 2-core machine); the hour of
guessing runs on a simulated clock.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dpsql.dashboard import auth
from dpsql.ledger import Cost
from dpsql.server.auth import Verifier, make_verifier
from tests.dashboard.conftest import PASSWORD, POLICY_ARGS, ROOT, Live
from tests.dashboard.test_hostile_clients import _login

# --- C: stored times without a UTC offset --------------------------------------------------------------


def test_pages_survive_a_charge_time_without_offset(live: Live) -> None:
    """A charge row inserted by hand with a naive ``at`` (and one that is no time at all) next to dpsql's own:
    /spend compared them and failed with 500; naive times now read as UTC."""
    live.ledger.reserve(
        dataset="health",
        analyst="alice",
        cost=Cost(0.5),
        dataset_budget=live.policy.budget.dataset,
        analyst_budget=live.policy.analyst_budget("alice"),
        fingerprint="f",
    )
    with live.ledger._append() as execute:
        execute("DROP TRIGGER IF EXISTS dpsql_ledger_sums", ())  # a hand with the file: a bare row
        execute(
            "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting) "
            "VALUES ('2026-01-01T00:00:00', 'health', 'bob', 'x', 0.1, 0, 0, 'pure')",
            (),
        )
        execute(
            "INSERT INTO dpsql_audit (at, dataset, analyst, fingerprint, shape, outcome, sqlstate, epsilon, delta, "
            "rho, latency_ms) "
            "VALUES ('not a time', 'health', 'carol', 'f', 'SELECT 1', 'refused', '42501', 0, 0, 0, 1)",
            (),
        )
    _, _, cookies = live.login()
    for path in ("/", "/spend", "/audit"):
        response, body = live.request("GET", path, cookies=cookies)
        assert response.status == 200, (path, body[:300])


# --- E: the port is taken --------------------------------------------------------------------------------


def test_a_taken_port_is_one_clean_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path), auth.ENV_PASSWORD: PASSWORD}
        done = subprocess.run(
            [sys.executable, "-m", "dpsql.cli", "dashboard", "--port", str(port), *POLICY_ARGS],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert f"ERROR:  could not listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "HINT:  Is another dashboard running there? Choose another with --port." in done.stderr


# --- F: the account's slow-down doubles up to a minute -------------------------------------------------


class _Clock:
    """A simulated monotonic clock: ``sleep`` moves it on, nothing really waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_hour_of_rotating_guesses_gets_about_sixty_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit item 7: guesses from a fresh address each time got a check every 5 s (~720 an hour). The
    spacing now doubles per failure up to SLOWDOWN_MAX_S: at most ~70 checks in the first hour (the free
    ones and the ramp), at most 61 in each hour after; the curator's device cookie is never slowed."""
    clock = _Clock()
    monkeypatch.setattr(time, "monotonic", clock.monotonic)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    monkeypatch.setattr(auth, "password_matches", lambda verifier, password: password == PASSWORD)
    curator = auth.Curator(Verifier.parse(make_verifier(PASSWORD)))
    assert auth.SLOWDOWN_MAX_S == 60.0
    start, checks, waits = clock.now, [], []
    i = 0
    while clock.now < start + 2 * 3600:
        before = clock.now
        assert curator.login(f"127.0.{1 + i // 250 % 250}.{1 + i % 250}", f"guess {i}") is None
        waits.append(clock.now - before)
        checks.append(clock.now)
        i += 1
    first = sum(1 for t in checks if t < start + 3600)
    second = len(checks) - first
    assert first <= 5 + 7 + 60, first
    assert second <= 61, second
    assert max(waits) == auth.SLOWDOWN_MAX_S
    assert waits[6:12] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]  # 5 free, one unslowed turn, then doubling
    # the curator's browser (device cookie) is never slowed, and the right password works without it
    before = clock.now
    assert curator.login("127.0.0.1", PASSWORD, device="dev") is not None
    assert clock.now == before
    assert curator.login("127.0.0.2", PASSWORD) is not None  # waited its turn (≤ a minute), then in
    assert clock.now - before <= auth.SLOWDOWN_MAX_S


def test_no_queue_behind_a_booked_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent guesses cannot pile up sleeping requests (each would hold a connection): when the next
    free turn is more than SLOWDOWN_MAX_S away the attempt is refused at once, unchecked and uncounted."""
    clock = _Clock()
    monkeypatch.setattr(time, "monotonic", clock.monotonic)
    curator = auth.Curator(Verifier.parse(make_verifier(PASSWORD)))
    for _ in range(auth.ACCOUNT_FREE_FAILURES + 8):
        curator._account.append(clock.now)
    first = curator.slowdown()
    second = curator.slowdown()
    assert first == 0.0 and second == auth.SLOWDOWN_MAX_S
    assert curator.slowdown() is None  # booked up: 429, no check
    with pytest.raises(auth.SlowedDown):
        curator.login("127.0.3.3", "guess")
    assert len(curator._account) == auth.ACCOUNT_FREE_FAILURES + 8


@pytest.fixture
def quick_doubling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "SLOWDOWN_STEP_S", 0.1)
    monkeypatch.setattr(auth, "SLOWDOWN_MAX_S", 0.8)


def test_over_http_concurrent_guesses_get_429_and_the_device_is_not_slowed(live: Live, quick_doubling: None) -> None:
    """Real sockets: a curator logs in (device cookie); a stranger fails from rotating addresses until checks
    are spaced out, then sends a burst at once: the surplus gets 429 (53400) at once instead of queueing,
    and the curator's browser still logs in immediately."""
    status, _, jar = _login(live, PASSWORD, "127.0.0.1")
    assert status == 303
    device = {"dpsql_device": jar["dpsql_device"]}
    for i in range(auth.ACCOUNT_FREE_FAILURES + 4):
        assert _login(live, "stranger", f"127.0.7.{i + 1}")[0] == 401
    results: list[tuple[int, str]] = []

    def guess(n: int) -> None:
        status, body, _ = _login(live, "stranger", f"127.0.8.{n + 1}")
        results.append((status, body))

    burst = [threading.Thread(target=guess, args=(n,)) for n in range(6)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(60)
    statuses = sorted(s for s, _ in results)
    assert 429 in statuses and statuses.count(401) <= 3, statuses
    refused = next(b for s, b in results if s == 429)
    assert "ERROR: 53400: too many failed logins for the curator: password checks are spaced out" in refused
    status, _, again = _login(live, PASSWORD, "127.0.8.200", cookies=device)
    assert status == 303 and "dpsql_session" in again
