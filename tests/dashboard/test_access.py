"""The dashboard from an analyst's side of the network: no password, nothing but the login page.

Plain HTTP against a real dashboard server (in-process, real sockets) on a file ledger: every page,
asset and unknown path without a session is a redirect to /login or a bare 401; POSTs without a
session or CSRF token change nothing; static files cannot be escaped; failed logins are limited;
the ledger's analyst-controlled text is escaped; every refusal has its SQLSTATE and message.
"""

from __future__ import annotations

import datetime as dt
import html
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsql.dashboard import auth
from dpsql.dashboard.auth import MAX_FAILURES
from dpsql.dashboard.server import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS
from dpsql.ledger import AuditEntry
from tests.dashboard.conftest import PASSWORD, ROOT, Live

PAGES = ("/", "/spend", "/audit", "/policy")


def test_nothing_without_a_session(live: Live) -> None:
    for path in PAGES:
        response, body = live.request("GET", path)
        assert (response.status, response.getheader("Location"), body) == (303, "/login", ""), path
    for path in ("/static/dashboard.css", "/static/../../etc/passwd", "/nowhere", "/levers", "/admin"):
        response, body = live.request("GET", path)
        assert (response.status, body) == (401, ""), path
    for path in ("/levers", "/logout", "/audit"):
        form = {"lever": "grant", "analyst": "bob", "epsilon": "100", "reason": "x", "csrf": "guess"}
        response, body = live.request("POST", path, form)
        assert (response.status, body) == (401, ""), path
    response, _ = live.request("DELETE", "/")
    assert response.status == 401
    response, _ = live.request("GET", "/", cookies={"dpsql_session": "forged-token"})
    assert response.status == 303
    assert live.ledger.lever_events(live.policy.dataset) == []  # nothing was written
    response, body = live.request("GET", "/login")
    assert response.status == 200 and 'name="password"' in body
    assert "alice" not in body and "ε" not in body  # the login page tells nothing about the ledger


def test_session_cookie_and_headers(live: Live) -> None:
    response, body, cookies = live.login()
    assert (response.status, response.getheader("Location")) == (303, "/")
    set_cookie = [h for h in response.headers.get_all("Set-Cookie") or [] if h.startswith("dpsql_session=")]
    assert len(set_cookie) == 1
    flags = {f.strip() for f in set_cookie[0].split(";")[1:]}
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= flags and "Secure" not in flags  # Secure under TLS only
    response, body = live.request("GET", "/", cookies=cookies)
    assert response.status == 200
    csp = response.getheader("Content-Security-Policy") or ""
    assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'none'" in csp
    assert response.getheader("X-Frame-Options") == "DENY"
    assert response.getheader("Cache-Control") == "no-store"
    assert "<script" not in body
    assert PASSWORD not in body and cookies["dpsql_session"] not in body


def test_wrong_password_and_the_failure_limit(live: Live) -> None:
    for _ in range(MAX_FAILURES):
        response, body, cookies = live.login("wrong")
        assert response.status == 401
        assert '<p class="error" id="error">ERROR: 28P01: password authentication failed for the curator</p>' in body
        assert "dpsql_session" not in cookies
    response, body, cookies = live.login(PASSWORD)  # even the right password, once throttled
    assert response.status == 429
    assert "ERROR: 53400: too many failed logins from this address" in body
    assert "HINT: Wait a few minutes before trying again." in body
    assert "dpsql_session" not in cookies


def test_login_needs_its_csrf_token(live: Live) -> None:
    response, body = live.request("POST", "/login", {"password": PASSWORD})
    assert response.status == 403
    assert "ERROR: 42501: invalid or missing CSRF token" in body
    assert "dpsql_session" not in (response.getheader("Set-Cookie") or "")


def test_posts_need_the_session_csrf_and_origin(live: Live) -> None:
    _, _, cookies = live.login()
    grant = {"lever": "grant", "analyst": "bob", "epsilon": "3", "reason": "r"}
    cases: tuple[tuple[dict[str, str], dict[str, str]], ...] = (
        (grant, {}),  # no token
        ({**grant, "csrf": "forged"}, {}),
        ({**grant, "csrf": cookies["dpsql_login"]}, {}),  # the login token is not the session's
    )
    for form, headers in cases:
        response, body = live.request("POST", "/levers", form, cookies, headers)
        assert response.status == 403
        assert '<p class="error" id="error">ERROR: 42501: invalid or missing CSRF token' in body
    # a page of the session carries the right token; a foreign Origin is still refused with it
    _, page = live.request("GET", "/", cookies=cookies)
    token = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    response, body = live.request(
        "POST", "/levers", {**grant, "csrf": token}, cookies, {"Origin": "http://evil.example"}
    )
    assert response.status == 403 and "ERROR: 42501: invalid or missing CSRF token" in body
    assert live.ledger.lever_events(live.policy.dataset) == []
    response, body = live.request("POST", "/levers", {**grant, "csrf": token}, cookies)
    assert response.status == 200 and "grant ε=3 δ=0" in body
    (event,) = live.ledger.lever_events(live.policy.dataset)
    assert (event.analyst, event.kind, event.epsilon, event.reason, event.by) == ("bob", "grant", 3.0, "r", "t")


