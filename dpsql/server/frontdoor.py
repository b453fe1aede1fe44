"""The front door: what clients that have not authenticated may hold, and how fast anyone may guess.

The privacy argument and design notes: docs/internals.md, section dpsql/server/frontdoor.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Pending:
    """One socket that has not finished authenticating."""

    address: str
    evict: Callable[[], object]
    since: float = field(default_factory=time.monotonic)
    #: 0: nothing received yet; 1: a first packet (encryption negotiation); 2: startup packet received
    #: (an account is authenticating).
    stage: int = 0
    #: When it reached stage 2.
    started: float = 0.0


class PreAuth:
    """Sockets before authentication: at most ``limit`` in all and ``per_address`` per client address.

    Entering never fails; at a cap an older pending socket is evicted instead (see the module)."""

    def __init__(self, limit: int, per_address: int, grace: float = 2.0) -> None:
        self.limit = max(1, limit)
        self.per_address = max(1, min(per_address, self.limit))
        self.grace = grace
        self._by_address: dict[str, dict[Pending, None]] = {}
        self.count = 0
        self.evicted = 0

    def enter(self, address: str, evict: Callable[[], object]) -> Pending | None:
        """A new socket's place; None when the cap is reached and no other may be closed yet (the caller
        then closes the newcomer)."""
        mine = self._by_address.get(address)
        if mine is not None and len(mine) >= self.per_address:
            if not self._evict_from(address):
                return None
        elif self.count >= self.limit:
            fullest = sorted(self._by_address, key=lambda a: len(self._by_address[a]), reverse=True)
            if not any(self._evict_from(a) for a in fullest):
                return None
        pending = Pending(address, evict)
        self._by_address.setdefault(address, {})[pending] = None
        self.count += 1
        return pending

    def leave(self, pending: Pending | None) -> None:
        """The socket authenticated, closed or was evicted (idempotent)."""
        if pending is None:
            return
        mine = self._by_address.get(pending.address)
        if mine is None or pending not in mine:
            return
        del mine[pending]
        if not mine:
            del self._by_address[pending.address]
        self.count -= 1

    def _evict_from(self, address: str) -> bool:
        """Close the least advanced, oldest socket of ``address`` that may be closed; False when none may."""
        now = time.monotonic()
        candidates = [p for p in self._by_address[address] if p.stage < 2 or now - p.started >= self.grace]
        if not candidates:
            return False
        victim = min(candidates, key=lambda p: (p.stage, p.since))
        self.leave(victim)
        self.evicted += 1
        victim.evict()
        return True


class Slots:
    """At most ``size`` holders at once; waiters are served strictly in arrival order (first come, first
    served: a waiting exchange is never overtaken by one that arrived after it)."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.held < self.size and not self._waiters:
            self.held += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # :meth:`release` handed its place over (``held`` unchanged)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over just as it was cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.held -= 1

    @property
    def idle(self) -> bool:
        return self.held == 0 and not self._waiters


@dataclass(slots=True)
class _Failures:
    count: int = 0
    last: float = 0.0
    until: float = 0.0


class LoginTurn:
    """One password exchange admitted by :meth:`LoginLimiter.turn`: call :meth:`failed` on a wrong password
    (or an exchange that held its place too long) instead of :meth:`LoginLimiter.failed`."""

    def __init__(self, limiter: LoginLimiter, user: str, address: str, slowed: bool) -> None:
        self.limiter, self.user, self.address = limiter, user, address
        #: The pair was slowed down when the exchange was admitted (it then has a deadline of its own).
        self.slowed = slowed
        #: How long the failure reply (and the exchange's place) is held; 0 until :meth:`failed`.
        self.hold = 0.0

    def failed(self) -> None:
        self.limiter.failed(self.user, self.address)
        self.hold = self.limiter.delay(self.user, self.address)


