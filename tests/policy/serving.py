"""A real ``dpsql serve`` subprocess for the tests: started, waited for, its log collected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.listening import port_of

ROOT = Path(__file__).resolve().parents[2]


class Served:
    """``dpsql serve …`` with its stderr read on a thread into :attr:`lines`."""

    def __init__(self, *argv: str, home: Path, catalog: bool = False) -> None:
        self._port: int | None = None
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpsql.cli", "serve", "--port", "0"]
            + ([] if catalog else ["--catalog-dsn", ""])
            + list(argv),
            cwd=ROOT,
            env={**os.environ, "DPSQL_HOME": str(home), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def port(self) -> int:
        """The port the server bound (``--port 0``), from its "dpsql serving" line (waited for)."""
        if self._port is None:
            self._port = port_of(self.wait_for("dpsql serving"))
        return self._port

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, count: int = 1, timeout: float = 90) -> str:
        """Wait until ``text`` appears in ``count`` log lines (fails if the server exits first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in list(self.lines) if text in line]
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None:
                self._reader.join(5)
                found = [line for line in self.lines if text in line]
                if len(found) >= count:
                    return found[count - 1]
                raise AssertionError(f"dpsql serve exited ({self.proc.returncode}) before {text!r}:\n{self.log}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.log}")

    def exit_code(self, timeout: float = 90) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def hup(self) -> None:
        os.kill(self.proc.pid, signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
