"""What the ledger stores, as values: charges, curator actions, audited statements, and how a stored
row reads back (a row no valid value can hold, as a hand could write it, reads as the worst case)."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from dpsql.accountant import NO_GRANT, Accounting, Allowance, BudgetLike, Cost, Remaining, Spent, remaining_budget
from dpsql.errors import InsufficientPrivilege


@dataclass(frozen=True)
class Charge:
    """A committed charge, with the totals it brought the analyst and the dataset to."""

    id: int
    at: dt.datetime
    dataset: str
    analyst: str
    fingerprint: str
    cost: Cost
    accounting: Accounting
    analyst_spent: Spent
    dataset_spent: Spent
    #: The analyst's limit this charge was checked against: the policy's budget plus every grant.
    analyst_limit: Allowance = NO_GRANT
    #: The ``dpsql_audit`` row written with the charge, in its transaction (finalised when the statement ends).
    audit_id: int | None = None
    #: The dataset's budget this charge was checked against (None: not known, e.g. a hand-made Charge).
    dataset_limit: Allowance | None = None
    #: Under pld accounting: the composed ε (PLD at the limit's δ) this charge brought the analyst and
    #: the dataset to (None: another accounting, or not known).
    composed: tuple[float, float] | None = None

    def remaining(self, accounting: Accounting) -> Remaining:
        """What the analyst can still spend after this charge: the smaller of their own remaining budget
        and the dataset's (see :func:`min_remaining`); under pld, from the composed losses."""
        if accounting == "pld" and self.composed is not None:
            own = pld_remaining(self.composed[0], self.analyst_spent, self.analyst_limit)
            if self.dataset_limit is None:
                return own
            return min_remaining(own, pld_remaining(self.composed[1], self.dataset_spent, self.dataset_limit))
        own = remaining_budget(self.analyst_spent, self.analyst_limit, accounting)
        if self.dataset_limit is None:
            return own
        return min_remaining(own, remaining_budget(self.dataset_spent, self.dataset_limit, accounting))


#: Who a charge made for the dataset itself is recorded as: a curator's synopsis (``synopsis:<name>``) or
#: DP bounds (``curator:<user>``, or ``curator``); never an analyst's budget.
DATASET_CHARGES = ("synopsis:", "curator:")


def dataset_charge(name: str, analysts: set[str]) -> bool:
    """Whether ledger rows under ``name`` are a dataset charge rather than an analyst's (``analysts``: the
    policy's names; a curator charging DP bounds to a declared analyst charges that analyst)."""
    return name not in analysts and (name.startswith(DATASET_CHARGES) or name == "curator")


def pld_remaining(loss: float, spent: Spent, budget: BudgetLike) -> Remaining:
    """What is left under pld accounting after a composed loss of ``loss`` (ε at the budget's δ):
    ε_budget − loss, the loss composed so far and not an additive allowance (the next charge composes
    sublinearly), and δ_budget − Σδ."""
    return Remaining(max(0.0, budget.epsilon - loss), max(0.0, budget.delta - spent.delta), 0.0)


def min_remaining(analyst: Remaining, dataset: Remaining) -> Remaining:
    """The budget an analyst can really spend: their own remaining and the dataset's, whichever is smaller
    (componentwise). Shown to the analyst too: it says no more about the others' spending than the free
    53P01 refusals a query beyond it already would."""
    return Remaining(
        min(analyst.epsilon, dataset.epsilon), min(analyst.delta, dataset.delta), min(analyst.rho, dataset.rho)
    )


@dataclass(frozen=True)
class ChargeRecord:
    """One row of the audit log as stored (under zcdp, ``cost.rho`` is the ρ actually charged)."""

    id: int
    at: dt.datetime
    dataset: str
    analyst: str
    fingerprint: str
    cost: Cost
    accounting: Accounting
    #: The stored cost is not a finite, valid cost (a tampered row): ``cost`` is then zero and readers
    #: must count the row as exhausting the budget.
    corrupt: bool = False


@dataclass(frozen=True)
class AnalystSpent:
    """One row of ``dpsql budget``: an analyst's spending on a dataset."""

    analyst: str
    spent: Spent
    last_at: dt.datetime | None


#: Largest δ a limit can have (``Allowance`` needs δ < 1).
MAX_DELTA = math.nextafter(1.0, 0.0)


@dataclass(frozen=True)
class Levers:
    """The curator's levers on one analyst: the sum of their grants and whether they are frozen."""

    grant: Allowance = NO_GRANT
    frozen: bool = False

    def limit(self, budget: BudgetLike) -> Allowance:
        """The analyst's limit: the policy's budget plus every grant (grants only ever add).

        δ stays below 1 however the stored grants add up, so a bad row never makes every reader raise."""
        base = Allowance.of(budget)
        return Allowance(base.epsilon + self.grant.epsilon, min(base.delta + self.grant.delta, MAX_DELTA))


#: Kinds of curator rows in ``dpsql_ledger_levers`` (``prune``: audit rows deleted, for no one analyst).
LEVER_KINDS = ("grant", "revoke", "freeze", "unfreeze", "prune")

