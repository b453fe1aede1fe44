"""The front door: what clients that have not authenticated may hold, and how fast anyone may guess.

Strangers must not be able to lock analysts out (issue #27), so:

- :class:`PreAuth` gives sockets that have not finished authenticating a budget of their own,
  separate from authenticated sessions (``max_connections``), capped in all and per client
  address. At a cap the *newcomer is let in* and the least advanced, oldest pre-auth socket of the
  fullest address is closed (53300): silent sockets first, then those that only negotiated
  encryption, then those authenticating, oldest first. A socket that has sent its startup packet (an
  account is logging in) is never closed before it had ``grace`` seconds to finish; when every
  candidate is such a socket, the newcomer itself is closed instead. A flood of idle or churning
  sockets thus only ever evicts itself, while a real client's handshake, which takes milliseconds,
  completes (issue #41: 256 new silent sockets a second from the analyst's own address failed 2 of 27
  logins). Every pre-auth socket also has the (short) startup deadline.
- :class:`LoginLimiter` counts failed password checks per (account, address), per account and per
  address over a sliding window. Beyond a few free failures the account and the address are locked
  for an exponentially growing but short time (at most ``max_lock``): locked logins are refused
  (28000) before any password is checked — but never where that account logged in successfully
  before, so an attacker elsewhere cannot keep the real analyst out. The (account, address) pair is
  never locked: an address may be shared (a NAT, another local user, every client behind a TCP load
  balancer), so the real analyst and a guesser can be the same pair. Its failures *slow it down*
  instead (:meth:`LoginLimiter.turn`): its exchanges run one at a time, in arrival order, and each is
  answered — success or failure alike, so that the timing tells nothing — no sooner than the pair's
  delay after it started (``lock`` doubling per failure beyond the free ones, at most ``max_delay``).
  A correct password is therefore never refused, only delayed by the guesses queued before it
  (issue #41: two threads of wrong passwords from the analyst's own address failed 29 of their 30
  logins); guesses from the pair are answered at most one per delay. Unknown names are counted,
  locked and slowed like real ones, so nothing tells which names exist.

Both are per process (``--processes N``: per worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
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


@dataclass(slots=True)
class _Failures:
    count: int = 0
    last: float = 0.0
    until: float = 0.0
    #: For a pair: its exchanges take turns while it is slowed down (created on first use, on the loop).
    turns: asyncio.Lock | None = None


class LoginLimiter:
    """Failed logins per (account, address), account and address; see the module docstring.

    ``free_failures`` failures of a pair within ``window`` seconds are free; each further one slows the
    pair down to ``lock`` × 2^(n − free) seconds per exchange, at most ``max_delay``. The account and the
    address keys are locked alike past ``account_failures`` and ``address_failures``, for at most
    ``max_lock``. Each table keeps at most ``max_entries`` keys (the least recently failed go first)."""

    def __init__(
        self,
        *,
        free_failures: int = 5,
        lock: float = 1.0,
        max_lock: float = 30.0,
        max_delay: float = 4.0,
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
        """Seconds each exchange of the pair takes at least now (0: not slowed down)."""
        entry = self._pairs.get((user, address))
        if entry is None or self.clock() - entry.last > self.window or entry.count < self.free_failures:
            return 0.0
        return float(min(self.max_delay, self.lock * 2.0 ** min(entry.count - self.free_failures, 30)))

    @contextlib.asynccontextmanager
    async def turn(
        self, user: str, address: str, extend: Callable[[float], object] = lambda _: None
    ) -> AsyncIterator[bool]:
        """Around one password exchange of ``user`` from ``address``: while the pair is slowed down, wait for
        its turn (exchanges of the pair run one at a time, in arrival order), and answer no sooner than its
        delay after the turn began, whatever the outcome. ``extend(seconds)`` is told how long the turn made
        the exchange wait, so that the startup deadline does not count it. Yields whether it was slowed."""
        if self.delay(user, address) <= 0:
            yield False
            return
        entry = self._pairs[(user, address)]
        if entry.turns is None:
            entry.turns = asyncio.Lock()
        turns, queued = entry.turns, time.monotonic()
        async with turns:
            began = time.monotonic()
            delay = self.delay(user, address)
            extend(began - queued + delay)
            try:
                yield True
            finally:
                await asyncio.sleep(max(0.0, began + delay - time.monotonic()))

    def failed(self, user: str, address: str) -> None:
        """Record a wrong password (the locks it sets apply at once, even to attempts in flight)."""
        now = self.clock()
        self._count(self._pairs, (user, address), now, self.free_failures)
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

    def _count(self, table: OrderedDict[Any, _Failures], key: Any, now: float, free: int) -> None:
        entry = table.get(key)
        if entry is None:
            entry = table[key] = _Failures()
            while len(table) > self.max_entries:
                table.popitem(last=False)
        elif now - entry.last > self.window:
            entry.count = 0
        table.move_to_end(key)
        entry.count += 1
        entry.last = now
        if entry.count >= free and table is not self._pairs:  # a pair is slowed down (:meth:`delay`), never locked
            entry.until = max(entry.until, now + min(self.max_lock, self.lock * 2 ** min(entry.count - free, 30)))


def _left(entry: _Failures | None, now: float) -> float:
    return 0.0 if entry is None else max(0.0, entry.until - now)
