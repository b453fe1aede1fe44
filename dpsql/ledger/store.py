"""What a ledger store provides (transactions, reads, one connection per thread) and the small dialect
table its shared statements go through.

Both stores run the same statements (written once, with ``?`` placeholders) and differ only in SQL
text and value encoding: the paramstyle, how a new row's id comes back, how a time is stored, and
whether the totals are set by the statement or by the store's insert trigger (:class:`Dialect`).
Everything that decides what is charged is written once, in :mod:`dpsql.ledger.base`.
"""

from __future__ import annotations

import datetime as dt
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from dpsql.accountant import Spent
from dpsql.errors import LedgerUnavailable
from dpsql.ledger.connections import ThreadConnections

HINT_UNAVAILABLE = (
    "No query is answered while the privacy ledger cannot record charges. "
    "Check the ledger URL, that its file or directory is writable, or that its database is reachable."
)

#: ``dpsql_ledger_meta`` key of the per-installation secret (see :meth:`dpsql.ledger.Ledger.installation_key`).
INSTALLATION_KEY = "installation_key"

#: ``execute(sql, params)`` inside a transaction of the store: returns a DB-API cursor.
Execute = Callable[[str, tuple[Any, ...]], Any]


def unavailable(reason: str, exc: BaseException | None = None) -> LedgerUnavailable:
    """The store's failure as :class:`LedgerUnavailable`: the caller fails closed (releases nothing)."""
    detail = f"{type(exc).__name__}: {exc}" if exc is not None else None
    return LedgerUnavailable(f"privacy ledger unavailable: {reason}", detail=detail, hint=HINT_UNAVAILABLE)


def ts(at: dt.datetime) -> str:
    """A time as stored in text: ISO 8601 in UTC, to the microsecond (so text order is time order)."""
    return at.astimezone(dt.UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class Dialect:
    """Where the stores' shared statements differ: SQL text and value encoding, nothing else."""

    #: The paramstyle's placeholder (the shared statements are written with ``?``).
    placeholder: str
    #: A new row's id comes from ``INSERT … RETURNING id`` (else from the cursor's ``lastrowid``).
    returning_id: bool
    #: Times are stored as ISO 8601 text (SQLite has no time type), else as ``timestamptz``.
    text_timestamps: bool
    #: Sets the analyst's totals row from a new charge's sums (None: the store's insert trigger does it).
    upsert_totals: str | None = None

    def sql(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def timestamp(self, at: dt.datetime) -> Any:
        return ts(at) if self.text_timestamps else at

    def params(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        """Parameters of a read, times encoded as stored (a ``since`` filter compares like with like)."""
        if not self.text_timestamps:
            return params
        return tuple(ts(p) if isinstance(p, dt.datetime) else p for p in params)

    def insert_id(self, execute: Execute, sql: str, params: tuple[Any, ...]) -> int:
        if self.returning_id:
            row = execute(sql + " RETURNING id", params).fetchone()
            assert row is not None
            return int(row[0])
        row_id = execute(sql, params).lastrowid
        assert row_id is not None
        return int(row_id)


class Store:
    """The primitives a ledger store supplies, and what both stores share: the dialect's encoding,
    one connection per thread (forgotten in a forked child), close hooks and closing."""

    url: str
    dialect: ClassVar[Dialect]
    #: Errors of a connection's ``close()`` that closing the ledger ignores (it is best effort).
    close_errors: ClassVar[tuple[type[BaseException], ...]] = (Exception,)

    _lock: threading.Lock
    _pool: ThreadConnections

    def _init_pool(self) -> None:
        self._pool = ThreadConnections(lambda: unavailable("the ledger is closed"))
        self._lock = self._pool.lock  # guards the connections (and SQLite's one :memory: connection)

    def _pooled(self) -> Any:
        """This thread's connection, None before its first; fails closed once the ledger is closed."""
        return self._pool.current()

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Run a read-only query (``?`` placeholders) and fetch every row; fail closed."""
        raise NotImplementedError

    def _append(self) -> AbstractContextManager[Execute]:
        """A short write transaction without the dataset's reservation lock (audit rows)."""
        raise NotImplementedError

    def _reservation(self, dataset: str) -> AbstractContextManager[Execute]:
        """A write transaction holding the dataset's reservation lock: every charge and lever on the
        dataset is ordered by it. Store errors surface as :class:`LedgerUnavailable` (fail closed)."""
        raise NotImplementedError

    def _spent_in(self, execute: Execute, dataset: str, analyst: str) -> tuple[Spent, Spent]:
        """(analyst's, dataset's) spending read inside a transaction of the store."""
        raise NotImplementedError

    def _meta_setdefault(self, key: str, value: str) -> str:
        """Store ``value`` under ``key`` unless some value is there already; return the stored one."""
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        """``sql`` (written with ``?`` placeholders) in the store's paramstyle."""
        return self.dialect.sql(sql)

    def _timestamp(self, at: dt.datetime) -> Any:
        return self.dialect.timestamp(at)

    def _insert_id(self, execute: Execute, sql: str, params: tuple[Any, ...]) -> int:
        return self.dialect.insert_id(execute, sql, params)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first when the ledger closes (the audit writer flushes and stops: a thread still
        writing on a connection being closed under it could crash the process). Held weakly."""
        self.__dict__.setdefault("_close_hooks", []).append(weakref.WeakMethod(hook))

    def _before_close(self) -> None:
        for ref in self.__dict__.pop("_close_hooks", []):
            hook = ref()
            if hook is not None:
                with suppress(Exception):
                    hook()

    def close(self) -> None:
        self._before_close()
        self._pool.close(self.close_errors)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
