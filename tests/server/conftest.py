"""Real dpsql servers (real engine over in-memory DuckDB demo data) on random ports, for real clients."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.policy import Analyst, Auth, Budget, Budgets, Policy, load_policy
from dpsql.server import ThreadedServer, make_verifier

PASSWORD = "correct horse battery staple"
ANALYSTS = ("analyst", "alice", "carol", "dave", "erin", "frank", "grace", "root")
#: One analyst per client in test_client_matrix.py, so each one's charges can be read alone.
MATRIX_CLIENTS = ("psycopg", "asyncpg", "pg8000", "psql", "sqlalchemy")


@dataclass(frozen=True)
class Running:
    host: str
    port: int
    engine: Engine

    def dsn(self, user: str = "analyst", **extra: str) -> str:
        parts = {"host": self.host, "port": str(self.port), "user": user, "dbname": "health", **extra}
        return " ".join(f"{k}={v}" for k, v in parts.items())

    def url(self, user: str = "analyst", driver: str = "postgresql") -> str:
        return f"{driver}://{user}@{self.host}:{self.port}/health"


def make_policy(trust: bool) -> Policy:
    base = load_policy(demo_policy_path("health"))
    analysts = [Analyst(name=n) for n in (*ANALYSTS, *(f"m_{c}" for c in MATRIX_CLIENTS))]
    analysts.append(Analyst(name="frugal", budget=Budget(epsilon=3.0, delta=1e-5)))
    analysts.append(Analyst(name="scram", password=make_verifier(PASSWORD)))
    return base.model_copy(
        update={
            "analysts": tuple(analysts),
            "auth": Auth(trust=trust),
            "budget": Budgets(dataset=Budget(epsilon=1e6, delta=0.5), analyst=Budget(epsilon=1e5, delta=0.1)),
        }
    )


def open_engine(trust: bool) -> Engine:
    engine = Engine.open(make_policy(trust), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["health"])
    return engine


@contextmanager
def serving(engine: Engine, *, owns_engine: bool = True, **options: Any) -> Iterator[tuple[Running, ThreadedServer]]:
    """A :class:`ThreadedServer` over ``engine`` with ``options``; stopped on exit, and ``engine`` closed
    with it unless a fixture of its own holds it (``owns_engine=False``)."""
    server = ThreadedServer(engine, **options)
    try:
        yield Running(server.host, server.port, engine), server
    finally:
        server.stop()
        if owns_engine:
            engine.close()


def self_signed_cert(directory: Path) -> tuple[Path, Path] | None:
    """A one-day self-signed certificate for localhost and its key in ``directory`` (None without openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    crt, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return crt, key


@pytest.fixture(scope="session")
def dp_server() -> Iterator[Running]:
    """Trust auth, shadow catalog started (a throwaway local PostgreSQL)."""
    with serving(open_engine(trust=True), statement_timeout=None) as (running, _):
        yield running


@pytest.fixture(scope="session")
def scram_server() -> Iterator[Running]:
    """SCRAM auth, no catalog (catalog_dsn="" disables it). The login limiter is out of the way:
    these tests compare many failed exchanges; the limiter has its own (test_front_door_limits)."""
    limits: dict[str, Any] = {
        "login_free_failures": 10**6,
        "login_account_failures": 10**6,
        "login_address_failures": 10**6,
    }
    with serving(open_engine(trust=False), catalog_dsn="", **limits) as (running, _):
        yield running


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """A trust-auth engine of the module's own (for servers a test module starts with its own options)."""
    engine = open_engine(trust=True)
    try:
        yield engine
    finally:
        engine.close()


def sqlstate_of(fn: Callable[[], Any]) -> str | None:
    """The SQLSTATE ``fn`` fails with (psycopg), None when it succeeds."""
    try:
        fn()
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def eventually(check: Callable[[], bool], seconds: float) -> bool:
    """Whether ``check`` holds within ``seconds`` (polled every 50 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (ConnectionError when it closes first)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