#: The grants one analyst may hold in total when no dataset budget caps them (the Python API without
#: ``dataset_budget``): ε as large as ``SET dpsql.epsilon`` accepts for one query, δ below 1.
GRANT_CEILING = Allowance(1e6, 0.999999)


@dataclass(frozen=True)
class LeverEvent:
    """One curator action as stored (append-only): who did what to which analyst, when and why."""

    id: int
    at: dt.datetime
    dataset: str
    analyst: str
    kind: str
    epsilon: float
    delta: float
    by: str
    reason: str


@dataclass(frozen=True)
class AuditEntry:
    """One audited statement: its shape (never a constant), what it cost and how it ended.

    ``outcome`` is ``answered`` (released; charged unless free), ``cache hit`` (a free repeat),
    ``refused`` (an error before any charge: nothing spent), ``failed`` (an error after the
    charge: spent, nothing released) or ``charged`` (the row written with the charge, in its
    transaction, whose statement's end was never recorded: the process died or still runs it).
    ``sqlstate`` is ``00000`` unless refused or failed. A free row (no charge) may stand for
    ``repeats`` identical statements, the last at ``last_at`` (see :mod:`dpsql.ledger.audit`).
    """

    at: dt.datetime
    dataset: str
    analyst: str
    fingerprint: str
    shape: str
    outcome: str
    sqlstate: str
    epsilon: float = 0.0
    delta: float = 0.0
    rho: float = 0.0
    latency_ms: float = 0.0
    charge_id: int | None = None
    id: int | None = None
    repeats: int = 1
    last_at: dt.datetime | None = None


def frozen_error(analyst: str) -> InsufficientPrivilege:
    """42501 for a frozen analyst: fixed text, no curator reason (it may say what the curator suspects)."""
    return InsufficientPrivilege(
        f'the data curator froze the privacy budget of analyst "{analyst}"',
        detail="No query is answered until the curator unfreezes it.",
        hint="Ask the data curator.",
    )


# --- reading rows back ----------------------------------------------------------------------------


#: What a stored time no reader can parse (a hand wrote it) reads as: conspicuous, and comparable.
UNREADABLE_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def parse_ts(value: Any) -> dt.datetime:
    """A stored time, always timezone-aware: a ``datetime`` (PostgreSQL) or ISO 8601 text (SQLite). dpsql
    writes UTC with its offset; a time without one (written by hand) reads as UTC, and one that is not a
    time at all as :data:`UNREADABLE_TIME`, so no reader (the dashboard's plot compares and sorts them)
    fails on a row a hand wrote."""
    if isinstance(value, dt.datetime):
        parsed = value
    else:
        try:
            parsed = dt.datetime.fromisoformat(value)
        except (TypeError, ValueError):
            return UNREADABLE_TIME
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


def number(value: Any) -> float:
    """A stored number as a float; what is not one (text a hand wrote into SQLite) reads as NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def spent_of(epsilon: Any, delta: Any, rho: Any, queries: Any, selection_delta: Any) -> Spent:
    """A stored total as read: NaN or a negative value (never written by dpsql) counts as infinite
    spending, so a bad row refuses charges (53P01) and readers show inf instead of failing."""

    def clean(value: Any) -> float:
        read = number(value)
        return read if read >= 0 else math.inf

    try:
        count = int(queries)
    except (TypeError, ValueError):
        count = 0
    return Spent(clean(epsilon), clean(delta), clean(rho), count, clean(selection_delta))


def charge_record(row: Any) -> ChargeRecord:
    """A charge row as read; one no :class:`Cost` can hold (inf, NaN, text: tampering) is ``corrupt``."""
    # a charge recorded before selection_delta existed counts its whole δ (conservative)
    numbers = (number(row[5]), number(row[6]), number(row[7]), number(row[6] if row[9] is None else row[9]))
    try:
        cost, corrupt = Cost(*numbers), False
    except ValueError:
        cost, corrupt = Cost(0.0), True
    return ChargeRecord(
        id=int(row[0]),
        at=parse_ts(row[1]),
        dataset=row[2],
        analyst=row[3],
        fingerprint=row[4],
        cost=cost,
        accounting=row[8],
        corrupt=corrupt,
    )


def lever_event(row: Any) -> LeverEvent:
    return LeverEvent(
        int(row[0]), parse_ts(row[1]), row[2], row[3], row[4], float(row[5]), float(row[6]), row[7], row[8]
    )


def audit_entry(row: Any) -> AuditEntry:
    return AuditEntry(
        at=parse_ts(row[1]),
        dataset=row[2],
        analyst=row[3],
        fingerprint=row[4],
        shape=row[5],
        outcome=row[6],
        sqlstate=row[7],
        epsilon=float(row[8]),
        delta=float(row[9]),
        rho=float(row[10]),
        latency_ms=float(row[11]),
        charge_id=None if row[12] is None else int(row[12]),
        id=int(row[0]),
        repeats=int(row[13]),
        last_at=None if row[14] is None else parse_ts(row[14]),
    )
