"""Shared-resource limits: worker slots with a per-analyst fair share, the shadow connection pool,
and interruption of a backend statement whose client gave up (through the backends' own seam,
:func:`dpsql.backends.cancellable`).

Everything here is used from the server's event loop thread, except :class:`Job`, which is
entered by the worker thread that runs a statement and poked by the loop to interrupt it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from dpsql.backends import statement_hook
from dpsql.errors import ConfigurationLimitExceeded, Error, QueryCanceled, TooManyConnections
from dpsql.ledger.audit import reservation_gate

log = logging.getLogger("dpsql.server")


def server_busy() -> Error:
    return ConfigurationLimitExceeded(
        "too many statements are waiting for a worker",
        hint="The server is saturated; retry shortly.",
    )


class WorkSlots:
    """Admission to the worker pool: ``workers`` slots in all, at most ``per_analyst`` for one analyst.

    A slot is held until the work *finishes* in its thread, not until the client stops waiting,
    so timed-out or cancelled work that is still running keeps counting against its analyst:
    one analyst can never occupy more than its share, however many statements it abandons.
    At most ``max_queued`` statements wait for a slot; beyond that new ones are refused (53400).
    """

    def __init__(self, workers: int, per_analyst: int, max_queued: int) -> None:
        self.workers = workers
        self.per_analyst = max(1, min(per_analyst, workers))
        self.max_queued = max_queued
        self._global = asyncio.Semaphore(workers)
        self._analysts: dict[str, asyncio.Semaphore] = {}
        self.queued = 0
        self.running: dict[str, int] = {}

    def _analyst(self, name: str) -> asyncio.Semaphore:
        sem = self._analysts.get(name)
        if sem is None:
            sem = self._analysts[name] = asyncio.Semaphore(self.per_analyst)
        return sem

    async def acquire(self, analyst: str) -> None:
        if self.queued >= self.max_queued:
            raise server_busy()
        own = self._analyst(analyst)
        self.queued += 1
        try:
            await own.acquire()
            try:
                await self._global.acquire()
            except BaseException:
                own.release()
                raise
        finally:
            self.queued -= 1
        self.running[analyst] = self.running.get(analyst, 0) + 1

    def release(self, analyst: str) -> None:
        self.running[analyst] -= 1
        if not self.running[analyst]:
            del self.running[analyst]
        self._global.release()
        self._analyst(analyst).release()


class Interrupted(QueryCanceled):
    """Raised into a pure job's thread by :meth:`Job.interrupt` (Python builds it without arguments)."""

    def __init__(self, message: str = "canceling statement due to user request", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)


class Job:
    """One statement running in a worker thread; :meth:`interrupt` stops its backend statement if it can."""

    _local = threading.local()

    def __init__(self, pure: bool = False) -> None:
        #: Pure work (statement splitting and routing: server code, no locks, no I/O) is stopped
        #: by raising QueryCanceled in its thread; other work only through the backend.
        self.pure = pure
        self._thread: int | None = None
        self.interrupted = False
        self._lock = threading.Lock()
        self._stoppers: list[Callable[[], Any]] = []
        #: Held around each reservation (:meth:`reserving`); :meth:`settle` waits for it.
        self._charging = threading.Lock()
        #: ε reserved by this statement so far (final once :meth:`settle` returned).
        self.charged = 0.0
        #: CPU seconds it used: its thread's CPU time and the helper process's time for it (:meth:`add_cpu`).
        self.cpu = 0.0

    @classmethod
    def current(cls) -> Job | None:
        return getattr(cls._local, "job", None)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        Job._local.job = self
        try:
            with self._lock:
                if self.interrupted:
                    raise QueryCanceled("canceling statement due to user request")
                self._thread = threading.get_ident() if self.pure else None
            started = time.thread_time()
            try:
                # backends offer each statement's cancel here; the engine's reservations pass the gate
                with statement_hook(self.stoppable), reservation_gate(self.reserving):
                    return fn(*args)
            finally:
                self.cpu += time.thread_time() - started
                with self._lock:
                    if self._thread is not None:
                        self._thread = None
                        _async_raise(threading.get_ident(), None)  # drop one not yet delivered
        finally:
            Job._local.job = None

    @contextlib.contextmanager
    def stoppable(self, stop: Callable[[], object]) -> Iterator[None]:
        """While a backend statement runs: :meth:`interrupt` calls ``stop`` (see
        :func:`dpsql.backends.cancellable`); a job already interrupted does not start it."""
        with self._lock:
            if self.interrupted:
                raise QueryCanceled("canceling statement due to user request")
            self._stoppers.append(stop)
        try:
            yield
        finally:
            with self._lock:
                self._stoppers.remove(stop)

    @contextlib.contextmanager
    def reserving(self) -> Iterator[Callable[[float], None]]:
        """Around one reservation: none starts once the job was interrupted (nobody would be told of
        it), and :meth:`settle` waits for one in progress, so the ε it reports is final."""
        with self._charging:
            if self.interrupted:
                raise QueryCanceled("canceling statement due to user request")
            yield self._record

    def add_cpu(self, seconds: float) -> None:
        """Time spent for this statement outside its thread (the statement-routing helper process)."""
        self.cpu += seconds

    def _record(self, epsilon: float) -> None:
        self.charged += epsilon

    def settle(self) -> float:
        """Interrupt, then the ε this statement reserved: no reservation can follow (blocking call)."""
        self.interrupt()
        with self._charging:
            return self.charged

    def interrupt(self) -> None:
        """Stop the work, once: a second call (settle, then abandon) must not raise into the thread again."""
        with self._lock:
            if self.interrupted:
                return
            self.interrupted = True
            stoppers = list(self._stoppers)
            if self._thread is not None:
                _async_raise(self._thread, Interrupted)
        for stop in stoppers:
            with contextlib.suppress(Exception):
                stop()


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


