"""A real ``dpsql serve`` in a subprocess, for tests where a crash must be observable as process death.

The server's stderr goes to a log file (never a pipe that could fill up and block it); the bound
port is read from its "dpsql listening on HOST:PORT" log line, so ``port=0`` works.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[2]
DPSQL = Path(sys.executable).with_name("dpsql")
_LISTENING = re.compile(r"dpsql listening on [^:\s]+:(\d+)")


class ServerStartFailed(RuntimeError):
    """``dpsql serve`` exited before listening (its exit code and log are kept for assertions)."""

    def __init__(self, returncode: int | None, log: str) -> None:
        super().__init__(f"dpsql serve exited with {returncode}:\n{log[-4000:]}")
        self.returncode = returncode
        self.log = log


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    host: str = "127.0.0.1"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def rss_kib(self) -> int:
        """Resident set size (VmRSS) of the server process, in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def dsn(self, user: str = "analyst", **extra: str) -> str:
        parts = {"host": self.host, "port": str(self.port), "user": user, "dbname": "health", **extra}
        return " ".join(f"{k}={v}" for k, v in parts.items())

    def connect(self, user: str = "analyst", **extra: str) -> psycopg.Connection:
        return psycopg.connect(self.dsn(user, connect_timeout="10", **extra), autocommit=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a power cut, the OOM killer)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, the clean shutdown path; SIGKILL after 20 s."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(
    policy: Path,
    ledger: Path,
    log_path: Path,
    *,
    database: str = "demo",
    port: int = 0,
    startup_timeout: float = 60.0,
    extra_args: tuple[str, ...] = (),
) -> ServerProcess:
    """Start ``dpsql serve`` (no shadow catalog) and wait until it listens; raise with its log if it dies."""
    argv = [
        str(DPSQL),
        "serve",
        "--policy",
        str(policy),
        "--database",
        database,
        "--ledger",
        f"sqlite://{ledger.resolve()}",
        "--port",
        str(port),
        "--catalog-dsn",
        "",
        "--log-level",
        "info",
        *extra_args,
    ]
    offset = log_path.stat().st_size if log_path.exists() else 0
    log = log_path.open("ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    log.close()  # the child holds its own descriptor
    server = ServerProcess(proc, log_path)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        text = log_path.read_bytes()[offset:].decode("utf-8", errors="replace")
        match = _LISTENING.search(text)
        if match is not None:
            server.port = int(match.group(1))
            return server
        if not server.alive():
            raise ServerStartFailed(proc.returncode, text)
        time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"dpsql serve did not start within {startup_timeout}s:\n{log_path.read_text()[-4000:]}")


def wait_for_exit(server: ServerProcess, timeout: float) -> int | None:
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def write_policy(directory: Path, *, analyst_epsilon: float = 1e9, dataset_epsilon: float = 1e9) -> Path:
    """A copy of schemas/health.yaml with its budgets replaced, written to ``directory``."""
    from tests.trust.conftest import health_policy_text

    path = directory / "health.yaml"
    path.write_text(health_policy_text(analyst_epsilon=analyst_epsilon, dataset_epsilon=dataset_epsilon))
    return path
