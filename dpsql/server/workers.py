"""Several ``dpsql serve`` worker processes on one port (``dpsql serve --processes N``).

The privacy argument and design notes: docs/internals.md, section dpsql/server/workers.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsql.curator.reload import default_pid_file, remove_pid_file, write_pid_file
from dpsql.server.cancels import MAX_WORKERS

log = logging.getLogger("dpsql.server.workers")


def _placeholder(host: str, port: int) -> socket.socket:
    """Bind (never listen on) ``host:port`` with SO_REUSEPORT: reserves the port, tells ``--port 0``'s choice."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


#: How often a worker checks that its supervisor is still its parent (where prctl is not available).
WATCH_SECONDS = 1.0
#: After SIGTERM for an orphaned worker, how long its clean shutdown may take before it is ended (its own
#: deadline, :func:`dpsql.server.server.shutdown_deadline`, comes first).
ORPHAN_GRACE_SECONDS = 20.0
#: After SIGTERM, how long the supervisor waits for its workers before it kills each worker's process
#: group (the worker and its helper processes): beyond the workers' own shutdown deadline.
KILL_AFTER_SECONDS = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with(supervisor: int) -> None:
    """End this worker when ``supervisor`` (its parent) dies, however it dies (``kill -9`` included).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, the kernel signals the worker when its parent exits.
    Everywhere: a daemon thread sees the parent change (an orphan is re-parented) and sends the worker
    SIGTERM itself, then ends it outright if the clean shutdown outlasts :data:`ORPHAN_GRACE_SECONDS`.
    The check after prctl covers a supervisor that died before the worker got that far."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(WATCH_SECONDS)
        log.error("supervisor (pid %d) is gone: this worker stops", supervisor)
        with contextlib.suppress(ProcessLookupError):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="dpsql-supervisor-watch", daemon=True).start()


def _worker_main(
    serve: Callable[[argparse.Namespace], int], options: dict[str, Any], index: int, supervisor: int | None = None
) -> None:
    """One worker: ``serve`` (``dpsql serve``'s command, handed down by it: pickled by name for the
    spawned process) on the shared port, its log lines tagged with its index and pid."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload before the server listens must not kill it
    with contextlib.suppress(OSError):
        os.setpgrp()  # its own process group, with its helper processes: the supervisor can end them all
    logging.basicConfig(
        level=str(options["log_level"]).upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [worker {index} pid %(process)d] %(message)s",
        stream=sys.stderr,
    )
    if supervisor is not None:
        _die_with(supervisor)
    args = argparse.Namespace(**options, worker_index=index)
    try:
        code = serve(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def supervise(args: argparse.Namespace, serve: Callable[[argparse.Namespace], int]) -> int:
    """Run ``args.processes`` workers of ``serve`` (a module-level function, ``dpsql serve``'s command)
    on ``args.host:args.port`` until SIGINT/SIGTERM or a worker exits."""
    count = int(args.processes)
    if count > MAX_WORKERS:
        print(f"ERROR:  --processes is at most {MAX_WORKERS}", file=sys.stderr)
        return 1
    if not hasattr(socket, "SO_REUSEPORT"):
        print("ERROR:  --processes needs SO_REUSEPORT (Linux, BSD, macOS)", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    try:
        placeholder = _placeholder(args.host, args.port)
    except OSError as exc:
        print(f"ERROR:  could not listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    port = int(placeholder.getsockname()[1])
    options = {k: v for k, v in vars(args).items() if k != "func"}
    options.update(port=port, processes=1, reuse_port=True, pid_file="")  # the supervisor's pid is the one to signal
    cancel_dir = tempfile.mkdtemp(prefix="dpsql-cancel-")  # 0700: only this user's workers reach the sockets
    options["cancel_dir"] = cancel_dir
    ctx = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    def forward_reload(signum: int, frame: Any) -> None:  # SIGHUP: every worker re-reads the policy
        for proc in workers:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGHUP)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, forward_reload)
    workers: list[Any] = []
    pid_file = Path(args.pid_file) if getattr(args, "pid_file", None) else default_pid_file(port)
    if getattr(args, "pid_file", None) != "":
        write_pid_file(pid_file, count)
        options["reload_status"] = str(pid_file)  # each worker's reload verdict goes next to it
    code = 0
    try:
        for index in range(count):
            proc = ctx.Process(
                target=_worker_main, args=(serve, options, index, os.getpid()), name=f"dpsql-worker-{index}"
            )
            proc.start()
            workers.append(proc)
        log.info("dpsql supervisor: %d worker processes on %s:%d", count, args.host, port)
        while not stopping:
            dead = [p for p in workers if not p.is_alive()]
            if dead:
                code = dead[0].exitcode or 1
                log.error("worker %s exited with %s: stopping the others", dead[0].name, dead[0].exitcode)
                break
            time.sleep(0.2)
    finally:
        for proc in workers:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()  # SIGTERM: each worker shuts down cleanly, logging late charges
        deadline = time.monotonic() + KILL_AFTER_SECONDS
        for proc in workers:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in workers:  # a stuck worker, and any helper left behind by one that exited: the whole group
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.join(5)
        placeholder.close()
        remove_pid_file(pid_file)
        shutil.rmtree(cancel_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
