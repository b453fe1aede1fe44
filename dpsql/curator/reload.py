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
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dpsql.cache import policy_hash
from dpsql.errors import PolicyError

from .check import check_file

if TYPE_CHECKING:
    from dpsql.engine import Engine

log = logging.getLogger("dpsql.curator")


def make_reloader(policy_path: str | Path) -> Callable[[Engine], Engine]:
    """What the server calls on SIGHUP: the engine for the re-read policy (``current`` if unchanged)."""
    path = Path(policy_path)

    def reload(current: Engine) -> Engine:
        from dpsql.engine import Engine

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
    from dpsql.ledger import dpsql_home

    return dpsql_home() / f"serve-{port}.pid"


def write_pid_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n", encoding="utf-8")
    tmp.replace(path)


def remove_pid_file(path: Path) -> None:
    """Remove the pid file if it is still this process's (a newer server may have replaced it)."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text(encoding="utf-8").split()[0]) == os.getpid():
            path.unlink()


def signal_reload(pid_file: Path) -> int:
    """Send SIGHUP to the server named in ``pid_file``; returns its pid. Raises OSError/ValueError."""
    pid = int(pid_file.read_text(encoding="utf-8").split()[0])
    os.kill(pid, signal.SIGHUP)
    return pid
