"""Each analyst's share of the server's CPU, with back-pressure: the cap on free work.

Much of what an analyst can make the server do costs no ε: reading, routing and analysing a statement
(a 168 kB IN list took a second of the server's GIL), EXPLAIN, ``LIMIT 0`` probes, answers derived from
a synopsis or a coarsened release, accuracy-first's bisections, refusals. A charged query's CPU is no
better bounded either: at ε = 10⁻⁶ a budget pays for millions. Four connections of such work made another
analyst's DP COUNT 20× slower (issue #41), through the GIL more than the cores.

So every statement's CPU time in the server is metered against its analyst (:class:`CpuShare`): the
worker thread's own CPU time, plus the CPU the statement-routing helper process spent on it, as a
decaying average (CPU-seconds per second over the last ``window`` seconds). While other analysts are
active (a statement running, or one in the last :data:`ACTIVE_SECONDS`), an analyst using more than its
``share``, running statements side by side or costly ones (:data:`HEAVY_STATEMENT` on average), and more
than each other such analyst is the one that yields: its next statement waits until its average has
fallen back to the share (the wait counts against its statement timeout: 57014 when it outlasts it), and
its statements then run one at a time. An analyst alone is never held back (work-conserving), nor one
sending cheap statements one after another (the session the share protects, whatever its own rate). An
analyst sending free work without pause thus runs on one thread about ``share`` of the time while another
analyst is active, and that one's statements keep their latency (bench/attacks.py). The share is not
raised to the others' use: a light analyst querying without pause would otherwise license as much work
from the heavy one.

Privacy: whether a statement waits depends on the CPU the analyst's own statements used (visible to them
as their own latency) and on whether other analysts were active and their CPU use, as any shared server's
latency does; never on data through anything but the run times every query already shows.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dpsql.errors import QueryCanceled

#: CPU-seconds per second an analyst may use while others are active before it yields to them (a tenth of
#: the GIL: a quarter let a flood of free work slow another analyst's p50 2-16× on a loaded 2-core box).
DEFAULT_SHARE = 0.1
#: A statement costing this much CPU on average is heavy: its analyst yields even when it sends one at a time.
HEAVY_STATEMENT = 0.05
#: Seconds over which an analyst's CPU use is averaged (exponential decay).
DEFAULT_WINDOW = 5.0
#: An analyst counts as active for this long after its last statement.
ACTIVE_SECONDS = 2.0


@dataclass(slots=True)
class _Usage:
    #: Decayed CPU seconds (the rate is ``used / window``) and decayed number of statements, as of ``at``.
    used: float = 0.0
    statements: float = 0.0
    at: float = 0.0
    seen: float = -math.inf
    running: int = 0
    #: Held by the one statement admitted while this analyst yields (the others wait for it).
    serial: asyncio.Lock = field(default_factory=asyncio.Lock)


class CpuShare:
    """CPU use per analyst, and who yields to whom (see the module docstring). Used on the event loop:
    :meth:`started` and :meth:`finished` around every statement, :meth:`admit` before one that must yield."""

    def __init__(
        self, share: float = DEFAULT_SHARE, window: float = DEFAULT_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.share = share
        self.window = max(window, 1e-3)
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    def _of(self, analyst: str) -> _Usage:
        usage = self._usage.get(analyst)
        if usage is None:
            usage = self._usage[analyst] = _Usage(at=self.clock())
        return usage

    def rate(self, analyst: str) -> float:
        """``analyst``'s CPU-seconds per second, averaged over the window."""
        usage = self._usage.get(analyst)
        if usage is None:
            return 0.0
        return usage.used * math.exp(-(self.clock() - usage.at) / self.window) / self.window

    def _heavy(self, analyst: str) -> bool:
        """Whether ``analyst`` may have to yield: over its share, and either running statements side by side
        or sending costly ones (a session sending one cheap statement after another never yields: it is
        what the share protects, whatever its own rate)."""
        usage = self._usage.get(analyst)
        if usage is None or self.rate(analyst) <= self.share:
            return False
        return usage.running > 0 or usage.used >= HEAVY_STATEMENT * usage.statements

    def _target(self, analyst: str) -> float | None:
        """The rate ``analyst`` must fall to before its next statement (None: it need not wait): the share,
        when other analysts are active and it is the heaviest of those that may have to yield."""
        if self.share <= 0 or not self._heavy(analyst):
            return None
        now = self.clock()
        active = [n for n, u in self._usage.items() if n != analyst and (u.running or now - u.seen < ACTIVE_SECONDS)]
        if not active:
            return None
        mine = self.rate(analyst)
        if any(self._heavy(n) and self.rate(n) > mine for n in active):
            return None
        return self.share

    def must_wait(self, analyst: str) -> bool:
        usage = self._usage.get(analyst)
        return self._target(analyst) is not None or (usage is not None and usage.serial.locked())

    def started(self, analyst: str) -> None:
        usage = self._of(analyst)
        usage.running += 1
        usage.seen = self.clock()

    def finished(self, analyst: str, seconds: float) -> None:
        """A statement of ``analyst`` ended, having used ``seconds`` of CPU."""
        usage = self._of(analyst)
        now = self.clock()
        decay = math.exp(-(now - usage.at) / self.window)
        usage.used = usage.used * decay + max(seconds, 0.0)
        usage.statements = usage.statements * decay + 1.0
        usage.at = usage.seen = now
        usage.running = max(0, usage.running - 1)
        if len(self._usage) > 4096:  # forget analysts gone quiet
            for name in [n for n, u in self._usage.items() if not u.running and now - u.seen > 10 * self.window]:
                del self._usage[name]

    async def admit(self, analyst: str, remaining: Callable[[], float | None]) -> asyncio.Lock:
        """Wait for ``analyst``'s turn: its serial lock (one statement at a time while it yields), then until
        its rate has fallen to its target; 57014 when its statement's ``remaining()`` time runs out first.
        Returns the lock, held: the caller releases it when the statement ends."""
        lock = self._of(analyst).serial
        try:
            async with asyncio.timeout(remaining()):
                await lock.acquire()
                try:
                    while (target := self._target(analyst)) is not None:
                        rate = self.rate(analyst)
                        await asyncio.sleep(max(0.01, self.window * math.log(rate / target)))
                except BaseException:
                    lock.release()
                    raise
        except TimeoutError:
            raise QueryCanceled("canceling statement due to statement timeout") from None
        return lock
