"""One database connection per thread, shared by the ledger's stores and the PostgreSQL result cache.

A DB-API connection must not be used by two threads at once, nor cross ``fork()`` (a child sharing its
parent's libpq socket corrupts both sessions): each thread opens its own, a forked child forgets every
connection of its parent, and closing closes them all (best effort) and refuses new ones.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any


class ThreadConnections:
    """This process's connections, one per thread. ``closed`` makes the error a closed holder raises
    (the ledger's and the cache's say which of them is closed). ``lock`` guards the list; a store may
    hold it to share one connection (SQLite's ``:memory:``)."""

    def __init__(self, closed: Callable[[], Exception]) -> None:
        self.lock = threading.Lock()
        self._closed_error = closed
        self._local = threading.local()
        self._all: list[Any] = []
        self._pid = os.getpid()
        self._closed = False

    def current(self) -> Any:
        """This thread's connection, None before its first; raises ``closed()`` once closed."""
        if self._closed:
            raise self._closed_error()
        if os.getpid() != self._pid:  # a forked child: never reuse the parent's connections
            self._pid = os.getpid()
            self._local = threading.local()
            self._all = []
        return getattr(self._local, "conn", None)

    def first(self) -> Any:
        """The first connection opened (None: none yet); call holding :attr:`lock`."""
        return self._all[0] if self._all else None

    def keep(self, conn: Any, *, locked: bool = False) -> Any:
        """Make ``conn`` this thread's connection (``locked``: the caller holds :attr:`lock`)."""
        if locked:
            self._all.append(conn)
        else:
            with self.lock:
                self._all.append(conn)
        self._local.conn = conn
        return conn

    def use(self, conn: Any) -> Any:
        """Make an already kept connection this thread's too (a shared one)."""
        self._local.conn = conn
        return conn

    def drop(self, conn: Any | None = None) -> None:
        """Forget this thread's connection (or ``conn``) after an error and close it; the next call
        reconnects."""
        if conn is None:
            conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is None:
            return
        with self.lock:
            if conn in self._all:
                self._all.remove(conn)
        with suppress(Exception):  # already failing
            conn.close()

    def close(self, errors: tuple[type[BaseException], ...] = (Exception,)) -> None:
        """Close every connection (ignoring ``errors``); later calls of :meth:`current` raise."""
        with self.lock:
            self._closed = True
            connections, self._all = self._all, []
        for conn in connections:
            with suppress(*errors):
                conn.close()
