"""The port a ``dpsql serve`` or ``dpsql dashboard`` started with ``--port 0`` got, read from its start line.

Tests let servers bind port 0 and report the port: a port probed free and released first can be taken by
another process on a loaded machine before the server binds it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: ``dpsql serving dataset "…" on HOST:PORT (…`` and ``dpsql dashboard for dataset "…" at http://HOST:PORT/ …``.
_STARTED = re.compile(r"dpsql (?:serving .*? on \S+:(\d+) |dashboard .*? at https?://\S+:(\d+)/)")


def port_of(line: str) -> int:
    """The port in a server's start line (``AssertionError`` when the line is not one)."""
    found = _STARTED.search(line)
    assert found is not None, f"not a start line: {line!r}"
    return int(found.group(1) or found.group(2))


def port_from_log(path: Path, proc: subprocess.Popen[Any], timeout: float = 120.0) -> int:
    """Wait until the server writing its stderr to ``path`` printed its start line; its port."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace")
        if (found := _STARTED.search(text)) is not None:
            return int(found.group(1) or found.group(2))
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before it started:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"the server did not start within {timeout:.0f} s:\n{text[-4000:]}"
        time.sleep(0.1)


def start_serve(*args: str, home: Path) -> subprocess.Popen[str]:
    """``python -m dpsql.cli serve --port 0 ARGS`` from the checkout with ``DPSQL_HOME=home``; its stderr
    a pipe to read the start line from (:func:`serving_line`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", "serve", "--port", "0", *args],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def serving_line(server: subprocess.Popen[str], deadline: float) -> str:
    """The ``dpsql serving`` line of a :func:`start_serve` server, read before ``time.monotonic()``
    passes ``deadline``."""
    assert server.stderr is not None
    line = ""
    while "dpsql serving" not in line:
        line = server.stderr.readline()
        assert line or server.poll() is None, "dpsql serve exited before serving"
        assert time.monotonic() < deadline
    return line
