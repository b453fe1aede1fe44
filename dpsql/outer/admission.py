"""Process-wide admission of post-processing sandboxes, and the databases they run in.

The privacy argument and design notes: docs/internals.md, section dpsql/outer/admission.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dpsql.backends import cancellable, timed_out
from dpsql.errors import ConfigurationLimitExceeded, QueryCanceled
from dpsql.outer.sandbox import Database, Sandbox
from dpsql.pgtypes import PgType

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: What one sandbox reserves: DuckDB's ``memory_limit`` (128 MB), the fetched result's cap (64 MiB), and
#: 64 MiB for what DuckDB does not count (strings) and the batch being converted.
RESERVED_BYTES = 256 * MIB
#: Sandbox memory of the process in all (``dpsql serve --sandbox-memory``): two sandboxes at once.
DEFAULT_MEMORY = 512 * MIB

#: (name, (column, PostgreSQL type) pairs, rows) of a table loaded into the sandbox.
Table = tuple[str, Sequence[tuple[str, PgType]], Sequence[tuple[Any, ...]]]


class _Waiter:
    __slots__ = ("analyst", "cancelled")

    def __init__(self, analyst: str) -> None:
        self.analyst = analyst
        self.cancelled = False


class Admission:
    """Admission of sandboxes: ``memory // RESERVED_BYTES`` at once (at least one), ``per_analyst`` per
    analyst, each analyst's CPU time charged to a token bucket (``cpu_rate`` 0: not limited).

    Thread-safe; used from the statements' worker threads. :attr:`running` and :attr:`peak` (the most
    sandboxes ever admitted at once) are for tests and the operator."""

    def __init__(
        self,
        memory: int = DEFAULT_MEMORY,
        per_analyst: int = 1,
        cpu_rate: float = 0.5,
        cpu_burst: float = 30.0,
        max_waiting: int = 64,
    ) -> None:
        self._cond = threading.Condition()
        self._queue: list[_Waiter] = []
        self._buckets: dict[str, tuple[float, float]] = {}
        self.running: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.configure(memory, per_analyst, cpu_rate, cpu_burst, max_waiting)

    def configure(
        self,
        memory: int | None = None,
        per_analyst: int | None = None,
        cpu_rate: float | None = None,
        cpu_burst: float | None = None,
        max_waiting: int | None = None,
    ) -> None:
        """Change the limits (None: keep); sandboxes already running keep their place."""
        with self._cond:
            if memory is not None:
                self.memory = memory
            if per_analyst is not None:
                self.per_analyst = max(1, per_analyst)
            if cpu_rate is not None:
                self.cpu_rate = max(0.0, cpu_rate)
            if cpu_burst is not None:
                self.cpu_burst = max(0.0, cpu_burst)
            if max_waiting is not None:
                self.max_waiting = max(0, max_waiting)
            self._cond.notify_all()

    @property
    def capacity(self) -> int:
        """Sandboxes admitted at once."""
        return max(1, self.memory // RESERVED_BYTES)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    # -- CPU --------------------------------------------------------------------------------------

    def _tokens(self, analyst: str, now: float) -> float:
        tokens, stamp = self._buckets.get(analyst, (self.cpu_burst, now))
        return min(self.cpu_burst, tokens + (now - stamp) * self.cpu_rate)

    def cpu_wait(self, analyst: str, now: float | None = None) -> float:
        """Seconds until ``analyst`` may start a sandbox again (0: now): the CPU time its sandboxes used
        beyond its bucket, refilled at ``cpu_rate``."""
        if not self.cpu_rate:
            return 0.0
        tokens = self._tokens(analyst, time.monotonic() if now is None else now)
        return 0.0 if tokens > 0 else -tokens / self.cpu_rate + 1e-3

    def charge(self, analyst: str, seconds: float) -> None:
        """Charge ``seconds`` of sandbox CPU time to ``analyst``."""
        with self._cond:
            now = time.monotonic()
            tokens = self._tokens(analyst, now) - seconds
            if tokens >= self.cpu_burst:
                self._buckets.pop(analyst, None)  # full: nothing to remember
            else:
                self._buckets[analyst] = (tokens, now)
            self._cond.notify_all()

    # -- admission ------------------------------------------------------------------------------

    def _turn(self, waiter: _Waiter, now: float) -> bool:
        """Whether ``waiter`` goes now: a place is free once every earlier waiter that may go has one."""
        free = self.capacity - self.total
        taken: dict[str, int] = {}
        for other in self._queue:
            if free <= 0:
                return False
            own = self.running.get(other.analyst, 0) + taken.get(other.analyst, 0)
            ready = own < self.per_analyst and self.cpu_wait(other.analyst, now) <= 0
            if other is waiter:
                return ready
            if ready:
                free -= 1
                taken[other.analyst] = taken.get(other.analyst, 0) + 1
        return False

    def _wake(self, waiter: _Waiter) -> None:
        with self._cond:
            waiter.cancelled = True
            self._cond.notify_all()

    def acquire(self, analyst: str, deadline: float | None) -> None:
        """Wait for a place (57014 at ``deadline``, :func:`time.monotonic`; 53400 when too many wait)."""
        waiter = _Waiter(analyst)
        with self._cond:
            if len(self._queue) >= self.max_waiting:
                raise ConfigurationLimitExceeded(
                    "too many post-processing statements are waiting for the sandbox",
                    hint="The server is saturated; retry shortly.",
                )
            self._queue.append(waiter)
        try:
            with cancellable(lambda: self._wake(waiter)), self._cond:
                while True:
                    if waiter.cancelled:
                        raise QueryCanceled("canceling statement due to user request")
                    now = time.monotonic()
                    if self._turn(waiter, now):
                        break
                    if deadline is not None and now >= deadline:
                        raise timed_out()
                    timeout = None if deadline is None else deadline - now
                    if self.cpu_wait(analyst, now) > 0:  # nobody notifies when the bucket refills
                        refill = self.cpu_wait(analyst, now)
                        timeout = refill if timeout is None else min(timeout, refill)
                    self._cond.wait(timeout)
                self.running[analyst] = self.running.get(analyst, 0) + 1
                self.total += 1
                self.peak = max(self.peak, self.total)
        finally:
            with self._cond:
                self._queue.remove(waiter)
                self._cond.notify_all()  # the order changed: a later waiter may go now

    def release(self, analyst: str, cpu_seconds: float = 0.0) -> None:
        """The sandbox has ended: its place is free, its CPU time charged."""
        with self._cond:  # a reentrant lock: charge takes it again
            self.running[analyst] -= 1
            if not self.running[analyst]:
                del self.running[analyst]
            self.total -= 1
            self.charge(analyst, cpu_seconds)


#: The process's sandbox admission (``dpsql serve`` configures it from its options).
ADMISSION = Admission()


def configure(
    memory: int | None = None,
    per_analyst: int | None = None,
    cpu_rate: float | None = None,
    cpu_burst: float | None = None,
    max_waiting: int | None = None,
) -> Admission:
    """Set the process's sandbox limits (None: keep); returns :data:`ADMISSION`."""
    ADMISSION.configure(memory, per_analyst, cpu_rate, cpu_burst, max_waiting)
    return ADMISSION


