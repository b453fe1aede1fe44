"""Live reload: ``kill -HUP <pid>`` or ``dpsql reload`` re-reads a running server's policy.

The server builds a new :class:`~dpsql.engine.Engine` on the *same* backend, ledger and result
cache and swaps it in (:meth:`dpsql.server.server.Server.reload`): open connections stay, the budget
carries on, statements already running finish under the policy they started with. The new policy
must pass the same checks as at start (:mod:`dpsql.curator.check`), else it is refused with its
``file:line`` errors in the log and the previous policy keeps serving. Cached plans live in the old
engine and are dropped with it; cached results are keyed on the policy's hash
(:func:`dpsql.cache.policy_hash`), so nothing computed under the old bounds or units is served under
the new ones (unchanged results of an unchanged policy still are).

Privacy: a reload changes what future queries may reveal, never what was spent: the ledger is the
same, and a changed dataset name (another ledger key) is refused — that needs a restart.

The verdict: ``dpsql reload`` leaves a random token next to the pid file before signalling; each
serving process (one, or each worker of ``--processes N``) writes its verdict on that token to
``<pid file>.verdict-<pid>`` when its reload ends — after the new engine *and* its shadow catalog
(``\\d+``, column comments) are in place, so success means every surface shows the new policy — and
``dpsql reload`` waits for all of them and exits non-zero if any refused the policy: a curator never
believes a refused policy is serving.

The pid file holds the pid alone (``kill -HUP $(cat FILE)`` works); how many processes answer a
reload (``--processes N``) is in ``<pid file>.processes`` beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpsql.cache import policy_hash
from dpsql.engine import Engine
from dpsql.errors import Error, PolicyError
from dpsql.ledger import dpsql_home

from .check import check_file

log = logging.getLogger("dpsql.curator")


def make_reloader(policy_path: str | Path, status: Callable[[], Path | None] | None = None) -> PolicyReloader:
    """What the server calls on SIGHUP (:class:`dpsql.server.server.Reloader`). ``status`` names the pid
    file (known once the server listens) next to which the verdict is written for ``dpsql reload``."""
    return PolicyReloader(Path(policy_path), status)


class PolicyReloader:
    """Checks the re-read policy and builds its engine (``current`` if unchanged); the server reports
    the outcome through :meth:`refused` or :meth:`applied` only once engine and shadow catalog are
    swapped, so ``dpsql reload`` never prints success while a surface still shows the old policy."""

    def __init__(self, path: Path, status: Callable[[], Path | None] | None = None) -> None:
        self._check = _reloader(path)
        self._status = status

    def __call__(self, current: Engine) -> Engine:
        return self._check(current)

    def refused(self, error: BaseException) -> None:
        if isinstance(error, Error):  # a refusal's file:line reason; anything else stays in the log
            message = error.message + (f"\n{error.detail}" if error.detail else "")
        else:
            message = "internal error (see the server's log)"
        self._write(False, message)

    def applied(self, engine: Engine, changed: bool, warning: str | None = None) -> None:
        policy = engine.policy
        counts = f"{_plural(len(policy.tables), 'table')}, {_plural(len(policy.analysts), 'analyst')}"
        note = f"; WARNING: {' '.join(warning.split())}" if warning else ""  # one line: `dpsql reload` adds the pid
        self._write(True, f"policy {'reloaded' if changed else 'unchanged'}: {counts}{note}")

    def _write(self, ok: bool, message: str) -> None:
        pid_file = self._status() if self._status is not None else None
        if pid_file is not None:
            write_verdict(pid_file, ok, message)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _reloader(path: Path) -> Callable[[Engine], Engine]:
    def reload(current: Engine) -> Engine:
        report = check_file(path, current.backend)
        for warning in report.warnings:
            log.warning("policy: %s", warning)
        if report.policy is None or report.errors:
            raise PolicyError(report.errors[0], detail="\n".join(report.errors[1:]) or None)
        policy = report.policy
        if policy.dataset != current.policy.dataset:
            raise PolicyError(
                f"{path}: dataset: changed from '{current.policy.dataset}' to '{policy.dataset}'; "
                "a reload keeps the ledger of the dataset being served: restart dpsql serve instead"
            )
        if policy_hash(policy) == policy_hash(current.policy):
            return current
        return Engine(policy, current.backend, current.ledger, current.cache)

    return reload


# --- finding a running server: the pid file ---------------------------------------------------


def default_pid_file(port: int) -> Path:
    """``$DPSQL_HOME/serve-<port>.pid``: where ``dpsql serve`` says which process to signal."""
    return dpsql_home() / f"serve-{port}.pid"


def write_pid_file(path: Path, processes: int = 1) -> None:
    """``<pid>`` alone, as ``kill $(cat FILE)`` and service managers expect; with ``--processes N``
    the number of serving processes whose verdicts ``dpsql reload`` waits for goes to
    ``<pid file>.processes``, written first so a reader that finds the pid finds the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = _processes(path)
    if processes > 1:
        _write_atomically(count, f"{processes}\n")
    else:
        with contextlib.suppress(OSError):
            count.unlink()  # a previous supervisor's, on the same pid file
    _write_atomically(path, f"{os.getpid()}\n")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def remove_pid_file(path: Path) -> None:
    """Remove the pid file if it is still this process's (a newer server may have replaced it)."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text(encoding="utf-8").split()[0]) == os.getpid():
            path.unlink()
            for leftover in (_request(path), _processes(path)):
                with contextlib.suppress(OSError):
                    leftover.unlink()


def _processes(pid_file: Path) -> Path:
    return pid_file.with_name(pid_file.name + ".processes")


def _request(pid_file: Path) -> Path:
    return pid_file.with_name(pid_file.name + ".request")


def _verdict(pid_file: Path, pid: int) -> Path:
    return pid_file.with_name(f"{pid_file.name}.verdict-{pid}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One serving process's answer to a reload request."""

    pid: int
    ok: bool
    message: str