@pytest.mark.parametrize(
    ("form", "error"),
    [
        (
            {"lever": "grant", "analyst": "zed", "epsilon": "1", "reason": "r"},
            '42704: analyst "zed" is not in the policy',
        ),
        ({"lever": "grant", "analyst": "bob", "epsilon": "abc", "reason": "r"}, '22023: invalid epsilon: "abc"'),
        ({"lever": "grant", "analyst": "bob", "epsilon": "-1", "reason": "r"}, "22023: invalid grant: ε=-1, δ=0"),
        ({"lever": "grant", "analyst": "bob", "epsilon": "nan", "reason": "r"}, "22023: invalid grant: ε=nan, δ=0"),
        ({"lever": "grant", "analyst": "bob", "epsilon": "1", "reason": " "}, "22023: a grant needs a --reason"),
        ({"lever": "grant", "analyst": "bob", "epsilon": "0", "reason": "r"}, "22023: a grant must add some ε or δ"),
        ({"lever": "drop", "analyst": "bob", "reason": "r"}, "22023: unknown lever 'drop'"),
    ],
)
def test_lever_refusals(live: Live, form: dict[str, str], error: str) -> None:
    _, _, cookies = live.login()
    _, page = live.request("GET", "/", cookies=cookies)
    token = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    response, body = live.request("POST", "/levers", {**form, "csrf": token}, cookies)
    assert response.status == 400
    assert f'<p class="error" id="error">ERROR: {html.escape(error)}' in body
    assert live.ledger.lever_events(live.policy.dataset) == []


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("since=yesterday", 'ERROR: 22007: invalid input syntax for type timestamp: "yesterday"'),
        ("outcome=deleted", 'ERROR: 22023: invalid outcome "deleted"'),
        ("limit=0", 'ERROR: 22023: invalid limit "0"'),
        ("limit=99999999", 'ERROR: 22023: invalid limit "99999999"'),
    ],
)
def test_audit_filter_refusals(live: Live, query: str, error: str) -> None:
    _, _, cookies = live.login()
    response, body = live.request("GET", f"/audit?{query}", cookies=cookies)
    assert response.status == 400
    assert error.replace('"', "&quot;") in body


