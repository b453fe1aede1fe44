"""Issue #27, dashboard side, over real sockets against an in-process dashboard (and one real
``dpsql dashboard`` process for the start warning): the login limiter per account as well as per
address without a lockout of the curator, slow-loris, the Host header, huge grants from the levers
form, refusals that cannot push an answered row off the audit page, and extreme ``since`` dates.

Timing assertions are lower bounds or generous upper bounds only (a shared 2-core machine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path

import pytest

from dpsql.dashboard import auth
from dpsql.dashboard.server import (
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    REQUEST_DEADLINE_S,
    insecure_listen_warning,
)
from dpsql.ledger import AuditEntry
from tests.dashboard.conftest import PASSWORD, POLICY_ARGS, ROOT, Live, cookie_values

ALL_INTERFACES = "0.0.0.0"  # noqa: S104  (the warning's subject)


def _request(
    live: Live,
    method: str,
    path: str,
    *,
    source: str = "127.0.0.1",
    form: dict[str, str] | None = None,
    cookies: dict[str, str] | None = None,
    host: str | None = None,
) -> tuple[HTTPResponse, str]:
    """One request from ``source`` (any 127.x address: Linux routes the whole /8 to loopback)."""
    conn = HTTPConnection("127.0.0.1", live.port, timeout=60, source_address=(source, 0))
    headers: dict[str, str] = {}
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if cookies:
        headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
    if host is not None:
        headers["Host"] = host
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response, text


def _login(live: Live, password: str, source: str, cookies: dict[str, str] | None = None) -> tuple[int, str, dict]:
    response, _ = _request(live, "GET", "/login", source=source, cookies=cookies)
    jar = {**(cookies or {}), **cookie_values(response)}
    response, text = _request(
        live, "POST", "/login", source=source, form={"csrf": jar["dpsql_login"], "password": password}, cookies=jar
    )
    jar.update(cookie_values(response))
    return response.status, text, jar


# --- item 7: the login limiter ---------------------------------------------------------------------------


@pytest.fixture
def quick_slowdown(monkeypatch: pytest.MonkeyPatch) -> float:
    step = 0.4
    monkeypatch.setattr(auth, "SLOWDOWN_STEP_S", step)
    monkeypatch.setattr(auth, "SLOWDOWN_MAX_S", step)
    return step


def test_rotating_addresses_meet_the_account_slowdown(live: Live, quick_slowdown: float) -> None:
    """Each guess from a fresh 127.x address: the address limit never triggers, but past the account's
    free failures every check waits its turn, so 15 guesses take at least 10 spacings (they took
    well under a second before)."""
    guesses = 15
    started = time.monotonic()
    for i in range(guesses):
        status, body, _ = _login(live, f"guess {i}", f"127.0.{1 + i // 200}.{10 + i % 200}")
        assert status == 401, body  # checked (and wrong), never a lockout
    elapsed = time.monotonic() - started
    assert elapsed >= (guesses - auth.ACCOUNT_FREE_FAILURES) * quick_slowdown * 0.9
    # the curator, from an address of their own, still gets in: slowed, never locked out
    status, _, jar = _login(live, PASSWORD, "127.0.9.9")
    assert status == 303 and "dpsql_session" in jar


def test_a_stranger_cannot_lock_the_curator_out(live: Live, quick_slowdown: float) -> None:
    """The curator logged in once (their browser has a device cookie). A stranger then fails from the
    curator's own address and from many others: the address is locked for cookie-less attempts, but
    the curator's browser still logs in, from that same address."""
    status, _, jar = _login(live, PASSWORD, "127.0.0.1")
    assert status == 303 and "dpsql_device" in jar
    device = {"dpsql_device": jar["dpsql_device"]}
    for _ in range(auth.MAX_FAILURES):
        assert _login(live, "stranger", "127.0.0.1")[0] == 401
    for i in range(8):
        assert _login(live, "stranger", f"127.0.5.{i + 1}")[0] == 401
    status, body, _ = _login(live, PASSWORD, "127.0.0.1")  # no device cookie: the address is locked
    assert status == 429 and "ERROR: 53400: too many failed logins from this address" in body
    started = time.monotonic()
    status, _, again = _login(live, PASSWORD, "127.0.0.1", cookies=device)
    assert status == 303 and "dpsql_session" in again
    assert time.monotonic() - started < 30  # no queue behind the stranger's slowed-down guesses
    # a device has its own allowance: guessing with a copied cookie locks that cookie only
    for _ in range(auth.MAX_FAILURES):
        assert _login(live, "wrong", "127.0.6.1", cookies=device)[0] == 401
    status, body, _ = _login(live, PASSWORD, "127.0.6.1", cookies=device)
    assert status == 429 and "too many failed logins from this browser" in body
    forged = {"dpsql_device": jar["dpsql_device"][:-4] + "0000"}
    assert live.server.app.curator.device(forged["dpsql_device"]) is None


