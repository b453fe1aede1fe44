"""``dpsql serve --processes N``: workers end with their supervisor, however it dies (issue #27 item 10).

Before, a ``kill -9`` of the supervisor left its workers serving the policy they had loaded: after a
restart with an analyst removed, that analyst was still answered on about half the connections.
"""

from __future__ import annotations

import contextlib
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


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (from /proc: parent pids)."""
    children: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), set()).add(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {pid for pid in found if _alive(pid)}


def test_sigterm_stops_every_process_within_its_deadline(tmp_path: Path, servers: list[Served]) -> None:
    """Issue #41 item 7: after long statements (each worker's statement-routing helper busy), SIGTERM ends
    the supervisor, both workers and their helpers within the stated deadline (README: 20 s)."""
    import threading

    import psycopg

    from dpsql.server.workers import KILL_AFTER_SECONDS

    policy = tmp_path / "policy.yaml"
    policy.write_text(HEALTH)
    server = Served("--policy", str(policy), "--processes", "2", home=tmp_path)
    servers.append(server)
    server.wait_for("dpsql serving", count=2)
    values = ",".join(f"{20 + i * 1e-4:.4f}" for i in range(20_000))
    long = f"SELECT COUNT(*) FROM patients WHERE bmi IN ({values})"

    def send() -> None:
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(
                f"postgresql://alice@127.0.0.1:{server.port}/health", autocommit=True, connect_timeout=30
            ) as conn,
        ):
            for _ in range(3):
                conn.execute(long)

    senders = [threading.Thread(target=send, daemon=True) for _ in range(6)]
    for thread in senders:
        thread.start()
    deadline = time.monotonic() + 60
    while len(_descendants(server.proc.pid)) < 4 and time.monotonic() < deadline:  # 2 workers, 2 helpers at least
        time.sleep(0.2)
    everything = _descendants(server.proc.pid) | {server.proc.pid}
    assert len(everything) >= 5, f"the helpers never started: {everything}"
    started = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    while any(_alive(pid) for pid in everything) and time.monotonic() - started < KILL_AFTER_SECONDS + 15:
        time.sleep(0.2)
    left = [pid for pid in everything if _alive(pid)]
    assert not left, f"still running {time.monotonic() - started:.0f} s after SIGTERM: {left}"
    assert time.monotonic() - started <= KILL_AFTER_SECONDS + 5