def test_idle_connections_are_capped(live: Live) -> None:
    """One address holds MAX_CONNECTIONS_PER_ADDRESS sockets, no more (the next is closed unanswered);
    idle sockets from several addresses fill MAX_CONNECTIONS threads and never more; once they go,
    pages are served again. (Eviction of slow senders: tests/dashboard/test_hostile_clients.py.)"""
    port = live.port

    def connect(source: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))

    held = [connect("127.0.0.1") for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    try:
        deadline = time.monotonic() + 10
        while live.server.slots._value > MAX_CONNECTIONS - len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        extra = connect("127.0.0.1")
        extra.sendall(b"GET /login HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        assert extra.recv(100) == b""  # closed unanswered: the address has its share
        extra.close()
        others = MAX_CONNECTIONS // MAX_CONNECTIONS_PER_ADDRESS - 1
        held += [connect(f"127.0.0.{2 + a}") for a in range(others) for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
        deadline = time.monotonic() + 10
        while live.server.slots._value > 0 and time.monotonic() < deadline:  # every idle socket accepted
            time.sleep(0.01)
        assert live.server.slots._value == 0  # MAX_CONNECTIONS threads, and the semaphore is bounded
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while live.server.slots._value < MAX_CONNECTIONS and time.monotonic() < deadline:
        time.sleep(0.01)
    response, _ = live.request("GET", "/login")
    assert response.status == 200


def test_no_path_traversal(live: Live) -> None:
    _, _, cookies = live.login()
    response, css = live.request("GET", "/static/dashboard.css", cookies=cookies)
    assert "font-family" in css
    assert response.status == 200 and response.getheader("Content-Type") == "text/css; charset=utf-8"
    for path in (
        "/static/../../../../etc/passwd",
        "/static/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/static/..%2f..%2f..%2fetc%2fpasswd",
        "/static/dashboard.css/../../server.py",
        "/static/../server.py",
        "/static//etc/passwd",
        "/../../etc/passwd",
        "/static/",
    ):
        response, body = live.request("GET", path, cookies=cookies)
        assert response.status == 404, path
        assert "root:" not in body and "import" not in body


def test_ledger_text_is_escaped(live: Live) -> None:
    hostile = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    live.ledger.record_audit(
        [
            AuditEntry(
                at=dt.datetime.now(dt.UTC),
                dataset=live.policy.dataset,
                analyst="alice",
                fingerprint="f" * 64,
                shape=f'SELECT COUNT(*) AS "{hostile}" FROM patients',
                outcome="refused",
                sqlstate="42601",
            )
        ]
    )
    live.ledger.grant(dataset=live.policy.dataset, analyst="bob", epsilon=1, by=hostile, reason=hostile)
    _, _, cookies = live.login()
    for path in ("/audit", "/audit?analyst=bob", "/", "/spend"):
        response, body = live.request("GET", path, cookies=cookies)
        assert response.status == 200
        assert "<script" not in body and "<img" not in body, path
    _, body = live.request("GET", "/audit", cookies=cookies)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in body
    _, body = live.request("GET", "/audit?analyst=%3Cscript%3E", cookies=cookies)  # the filter's echo too
    assert 'value="&lt;script&gt;"' in body


def test_logs_hold_no_secret(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dpsql.dashboard")
    live.login("a wrong guess")
    _, _, cookies = live.login()
    live.request("GET", "/audit?analyst=alice&since=2020-01-01", cookies=cookies)
    text = caplog.text
    assert "failed dashboard login from 127.0.0.1" in text and "GET /audit" in text
    for secret in (PASSWORD, "a wrong guess", cookies["dpsql_session"], cookies["dpsql_login"], "since=2020"):
        assert secret not in text


def test_refuses_to_start_without_a_password(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_PASSWORD, auth.ENV_VERIFIER)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsql.cli",
            "dashboard",
            "--policy",
            str(ROOT / "schemas" / "health.yaml"),
            "--port",
            "0",
            "--ledger",
            f"sqlite:///{tmp_path / 'l.sqlite'}",
        ],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("ERROR:  no curator password for the dashboard\nHINT:  Give --password-file")
    bad = tmp_path / "verifier"
    bad.write_text("plaintext-password\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsql.cli",
            "dashboard",
            "--port",
            "0",
            "--password-file",
            str(bad),
        ],  # no --policy needed to fail
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith(f"ERROR:  {bad}: not a SCRAM-SHA-256 verifier")
    assert "plaintext-password" not in out.stderr


def test_verifier_file_and_tls(tmp_path: Path) -> None:
    """A verifier from ``dpsql passwd`` logs in; under TLS the session cookie is Secure."""
    import http.client
    import ssl
    import urllib.parse

    from tests.dashboard.conftest import _spawn, _stop

    verifier = subprocess.run(
        [sys.executable, "-m", "dpsql.cli", "passwd", "--password", PASSWORD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout.strip()
    (tmp_path / "curator.verifier").write_text(verifier + "\n")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_PASSWORD, auth.ENV_VERIFIER)}
    running = _spawn(
        [
            "dashboard",
            "--policy",
            str(ROOT / "schemas" / "health.yaml"),
            "--port",
            "0",
            "--password-file",
            str(tmp_path / "curator.verifier"),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--ledger",
            f"sqlite:///{tmp_path / 'l.sqlite'}",
        ],
        "dpsql dashboard",
        {**env, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path)},
    )
    port = running.port
    try:
        assert f"at https://127.0.0.1:{port}/" in running.banner
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False

        def request(method: str, path: str, body: str | None = None, cookie: str = "") -> http.client.HTTPResponse:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
            headers = {"Cookie": cookie} if cookie else {}
            if body is not None:
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            conn.close()
            return response

        first = request("GET", "/login")
        login = (first.getheader("Set-Cookie") or "").split(";", 1)[0]
        assert "Secure" in (first.getheader("Set-Cookie") or "")
        token = login.split("=", 1)[1]
        response = request("POST", "/login", urllib.parse.urlencode({"csrf": token, "password": PASSWORD}), login)
        assert response.status == 303
        session = response.getheader("Set-Cookie") or ""
        assert session.startswith("dpsql_session=") and "Secure" in session and "HttpOnly" in session
        assert request("GET", "/policy", cookie=session.split(";", 1)[0]).status == 200
    finally:
        _stop(running)
