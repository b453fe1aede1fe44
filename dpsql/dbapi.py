"""PEP 249 (DB-API 2.0) driver: ``dpsql.connect(...)`` talks to an in-process :class:`Engine`.

Cursors expose, beside the standard API, what a DP answer needs to be read correctly:
``accuracy`` (confidence half-width per cell), ``intervals`` (quantiles' value intervals),
``epsilon_spent``, ``delta_spent``, ``remaining_epsilon`` and ``notices``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpsql import errors
from dpsql.backends import DEFAULT_STATEMENT_TIMEOUT_MS
from dpsql.engine import Engine
from dpsql.errors import (
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    InterfaceError,
    InternalError,
    InvalidCursorState,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    Warning,
)
from dpsql.pgtypes import BYTEA, OID, PG_TYPE_OIDS
from dpsql.policy import Policy
from dpsql.session import Result, Session

apilevel = "2.0"
threadsafety = 1  # threads may share the module; the engine itself is thread-safe
paramstyle = "pyformat"  # %s and %(name)s, as psycopg; $1 also works

__all__ = [
    "BINARY",
    "DATETIME",
    "NUMBER",
    "ROWID",
    "STRING",
    "Connection",
    "Cursor",
    "DataError",
    "DatabaseError",
    "Error",
    "IntegrityError",
    "InterfaceError",
    "InternalError",
    "NotSupportedError",
    "OperationalError",
    "ProgrammingError",
    "Warning",
    "apilevel",
    "connect",
    "paramstyle",
    "threadsafety",
]


class _TypeSet(frozenset[int]):
    """PEP 249 type objects compare equal to any of their type codes."""

    def __eq__(self, other: object) -> bool:
        return other in self if isinstance(other, int) else frozenset.__eq__(self, other)

    def __hash__(self) -> int:
        return frozenset.__hash__(self)


STRING = _TypeSet({PG_TYPE_OIDS["text"]})
NUMBER = _TypeSet({PG_TYPE_OIDS[t] for t in ("bigint", "integer", "smallint", "double precision", "numeric")})
DATETIME = _TypeSet({PG_TYPE_OIDS["date"], PG_TYPE_OIDS["timestamp"], PG_TYPE_OIDS["timestamp with time zone"]})
BINARY = _TypeSet({BYTEA})
ROWID = _TypeSet({OID})
Date, Time, Timestamp = dt.date, dt.time, dt.datetime


def connect(
    policy: str | Path | Policy | None = None,
    database: str = "duckdb://",
    analyst: str = "analyst",
    *,
    ledger: str | None = None,
    engine: Engine | None = None,
    epsilon: float | None = None,
    delta: float | None = None,
    mechanism: str | None = None,
    confidence: float | None = None,
    accuracy: float | str | None = None,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
) -> Connection:
    """Open a DP connection as ``analyst``: give a policy + database URL (+ ledger URL), or an engine.

    Without ``ledger`` the connection charges the persistent per-dataset ledger shared with the
    CLI (SQLite under ``$DPSQL_HOME``): every connection of a dataset draws on one budget.
    ``ledger="memory"`` (or ``"sqlite:///:memory:"``) gives a throwaway budget, for tests only.
    Statements on the database are cancelled after ``statement_timeout_ms`` (60 s by default; 0: never).
    ``accuracy`` (``10`` or ``'±10'``, as ``SET dpsql.accuracy``): each query is charged the least ε whose
    intervals are that narrow, instead of ``epsilon``.
    """
    # the SET dpsql.* grammar: a value the wire server would refuse is refused here too (22023)
    session = Session.configure(
        analyst, epsilon=epsilon, delta=delta, mechanism=mechanism, confidence=confidence, accuracy=accuracy
    )
    if engine is None:
        if policy is None:
            raise InterfaceError("connect() needs a policy (file path or Policy) or an engine")
        engine = Engine.open(policy, database, ledger, statement_timeout_ms=statement_timeout_ms)
        owns = True
    else:
        owns = False
    return Connection(engine, session, owns_engine=owns)


class Connection:
    """A session of one analyst; commit/rollback are no-ops (dpsql is read-only)."""

    Error, Warning, InterfaceError, DatabaseError = Error, Warning, InterfaceError, DatabaseError
    DataError, OperationalError, IntegrityError = DataError, OperationalError, IntegrityError
    InternalError, ProgrammingError, NotSupportedError = InternalError, ProgrammingError, NotSupportedError

    def __init__(self, engine: Engine, session: Session, *, owns_engine: bool = False) -> None:
        self.engine = engine
        self.session = session
        self._owns_engine = owns_engine
        self.closed = False

    def cursor(self) -> Cursor:
        self._check_open()
        return Cursor(self)

    def commit(self) -> None:
        self._check_open()

    def rollback(self) -> None:
        self._check_open()

    def close(self) -> None:
        if not self.closed and self._owns_engine:
            self.engine.close()
        self.closed = True

    def explain(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> Any:
        """What ``sql`` would cost and how accurate it would be; spends nothing."""
        self._check_open()
        return self.engine.explain(sql, self.session, params)

    def _check_open(self) -> None:
        if self.closed:
            raise InterfaceError("connection already closed")

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Cursor:
    """Runs DP queries; results are noisy rows plus their accuracy and cost."""

    arraysize = 1

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._result: Result | None = None
        self._position = 0
        self.closed = False

    @property
    def description(self) -> list[tuple[str, int, None, None, None, None, None]] | None:
        if self._result is None:
            return None
        return [(c.name, c.type_oid, None, None, None, None, None) for c in self._result.columns]

    @property
    def rowcount(self) -> int:
        return -1 if self._result is None else self._result.rowcount

    @property
    def accuracy(self) -> list[tuple[float | None, ...]]:
        """Confidence half-width of each released cell (same shape as the rows)."""
        return [] if self._result is None else self._result.accuracy

    @property
    def intervals(self) -> list[tuple[tuple[float, float] | None, ...]]:
        """Each quantile cell's value interval (low, high), same shape as the rows; [] when none has one
        (a result served again from the cache keeps only the notes that state them)."""
        return [] if self._result is None else self._result.intervals

    @property
    def epsilon_spent(self) -> float:
        return 0.0 if self._result is None else self._result.epsilon_spent

    @property
    def delta_spent(self) -> float:
        return 0.0 if self._result is None else self._result.delta_spent

    @property
    def remaining_epsilon(self) -> float | None:
        return None if self._result is None else self._result.remaining_epsilon

    @property
    def notices(self) -> list[str]:
        return [] if self._result is None else self._result.notices

    def execute(self, operation: str, parameters: Sequence[Any] | Mapping[str, Any] | None = None) -> Cursor:
        self._check_open()
        self._result = None
        try:
            self._result = self.connection.engine.execute(operation, self.connection.session, parameters)
        except Error:
            raise
        except Exception as exc:  # keep the PEP 249 contract: every failure is an Error
            raise errors.InternalError("internal error") from exc
        self._position = 0
        return self

    def executemany(self, operation: str, seq_of_parameters: Sequence[Any]) -> Cursor:
        for parameters in seq_of_parameters:
            self.execute(operation, parameters)
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        rows = self._rows()
        if self._position >= len(rows):
            return None
        self._position += 1
        return rows[self._position - 1]

    def fetchmany(self, size: int | None = None) -> list[tuple[Any, ...]]:
        rows = self._rows()
        size = self.arraysize if size is None else size
        chunk = rows[self._position : self._position + size]
        self._position += len(chunk)
        return chunk

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows = self._rows()
        chunk = rows[self._position :]
        self._position = len(rows)
        return chunk

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while (row := self.fetchone()) is not None:
            yield row

    def setinputsizes(self, sizes: Any) -> None:
        pass

    def setoutputsize(self, size: Any, column: Any = None) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def _rows(self) -> list[tuple[Any, ...]]:
        self._check_open()
        if self._result is None:
            raise InvalidCursorState("no results to fetch")
        return self._result.rows

    def _check_open(self) -> None:
        if self.closed:
            raise InterfaceError("cursor already closed")
        self.connection._check_open()

    def __enter__(self) -> Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
