"""CancelRequests between the worker processes of ``dpsql serve --processes N``.

A client cancels on a new connection, which the kernel may hand to any worker. Each worker hands out
backend pids that name it (:meth:`CancelRoutes.pid_of`: the worker's index in the top bits), and
listens on a Unix datagram socket in a directory only the server's user can enter, created by the
supervisor. A CancelRequest for another worker's pid is forwarded there as is (pid, secret): the
owner alone checks the secret and cancels, so the forwarding worker learns nothing, and a request
that matches nothing is dropped silently everywhere, as PostgreSQL drops it. One process alone
(``index`` None) keeps every pid local.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("dpsql.server")

#: Bits of a backend pid a worker numbers its connections with; the worker's index sits above them.
LOCAL_BITS = 24
#: Workers one supervisor may start: their index and the local bits fit a positive int32 pid.
MAX_WORKERS = 2 ** (31 - LOCAL_BITS)
_REQUEST = struct.Struct("!ii")


class CancelRoutes:
    """This worker's index, its pid range and its datagram socket, in the supervisor's ``directory``."""

    def __init__(self, index: int | None = None, directory: str | None = None) -> None:
        if index is not None and not 0 <= index < MAX_WORKERS:
            raise ValueError(f"worker index {index} outside [0, {MAX_WORKERS})")
        self.index = index if directory else None
        self.directory = Path(directory) if directory else None
        self._socket: socket.socket | None = None

    def pid_of(self, local: int) -> int:
        """The backend pid of this worker's ``local``-th connection (wraps within its range)."""
        local %= 1 << LOCAL_BITS
        return local if self.index is None else (self.index << LOCAL_BITS) | local

    def owner(self, pid: int) -> int | None:
        """The worker a pid names, None when it is this one's (or there are no workers)."""
        if self.index is None or pid < 0:
            return None
        worker = pid >> LOCAL_BITS
        return None if worker == self.index else worker

    def _path(self, index: int) -> Path:
        assert self.directory is not None
        return self.directory / f"cancel-{index}"

    def listen(self, deliver: Callable[[int, int], None]) -> None:
        """Receive the CancelRequests other workers forward here, on the running loop."""
        if self.index is None:
            return
        path = self._path(self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        self._socket = sock

        def readable() -> None:
            while True:
                try:
                    data = sock.recv(64)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                if len(data) == _REQUEST.size:
                    deliver(*_REQUEST.unpack(data))

        asyncio.get_running_loop().add_reader(sock.fileno(), readable)

    def forward(self, worker: int, pid: int, secret: int) -> None:
        """Hand a CancelRequest to the worker that owns ``pid``; never blocks, never fails aloud."""
        if self.directory is None:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.sendto(_REQUEST.pack(pid, secret), str(self._path(worker)))
            log.info("cancel request pid=%d forwarded to worker %d", pid, worker)

    def close(self) -> None:
        if self._socket is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
        self._socket.close()
        self._socket = None
        with contextlib.suppress(OSError):
            self._path(self.index or 0).unlink()