class ShadowPool:
    """Shadow-catalog connections shared by all clients: at most ``size`` open (all as the one
    analysts' role, so any idle connection serves anyone), at most half of them held by one analyst.

    A statement checks a connection out once it holds a worker slot, for the call only (the
    connection carries no client state: every client SET is answered by dpsql itself). When all
    are busy, or the analyst holds its share, it waits at most ``wait`` seconds, then gets 53300:
    an analyst flooding the catalog waits for its own connections, never takes all of them. A
    connection comes back when its call has ended, which the session's own deadline bounds
    (:class:`~dpsql.server.shadow_session.ShadowSession`); a broken one is discarded. Connecting and
    closing run on ``executor`` (None: the loop's default one), not on the statements' workers.
    """

    def __init__(self, shadow: Any, size: int, wait: float, executor: Executor | None = None) -> None:
        self.shadow = shadow
        self.size = size
        self.wait = wait
        self.executor = executor
        self.per_analyst = max(1, size // 2)
        self._busy = asyncio.Semaphore(size)
        self._analysts: dict[str, asyncio.Semaphore] = {}
        self._idle: list[Any] = []
        self.open = 0
        #: Connections checked out now.
        self.busy = 0

    async def acquire(self, analyst: str) -> Any:
        own = self._analysts.get(analyst)
        if own is None:
            own = self._analysts[analyst] = asyncio.Semaphore(self.per_analyst)
        try:
            async with asyncio.timeout(self.wait):
                await own.acquire()
                try:
                    await self._busy.acquire()
                except BaseException:
                    own.release()
                    raise
        except TimeoutError:
            raise TooManyConnections(
                "too many catalog queries in progress",
                hint="All catalog connections are busy; retry shortly.",
            ) from None
        self.busy += 1
        try:
            if self._idle:
                return self._idle.pop()
            self.open += 1
            try:
                return await asyncio.get_running_loop().run_in_executor(self.executor, self.shadow.connect, analyst)
            except BaseException:
                self.open -= 1
                raise
        except BaseException:
            self.busy -= 1
            self._busy.release()
            own.release()
            raise

    def _discard(self, session: Any) -> None:
        self.open -= 1
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().run_in_executor(self.executor, session.close)

    def release(self, analyst: str, session: Any) -> None:
        """Called on the loop once no thread uses ``session`` any more."""
        self.busy -= 1
        self._busy.release()
        self._analysts[analyst].release()
        if is_broken(session):
            self._discard(session)
        else:
            self._idle.append(session)

    def close(self) -> None:
        for session in self._idle:
            with contextlib.suppress(Exception):
                session.close()
        self._idle.clear()


def is_broken(session: Any) -> bool:
    conn = getattr(session, "_conn", None)
    if conn is None:
        return False
    if getattr(conn, "closed", False) or getattr(conn, "broken", False):
        return True
    try:
        from psycopg import pq

        return bool(conn.pgconn.status != pq.ConnStatus.OK)
    except Exception:
        return True
