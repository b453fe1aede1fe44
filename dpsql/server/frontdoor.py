"""The front door: what clients that have not authenticated may hold, and how fast anyone may guess.

Strangers must not be able to lock analysts out (issue #27), so:

- :class:`PreAuth` gives sockets that have not finished authenticating a budget of their own,
  separate from authenticated sessions (``max_connections``), capped in all and per client
  address. At a cap the *newcomer is let in* and the least advanced, oldest pre-auth socket of the
  fullest address is closed (53300): sockets without a startup packet yet go first, oldest first.
  A flood of idle sockets thus only ever evicts itself, while a real client's handshake, which
  takes milliseconds, completes. Every pre-auth socket also has the (short) startup deadline.
- :class:`LoginLimiter` counts failed password checks per (account, address), per account and per
  address over a sliding window. Beyond a few free failures each key is locked for an
  exponentially growing but short time (at most ``max_lock``): locked logins are refused (28000)
  before any password is checked. A lock on the account or on the address never applies where that
  account logged in successfully before, so an attacker elsewhere cannot keep the real analyst
  out; the (account, address) lock always applies, but stays short. Unknown names are counted and
  locked like real ones, so a lock tells nothing about which names exist.

Both are per process (``--processes N``: per worker).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Pending:
    """One socket that has not finished authenticating."""

    address: str
    evict: Callable[[], object]
    since: float = field(default_factory=time.monotonic)
    #: 0: nothing received yet; 1: startup packet received (authenticating).
    stage: int = 0


class PreAuth:
    """Sockets before authentication: at most ``limit`` in all and ``per_address`` per client address.

    Entering never fails; at a cap an older pending socket is evicted instead (see the module)."""

    def __init__(self, limit: int, per_address: int) -> None:
        self.limit = max(1, limit)
        self.per_address = max(1, min(per_address, self.limit))
        self._by_address: dict[str, dict[Pending, None]] = {}
        self.count = 0
        self.evicted = 0

    def enter(self, address: str, evict: Callable[[], object]) -> Pending:
        mine = self._by_address.get(address)
        if mine is not None and len(mine) >= self.per_address:
            self._evict_from(address)
        elif self.count >= self.limit:
            self._evict_from(max(self._by_address, key=lambda a: len(self._by_address[a])))
        pending = Pending(address, evict)
        self._by_address.setdefault(address, {})[pending] = None
        self.count += 1
        return pending

    def leave(self, pending: Pending) -> None:
        """The socket authenticated, closed or was evicted (idempotent)."""
        mine = self._by_address.get(pending.address)
        if mine is None or pending not in mine:
            return
        del mine[pending]
        if not mine:
            del self._by_address[pending.address]
        self.count -= 1

    def _evict_from(self, address: str) -> None:
        victim = min(self._by_address[address], key=lambda p: (p.stage, p.since))
        self.leave(victim)
        self.evicted += 1
        victim.evict()


@dataclass(slots=True)
class _Failures:
    count: int = 0
    last: float = 0.0
    until: float = 0.0


class LoginLimiter:
    """Failed logins per (account, address), account and address; see the module docstring.

    ``free_failures`` failures of a key within ``window`` seconds are free; each further one locks
    the key for ``lock`` × 2^(n − free) seconds, at most ``max_lock``. The account and the address
    keys use the larger thresholds ``account_failures`` and ``address_failures``. Each table keeps
    at most ``max_entries`` keys (the least recently failed are forgotten first)."""

    def __init__(
        self,
        *,
        free_failures: int = 5,
        lock: float = 1.0,
        max_lock: float = 30.0,
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
        """Seconds until ``user`` may try a password from ``address`` again (0: now)."""
        now = self.clock()
        left = _left(self._pairs.get((user, address)), now)
        if not self._known_good(user, address, now):
            left = max(left, _left(self._accounts.get(user), now), _left(self._addresses.get(address), now))
        return left

    def failed(self, user: str, address: str) -> None:
        """Record a wrong password (the locks it sets apply at once, even to attempts in flight)."""
        now = self.clock()
        self._count(self._pairs, (user, address), now, self.free_failures)
        self._count(self._accounts, user, now, self.account_failures)
        self._count(self._addresses, address, now, self.address_failures)

    def succeeded(self, user: str, address: str) -> None:
        self._pairs.pop((user, address), None)
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
        if entry.count >= free:
            entry.until = max(entry.until, now + min(self.max_lock, self.lock * 2 ** min(entry.count - free, 30)))


def _left(entry: _Failures | None, now: float) -> float:
    return 0.0 if entry is None else max(0.0, entry.until - now)