# --- item 7: slow clients ------------------------------------------------------------------------------


@pytest.fixture
def tricklers(live: Live) -> Iterator[list[socket.socket]]:
    """MAX_CONNECTIONS sockets from several 127.x addresses, each sending a request a byte a second."""
    socks: list[socket.socket] = []
    stop = threading.Event()
    per = MAX_CONNECTIONS_PER_ADDRESS
    for i in range(MAX_CONNECTIONS):
        sock = socket.create_connection(
            ("127.0.0.1", live.port), timeout=10, source_address=(f"127.0.7.{1 + i // per}", 0)
        )
        sock.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks.append(sock)

    def trickle() -> None:
        for _ in range(40):  # bounded: 40 s at most
            if stop.wait(1.0):
                return
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield socks
    finally:
        stop.set()
        thread.join(5)
        for sock in socks:
            sock.close()


def test_trickling_sockets_do_not_block_the_curator(live: Live, tricklers: list[socket.socket]) -> None:
    deadline = time.monotonic() + 10
    while live.server.slots._value > 0 and time.monotonic() < deadline:  # every trickler holds a slot
        time.sleep(0.05)
    assert live.server.slots._value == 0
    served = None
    started = time.monotonic()
    while served is None and time.monotonic() - started < 25:  # was blocked for 70 s
        try:
            response, _ = _request(live, "GET", "/login", source="127.0.8.1")
            served = response.status
        except OSError:  # closed at once: every slot taken
            time.sleep(0.5)
    assert served == 200


