"""Bytes the server holds for its clients, capped per statement, session, analyst and server.

The privacy argument and design notes: docs/internals.md, section dpsql/server/memory.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from dpsql.errors import OutOfMemory, ProgramLimitExceeded, QueryCanceled

log = logging.getLogger("dpsql.server")

MIB = 1 << 20
#: One result (or portal, cursor, prepared statement): above the shadow catalog's own 32 MB cut
#: and the sandbox's 64 MiB of values, so any result those let through fits unless it has very
#: many tiny rows (a Python tuple per row costs more than its values).
STATEMENT_MEMORY = 64 * MIB
#: One session: a cursor or portal holding one full-size result and room to read another.
SESSION_MEMORY = 128 * MIB
#: All sessions of one analyst (up to 32): two sessions' worth, so opening sessions buys nothing.
ANALYST_MEMORY = 256 * MIB
#: All sessions: three analysts at their cap. With the interpreter, DuckDB and the engine's caches
#: (~300 MB) `dpsql serve` then stays near 1 GB even when every analyst holds the most it may.
SERVER_MEMORY = 768 * MIB
#: Reserved for every authenticated session whatever the others hold: its prepared statements (asyncpg and
#: JDBC prepare every statement) and small catalog results never meet a full server (issue #41).
SESSION_FLOOR = 1 * MIB
#: After this much was given back, the C allocator returns free memory to the OS (RSS falls).
TRIM_AFTER = 32 * MIB
#: What a prepared statement holds besides its text (the planned Statement, columns, parameter types).
STATEMENT_OVERHEAD = 1024


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MB" if n >= MIB else f"{(n + 1023) // 1024} kB"


def value_size(value: Any, depth: int = 0) -> int:
    """What one value costs in Python (its object; a container's elements, a few levels deep)."""
    if value is None or value is True or value is False:
        return 0  # singletons
    size = sys.getsizeof(value)
    if depth < 3 and isinstance(value, list | tuple | set | frozenset):
        size += sum(value_size(v, depth + 1) for v in value)
    elif depth < 3 and isinstance(value, dict):
        size += sum(value_size(k, depth + 1) + value_size(v, depth + 1) for k, v in value.items())
    return size


def row_size(row: Sequence[Any]) -> int:
    """A row as held in a result: its tuple, its values and its slot in the list of rows."""
    return 8 + sys.getsizeof(row) + sum(value_size(v) for v in row)


def rows_size(rows: Iterable[Sequence[Any]]) -> int:
    return 64 + sum(row_size(r) for r in rows)


def statement_size(sql: str, param_oids: Sequence[int] = ()) -> int:
    """A prepared statement as the session holds it: its text and its plan's small parts.

    Parse trees are not held by the session but by the engine's statement and plan caches, which
    are bounded by bytes themselves (see :class:`dpsql.lru.LRU`); measured with tracemalloc, the
    server's own Statement costs its text plus well under 1 kB."""
    return sys.getsizeof(sql) + 8 * len(param_oids) + STATEMENT_OVERHEAD


def params_size(params: Sequence[bytes | None]) -> int:
    return 64 + sum(8 + (sys.getsizeof(p) if p is not None else 0) for p in params)


class Memory:
    """The server's accountant: bytes held per session, per analyst and in all, under caps."""

    def __init__(
        self,
        statement: int = STATEMENT_MEMORY,
        session: int = SESSION_MEMORY,
        analyst: int = ANALYST_MEMORY,
        total: int = SERVER_MEMORY,
        floor: int = SESSION_FLOOR,
    ) -> None:
        self.statement_cap = statement
        self.session_cap = session
        self.analyst_cap = analyst
        self.total_cap = total
        self.floor = max(0, floor)
        self._lock = threading.Lock()
        #: Bytes held in all (floors included), and beyond the floors per analyst and in all.
        self.total = 0
        self.by_analyst: dict[str, int] = {}
        self.shared = 0
        #: Authenticated sessions open (each reserves its floor).
        self.sessions = 0
        self._freed = 0

    def session(self) -> SessionMemory:
        return SessionMemory(self)

    def _beyond(self, account: SessionMemory, held: int) -> int:
        """The part of ``held`` bytes of ``account`` that comes from the shared pool (beyond its floor)."""
        return max(0, held - (self.floor if account.floored else 0))

    def _take(self, account: SessionMemory, hold: Hold, n: int) -> None:
        with self._lock:
            if account.closed or hold.released:
                raise QueryCanceled("canceling statement because the session ended")
            if hold.nbytes + n > self.statement_cap:
                raise ProgramLimitExceeded(
                    f"{hold.what} is too large (more than {_size(self.statement_cap)}, the limit for one statement)",
                    hint=_HINTS.get(hold.what, _HINT),
                )
            analyst = self.by_analyst.get(account.analyst, 0)
            extra = self._beyond(account, account.held + n) - self._beyond(account, account.held)
            pool = self.total_cap - self.floor * self.sessions  # every open session's floor stays reserved
            if account.held + n > self.session_cap:
                where = f"this session holds {_size(account.held)} (at most {_size(self.session_cap)} per session)"
            elif extra and analyst + extra > self.analyst_cap:
                where = (
                    f'the sessions of role "{account.analyst}" hold {_size(analyst)} together beyond their reserved '
                    f"{_size(self.floor)} each (at most {_size(self.analyst_cap)} per analyst)"
                )
            elif extra and self.shared + extra > pool:
                where = (
                    f"the server holds its limit for all sessions ({_size(self.total_cap)}, of which "
                    f"{_size(self.floor)} is reserved for each session)"
                )
            else:
                hold.nbytes += n
                account.held += n
                self.total += n
                self._adjust(account.analyst, extra)
                return
        raise OutOfMemory(
            "out of memory",
            detail=f"Failed on request of size {n} bytes for a {hold.what}: {where}.",
            hint=_HINT,
        )

    def _give(self, account: SessionMemory, hold: Hold, n: int | None = None) -> None:
        with self._lock:
            n = hold.nbytes if n is None else min(n, hold.nbytes)
            hold.nbytes -= n
            if account.closed or n <= 0:
                return
            self._credit(account, account.held - n)

    def _credit(self, account: SessionMemory, held: int) -> None:
        """``account`` now holds ``held`` bytes (less than before): the analyst's and the pool's figures follow."""
        freed = account.held - held
        self._adjust(account.analyst, self._beyond(account, held) - self._beyond(account, account.held))
        account.held = held
        self.total -= freed
        self._freed += freed

    def _adjust(self, analyst: str, delta: int) -> None:
        """``analyst``'s bytes beyond its sessions' floors change by ``delta`` (and the shared pool's)."""
        if not delta:
            return
        left = self.by_analyst.get(analyst, 0) + delta
        if left > 0:
            self.by_analyst[analyst] = left
        else:
            self.by_analyst.pop(analyst, None)
        self.shared += delta

    def _open(self, account: SessionMemory, analyst: str) -> None:
        """``account`` authenticated as ``analyst``: its floor is reserved from now on."""
        with self._lock:
            if account.closed or account.floored:
                return
            self._adjust(account.analyst, -self._beyond(account, account.held))
            account.analyst, account.floored = analyst, True
            self.sessions += 1
            self._adjust(analyst, self._beyond(account, account.held))

    def _close(self, account: SessionMemory) -> int:
        with self._lock:
            if account.closed:
                return 0
            held = account.held
            self._credit(account, 0)
            account.closed = True
            if account.floored:
                self.sessions -= 1
            return held

    def _move(self, source: Hold, target: Hold) -> None:
        with self._lock:
            target.nbytes += source.nbytes
            source.nbytes = 0

    def trim_due(self) -> bool:
        """Whether enough was given back since the last trim to return memory to the OS now."""
        with self._lock:
            if self._freed < TRIM_AFTER:
                return False
            self._freed = 0
            return True


_HINT = (
    "Read the results you asked for, CLOSE cursors, close portals and DEALLOCATE prepared statements "
    "that are no longer needed, or use fewer sessions at once."
)
_HINTS = {
    "result": "Add LIMIT, aggregate further, or select fewer or shorter columns.",
    "cursor": "Add LIMIT, aggregate further, or select fewer or shorter columns.",
    "portal": "Bind fewer or shorter parameters.",
}


class SessionMemory:
    """One session's account; ``analyst`` is set once it has authenticated."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.analyst = ""
        self.held = 0
        self.closed = False
        #: Authenticated: its floor is reserved (:meth:`open`).
        self.floored = False

    def open(self, analyst: str) -> None:
        """The session authenticated as ``analyst``: its holds count against that analyst, and its floor is
        reserved for it from now on."""
        self.memory._open(self, analyst)

    @property
    def beyond_floor(self) -> int:
        """Bytes this session holds beyond its reserved floor."""
        return self.memory._beyond(self, self.held)

    def hold(self, what: str, nbytes: int = 0) -> Hold:
        """A new hold of ``nbytes`` for a ``what`` (named in refusals); raises 54000/53200 beyond a cap."""
        hold = Hold(self, what)
        hold.grow(nbytes)
        return hold

    def close(self) -> int:
        """Disconnect: give back everything the session holds (later releases are no-ops); the bytes."""
        return self.memory._close(self)


class Hold:
    """The bytes one object holds: grown as it fills (54000/53200 beyond a cap, nothing kept),
    given back once by :meth:`release` (shared holds: once the last sharer released it)."""

    __slots__ = ("account", "nbytes", "parts", "refs", "released", "what")

    def __init__(self, account: SessionMemory, what: str) -> None:
        self.account = account
        self.what = what
        self.nbytes = 0
        self.refs = 1
        self.released = False
        #: Holds released with this one (a portal shares its prepared statement's).
        self.parts: list[Hold] = []

    def grow(self, n: int) -> None:
        """Take ``n`` more bytes (thread-safe); a released hold refuses (its work is abandoned)."""
        if n > 0:
            self.account.memory._take(self.account, self, n)

    def give_back(self, n: int | None = None) -> None:
        """Return ``n`` bytes (all by default) and stay usable."""
        self.account.memory._give(self.account, self, n)

    def share(self) -> Hold:
        self.refs += 1
        return self

    def absorb(self, other: Hold) -> None:
        """Take over ``other``'s bytes (already accounted: no cap is checked again) and parts."""
        self.account.memory._move(other, self)
        self.parts.extend(other.parts)
        other.parts = []
        other.release()

    def release(self) -> None:
        if self.released:
            return
        self.refs -= 1
        if self.refs > 0:
            return
        self.released = True
        self.give_back()
        parts, self.parts = self.parts, []
        for part in parts:
            part.release()


K = TypeVar("K")
V = TypeVar("V")


class HeldStore(dict[K, V]):
    """A session's named objects (prepared statements, portals, cursors) and the hold of each.

    However an entry leaves (del, pop, clear, replaced by a new value), its hold is released, so
    no code path that closes an object can forget to give its bytes back."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: dict[K, Hold] = {}

    def put(self, key: K, value: V, hold: Hold | None) -> None:
        """Store ``value`` with ``hold`` (the previous entry's is released)."""
        self[key] = value
        if hold is not None:
            self.attach(key, hold)

    def attach(self, key: K, hold: Hold) -> None:
        """Add ``hold`` to ``key``'s (released at once when there is no such entry any more)."""
        if key not in self:
            hold.release()
        elif (held := self.holds.get(key)) is not None:
            held.absorb(hold)
        else:
            self.holds[key] = hold

    def hold_of(self, key: K) -> Hold | None:
        return self.holds.get(key)

    def _drop(self, key: K) -> None:
        hold = self.holds.pop(key, None)
        if hold is not None:
            hold.release()

    def __setitem__(self, key: K, value: V) -> None:
        if key in self and self[key] is not value:
            self._drop(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._drop(key)

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            value = super().pop(key)
            self._drop(key)
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        self._drop(key)
        return key, value

    def clear(self) -> None:
        holds = list(self.holds.values())
        self.holds.clear()
        super().clear()
        for hold in holds:
            hold.release()

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


#: glibc once looked up (False: not available).
_libc: Any = None
#: mallopt's M_MMAP_THRESHOLD, and the size above which every block gets its own mapping.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 * 1024


def _glibc() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt"):
                _libc = libc
    return _libc


def tune_allocator() -> bool:
    """Keep every block above 256 kB (large values, statement texts, socket buffers) in its own
    mapping, returned to the OS as soon as it is freed. glibc would otherwise raise that threshold
    each time such a block is freed (up to 32 MB), serve the next ones from heaps that rarely
    shrink, and RSS would stay near its peak long after the memory was given back. A no-op without
    glibc."""
    libc = _glibc()
    if not libc:
        return False
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except Exception:  # pragma: no cover - a libc without a usable mallopt
        return False


def release_to_os() -> bool:
    """``malloc_trim(0)``: glibc keeps freed memory for reuse, so after a large result or a session
    is freed RSS would stay high; this hands free pages back. A no-op without glibc."""
    libc = _glibc()
    if not libc:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except Exception:  # pragma: no cover - a libc without a usable malloc_trim
        return False


__all__ = [
    "ANALYST_MEMORY",
    "SERVER_MEMORY",
    "SESSION_FLOOR",
    "SESSION_MEMORY",
    "STATEMENT_MEMORY",
    "HeldStore",
    "Hold",
    "Memory",
    "SessionMemory",
    "params_size",
    "release_to_os",
    "row_size",
    "rows_size",
    "statement_size",
    "tune_allocator",
    "value_size",
]
