"""Cancel under ``dpsql serve --processes 2`` (#40 item 5): a client's CancelRequest reaches the worker
running its statement whichever worker the kernel hands it to, so it reads 57014 "canceling statement
due to user request" (never "due to statement timeout", none being set), and for every statement the
ε the client was told (the NOTICE, or a failure's DETAIL), the ledger's charge and the server's log
line agree — a cancel landing before, during or after the reservation alike."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

from dpsql.ledger import Ledger
from tests.trust.serverproc import ServerProcess, start_server, write_policy

_QUERY_LINE = re.compile(r"query analyst=analyst fingerprint=\S+ route=engine epsilon=(\S+) outcome=(\S+)")
_LISTENING = re.compile(r"dpsql listening on [^:\s]+:(\d+)")


def _two_workers(tmp_path: Path) -> tuple[ServerProcess, Path]:
    ledger = tmp_path / "ledger.sqlite"
    log = tmp_path / "serve.log"
    server = start_server(write_policy(tmp_path), ledger, log, extra_args=("--processes", "2"))
    deadline = time.monotonic() + 60
    while len(_LISTENING.findall(server.log_text())) < 2:
        assert time.monotonic() < deadline and server.alive(), server.log_text()[-3000:]
        time.sleep(0.05)
    return server, ledger


def _query_lines(server: ServerProcess) -> list[tuple[float, str]]:
    return [(float(eps), state) for eps, state in _QUERY_LINE.findall(server.log_text())]


def _one(server: ServerProcess, ledger: Ledger, i: int, delay: float) -> tuple[str | None, float, float, float]:
    """One statement cancelled after ``delay`` s: (SQLSTATE or None, ε told, ε charged, ε logged)."""
    logged_before = len(_query_lines(server))
    spent_before = ledger.spent("health", "analyst").epsilon
    notices: list[str] = []
    outcome: dict[str, psycopg.Error | None] = {"error": None}
    with server.connect("analyst") as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("SET dpsql.epsilon = 0.3")

        def run() -> None:
            try:
                conn.execute(f"SELECT COUNT(*), AVG(age) FROM patients WHERE age > {i % 50} AND age < {200 + i}")
            except psycopg.Error as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(delay)
        conn.cancel()
        worker.join(30)
        error = outcome["error"]
    state, told = None, 0.0
    if error is None:
        told = next(float(n.split("ε=")[1].split(";")[0]) for n in notices if "charged ε=" in n)
    else:
        state = error.sqlstate
        assert state == "57014", (state, str(error))
        assert error.diag.message_primary == "canceling statement due to user request", server.log_text()[-2500:]
        detail = error.diag.message_detail or ""
        if "was charged for this statement" in detail:
            told = float(detail.split("ε=")[1].split(" ")[0])
    deadline = time.monotonic() + 10  # an abandoned statement logs its line when it ends
    while len(_query_lines(server)) <= logged_before:
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.02)
    logged, _ = _query_lines(server)[logged_before]
    return state, told, ledger.spent("health", "analyst").epsilon - spent_before, logged


def test_cancel_under_processes_is_the_users_and_every_figure_agrees(tmp_path: Path) -> None:
    server, path = _two_workers(tmp_path)
    ledger = Ledger.open(f"sqlite://{path.resolve()}")
    outcomes: Counter[str] = Counter()
    try:
        for i in range(30):
            state, told, charged, logged = _one(server, ledger, i, (0.0, 0.005, 0.015, 0.03, 0.06)[i % 5])
            outcomes[f"{state or 'ok'} charged={charged > 0}"] += 1
            assert abs(told - charged) < 1e-9 and abs(logged - charged) < 1e-6, (i, state, told, charged, logged)
        forwarded = len(re.findall(r"cancel request pid=\d+ forwarded to worker", server.log_text()))
    finally:
        ledger.close()
        server.stop()
    print(f"\ncancel outcomes under --processes 2: {dict(outcomes)}; forwarded between workers: {forwarded}")
    assert sum(n for k, n in outcomes.items() if k.startswith("57014")) >= 5, outcomes
    assert forwarded >= 1  # 30 cancels on new connections: the kernel gives some to the other worker
    assert "due to statement timeout" not in server.log_text()
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]