class LoginLimiter:
    """Failed logins per (account, address), account and address; see the module docstring.

    ``free_failures`` failures of a pair within ``window`` seconds are free; each further one slows the
    pair down: its wrong passwords are answered, and keep their place among the pair's ``slots`` checks,
    ``lock`` × 2^(n − free) seconds, at most ``max_delay``. The account and the address keys are locked
    alike past ``account_failures`` and ``address_failures``, for at most ``max_lock``. Each table keeps at
    most ``max_entries`` keys (the least recently failed go first)."""

    def __init__(
        self,
        *,
        free_failures: int = 5,
        lock: float = 1.0,
        max_lock: float = 30.0,
        max_delay: float = 16.0,
        slots: int = 8,
        account_failures: int = 30,
        address_failures: int = 60,
        window: float = 900.0,
        remember: float = 7 * 86400.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free_failures = max(1, free_failures)
        self.lock = lock
        self.max_lock = max_lock
        self.max_delay = max_delay
        self.slots = max(1, slots)
        self.account_failures = max(1, account_failures)
        self.address_failures = max(1, address_failures)
        self.window = window
        self.remember = remember
        self.max_entries = max(1, max_entries)
        self.clock = clock
        self._pairs: OrderedDict[tuple[str, str], _Failures] = OrderedDict()
        self._accounts: OrderedDict[str, _Failures] = OrderedDict()
        self._addresses: OrderedDict[str, _Failures] = OrderedDict()
        #: (account, address) pairs that logged in successfully, and when.
        self._good: OrderedDict[tuple[str, str], float] = OrderedDict()
        #: Each pair's places while any is taken or awaited (at most one per pre-auth socket or held failure):
        #: apart from the failure counts, so that no churn of other names can evict them.
        self._places: dict[tuple[str, str], Slots] = {}

    def __len__(self) -> int:
        return len(self._pairs) + len(self._accounts) + len(self._addresses) + len(self._good)

    def locked(self, user: str, address: str) -> float:
        """Seconds until ``user`` may try a password from ``address`` again (0: now): the account's and the
        address's locks, which never apply where ``user`` logged in before (the pair itself is only slowed)."""
        now = self.clock()
        if self._known_good(user, address, now):
            return 0.0
        return max(_left(self._accounts.get(user), now), _left(self._addresses.get(address), now))

    def delay(self, user: str, address: str) -> float:
        """Seconds a wrong password of the pair is held now (0: not slowed down)."""
        entry = self._pairs.get((user, address))
        if entry is None or self.clock() - entry.last > self.window or entry.count < self.free_failures:
            return 0.0
        return float(min(self.max_delay, self.lock * 2.0 ** min(entry.count - self.free_failures, 30)))

    @contextlib.asynccontextmanager
    async def turn(
        self, user: str, address: str, paused: Callable[[], contextlib.AbstractContextManager[object]]
    ) -> AsyncIterator[LoginTurn]:
        """Around one password exchange of ``user`` from ``address``. Every exchange of the pair takes one of
        its ``slots`` places first (waiting in arrival order) and is checked at once when admitted; a correct
        password leaves at once, a wrong one (:meth:`LoginTurn.failed`) keeps its place and its reply for the
        pair's delay, even when its client has gone. So the pair's guesses are checked at most ``slots`` per
        delay, and a correct password waits only for the places of the exchanges that were waiting before it.
        ``paused()`` suspends the startup deadline while waiting or holding."""
        key, loop = (user, address), asyncio.get_running_loop()
        slots = self._places.get(key)
        if slots is None:
            slots = self._places[key] = Slots(self.slots)

        def give_back() -> None:
            slots.release()
            if slots.idle and self._places.get(key) is slots:
                del self._places[key]

        try:
            with paused():
                await slots.acquire()
        except BaseException:
            if slots.idle and self._places.get(key) is slots:
                del self._places[key]
            raise
        turn = LoginTurn(self, user, address, slowed=self.delay(user, address) > 0)
        try:
            yield turn
        finally:
            if turn.hold > 0:  # the place is given back by the loop, whatever becomes of this exchange
                loop.call_later(turn.hold, give_back)
                with paused():
                    await asyncio.sleep(turn.hold)
            else:
                give_back()

    def failed(self, user: str, address: str) -> None:
        """Record a wrong password (the locks it sets apply at once, even to attempts in flight)."""
        now = self.clock()
        self._count(self._pairs, (user, address), now, self.free_failures)
        if self._known_good(user, address, now):  # the pair's slow-down bounds these guesses: a guesser sharing
            return  # the analyst's address must not lock the analyst out elsewhere, nor the address's others
        self._count(self._accounts, user, now, self.account_failures)
        self._count(self._addresses, address, now, self.address_failures)

    def succeeded(self, user: str, address: str) -> None:
        """A correct password: the pair is known good (its failures stay: a guesser may share it)."""
        self._good[(user, address)] = self.clock()
        self._good.move_to_end((user, address))
        while len(self._good) > self.max_entries:
            self._good.popitem(last=False)

    def _known_good(self, user: str, address: str, now: float) -> bool:
        when = self._good.get((user, address))
        return when is not None and now - when < self.remember

    def _entry(self, table: OrderedDict[Any, _Failures], key: Any) -> _Failures:
        entry = table.get(key)
        if entry is None:
            entry = table[key] = _Failures()
            while len(table) > self.max_entries:
                table.popitem(last=False)
        table.move_to_end(key)
        return entry

    def _count(self, table: OrderedDict[Any, _Failures], key: Any, now: float, free: int) -> None:
        entry = self._entry(table, key)
        if now - entry.last > self.window:
            entry.count = 0
        entry.count += 1
        entry.last = now
        if entry.count >= free and table is not self._pairs:  # a pair is slowed down (:meth:`delay`), never locked
            entry.until = max(entry.until, now + min(self.max_lock, self.lock * 2 ** min(entry.count - free, 30)))


def _left(entry: _Failures | None, now: float) -> float:
    return 0.0 if entry is None else max(0.0, entry.until - now)
