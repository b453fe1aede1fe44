"""Fixtures for the dashboard: a real ``dpsql serve`` and ``dpsql dashboard`` (subprocesses) on one file
ledger, an in-process dashboard server for plain-HTTP attacks, and a real headless Chromium.

Chromium comes from Debian (``chromium``, ``chromium-driver``; ``scripts/setup.sh test`` installs
them) and is driven by Selenium through ``/usr/bin/chromedriver``. As with PostgreSQL
(``tests/pg.py``), a missing browser skips locally but *fails* under ``CI``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any

import pytest

from dpsql.dashboard.auth import Curator
from dpsql.dashboard.server import Dashboard, DashboardServer, make_server
from dpsql.dev.demo import demo_policy_path
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.server.auth import Verifier, make_verifier
from tests.listening import port_of

ROOT = Path(__file__).resolve().parents[2]
#: Curator commands need --policy (no fallback to the demo): the demo's, given explicitly.
HEALTH_POLICY = ROOT / "schemas" / "health.yaml"
POLICY_ARGS = ("--policy", str(HEALTH_POLICY))
PASSWORD = "curator correct horse"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason + "\n(CI is set: the browser tests must run, not be skipped)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chrome() -> Iterator[Any]:
    """A headless Chromium under Selenium (one per session; tests delete its cookies)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    if not (os.access(CHROMEDRIVER, os.X_OK) and os.access(CHROMIUM, os.X_OK)):
        _unavailable("Debian's chromium and chromium-driver are not installed (bash scripts/setup.sh test)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except Exception as exc:  # the browser could not start
        _unavailable(f"headless Chromium did not start: {exc}")
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait_line(proc: subprocess.Popen[str], marker: str, timeout: float = 90) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while True:
        line = proc.stderr.readline()
        if marker in line:
            return line
        assert line or proc.poll() is None, f"process exited before printing {marker!r}"
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout} s"


def _drain(proc: subprocess.Popen[str], sink: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sink.append(line)


@dataclass
class Process:
    proc: subprocess.Popen[str]
    port: int
    banner: str
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _spawn(args: list[str], marker: str, env: dict[str, str]) -> Process:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = _wait_line(proc, marker)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    running = Process(proc, port_of(banner), banner)  # started with --port 0: the port it got
    threading.Thread(target=_drain, args=(proc, running.log), daemon=True).start()
    return running


def _stop(running: Process) -> None:
    running.proc.terminate()
    try:
        running.proc.wait(30)
    except subprocess.TimeoutExpired:
        running.proc.kill()
        running.proc.wait(10)


@pytest.fixture
def serve_and_dashboard(tmp_path: Path) -> Iterator[Callable[[str], tuple[Process, Callable[[], Process]]]]:
    """``start(ledger_url)`` -> (a running ``dpsql serve``, a function starting ``dpsql dashboard`` on the
    same ledger); both are stopped at teardown."""
    started: list[Process] = []
    env = {**os.environ, "DPSQL_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def start(ledger_url: str) -> tuple[Process, Callable[[], Process]]:
        serve = _spawn(["serve", "--port", "0", "--catalog-dsn", "", "--ledger", ledger_url], "dpsql serving", env)
        started.append(serve)

        def dashboard() -> Process:
            running = _spawn(
                [
                    "dashboard",
                    "--port",
                    "0",
                    "--ledger",
                    ledger_url,
                    "--by",
                    "curator-test",
                    "--policy",
                    str(HEALTH_POLICY),
                ],
                "dpsql dashboard",
                {**env, "DPSQL_CURATOR_PASSWORD": PASSWORD},
            )
            started.append(running)
            return running

        return serve, dashboard

    try:
        yield start
    finally:
        for running in reversed(started):
            _stop(running)


# --- an in-process dashboard, for plain-HTTP tests -------------------------------------------------


@dataclass
class Live:
    server: DashboardServer
    ledger: Ledger
    policy: Policy

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def request(
        self,
        method: str,
        path: str,
        form: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[HTTPResponse, str]:
        conn = HTTPConnection("127.0.0.1", self.port, timeout=30)
        sent = dict(headers or {})
        body = None
        if form is not None:
            body = urllib.parse.urlencode(form)
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        if cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        return response, text

    def login(self, password: str = PASSWORD) -> tuple[HTTPResponse, str, dict[str, str]]:
        """GET /login (its CSRF cookie), then POST the password; returns the response and the cookies."""
        response, _ = self.request("GET", "/login")
        cookies = cookie_values(response)
        response, text = self.request("POST", "/login", {"csrf": cookies["dpsql_login"], "password": password}, cookies)
        cookies.update(cookie_values(response))
        return response, text, cookies


def cookie_values(response: HTTPResponse) -> dict[str, str]:
    out = {}
    for header in response.headers.get_all("Set-Cookie") or []:
        name, _, rest = header.partition("=")
        out[name] = rest.split(";", 1)[0]
    return out


def start_live(policy: Policy, ledger: Ledger, verifier: Verifier | None = None) -> Live:
    app = Dashboard(policy, ledger, Curator(verifier or Verifier.parse(make_verifier(PASSWORD))), by="t", tls=False)
    server = make_server(app, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Live(server, ledger, policy)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    """The health policy's dashboard on a fresh file ledger, in this process (real sockets, real HTTP)."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    running = start_live(load_policy(demo_policy_path("health")), ledger)
    try:
        yield running
    finally:
        running.server.shutdown()
        running.server.server_close()
        ledger.close()


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    """tests/dashboard/artifacts/<test>/ (git-ignored): screenshots for a human to look at."""
    path = ARTIFACTS / request.node.name.replace("/", "_").replace("[", "-").replace("]", "")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