# -- databases --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublicTable:
    """A public policy table the outer statement reads: ``name`` in the statement, its declared
    ``columns``, the ``key`` of its rows (backend, data stamp, source, columns: equal keys, equal rows)
    and ``read``, which reads them from the backend when no kept copy has that key."""

    name: str
    columns: Sequence[tuple[str, PgType]]
    key: str
    read: Callable[[], Sequence[tuple[Any, ...]]]


class Databases:
    """Post-processing databases kept between statements (:class:`dpsql.outer.sandbox.Database`), at most
    as many idle as sandboxes may run at once; each admitted statement takes one for itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Database] = []

    def take(self) -> Database:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return Database()

    def give(self, database: Database, keep: int) -> None:
        """Back after a statement: reset (:meth:`Database.reset`), kept unless broken or ``keep`` are idle."""
        database.reset()
        with self._lock:
            if not database.broken and len(self._idle) < keep:
                self._idle.append(database)
                return
        database.close()

    def clear(self) -> None:
        """Close the idle databases (their public copies go with them)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for database in idle:
            database.close()


#: The process's post-processing databases.
DATABASES = Databases()


def post_process(
    analyst: str,
    deadline: float | None,
    tables: Sequence[Table],
    sql: str,
    kinds: Sequence[PgType | None] | None = None,
    admission: Admission | None = None,
    public: Sequence[PublicTable] = (),
) -> list[tuple[Any, ...]]:
    """Run ``sql`` over ``tables`` (released rows) and ``public`` tables, once admitted, in a kept
    database (a connection of its own, on this thread: the priority of the statement it serves); its
    rows as released values of ``kinds`` (see :meth:`Sandbox.run`).

    The place is given back, and the sandbox's CPU time (reading a public table from the backend
    excepted) charged to ``analyst``, when the sandbox has ended."""
    gate = ADMISSION if admission is None else admission
    gate.acquire(analyst, deadline)
    started = time.thread_time()
    reading = 0.0
    database = DATABASES.take()

    def reader(table: PublicTable) -> Callable[[], Sequence[tuple[Any, ...]]]:
        def read() -> Sequence[tuple[Any, ...]]:
            nonlocal reading
            began = time.thread_time()
            try:
                return table.read()
            finally:
                reading += time.thread_time() - began

        return read

    try:
        with Sandbox(deadline, database=database) as box:
            for spec in public:
                box.alias(spec.name, database.public_table(box, spec.key, spec.columns, reader(spec)))
            for name, columns, rows in tables:
                box.load(name, columns, rows)
            return box.run(sql, kinds)
    finally:
        DATABASES.give(database, gate.capacity)
        gate.release(analyst, max(0.0, time.thread_time() - started - reading))