def write_verdict(pid_file: Path, ok: bool, message: str) -> None:
    """This process's verdict on the pending request (its token; none: ``kill -HUP`` by hand)."""
    try:
        token = _request(pid_file).read_text(encoding="utf-8").strip()
    except OSError:
        token = ""
    out = _verdict(pid_file, os.getpid())
    tmp = out.with_name(out.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"token": token, "ok": ok, "message": message}), encoding="utf-8")
        tmp.replace(out)


def remove_verdict(pid_file: Path) -> None:
    with contextlib.suppress(OSError):
        _verdict(pid_file, os.getpid()).unlink()


def signal_reload(pid_file: Path) -> tuple[int, str, int]:
    """Leave a fresh token, send SIGHUP to the server named in ``pid_file``; returns (pid, token,
    processes to hear from). Raises OSError/ValueError/IndexError when there is no such server."""
    lines = pid_file.read_text(encoding="utf-8").split("\n")
    pid = int(lines[0].split()[0])
    processes = 1
    with contextlib.suppress(OSError, ValueError, IndexError):  # none: a single serving process
        processes = max(1, int(_processes(pid_file).read_text(encoding="utf-8").split()[0]))
    for line in lines[1:]:  # a pid file written by an earlier release
        if line.startswith("processes "):
            processes = max(1, int(line.split()[1]))
    os.kill(pid, 0)  # alive (raises ProcessLookupError) before leaving a request behind
    token = secrets.token_hex(8)
    _request(pid_file).write_text(token + "\n", encoding="utf-8")
    os.kill(pid, signal.SIGHUP)
    return pid, token, processes


def await_verdicts(pid_file: Path, token: str, processes: int, timeout: float) -> list[Verdict]:
    """The verdicts on ``token`` written so far, polling until ``processes`` answered or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for path in pid_file.parent.glob(pid_file.name + ".verdict-*"):
            if path.name.endswith(".tmp"):
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads(path.read_text(encoding="utf-8"))
                if data["token"] == token:
                    found.append(Verdict(int(path.name.rsplit("-", 1)[1]), bool(data["ok"]), str(data["message"])))
        if len(found) >= processes or time.monotonic() >= deadline:
            return sorted(found, key=lambda v: v.pid)
        time.sleep(0.1)
