"""``dpsql serve --processes N``: workers end with their supervisor, however it dies (issue #27 item 10).

Before, a ``kill -9`` of the supervisor left its workers serving the policy they had loaded: after a
restart with an analyst removed, that analyst was still answered on about half the connections.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsql.dev.demo import demo_policy_path

from .serving import Served

HEALTH = demo_policy_path("health").read_text()


@pytest.fixture
def servers() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for server in started:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_workers_end_when_the_supervisor_is_killed(tmp_path: Path, servers: list[Served]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), "--processes", "2", home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving", count=2)
    workers = {int(m.group(1)) for line in server.lines if (m := re.search(r"\[worker \d pid (\d+)\]", line))}
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers), "orphaned workers still serving"