def test_a_request_has_a_whole_deadline(live: Live) -> None:
    """A byte every second used to keep a socket open forever (the timeout was per read)."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=5)
    sock.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    started = time.monotonic()
    closed = False
    try:
        while not closed and time.monotonic() - started < 40:
            try:
                sock.sendall(b"a")
                sock.settimeout(1.0)
                closed = sock.recv(100) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
    finally:
        sock.close()
    assert closed
    assert time.monotonic() - started < REQUEST_DEADLINE_S + 15


# --- item 7: the Host header and the start warning ----------------------------------------------------------


def test_host_header_is_checked(live: Live) -> None:
    for host in (f"127.0.0.1:{live.port}", f"localhost:{live.port}", f"[::1]:{live.port}", "LOCALHOST."):
        response, _ = _request(live, "GET", "/login", host=host)
        assert response.status == 200, host
    for host in (f"evil.example:{live.port}", "attacker.test", "127.0.0.1.nip.io"):
        response, body = _request(live, "GET", "/login", host=host)
        assert response.status == 421, host
        assert body.startswith(f'ERROR: 42501: host "{host}" is not served here'), body
        assert "dpsql_login" not in (response.getheader("Set-Cookie") or "")
    # a DNS-rebinding page cannot even try a password
    response, body = _request(live, "POST", "/login", form={"csrf": "x", "password": PASSWORD}, host="evil.example")
    assert response.status == 421 and "dpsql_session" not in (response.getheader("Set-Cookie") or "")
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    sock.sendall(b"GET /login HTTP/1.0\r\n\r\n")  # no Host at all
    assert sock.recv(100).startswith(b"HTTP/1.0 400")
    sock.close()


def test_warning_when_listening_beyond_loopback_without_tls() -> None:
    assert insecure_listen_warning("127.0.0.1", tls=False) is None
    assert insecure_listen_warning("localhost", tls=False) is None
    assert insecure_listen_warning("::1", tls=False) is None
    assert insecure_listen_warning(ALL_INTERFACES, tls=True) is None
    for host in (ALL_INTERFACES, "::", "192.0.2.7", "dashboard.example"):
        assert "without TLS" in (insecure_listen_warning(host, tls=False) or ""), host


def test_dashboard_warns_at_start_on_0_0_0_0(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path), auth.ENV_PASSWORD: PASSWORD}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", "dashboard", "--host", ALL_INTERFACES, "--port", "0", *POLICY_ARGS],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "dpsql dashboard for dataset" in line:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "".join(lines)
    assert "WARNING:  the dashboard listens on 0.0.0.0 without TLS" in text, text
    assert text.index("WARNING:") < text.index("dpsql dashboard for dataset")


# --- item 6: the levers form ---------------------------------------------------------------------------


def _csrf(live: Live, cookies: dict[str, str]) -> str:
    _, page = live.request("GET", "/", cookies=cookies)
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_levers_form_refuses_huge_grants(live: Live) -> None:
    _, _, cookies = live.login()
    grant = {"lever": "grant", "analyst": "bob", "reason": "r", "csrf": _csrf(live, cookies)}
    for epsilon in ("1e308", "1e308", "inf", "51"):
        response, body = live.request("POST", "/levers", {**grant, "epsilon": epsilon}, cookies)
        assert response.status == 400, epsilon
        assert "ERROR: 22023: invalid grant" in html.unescape(body), body
    response, body = live.request("POST", "/levers", {**grant, "epsilon": "40"}, cookies)
    assert response.status == 200
    response, body = live.request("POST", "/levers", {**grant, "epsilon": "20"}, cookies)
    assert response.status == 400
    assert "grants would total ε=60, more than the dataset's budget ε=50" in html.unescape(body)
    assert [e.epsilon for e in live.ledger.lever_events(live.policy.dataset)] == [40.0]
    response, _ = live.request("GET", "/", cookies=cookies)
    assert response.status == 200


def test_pages_survive_infinite_grants_already_stored(live: Live) -> None:
    insert = (
        "INSERT INTO dpsql_ledger_levers (at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
        "VALUES (?, 'health', 'bob', 'grant', ?, 0, 'old', 'old')"
    )
    with live.ledger._append() as execute:
        for epsilon in (1e308, 1e308):
            execute(insert, (dt.datetime.now(dt.UTC).isoformat(), epsilon))
    _, _, cookies = live.login()
    for path in ("/", "/spend", "/audit", "/policy"):
        response, _ = live.request("GET", path, cookies=cookies)
        assert response.status == 200, path


# --- item 8: refusals never hide an answered statement -----------------------------------------------------


def test_a_flood_of_refusals_does_not_push_answered_rows_off_the_page(live: Live) -> None:
    now = dt.datetime.now(dt.UTC)
    answered = AuditEntry(now, "health", "alice", "a" * 64, "SELECT COUNT(*) FROM patients", "answered", "00000", 1.0)
    floods = [
        AuditEntry(
            now + dt.timedelta(seconds=1 + i), "health", "mallory", f"{i:064d}", f"SELECT c{i}", "refused", "42703"
        )
        for i in range(300)
    ]
    live.ledger.record_audit([answered, *floods])
    _, _, cookies = live.login()
    response, body = live.request("GET", "/audit", cookies=cookies)
    assert response.status == 200
    assert "SELECT COUNT(*) FROM patients" in body
    assert body.count('<span class="event">refused</span>') == 200  # the refusals' own limit
    response, body = live.request("GET", "/audit?outcome=answered", cookies=cookies)
    assert body.count('<span class="event">answered</span>') == 1


def test_folded_rows_show_their_repeats(live: Live) -> None:
    now = dt.datetime.now(dt.UTC)
    entry = AuditEntry(now, "health", "bob", "b" * 64, "SELECT name FROM patients", "refused", "42501", repeats=5100)
    live.ledger.record_audit([entry])
    _, _, cookies = live.login()
    _, body = live.request("GET", "/audit", cookies=cookies)
    assert '<span class="event">refused</span> <span class="repeats">×5100</span>' in body


# --- item 11: extreme dates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("since", "status", "error"),
    [
        ("0001-01-01T00:00:00+05:00", 400, "ERROR: 22008: date/time field value out of range"),
        ("9999-12-31T23:59:59-05:00", 400, "ERROR: 22008: date/time field value out of range"),
        ("99999-01-01", 400, "ERROR: 22007: invalid input syntax for type timestamp"),
        ("+99999-01-01", 400, "ERROR: 22007: invalid input syntax for type timestamp"),
        ("0001-01-01", 200, None),
        ("9999-12-31", 200, None),
    ],
)
def test_extreme_since_dates(live: Live, since: str, status: int, error: str | None) -> None:
    _, _, cookies = live.login()
    response, body = live.request("GET", f"/audit?since={urllib.parse.quote(since)}", cookies=cookies)
    assert response.status == status
    if error is not None:
        assert error in html.unescape(body), body
    else:
        assert f'value="{since}' in body  # echoed so that it reads back (year 1 as 0001)
