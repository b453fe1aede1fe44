"""The port a ``dpsql serve`` or ``dpsql dashboard`` started with ``--port 0`` got, read from its start line.

Tests let servers bind port 0 and report the port: a port probed free and released first can be taken by
another process on a loaded machine before the server binds it.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

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
