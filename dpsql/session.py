"""Values that cross the engine boundary: who asks, with which settings, and what comes back.

Front doors (DB-API driver, CLI, wire server) build a :class:`Session` and receive a
:class:`Result`; they never see the rewritten SQL's raw output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PgType = Literal["bigint", "double precision", "text", "date", "timestamp", "boolean", "numeric"]

#: PostgreSQL type OIDs for the types dpsql returns (wire protocol, DB-API type codes).
PG_TYPE_OIDS: dict[str, int] = {
    "boolean": 16,
    "bigint": 20,
    "text": 25,
    "double precision": 701,
    "date": 1082,
    "timestamp": 1114,
    "numeric": 1700,
}


@dataclass(frozen=True, slots=True)
class OutputColumn:
    """One released column, named as PostgreSQL would name it."""

    name: str
    type: PgType

    @property
    def type_oid(self) -> int:
        return PG_TYPE_OIDS[self.type]


@dataclass(slots=True)
class Session:
    """Per-connection state: the analyst and the dpsql settings they chose (``SET dpsql.…``)."""

    analyst: str
    epsilon: float | None = None
    delta: float | None = None
    mechanism: Literal["laplace", "gaussian"] | None = None
    confidence: float | None = None
    settings: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Result:
    """A released answer: noisy rows plus what the analyst needs to judge them."""

    columns: list[OutputColumn]
    rows: list[tuple[Any, ...]]
    #: 95% (or session confidence) half-width per cell; None for group keys and exact values.
    accuracy: list[tuple[float | None, ...]]
    epsilon_spent: float
    delta_spent: float
    remaining_epsilon: float | None = None
    notices: list[str] = field(default_factory=list)
    command_tag: str = "SELECT"

    @property
    def rowcount(self) -> int:
        return len(self.rows)
