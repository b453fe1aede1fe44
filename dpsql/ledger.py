"""Persistent privacy accountant: every charge is durably committed *before* a result leaves.

The ledger is the one place where privacy loss is remembered, so it fails closed: if a
charge cannot be checked and committed (corrupt file, read-only disk, unreachable server)
the caller gets :class:`~dpsql.errors.LedgerUnavailable` and must not release anything.
There is deliberately no API to delete or refund a charge.

Two stores share one contract:

* SQLite (``sqlite:///abs/path.sqlite``, the embedded default): WAL journal,
  ``synchronous=FULL`` and ``BEGIN IMMEDIATE``, so the check-then-insert is serialised
  across threads *and* processes sharing the file, and each commit is fsync'd.
* PostgreSQL (``postgresql://…``): a transaction that takes
  ``pg_advisory_xact_lock`` on the dataset, reads the totals, inserts the charge and
  commits with ``synchronous_commit = on``.

Each charge row is the audit log; a small ``…_totals`` table, updated in the same
transaction, keeps per-(dataset, analyst) sums so a reserve costs O(1) however long the
history grows.

Schema 5 makes the append-only rows the authority on what was spent: each charge row also carries
its analyst's and its dataset's sums after it, and a reservation charges against the larger of those
(two index probes) and the totals, so a total lowered by hand (``UPDATE dpsql_ledger_totals``) or
deleted tail rows never give budget back; a disagreement is logged at ERROR once per process, and
:meth:`Ledger.verify` re-adds every row. Max rather than fail-closed: either source alone already
gives a safe figure, and refusing every query would hand anyone with the ledger's credentials a
switch to stop the service without buying any privacy. On PostgreSQL a ``SECURITY DEFINER`` insert
trigger computes the sums and sets the totals, so the server's role needs INSERT on the charges only
(README: "Least-privilege database roles"); :func:`serve_role_warnings` warns when it holds more.

Composition, conversion and the budget checks are :mod:`dpsql.accountant`'s; the ledger stores
what it needs (ε, δ, ρ and selection δ per charge) and runs its checks inside the reservation.
Dataset totals sum *all* analysts, since analysts may collude.

Schema 3 adds two append-only tables (new tables only, created on open): ``dpsql_ledger_levers``
(the curator's grants, freezes and unfreezes: who, when, why; an analyst's limit is the policy's
budget plus the sum of their grants, and both the limit and the freeze are read inside each
reservation, so a running server obeys them at once) and ``dpsql_audit`` (one row per statement,
see :mod:`dpsql.audit`).

Ledgers written before ``selection_delta`` existed are migrated on open: the column is added,
and existing totals take their recorded δ as selection δ (an upper bound: conservative).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import secrets
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpsql.accountant import (
    NO_GRANT,
    Accounting,
    Allowance,
    BudgetLike,
    Cost,
    Remaining,
    Spent,
    check_budget,
    max_rho,
    remaining_budget,
    zcdp_epsilon,
)
from dpsql.errors import InsufficientPrivilege, InvalidParameterValue, LedgerUnavailable, PrivacyBudgetExhausted

__all__ = [  # the accountant's names, re-exported for the ledger's callers
    "Accounting",
    "Allowance",
    "BudgetLike",
    "Cost",
    "Remaining",
    "Spent",
    "check_budget",
    "max_rho",
    "remaining_budget",
    "zcdp_epsilon",
]

if TYPE_CHECKING:
    import psycopg


log = logging.getLogger("dpsql.ledger")

#: ``dpsql_ledger_meta`` key of the per-installation secret (see :meth:`Ledger.installation_key`).
_INSTALLATION_KEY = "installation_key"

_HINT_UNAVAILABLE = (
    "No query is answered while the privacy ledger cannot record charges. "
    "Check the ledger URL, that its file or directory is writable, or that its database is reachable."
)
# Two-key advisory lock namespace: ("dpsql", hashtext(dataset)); 0x64707371 is b"dpsq".
_PG_LOCK_NAMESPACE = 0x64707371
_SQLITE_BUSY_TIMEOUT_S = 30.0


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

    def remaining(self, accounting: Accounting) -> Remaining:
        """What the analyst can still spend after this charge: the smaller of their own remaining budget
        and the dataset's (see :func:`min_remaining`)."""
        own = remaining_budget(self.analyst_spent, self.analyst_limit, accounting)
        if self.dataset_limit is None:
            return own
        return min_remaining(own, remaining_budget(self.dataset_spent, self.dataset_limit, accounting))


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


@dataclass(frozen=True)
class Levers:
    """The curator's levers on one analyst: the sum of their grants and whether they are frozen."""

    grant: Allowance = NO_GRANT
    frozen: bool = False

    def limit(self, budget: BudgetLike) -> Allowance:
        """The analyst's limit: the policy's budget plus every grant (grants only ever add).

        δ stays below 1 however the stored grants add up, so a bad row never makes every reader raise."""
        base = Allowance.of(budget)
        return Allowance(base.epsilon + self.grant.epsilon, min(base.delta + self.grant.delta, _MAX_DELTA))


#: Kinds of curator rows in ``dpsql_ledger_levers`` (``prune``: audit rows deleted, for no one analyst).
LEVER_KINDS = ("grant", "revoke", "freeze", "unfreeze", "prune")

#: The grants one analyst may hold in total when no dataset budget caps them (the Python API without
#: ``dataset_budget``): ε as large as ``SET dpsql.epsilon`` accepts for one query, δ below 1.
GRANT_CEILING = Allowance(1e6, 0.999999)
#: Largest δ a limit can have (``Allowance`` needs δ < 1).
_MAX_DELTA = math.nextafter(1.0, 0.0)


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
    ``repeats`` identical statements, the last at ``last_at`` (see :mod:`dpsql.audit`).
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


#: Ledger URLs that ask explicitly for a throwaway in-memory ledger (a fresh budget per engine).
MEMORY_LEDGER_URLS = ("memory", "sqlite:///:memory:")


def dpsql_home() -> Path:
    """``$DPSQL_HOME``, else ``~/.local/share/dpsql``: where default ledgers (and result caches) live."""
    return Path(os.environ.get("DPSQL_HOME") or Path.home() / ".local" / "share" / "dpsql")


def default_ledger(dataset: str) -> str:
    """The persistent SQLite ledger every front door (CLI, ``dpsql.connect``, ``Engine.open``) shares
    for ``dataset`` when no ledger is given: one budget per dataset, however many connections."""
    home = dpsql_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home.resolve() / f'ledger-{dataset}.sqlite'}"


def resolve_ledger_url(url: str | None, dataset: str) -> str:
    """The ledger URL to open: the persistent default when none is given; ``memory`` only on request."""
    if url is None or url == "":
        return default_ledger(dataset)
    return "sqlite:///:memory:" if url in MEMORY_LEDGER_URLS else url


# --- the stores ---------------------------------------------------------------------------


class Ledger:
    """A durable, concurrency-safe privacy ledger; open with :meth:`Ledger.open`."""

    url: str

    @staticmethod
    def open(url: str) -> Ledger:
        """``sqlite:///abs/path.sqlite``, ``sqlite:///:memory:`` (or ``memory``) or ``postgresql://…``."""
        if url == "memory":
            return SQLiteLedger(":memory:")
        if url.startswith("sqlite://"):
            path = url.removeprefix("sqlite://")
            if path != "/:memory:" and not path.startswith("/"):
                raise LedgerUnavailable(
                    f"privacy ledger unavailable: {url!r} is not sqlite:///<absolute path>",
                    hint=_HINT_UNAVAILABLE,
                )
            return SQLiteLedger(":memory:" if path == "/:memory:" else path)
        if url.startswith(("postgresql://", "postgres://")):
            return PostgresLedger(url)
        raise LedgerUnavailable(
            "privacy ledger unavailable: unsupported ledger URL scheme",
            detail="Use sqlite:///<absolute path> or postgresql://…",
            hint=_HINT_UNAVAILABLE,
        )

    # -- public API (shared) ----------------------------------------------------------------

    def reserve(
        self,
        *,
        dataset: str,
        analyst: str,
        cost: Cost,
        dataset_budget: BudgetLike,
        analyst_budget: BudgetLike,
        fingerprint: str,
        accounting: Accounting = "pure",
        rho_delta: float | None = None,
    ) -> Charge:
        """Atomically check both budgets and durably record the charge, or raise.

        Raises :class:`PrivacyBudgetExhausted` (nothing recorded) or
        :class:`LedgerUnavailable` (nothing may be released).
        """
        if accounting not in ("pure", "zcdp"):
            raise ValueError(f"unknown accounting {accounting!r}")
        from dpsql.audit import charged_entry

        rho = cost.zcdp_rho() if accounting == "zcdp" else self._recorded_rho(cost)
        recorded = Cost(cost.epsilon, cost.delta, rho, cost.selection_delta)
        now = dt.datetime.now(dt.UTC)
        limit = Allowance.of(analyst_budget)
        # The statement's audit row, written in the charge's transaction: a charge never lacks one.
        audit_row = charged_entry(dataset, analyst, fingerprint, cost, now)

        def check(analyst_spent: Spent, dataset_spent: Spent, levers: Levers) -> None:
            # Read in the reservation's transaction: a freeze or grant committed before it counts.
            nonlocal limit
            if levers.frozen:
                raise frozen_error(analyst)
            limit = levers.limit(analyst_budget)
            _require_finite("analyst", analyst, analyst_spent + cost)
            _require_finite("dataset", dataset, dataset_spent + cost)
            common: dict[str, Any] = {
                "cost": cost,
                "accounting": accounting,
                "rho_delta": rho_delta,
            }
            check_budget(who="analyst", name=analyst, spent=analyst_spent, budget=limit, **common)
            check_budget(who="dataset", name=dataset, spent=dataset_spent, budget=dataset_budget, **common)

        charge_id, audit_id, analyst_spent, dataset_spent = self._reserve(
            dataset=dataset,
            analyst=analyst,
            fingerprint=fingerprint,
            cost=recorded,
            accounting=accounting,
            at=now,
            check=check,
            audit=audit_row,
        )
        return Charge(
            id=charge_id,
            at=now,
            dataset=dataset,
            analyst=analyst,
            fingerprint=fingerprint,
            cost=cost,
            accounting=accounting,
            analyst_spent=analyst_spent,
            dataset_spent=dataset_spent,
            analyst_limit=limit,
            audit_id=audit_id,
            dataset_limit=Allowance.of(dataset_budget),
        )

    def spent(self, dataset: str, analyst: str | None = None) -> Spent:
        """Totals for one analyst, or for the whole dataset (all analysts) when ``analyst`` is None."""
        rows = self.summary(dataset)
        if analyst is not None:
            rows = [row for row in rows if row.analyst == analyst]
        return Spent.total(row.spent for row in rows)

    def remaining(
        self,
        dataset: str,
        analyst: str | None = None,
        *,
        budget: BudgetLike,
        accounting: Accounting = "pure",
        rho_delta: float | None = None,
        dataset_budget: BudgetLike | None = None,
    ) -> Remaining:
        """What is left of ``budget`` (plus the analyst's grants) given what the analyst (or the
        dataset) has spent; with ``dataset_budget``, no more than the dataset has left (what the analyst
        can really spend: :func:`min_remaining`)."""
        if analyst is not None:
            budget = self.levers(dataset, analyst).limit(budget)
        left = remaining_budget(self.spent(dataset, analyst), budget, accounting, rho_delta=rho_delta)
        if analyst is None or dataset_budget is None:
            return left
        everyone = remaining_budget(self.spent(dataset), dataset_budget, accounting, rho_delta=rho_delta)
        return min_remaining(left, everyone)

    def summary(self, dataset: str) -> list[AnalystSpent]:
        """Per-analyst spending on ``dataset``, sorted by analyst name (for ``dpsql budget``)."""
        raise NotImplementedError

    def charges(self, dataset: str, analyst: str | None = None, *, limit: int = 100) -> list[ChargeRecord]:
        """Most recent charges first, for auditing."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

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

    # -- curator levers and the audit trail (append-only) ------------------------------------

    def levers(self, dataset: str, analyst: str) -> Levers:
        """The analyst's grants and freeze state, read now (no cache: a curator's change takes effect
        on the next query of every running process)."""
        rows = self._read(_LEVERS_SQL, (dataset, analyst, dataset, analyst))
        return _levers(rows[0] if rows else None)

    def check_not_frozen(self, dataset: str, analyst: str) -> None:
        """Raise 42501 if the curator froze ``analyst``: called before a statement is even analysed."""
        if self.levers(dataset, analyst).frozen:
            raise frozen_error(analyst)

    def grant(
        self,
        *,
        dataset: str,
        analyst: str,
        epsilon: float,
        delta: float = 0.0,
        by: str,
        reason: str,
        dataset_budget: BudgetLike | None = None,
    ) -> LeverEvent:
        """Add (ε, δ) to the analyst's limit, as a new row (grants are never changed or removed).

        The analyst's grants may add up to ``dataset_budget`` at most (:data:`GRANT_CEILING` without
        one): the dataset's budget bounds what all analysts together may spend, so a larger grant
        buys nothing, and a bound keeps every sum finite (two grants of 1e308 would add up to inf).
        Checked against the grants already recorded, in the same transaction as the insert."""
        try:
            grant = Allowance(epsilon, delta)
        except (TypeError, ValueError):
            raise InvalidParameterValue(
                f"invalid grant: ε={epsilon!r}, δ={delta!r}",
                hint="Grant a finite ε ≥ 0 and a δ in [0, 1).",
            ) from None
        if grant.epsilon == 0 and grant.delta == 0:
            raise InvalidParameterValue("a grant must add some ε or δ")
        if not reason.strip():
            raise InvalidParameterValue("a grant needs a --reason")
        cap = GRANT_CEILING if dataset_budget is None else Allowance.of(dataset_budget)
        what = "the largest grant" if dataset_budget is None else "the dataset's budget"
        _check_grant(analyst, grant, NO_GRANT, cap, what)  # before taking the lock: the common refusal

        def within_cap(execute: Execute) -> None:
            granted = _levers(execute(self._sql(_LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone()).grant
            _check_grant(analyst, grant, granted, cap, what)

        return self._lever(dataset, analyst, "grant", grant, by, reason, within_cap)

    def revoke(
        self,
        *,
        dataset: str,
        analyst: str,
        epsilon: float,
        delta: float = 0.0,
        by: str,
        reason: str,
        analyst_budget: BudgetLike,
        accounting: Accounting = "pure",
    ) -> LeverEvent:
        """Take (ε, δ) back from the analyst's grants, as a new row (the grants stay: a revoke is its own
        append-only row with who, when and why).

        22023 when it would take back more than the analyst's grants add up to (a revoke takes back
        grants; the policy's budget is the policy's), or lower the limit below what the analyst has
        already spent (spent budget is never given back, nor taken back). Both checked in the same
        transaction as the insert, under the dataset's reservation lock: no charge slips in between."""
        try:
            amount = Allowance(epsilon, delta)
        except (TypeError, ValueError):
            raise InvalidParameterValue(
                f"invalid revoke: ε={epsilon!r}, δ={delta!r}", hint="Revoke a finite ε ≥ 0 and a δ in [0, 1)."
            ) from None
        if amount.epsilon == 0 and amount.delta == 0:
            raise InvalidParameterValue("a revoke must take back some ε or δ")
        if not reason.strip():
            raise InvalidParameterValue("a revoke needs a --reason")

        def within_grants(execute: Execute) -> None:
            levers = _levers(execute(self._sql(_LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone())
            granted = levers.grant
            for name, taken, held in (("ε", amount.epsilon, granted.epsilon), ("δ", amount.delta, granted.delta)):
                if taken > held * (1 + 1e-9):
                    raise InvalidParameterValue(
                        f'invalid revoke: analyst "{analyst}" holds grants of {name}={_g(held)} in all, '
                        f"less than the {name}={_g(taken)} to revoke",
                        hint="A revoke takes back grants only; the policy's budget is changed in the policy.",
                    )
            net = Allowance(max(granted.epsilon - amount.epsilon, 0.0), max(granted.delta - amount.delta, 0.0))
            limit = Levers(net, levers.frozen).limit(analyst_budget)
            spent, _ = self._spent_in(execute, dataset, analyst)
            try:
                check_budget(
                    who="analyst", name=analyst, spent=spent, cost=Cost(0.0), budget=limit, accounting=accounting
                )
            except PrivacyBudgetExhausted:
                used = spent.privacy_loss(accounting, limit.delta)[0]
                raise InvalidParameterValue(
                    f'invalid revoke: analyst "{analyst}" has already spent ε={_g(used)}; '
                    f"the limit would fall to ε={_g(limit.epsilon)}, δ={_g(limit.delta)}",
                    hint="Spent budget is never taken back: revoke at most the unspent part.",
                ) from None

        return self._lever(dataset, analyst, "revoke", amount, by, reason, within_grants)

    def prune_audit(self, *, dataset: str, before: dt.datetime, by: str, reason: str) -> tuple[LeverEvent, int]:
        """Delete the audit rows of free refusals and cache hits whose last statement is before ``before``;
        returns the curator row recording it (kind ``prune``, with the cut-off and the count) and the count.

        Rows of charged or answered statements are never deleted (the triggers refuse it too), nor any
        row without a later prune row of the curator: every deletion is an audited curator action."""
        now = dt.datetime.now(dt.UTC)
        if before.tzinfo is None:
            before = before.replace(tzinfo=dt.UTC)
        if before > now:
            raise InvalidParameterValue(
                f"invalid prune: {_ts(before)} is in the future", hint="Prune rows before a past date or time."
            )
        if not reason.strip():
            raise InvalidParameterValue("a prune needs a --reason")
        where = (
            "FROM dpsql_audit WHERE dataset = ? AND charge_id IS NULL AND outcome IN ('refused', 'cache hit') "
            "AND COALESCE(last_at, at) < ?"
        )
        params = (dataset, self._timestamp(before))
        with self._append() as execute:
            count = int(execute(self._sql("SELECT COUNT(*) " + where), params).fetchone()[0])
            text = f"{reason} (audit rows of free refusals and cache hits before {_ts(before)}: {count} deleted)"
            row = (self._timestamp(now), dataset, "", "prune", 0.0, 0.0, by, text)
            event_id = self._insert_id(execute, self._sql(_INSERT_LEVER_SQL), row)
            execute(self._sql("DELETE " + where), params)
        return LeverEvent(event_id, now, dataset, "", "prune", 0.0, 0.0, by, text), count

    def verify(self, dataset: str | None = None) -> list[str]:
        """Check the whole ledger against itself; one line per problem (none: consistent).

        Reads every charge row in order: each cost finite, each row's sums equal to the sum of the rows
        before it plus its own (so a deleted or changed row shows), and each totals row equal to its
        analyst's rows. O(charges): for ``dpsql ledger verify``, never on a query's path."""
        where, params = ("", ()) if dataset is None else (" WHERE dataset = ?", (dataset,))
        rows = self._read(
            "SELECT id, dataset, analyst, epsilon, delta, rho, selection_delta, sum_epsilon, sum_delta, sum_rho, "
            "sum_queries, sum_selection_delta, ds_epsilon, ds_delta, ds_rho, ds_queries, ds_selection_delta "
            f"FROM dpsql_ledger{where} ORDER BY id",
            params,
        )
        problems: list[str] = []
        mine: dict[tuple[str, str], Spent] = {}
        everyone: dict[str, Spent] = {}
        for r in rows:
            ds, who = r[1], r[2]
            eps, delta, rho = _number(r[3]), _number(r[4]), _number(r[5])
            sel = delta if r[6] is None else _number(r[6])
            if not all(0 <= v < math.inf for v in (eps, delta, rho, sel)):
                problems.append(
                    f'charge #{r[0]} of analyst "{who}" on dataset "{ds}": a cost that is not a '
                    f"finite number ≥ 0 (ε={r[3]!r}, δ={r[4]!r}, ρ={r[5]!r}); it counts as exhausting"
                )
                eps, delta, rho, sel = (math.inf,) * 4
            step = Spent(eps, delta, rho, 1, sel)
            mine[(ds, who)] = mine.get((ds, who), Spent()) + step
            everyone[ds] = everyone.get(ds, Spent()) + step
            for label, sums, running in (
                (f'analyst "{who}"', r[7:12], mine[(ds, who)]),
                ("the dataset", r[12:17], everyone[ds]),
            ):
                if sums[0] is None:
                    continue  # written before schema 5
                recorded = _spent(*sums)
                if not _agree(recorded, running):
                    problems.append(
                        f'charge #{r[0]} on dataset "{ds}": its sums for {label} (ε={recorded.epsilon:g}, '
                        f"{recorded.queries} queries) disagree with the rows up to it (ε={running.epsilon:g}, "
                        f"{running.queries} queries): a row was changed or deleted"
                    )
        totals = self._read(
            f"SELECT dataset, analyst, epsilon, delta, rho, queries, selection_delta FROM dpsql_ledger_totals{where}",
            params,
        )
        seen = set()
        for t in totals:
            key = (t[0], t[1])
            seen.add(key)
            recorded, actual = _spent(*t[2:7]), mine.get(key, Spent())
            if not _agree(recorded, actual):
                problems.append(
                    f'totals of analyst "{t[1]}" on dataset "{t[0]}" (ε={recorded.epsilon:g}, {recorded.queries} '
                    f"queries) disagree with its charge rows (ε={actual.epsilon:g}, {actual.queries} queries)"
                )
        for ds, who in sorted(set(mine) - seen):
            problems.append(f'analyst "{who}" on dataset "{ds}" has charge rows but no totals row')
        return problems

    def freeze(self, *, dataset: str, analyst: str, by: str, reason: str = "") -> LeverEvent:
        """Refuse (42501) every further query of ``analyst`` until :meth:`unfreeze`."""
        return self._lever(dataset, analyst, "freeze", NO_GRANT, by, reason)

    def unfreeze(self, *, dataset: str, analyst: str, by: str, reason: str = "") -> LeverEvent:
        return self._lever(dataset, analyst, "unfreeze", NO_GRANT, by, reason)

    def _lever(
        self,
        dataset: str,
        analyst: str,
        kind: str,
        amount: Allowance,
        by: str,
        reason: str,
        check: Callable[[Execute], None] | None = None,
    ) -> LeverEvent:
        at = dt.datetime.now(dt.UTC)
        row = (self._timestamp(at), dataset, analyst, kind, amount.epsilon, amount.delta, by, reason)
        # Under the dataset's reservation lock: a grant or freeze is ordered with every charge.
        with self._reservation(dataset) as execute:
            if check is not None:
                check(execute)  # raises to refuse: nothing is written
            event_id = self._insert_id(execute, self._sql(_INSERT_LEVER_SQL), row)
        return LeverEvent(event_id, at, dataset, analyst, kind, amount.epsilon, amount.delta, by, reason)

    def lever_events(
        self, dataset: str, analyst: str | None = None, *, since: dt.datetime | None = None, limit: int = 100
    ) -> list[LeverEvent]:
        """Curator actions, most recent first."""
        sql, params = _filtered(_SELECT_LEVERS_SQL, dataset, analyst, since, limit)
        return [_lever_event(row) for row in self._read(sql, params)]

    def record_audit(self, entries: list[AuditEntry]) -> None:
        """Append audit rows in one transaction."""
        self.write_audit(entries)

    def write_audit(
        self,
        inserts: Sequence[AuditEntry],
        finals: Sequence[AuditEntry] = (),
        repeats: Sequence[tuple[int, int, dt.datetime]] = (),
    ) -> list[int]:
        """One transaction of :class:`dpsql.audit.AuditTrail`'s writer: append ``inserts`` (their ids are
        returned, in order), finalise the ``charged`` rows named by ``finals`` (``id``: the row written
        with the charge; its outcome, SQLSTATE and latency are set) and add ``(id, n, last_at)``
        repeats to free rows. The triggers allow exactly these two updates, nothing else."""
        if not (inserts or finals or repeats):
            return []
        ids: list[int] = []
        with self._append() as execute:
            for entry in inserts:
                ids.append(self._insert_id(execute, self._sql(_INSERT_AUDIT_SQL), self._audit_params(entry)))
            for entry in finals:
                execute(self._sql(_FINALISE_AUDIT_SQL), (entry.outcome, entry.sqlstate, entry.latency_ms, entry.id))
            for row_id, count, last_at in repeats:
                execute(self._sql(_REPEAT_AUDIT_SQL), (count, self._timestamp(last_at), row_id))
        return ids

    def _audit_params(self, e: AuditEntry) -> tuple[Any, ...]:
        return (
            self._timestamp(e.at),
            e.dataset,
            e.analyst,
            e.fingerprint,
            e.shape,
            e.outcome,
            e.sqlstate,
            e.epsilon,
            e.delta,
            e.rho,
            e.latency_ms,
            e.charge_id,
            e.repeats,
            None if e.last_at is None else self._timestamp(e.last_at),
        )

    def audit(
        self,
        dataset: str,
        analyst: str | None = None,
        *,
        since: dt.datetime | None = None,
        limit: int = 100,
        outcomes: Sequence[str] | None = None,
    ) -> list[AuditEntry]:
        """Audited statements, most recent first by time (a row of repeats counts from its first
        statement; ``since`` also matches its last one); only ``outcomes`` when given."""
        sql = _SELECT_AUDIT_SQL
        params: tuple[Any, ...] = (dataset,)
        if analyst is not None:
            sql, params = sql + " AND analyst = ?", (*params, analyst)
        if since is not None:
            sql, params = sql + " AND (at >= ? OR last_at >= ?)", (*params, since, since)
        if outcomes is not None:
            if not outcomes:
                return []
            sql += f" AND outcome IN ({', '.join('?' for _ in outcomes)})"
            params = (*params, *outcomes)
        # By time, not id: a charge's row is written at once, free rows a moment later by the writer.
        rows = self._read(sql + " ORDER BY at DESC, id DESC LIMIT ?", (*params, limit))
        return [_audit_entry(row) for row in rows]

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Run a read-only query (``?`` placeholders) and fetch every row; fail closed."""
        raise NotImplementedError

    def _spent_in(self, execute: Execute, dataset: str, analyst: str) -> tuple[Spent, Spent]:
        """(analyst's, dataset's) spending read inside a transaction of the store."""
        raise NotImplementedError

    def _append(self) -> AbstractContextManager[Execute]:
        """A short write transaction without the dataset's reservation lock (audit rows)."""
        raise NotImplementedError

    def _reservation(self, dataset: str) -> AbstractContextManager[Execute]:
        raise NotImplementedError

    def _insert_id(self, execute: Execute, sql: str, params: tuple[Any, ...]) -> int:
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        """``sql`` (written with ``?`` placeholders) in the store's paramstyle."""
        return sql

    def _timestamp(self, at: dt.datetime) -> Any:
        return at

    def installation_key(self) -> bytes:
        """This installation's secret (32 random bytes), generated once and kept in the ledger's own
        database (``dpsql_ledger_meta``, key ``installation_key``), so every process sharing a ledger
        shares it and another installation has another. It keys the query fingerprints (log and
        ledger), the mock SCRAM salts of the server and the row-selection salt of every Engine
        (:mod:`dpsql.fingerprint`); it never leaves the process otherwise.
        An in-memory ledger gets a fresh one."""
        key: bytes | None = getattr(self, "_installation_key", None)
        if key is None:
            candidate = secrets.token_hex(32)
            try:
                key = bytes.fromhex(self._meta_setdefault(_INSTALLATION_KEY, candidate))
            except ValueError as exc:
                raise _unavailable("the installation key in the ledger is corrupt", exc) from exc
            self._installation_key = key
        return key

    def _meta_setdefault(self, key: str, value: str) -> str:
        """Store ``value`` under ``key`` unless some value is there already; return the stored one."""
        raise NotImplementedError

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- store-specific ---------------------------------------------------------------------

    @staticmethod
    def _recorded_rho(cost: Cost) -> float:
        # Under pure accounting still record a sound ρ when one exists, so that a later switch
        # of the policy to zcdp does not undercount earlier pure-DP charges.
        if cost.rho > 0:
            return cost.rho
        return cost.epsilon * cost.epsilon / 2 if cost.delta == cost.selection_delta else 0.0

    def _reserve(
        self,
        *,
        dataset: str,
        analyst: str,
        fingerprint: str,
        cost: Cost,
        accounting: Accounting,
        at: dt.datetime,
        check: Callable[[Spent, Spent, Levers], None],
        audit: AuditEntry,
    ) -> tuple[int, int, Spent, Spent]:
        raise NotImplementedError


def _unavailable(reason: str, exc: BaseException | None = None) -> LedgerUnavailable:
    detail = f"{type(exc).__name__}: {exc}" if exc is not None else None
    return LedgerUnavailable(f"privacy ledger unavailable: {reason}", detail=detail, hint=_HINT_UNAVAILABLE)


def _ts(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).isoformat(timespec="microseconds")


def _parse_ts(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(value)


#: The curator's rows (schema 5: revoke and prune added to the kinds).
_SQLITE_LEVERS_TABLE = """CREATE TABLE IF NOT EXISTS dpsql_ledger_levers (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    at       TEXT    NOT NULL,
    dataset  TEXT    NOT NULL,
    analyst  TEXT    NOT NULL,
    kind     TEXT    NOT NULL CHECK (kind IN ('grant', 'revoke', 'freeze', 'unfreeze', 'prune')),
    epsilon  REAL    NOT NULL CHECK (epsilon >= 0),
    delta    REAL    NOT NULL CHECK (delta >= 0 AND delta < 1),
    by_user  TEXT    NOT NULL,
    reason   TEXT    NOT NULL
)"""

_SQLITE_SCHEMA = (
    """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS dpsql_ledger (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          TEXT    NOT NULL,
    dataset     TEXT    NOT NULL,
    analyst     TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    epsilon     REAL    NOT NULL CHECK (epsilon >= 0),
    delta       REAL    NOT NULL CHECK (delta >= 0),
    rho         REAL    NOT NULL CHECK (rho >= 0),
    accounting  TEXT    NOT NULL,
    selection_delta REAL CHECK (selection_delta >= 0),  -- NULL: recorded before schema 2 (count delta)
    -- Schema 5: the analyst's and the dataset's sums after this charge (NULL: recorded before schema 5)
    sum_epsilon REAL, sum_delta REAL, sum_rho REAL, sum_selection_delta REAL, sum_queries INTEGER,
    ds_epsilon  REAL, ds_delta  REAL, ds_rho  REAL, ds_selection_delta  REAL, ds_queries  INTEGER
);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_owner ON dpsql_ledger (dataset, analyst, id);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_dataset ON dpsql_ledger (dataset, id);
CREATE TABLE IF NOT EXISTS dpsql_ledger_totals (
    dataset  TEXT    NOT NULL,
    analyst  TEXT    NOT NULL,
    epsilon  REAL    NOT NULL,
    delta    REAL    NOT NULL,
    rho      REAL    NOT NULL,
    queries  INTEGER NOT NULL,
    last_at  TEXT    NOT NULL,
    selection_delta REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (dataset, analyst)
);
CREATE TRIGGER IF NOT EXISTS dpsql_ledger_no_delete BEFORE DELETE ON dpsql_ledger
BEGIN SELECT RAISE(ABORT, 'privacy ledger charges are never deleted'); END;
CREATE TRIGGER IF NOT EXISTS dpsql_ledger_no_update BEFORE UPDATE ON dpsql_ledger
BEGIN SELECT RAISE(ABORT, 'privacy ledger charges are never changed'); END;
-- Schema 5: a charge is finite (text, inf and NaN, which SQLite stores as NULL, are refused).
CREATE TRIGGER IF NOT EXISTS dpsql_ledger_finite BEFORE INSERT ON dpsql_ledger
WHEN NOT (NEW.epsilon <= 1.7976931348623157e308 AND NEW.delta < 1 AND NEW.rho <= 1.7976931348623157e308
          AND COALESCE(NEW.selection_delta, 0) < 1)
BEGIN SELECT RAISE(ABORT, 'privacy ledger charges are finite numbers'); END;
CREATE TABLE IF NOT EXISTS dpsql_ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Schema 3: the curator's levers and the audit trail (new tables only: nothing to migrate).
"""
    + _SQLITE_LEVERS_TABLE
    + """;
CREATE INDEX IF NOT EXISTS dpsql_ledger_levers_by_owner ON dpsql_ledger_levers (dataset, analyst, id);
CREATE TABLE IF NOT EXISTS dpsql_audit (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          TEXT    NOT NULL,
    dataset     TEXT    NOT NULL,
    analyst     TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    shape       TEXT    NOT NULL,
    outcome     TEXT    NOT NULL,
    sqlstate    TEXT    NOT NULL,
    epsilon     REAL    NOT NULL,
    delta       REAL    NOT NULL,
    rho         REAL    NOT NULL,
    latency_ms  REAL    NOT NULL,
    charge_id   INTEGER,
    repeats     INTEGER NOT NULL DEFAULT 1,  -- schema 4: identical free statements folded into one row
    last_at     TEXT
);
CREATE INDEX IF NOT EXISTS dpsql_audit_by_time ON dpsql_audit (dataset, at);
CREATE INDEX IF NOT EXISTS dpsql_audit_by_outcome ON dpsql_audit (dataset, outcome, at);
CREATE TRIGGER IF NOT EXISTS dpsql_levers_no_delete BEFORE DELETE ON dpsql_ledger_levers
BEGIN SELECT RAISE(ABORT, 'curator actions are never deleted'); END;
CREATE TRIGGER IF NOT EXISTS dpsql_levers_no_update BEFORE UPDATE ON dpsql_ledger_levers
BEGIN SELECT RAISE(ABORT, 'curator actions are never changed'); END;
-- Schema 5: only free refusals and cache hits are ever deleted, after a curator's prune row that is
-- later than them (see Ledger.prune_audit); a charged or answered statement's row never is.
DROP TRIGGER IF EXISTS dpsql_audit_no_delete;
CREATE TRIGGER dpsql_audit_no_delete BEFORE DELETE ON dpsql_audit
WHEN NOT (OLD.charge_id IS NULL AND OLD.outcome IN ('refused', 'cache hit') AND EXISTS (
    SELECT 1 FROM dpsql_ledger_levers p WHERE p.dataset = OLD.dataset AND p.kind = 'prune'
    AND p.at > COALESCE(OLD.last_at, OLD.at)))
BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END;
-- Schema 4: two updates only. A charge's row (written with the charge) gets its statement's end once;
-- a free row counts more repeats. Who, what, when and the cost never change.
DROP TRIGGER IF EXISTS dpsql_audit_no_update;
CREATE TRIGGER IF NOT EXISTS dpsql_audit_guard_update BEFORE UPDATE ON dpsql_audit
WHEN NOT (
    NEW.id IS OLD.id AND NEW.at IS OLD.at AND NEW.dataset IS OLD.dataset AND NEW.analyst IS OLD.analyst
    AND NEW.fingerprint IS OLD.fingerprint AND NEW.shape IS OLD.shape AND NEW.epsilon IS OLD.epsilon
    AND NEW.delta IS OLD.delta AND NEW.rho IS OLD.rho AND NEW.charge_id IS OLD.charge_id
    AND ((OLD.outcome = 'charged' AND NEW.outcome IN ('answered', 'failed')
          AND NEW.repeats IS OLD.repeats AND NEW.last_at IS OLD.last_at)
         OR (OLD.charge_id IS NULL AND OLD.outcome <> 'charged' AND NEW.outcome IS OLD.outcome
             AND NEW.sqlstate IS OLD.sqlstate AND NEW.latency_ms IS OLD.latency_ms AND NEW.repeats > OLD.repeats))
)
BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END;
-- A real write on every open: a read-only file or directory fails here, not mid-query.
INSERT INTO dpsql_ledger_meta (key, value) VALUES ('schema', '5')
    ON CONFLICT (key) DO UPDATE SET value = excluded.value;
COMMIT;
"""
)

# Schema 1 → 2 (run inside the BEGIN IMMEDIATE of _SQLITE_SCHEMA's successor, after re-checking).
# Old totals take their whole recorded δ as selection δ: an upper bound, so never an undercount.
_SQLITE_MIGRATE_2 = (
    "ALTER TABLE dpsql_ledger ADD COLUMN selection_delta REAL CHECK (selection_delta >= 0)",
    "ALTER TABLE dpsql_ledger_totals ADD COLUMN selection_delta REAL NOT NULL DEFAULT 0",
    "UPDATE dpsql_ledger_totals SET selection_delta = delta",
)

# Schema 5: the totals are set to the new charge row's sums (never incremented on their own).
_UPSERT_TOTALS = """
INSERT INTO dpsql_ledger_totals (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (dataset, analyst) DO UPDATE SET
    epsilon = excluded.epsilon,
    delta   = excluded.delta,
    rho     = excluded.rho,
    queries = excluded.queries,
    last_at = excluded.last_at,
    selection_delta = excluded.selection_delta
"""


def _sqlite_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})").fetchall()}


def _sqlite_migrate_audit(conn: sqlite3.Connection) -> None:
    """Schema 3 → 4: the audit's ``repeats`` and ``last_at`` columns (before the schema script, whose
    trigger names them); no-op on new or current files."""
    columns = _sqlite_columns(conn, "dpsql_audit")
    if not columns or "repeats" in columns:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "repeats" not in _sqlite_columns(conn, "dpsql_audit"):  # another opener may have won
            conn.execute("ALTER TABLE dpsql_audit ADD COLUMN repeats INTEGER NOT NULL DEFAULT 1")
            conn.execute("ALTER TABLE dpsql_audit ADD COLUMN last_at TEXT")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


#: Schema 5's columns of ``dpsql_ledger``: the analyst's and the dataset's sums after each charge.
_SUM_COLUMNS = ("sum_epsilon", "sum_delta", "sum_rho", "sum_selection_delta", "sum_queries")
_DS_COLUMNS = ("ds_epsilon", "ds_delta", "ds_rho", "ds_selection_delta", "ds_queries")


def _sqlite_levers_old(conn: sqlite3.Connection) -> bool:
    """Whether the levers table predates schema 5 (its CHECK lacks the revoke and prune kinds)."""
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'dpsql_ledger_levers'").fetchone()
    return row is not None and "'revoke'" not in row[0]


def _sqlite_migrate_5(conn: sqlite3.Connection) -> None:
    """Schema 4 → 5: the charges' sums columns, and the levers' new kinds (SQLite cannot alter a CHECK,
    so that table is copied: same ids, same rows; its triggers and index come back with the schema)."""
    charges = _sqlite_columns(conn, "dpsql_ledger")
    levers_old = _sqlite_levers_old(conn)
    if (not charges or "sum_epsilon" in charges) and not levers_old:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if charges and "sum_epsilon" not in _sqlite_columns(conn, "dpsql_ledger"):  # another opener may have won
            for column in (*_SUM_COLUMNS, *_DS_COLUMNS):
                kind = "INTEGER" if column.endswith("queries") else "REAL"
                conn.execute(f"ALTER TABLE dpsql_ledger ADD COLUMN {column} {kind}")
        if _sqlite_levers_old(conn):
            conn.execute(_SQLITE_LEVERS_TABLE.replace("dpsql_ledger_levers", "dpsql_ledger_levers_5"))
            conn.execute(
                "INSERT INTO dpsql_ledger_levers_5 (id, at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
                "SELECT id, at, dataset, analyst, kind, epsilon, delta, by_user, reason FROM dpsql_ledger_levers"
            )
            conn.execute("DROP TABLE dpsql_ledger_levers")
            conn.execute("ALTER TABLE dpsql_ledger_levers_5 RENAME TO dpsql_ledger_levers")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


def _sqlite_migrate(conn: sqlite3.Connection) -> None:
    """Bring a schema-1 ledger (no ``selection_delta``) to schema 2; no-op on new or current files."""
    if "selection_delta" in _sqlite_columns(conn, "dpsql_ledger_totals") or not _sqlite_columns(
        conn, "dpsql_ledger_totals"
    ):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "selection_delta" not in _sqlite_columns(conn, "dpsql_ledger_totals"):  # another opener may have won
            for statement in _SQLITE_MIGRATE_2:
                conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


def _create_private(path: str) -> None:
    """Create a new ledger file with mode 0600 (it holds the installation key; SQLite gives its
    -wal and -shm files the same mode). An existing file is left as the operator made it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise _unavailable(f"cannot create {path!r}", exc) from exc
    os.close(fd)


_TOTALS_SQL = (
    "SELECT analyst, epsilon, delta, rho, queries, selection_delta FROM dpsql_ledger_totals "
    "WHERE dataset = ? ORDER BY analyst"
)
_INSERT_CHARGE_SQL = (
    "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta, "
    "sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries, "
    "ds_epsilon, ds_delta, ds_rho, ds_selection_delta, ds_queries) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# The sums on the last charge row of the analyst (kind 0) and of the dataset (kind 1): two index probes.
_ANCHORS_SQL = (
    "SELECT 0, sum_epsilon, sum_delta, sum_rho, sum_queries, sum_selection_delta FROM dpsql_ledger "
    "WHERE id = (SELECT MAX(id) FROM dpsql_ledger WHERE dataset = ? AND analyst = ?) "
    "UNION ALL SELECT 1, ds_epsilon, ds_delta, ds_rho, ds_queries, ds_selection_delta FROM dpsql_ledger "
    "WHERE id = (SELECT MAX(id) FROM dpsql_ledger WHERE dataset = ?)"
)
# Each analyst's totals next to the sums on their last charge row.
_SUMMARY_SQL = (
    "SELECT t.analyst, t.epsilon, t.delta, t.rho, t.queries, t.last_at, t.selection_delta, "
    "l.id, l.sum_epsilon, l.sum_delta, l.sum_rho, l.sum_queries, l.sum_selection_delta "
    "FROM dpsql_ledger_totals t LEFT JOIN dpsql_ledger l ON l.id = "
    "(SELECT MAX(m.id) FROM dpsql_ledger m WHERE m.dataset = t.dataset AND m.analyst = t.analyst) "
    "WHERE t.dataset = ? ORDER BY t.analyst"
)

#: ``execute(sql, params)`` inside a reservation's transaction: returns a DB-API cursor.
Execute = Callable[[str, tuple[Any, ...]], Any]

# Grants summed, and the latest freeze/unfreeze: curator rows are few, so no derived state to keep.
# Each row is clamped first (inf, NaN or a huge ε written by an older version count as the ceiling),
# so the sum stays finite and PostgreSQL's float overflow error can never make every read fail.
# Revokes are summed apart and taken off the grants (a revoke row clamped the same way only takes more back).
_LEVERS_SQL = (
    "SELECT COALESCE(SUM(CASE WHEN kind <> 'grant' THEN 0 WHEN epsilon <= 1e6 THEN epsilon ELSE 1e6 END), 0), "
    "COALESCE(SUM(CASE WHEN kind <> 'grant' THEN 0 WHEN delta < 1 THEN delta ELSE 1 END), 0), "
    "(SELECT kind FROM dpsql_ledger_levers WHERE dataset = ? AND analyst = ? "
    "AND kind IN ('freeze', 'unfreeze') ORDER BY id DESC LIMIT 1), "
    "COALESCE(SUM(CASE WHEN kind <> 'revoke' THEN 0 WHEN epsilon <= 1e6 THEN epsilon ELSE 1e6 END), 0), "
    "COALESCE(SUM(CASE WHEN kind <> 'revoke' THEN 0 WHEN delta < 1 THEN delta ELSE 1 END), 0) "
    "FROM dpsql_ledger_levers WHERE dataset = ? AND analyst = ? AND kind IN ('grant', 'revoke')"
)
_INSERT_LEVER_SQL = (
    "INSERT INTO dpsql_ledger_levers (at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_SELECT_LEVERS_SQL = (
    "SELECT id, at, dataset, analyst, kind, epsilon, delta, by_user, reason FROM dpsql_ledger_levers WHERE dataset = ?"
)
_INSERT_AUDIT_SQL = (
    "INSERT INTO dpsql_audit (at, dataset, analyst, fingerprint, shape, outcome, sqlstate, epsilon, delta, rho, "
    "latency_ms, charge_id, repeats, last_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# The two updates the audit's triggers allow: a charge's row gets its statement's end, a free row more repeats.
_FINALISE_AUDIT_SQL = (
    "UPDATE dpsql_audit SET outcome = ?, sqlstate = ?, latency_ms = ? WHERE id = ? AND outcome = 'charged'"
)
_REPEAT_AUDIT_SQL = "UPDATE dpsql_audit SET repeats = repeats + ?, last_at = ? WHERE id = ? AND charge_id IS NULL"
_SELECT_AUDIT_SQL = (
    "SELECT id, at, dataset, analyst, fingerprint, shape, outcome, sqlstate, epsilon, delta, rho, latency_ms, "
    "charge_id, repeats, last_at FROM dpsql_audit WHERE dataset = ?"
)


def _filtered(
    sql: str, dataset: str, analyst: str | None, since: dt.datetime | None, limit: int
) -> tuple[str, tuple[Any, ...]]:
    params: tuple[Any, ...] = (dataset,)
    if analyst is not None:
        sql += " AND analyst = ?"
        params += (analyst,)
    if since is not None:
        sql += " AND at >= ?"
        params += (since,)
    return sql + " ORDER BY id DESC LIMIT ?", (*params, limit)


def _levers(row: Any) -> Levers:
    """The levers from :data:`_LEVERS_SQL`'s row; sums beyond :data:`GRANT_CEILING` (only rows written
    before grants were capped can get there) read as the ceiling, never as an error."""
    if row is None:
        return Levers()
    # Net of revokes, never below zero (a revoke takes back grants only; a bad row cannot make it negative).
    epsilon = max(_clamped(row[0], GRANT_CEILING.epsilon) - _clamped(row[3], GRANT_CEILING.epsilon), 0.0)
    delta = max(_clamped(row[1], GRANT_CEILING.delta) - _clamped(row[4], GRANT_CEILING.delta), 0.0)
    grant = Allowance(epsilon, delta) if epsilon or delta else NO_GRANT
    return Levers(grant, row[2] == "freeze")


def _clamped(value: Any, ceiling: float) -> float:
    number = _number(value or 0.0)
    return ceiling if not number <= ceiling else max(number, 0.0)  # NaN and inf: the ceiling


def _number(value: Any) -> float:
    """A stored number as a float; what is not one (text a hand wrote into SQLite) reads as NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _check_grant(analyst: str, grant: Allowance, granted: Allowance, cap: Allowance, what: str) -> None:
    """22023 unless the analyst's grants, with this one, stay within ``cap`` (ε and δ)."""
    epsilon, delta = granted.epsilon + grant.epsilon, granted.delta + grant.delta
    for name, total, limit, amount in (
        ("ε", epsilon, cap.epsilon, grant.epsilon),
        ("δ", delta, cap.delta, grant.delta),
    ):
        if amount > 0 and not total <= limit * (1 + 1e-9):
            already = f" (granted so far: {name}={_g(total - amount)})" if total != amount else ""
            raise InvalidParameterValue(
                f'invalid grant: analyst "{analyst}"\'s grants would total {name}={_g(total)}, '
                f"more than {what} {name}={_g(limit)}{already}",
                hint="The dataset's budget bounds what all analysts together may spend: "
                "no analyst's grants need to exceed it.",
            )


def _g(value: float) -> str:
    return f"{value:g}"


def _require_finite(who: str, name: str, total: Spent) -> None:
    """53P01 when a recorded total plus this charge is not finite (a corrupt or overflowing ledger row):
    refused like an exhausted budget, never an internal error, and never a release."""
    if not all(math.isfinite(v) for v in (total.epsilon, total.delta, total.rho, total.selection_delta)):
        raise PrivacyBudgetExhausted(
            f'privacy budget exhausted for {who} "{name}"',
            detail=f"The ledger's recorded total for this {who} is not a finite number.",
            hint="Ask the data curator: the ledger's totals need to be checked.",
        )


def _spent(epsilon: Any, delta: Any, rho: Any, queries: Any, selection_delta: Any) -> Spent:
    """A stored total as read: NaN or a negative value (never written by dpsql) counts as infinite
    spending, so a bad row refuses charges (53P01) and readers show inf instead of failing."""

    def clean(value: Any) -> float:
        number = _number(value)
        return number if number >= 0 else math.inf

    try:
        count = int(queries)
    except (TypeError, ValueError):
        count = 0
    return Spent(clean(epsilon), clean(delta), clean(rho), count, clean(selection_delta))


def _at_least(a: Spent, b: Spent) -> Spent:
    """Componentwise maximum: the spending both records agree is at least."""
    return Spent(
        max(a.epsilon, b.epsilon),
        max(a.delta, b.delta),
        max(a.rho, b.rho),
        max(a.queries, b.queries),
        max(a.selection_delta, b.selection_delta),
    )


def _agree(a: Spent, b: Spent) -> bool:
    """Equal up to float rounding (the dataset's sums add in another order than its analysts' totals)."""
    pairs = ((a.epsilon, b.epsilon), (a.delta, b.delta), (a.rho, b.rho), (a.selection_delta, b.selection_delta))
    return a.queries == b.queries and all(x == y or abs(x - y) <= 1e-9 * max(abs(x), abs(y)) + 1e-15 for x, y in pairs)


#: (ledger, dataset, whose) mismatches already logged by this process: one operator line each.
_REPORTED: set[tuple[str, str, str]] = set()
#: Marks "no charge row at all" apart from "rows written before schema 5" (no sums to compare).
_NO_ROWS = Spent(queries=0)


def _reconciled(url: str, dataset: str, whose: str, totals: Spent | None, anchor: Spent | None) -> Spent:
    """What ``whose`` has spent: the larger of the totals row and the sums on the last charge row.

    The totals are an index kept for speed; the charge rows are append-only. Taking the maximum means a
    lowered total (``UPDATE dpsql_ledger_totals``) or deleted tail rows never give budget back, and the
    service keeps answering. A disagreement is tampering or corruption: one operator log line (ERROR)
    per process names it and points at ``dpsql ledger verify``. ``anchor`` None: no sums to compare
    (rows written before schema 5)."""
    base = totals if totals is not None else Spent()
    if anchor is None:
        return base
    if not _agree(base, anchor):
        key = (url, dataset, whose)
        if key not in _REPORTED:
            _REPORTED.add(key)
            log.error(
                "privacy ledger integrity: the totals of %s on dataset %r (ε=%g, %d queries) disagree with its "
                "append-only charge rows (ε=%g, %d queries); charging against the larger. Someone with write "
                "access to the ledger may have changed it: run `dpsql ledger verify --ledger …`",
                whose,
                dataset,
                base.epsilon,
                base.queries,
                anchor.epsilon,
                anchor.queries,
            )
    return _at_least(base, anchor)


def _anchors(rows: Sequence[Any]) -> tuple[Spent | None, Spent | None]:
    """(analyst's, dataset's) sums from :data:`_ANCHORS_SQL`: :data:`_NO_ROWS` when there is no charge,
    None when the last one predates schema 5."""
    found: dict[int, Spent | None] = {}
    for row in rows:
        found[int(row[0])] = None if row[1] is None else _spent(row[1], row[2], row[3], row[4], row[5])
    return found.get(0, _NO_ROWS), found.get(1, _NO_ROWS)


def _lever_event(row: Any) -> LeverEvent:
    return LeverEvent(
        int(row[0]), _parse_ts(row[1]), row[2], row[3], row[4], float(row[5]), float(row[6]), row[7], row[8]
    )


def _audit_entry(row: Any) -> AuditEntry:
    return AuditEntry(
        at=_parse_ts(row[1]),
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
        last_at=None if row[14] is None else _parse_ts(row[14]),
    )


class _SQLLedger(Ledger):
    """The reservation both stores share, over two small adapters.

    :meth:`_reserve` is the template: in one transaction that holds the dataset's write lock,
    read the per-analyst totals → ``check`` them (raises to refuse) → insert the charge →
    upsert the totals → commit. A store supplies :meth:`_reservation` (the transaction and its
    lock, with its errors mapped to :class:`LedgerUnavailable`: fail closed), :meth:`_sql`
    (its paramstyle), :meth:`_insert_id` and :meth:`_timestamp`, and its totals upsert.
    """

    #: Sets the analyst's totals row from the new charge's sums (None: a trigger of the store does it).
    _UPSERT_TOTALS_SQL: str | None

    def _reserve(
        self,
        *,
        dataset: str,
        analyst: str,
        fingerprint: str,
        cost: Cost,
        accounting: Accounting,
        at: dt.datetime,
        check: Callable[[Spent, Spent, Levers], None],
        audit: AuditEntry,
    ) -> tuple[int, int, Spent, Spent]:
        stamp = self._timestamp(at)
        eps, delta, rho, sel = cost.epsilon, cost.delta, cost.rho, cost.selection_delta
        with self._reservation(dataset) as execute:
            analyst_spent, dataset_spent = self._spent_in(execute, dataset, analyst)
            levers = _levers(execute(self._sql(_LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone())
            check(analyst_spent, dataset_spent, levers)  # refuses (42501, 53P01) before anything is written
            mine, all_ = analyst_spent + cost, dataset_spent + cost
            sums = (mine.epsilon, mine.delta, mine.rho, mine.selection_delta, mine.queries)
            ds_sums = (all_.epsilon, all_.delta, all_.rho, all_.selection_delta, all_.queries)
            charge = (stamp, dataset, analyst, fingerprint, eps, delta, rho, accounting, sel, *sums, *ds_sums)
            charge_id = self._insert_id(execute, self._sql(_INSERT_CHARGE_SQL), charge)
            if self._UPSERT_TOTALS_SQL is not None:  # PostgreSQL: the insert trigger sets the totals
                execute(self._UPSERT_TOTALS_SQL, (dataset, analyst, *sums[:3], mine.queries, stamp, sums[3]))
            row = replace(audit, charge_id=charge_id)
            audit_id = self._insert_id(execute, self._sql(_INSERT_AUDIT_SQL), self._audit_params(row))
        return charge_id, audit_id, mine, all_

    def _spent_in(self, execute: Execute, dataset: str, analyst: str) -> tuple[Spent, Spent]:
        """(analyst's, dataset's) spending inside a transaction: totals reconciled with the charge rows."""
        rows = execute(self._sql(_TOTALS_SQL), (dataset,)).fetchall()
        per_analyst = {row[0]: _spent(row[1], row[2], row[3], row[4], row[5]) for row in rows}
        mine, everyone = _anchors(execute(self._sql(_ANCHORS_SQL), (dataset, analyst, dataset)).fetchall())
        return (
            _reconciled(self.url, dataset, f'analyst "{analyst}"', per_analyst.get(analyst), mine),
            _reconciled(self.url, dataset, "the dataset", Spent.total(per_analyst.values()), everyone),
        )

    def summary(self, dataset: str) -> list[AnalystSpent]:
        rows = self._read(_SUMMARY_SQL, (dataset,))
        out = []
        for r in rows:
            totals = _spent(r[1], r[2], r[3], r[4], r[6])
            anchor = _NO_ROWS if r[7] is None else None if r[8] is None else _spent(r[8], r[9], r[10], r[11], r[12])
            spent = _reconciled(self.url, dataset, f'analyst "{r[0]}"', totals, anchor)
            out.append(AnalystSpent(r[0], spent, _parse_ts(r[5])))
        return out

    def spent(self, dataset: str, analyst: str | None = None) -> Spent:
        """Totals for one analyst, or for the whole dataset (all analysts) when ``analyst`` is None; each
        reconciled with the append-only charge rows (the larger wins)."""
        rows = self.summary(dataset)
        mine, everyone = _anchors(self._read(_ANCHORS_SQL, (dataset, analyst or "", dataset)))
        if analyst is None:
            return _reconciled(self.url, dataset, "the dataset", Spent.total(r.spent for r in rows), everyone)
        own = next((r.spent for r in rows if r.analyst == analyst), None)
        return _reconciled(self.url, dataset, f'analyst "{analyst}"', own, mine)


class SQLiteLedger(_SQLLedger):
    """Embedded ledger: one long-lived connection per thread on a WAL-mode SQLite file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = "sqlite:///:memory:" if path == ":memory:" else f"sqlite://{path}"
        self._memory = path == ":memory:"
        self._lock = threading.Lock()  # guards _connections, and serialises the one :memory: connection
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._pid = os.getpid()
        self._closed = False
        if not self._memory:
            parent = os.path.dirname(path)
            if os.path.isdir(path):
                raise _unavailable(f"{path!r} is a directory")
            if not os.path.isdir(parent):
                raise _unavailable(f"directory {parent!r} does not exist")
            _create_private(path)
        try:
            conn = self._conn()
            row = conn.execute("PRAGMA quick_check").fetchone()
        except sqlite3.Error as exc:
            self.close()
            raise _unavailable(f"cannot open {path!r}", exc) from exc
        except LedgerUnavailable:
            self.close()
            raise
        if row is None or row[0] != "ok":
            self.close()
            raise _unavailable(f"{path!r} failed its integrity check")

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=_SQLITE_BUSY_TIMEOUT_S,
                isolation_level=None,  # we issue BEGIN IMMEDIATE / COMMIT ourselves
                check_same_thread=False,  # only so that close() may close every thread's connection
            )
        except sqlite3.Error as exc:
            raise _unavailable(f"cannot open {self.path!r}", exc) from exc
        try:
            if not self._memory:
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
                if mode is None or str(mode[0]).lower() != "wal":
                    raise _unavailable(f"{self.path!r} cannot use write-ahead logging")
            conn.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            conn.execute("PRAGMA fullfsync=ON")  # F_FULLFSYNC on macOS; ignored elsewhere
            _sqlite_migrate(conn)
            _sqlite_migrate_audit(conn)
            _sqlite_migrate_5(conn)
            conn.executescript(_SQLITE_SCHEMA)
        except (sqlite3.Error, LedgerUnavailable) as exc:
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            conn.close()
            if isinstance(exc, LedgerUnavailable):
                raise
            raise _unavailable(f"cannot open {self.path!r}", exc) from exc
        return conn

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise _unavailable("the ledger is closed")
        if os.getpid() != self._pid:
            # Forked child: SQLite connections must not cross fork(); start afresh.
            self._pid = os.getpid()
            self._local = threading.local()
            self._connections = []
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            with self._lock:
                if self._memory and self._connections:
                    conn = self._connections[0]
                else:
                    conn = self._connect()
                    self._connections.append(conn)
            self._local.conn = conn
        return conn

    @contextmanager
    def _turn(self) -> Iterator[None]:
        # The single :memory: connection is shared by all threads, so they take turns.
        if self._memory:
            with self._lock:
                yield
        else:
            yield

    _UPSERT_TOTALS_SQL = _UPSERT_TOTALS

    @contextmanager
    def _reservation(self, dataset: str) -> Iterator[Execute]:
        conn = self._conn()
        with self._turn():
            try:
                # BEGIN IMMEDIATE takes the file's write lock now, so no other thread or process
                # can commit a charge between our read of the totals and our insert.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn.execute
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise _unavailable(f"cannot record a charge in {self.path!r}", exc) from exc

    @contextmanager
    def _append(self) -> Iterator[Execute]:
        # Same write lock as a reservation (SQLite has one writer); held for a few inserts only.
        with self._reservation("") as execute:
            yield execute

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        conn = self._conn()
        params = tuple(_ts(p) if isinstance(p, dt.datetime) else p for p in params)
        with self._turn():
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise _unavailable(f"cannot read {self.path!r}", exc) from exc

    def _insert_id(self, execute: Execute, sql: str, params: tuple[Any, ...]) -> int:
        charge_id = execute(sql, params).lastrowid
        assert charge_id is not None
        return int(charge_id)

    def _timestamp(self, at: dt.datetime) -> Any:
        return _ts(at)

    def _meta_setdefault(self, key: str, value: str) -> str:
        conn = self._conn()
        with self._turn():
            try:
                conn.execute(
                    "INSERT INTO dpsql_ledger_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                    (key, value),
                )
                row = conn.execute("SELECT value FROM dpsql_ledger_meta WHERE key = ?", (key,)).fetchone()
            except sqlite3.Error as exc:
                raise _unavailable(f"cannot write {self.path!r}", exc) from exc
        return str(row[0])

    def charges(self, dataset: str, analyst: str | None = None, *, limit: int = 100) -> list[ChargeRecord]:
        sql = (
            "SELECT id, at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta "
            "FROM dpsql_ledger WHERE dataset = ?"
        )
        params: tuple[Any, ...] = (dataset,)
        if analyst is not None:
            sql += " AND analyst = ?"
            params += (analyst,)
        sql += " ORDER BY id DESC LIMIT ?"
        conn = self._conn()
        with self._turn():
            try:
                rows = conn.execute(sql, (*params, limit)).fetchall()
            except sqlite3.Error as exc:
                raise _unavailable(f"cannot read {self.path!r}", exc) from exc
        return [_record(row) for row in rows]

    def close(self) -> None:
        self._before_close()
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            with suppress(sqlite3.Error):
                conn.close()


def _record(row: Any) -> ChargeRecord:
    """A charge row as read; one no :class:`Cost` can hold (inf, NaN, text: tampering) is ``corrupt``."""
    # a charge recorded before selection_delta existed counts its whole δ (conservative)
    numbers = (_number(row[5]), _number(row[6]), _number(row[7]), _number(row[6] if row[9] is None else row[9]))
    try:
        cost, corrupt = Cost(*numbers), False
    except ValueError:
        cost, corrupt = Cost(0.0), True
    return ChargeRecord(
        id=int(row[0]),
        at=_parse_ts(row[1]),
        dataset=row[2],
        analyst=row[3],
        fingerprint=row[4],
        cost=cost,
        accounting=row[8],
        corrupt=corrupt,
    )


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS dpsql_ledger_meta (key text PRIMARY KEY, value text NOT NULL);
REVOKE ALL ON dpsql_ledger_meta FROM PUBLIC;
CREATE TABLE IF NOT EXISTS dpsql_ledger (
    id          bigserial        PRIMARY KEY,
    at          timestamptz      NOT NULL,
    dataset     text             NOT NULL,
    analyst     text             NOT NULL,
    fingerprint text             NOT NULL,
    epsilon     double precision NOT NULL CHECK (epsilon >= 0),
    delta       double precision NOT NULL CHECK (delta >= 0),
    rho         double precision NOT NULL CHECK (rho >= 0),
    accounting  text             NOT NULL,
    selection_delta double precision CHECK (selection_delta >= 0)  -- NULL: before schema 2 (count delta)
);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_owner ON dpsql_ledger (dataset, analyst, id);
CREATE TABLE IF NOT EXISTS dpsql_ledger_totals (
    dataset text             NOT NULL,
    analyst text             NOT NULL,
    epsilon double precision NOT NULL,
    delta   double precision NOT NULL,
    rho     double precision NOT NULL,
    queries bigint           NOT NULL,
    last_at timestamptz      NOT NULL,
    selection_delta double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (dataset, analyst)
);
-- Schema 1 → 2: old totals take their whole recorded δ as selection δ (conservative).
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'dpsql_ledger_totals'::regclass
                   AND attname = 'selection_delta' AND NOT attisdropped) THEN
        ALTER TABLE dpsql_ledger ADD COLUMN selection_delta double precision CHECK (selection_delta >= 0);
        ALTER TABLE dpsql_ledger_totals ADD COLUMN selection_delta double precision NOT NULL DEFAULT 0;
        UPDATE dpsql_ledger_totals SET selection_delta = delta;
    END IF;
END
$do$;
CREATE OR REPLACE FUNCTION dpsql_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'privacy ledger charges are never changed or deleted';
END
$fn$;
-- Schema 3: the curator's levers and the audit trail (new tables only: nothing to migrate).
CREATE TABLE IF NOT EXISTS dpsql_ledger_levers (
    id       bigserial        PRIMARY KEY,
    at       timestamptz      NOT NULL,
    dataset  text             NOT NULL,
    analyst  text             NOT NULL,
    kind     text             NOT NULL CHECK (kind IN ('grant', 'revoke', 'freeze', 'unfreeze', 'prune')),
    epsilon  double precision NOT NULL CHECK (epsilon >= 0),
    delta    double precision NOT NULL CHECK (delta >= 0 AND delta < 1),
    by_user  text             NOT NULL,
    reason   text             NOT NULL
);
CREATE INDEX IF NOT EXISTS dpsql_ledger_levers_by_owner ON dpsql_ledger_levers (dataset, analyst, id);
CREATE TABLE IF NOT EXISTS dpsql_audit (
    id          bigserial        PRIMARY KEY,
    at          timestamptz      NOT NULL,
    dataset     text             NOT NULL,
    analyst     text             NOT NULL,
    fingerprint text             NOT NULL,
    shape       text             NOT NULL,
    outcome     text             NOT NULL,
    sqlstate    text             NOT NULL,
    epsilon     double precision NOT NULL,
    delta       double precision NOT NULL,
    rho         double precision NOT NULL,
    latency_ms  double precision NOT NULL,
    charge_id   bigint
);
CREATE INDEX IF NOT EXISTS dpsql_audit_by_time ON dpsql_audit (dataset, at);
-- Schema 4: identical free statements folded into one row.
ALTER TABLE dpsql_audit ADD COLUMN IF NOT EXISTS repeats bigint NOT NULL DEFAULT 1;
ALTER TABLE dpsql_audit ADD COLUMN IF NOT EXISTS last_at timestamptz;
CREATE INDEX IF NOT EXISTS dpsql_audit_by_outcome ON dpsql_audit (dataset, outcome, at);
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'dpsql_levers_append_only' AND tgrelid = 'dpsql_ledger_levers'::regclass) THEN
        CREATE TRIGGER dpsql_levers_append_only BEFORE UPDATE OR DELETE ON dpsql_ledger_levers
            FOR EACH ROW EXECUTE FUNCTION dpsql_ledger_append_only();
        CREATE TRIGGER dpsql_levers_no_truncate BEFORE TRUNCATE ON dpsql_ledger_levers
            FOR EACH STATEMENT EXECUTE FUNCTION dpsql_ledger_append_only();
        CREATE TRIGGER dpsql_audit_no_truncate BEFORE TRUNCATE ON dpsql_audit
            FOR EACH STATEMENT EXECUTE FUNCTION dpsql_ledger_append_only();
    END IF;
END
$do$;
-- Schema 4: two updates only. A charge's row (written with the charge) gets its statement's end once;
-- a free row counts more repeats. Who, what, when and the cost never change.
CREATE OR REPLACE FUNCTION dpsql_audit_guard() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF (NEW.id, NEW.at, NEW.dataset, NEW.analyst, NEW.fingerprint, NEW.shape, NEW.epsilon, NEW.delta, NEW.rho,
        NEW.charge_id) IS NOT DISTINCT FROM (OLD.id, OLD.at, OLD.dataset, OLD.analyst, OLD.fingerprint, OLD.shape,
        OLD.epsilon, OLD.delta, OLD.rho, OLD.charge_id)
       AND ((OLD.outcome = 'charged' AND NEW.outcome IN ('answered', 'failed')
             AND (NEW.repeats, NEW.last_at) IS NOT DISTINCT FROM (OLD.repeats, OLD.last_at))
            OR (OLD.charge_id IS NULL AND OLD.outcome <> 'charged'
                AND (NEW.outcome, NEW.sqlstate, NEW.latency_ms) IS NOT DISTINCT FROM
                    (OLD.outcome, OLD.sqlstate, OLD.latency_ms)
                AND NEW.repeats > OLD.repeats)) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'the audit trail is append-only';
END
$fn$;
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'dpsql_audit_guard_update' AND tgrelid = 'dpsql_audit'::regclass) THEN
        DROP TRIGGER IF EXISTS dpsql_audit_append_only ON dpsql_audit;  -- schema 3: no update at all
        CREATE TRIGGER dpsql_audit_no_delete BEFORE DELETE ON dpsql_audit
            FOR EACH ROW EXECUTE FUNCTION dpsql_ledger_append_only();
        CREATE TRIGGER dpsql_audit_guard_update BEFORE UPDATE ON dpsql_audit
            FOR EACH ROW EXECUTE FUNCTION dpsql_audit_guard();
    END IF;
END
$do$;
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'dpsql_ledger_append_only' AND tgrelid = 'dpsql_ledger'::regclass) THEN
        CREATE TRIGGER dpsql_ledger_append_only BEFORE UPDATE OR DELETE ON dpsql_ledger
            FOR EACH ROW EXECUTE FUNCTION dpsql_ledger_append_only();
        CREATE TRIGGER dpsql_ledger_no_truncate BEFORE TRUNCATE ON dpsql_ledger
            FOR EACH STATEMENT EXECUTE FUNCTION dpsql_ledger_append_only();
    END IF;
END
$do$;
-- Schema 5: each charge row carries its analyst's and its dataset's sums after it, computed here (not by
-- the inserting role) under the dataset's advisory lock, from the larger of the last row's sums and the
-- totals; the totals are then set from them. SECURITY DEFINER: the ledger-writer role needs INSERT on
-- dpsql_ledger only, never UPDATE on dpsql_ledger_totals, so it cannot lower a total.
ALTER TABLE dpsql_ledger ADD COLUMN IF NOT EXISTS sum_epsilon double precision,
    ADD COLUMN IF NOT EXISTS sum_delta double precision, ADD COLUMN IF NOT EXISTS sum_rho double precision,
    ADD COLUMN IF NOT EXISTS sum_selection_delta double precision, ADD COLUMN IF NOT EXISTS sum_queries bigint,
    ADD COLUMN IF NOT EXISTS ds_epsilon double precision, ADD COLUMN IF NOT EXISTS ds_delta double precision,
    ADD COLUMN IF NOT EXISTS ds_rho double precision, ADD COLUMN IF NOT EXISTS ds_selection_delta double precision,
    ADD COLUMN IF NOT EXISTS ds_queries bigint;
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_dataset ON dpsql_ledger (dataset, id);
CREATE OR REPLACE FUNCTION dpsql_ledger_charge() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    a record;
    d record;
    t record;
    s record;
BEGIN
    IF NOT (NEW.epsilon >= 0 AND NEW.epsilon < 'Infinity' AND NEW.delta >= 0 AND NEW.delta < 1
            AND NEW.rho >= 0 AND NEW.rho < 'Infinity'
            AND COALESCE(NEW.selection_delta, 0) >= 0 AND COALESCE(NEW.selection_delta, 0) < 1) THEN
        RAISE EXCEPTION 'privacy ledger charges are finite numbers' USING ERRCODE = '22003';
    END IF;
    PERFORM pg_advisory_xact_lock(1685091185, hashtext(NEW.dataset));  -- _PG_LOCK_NAMESPACE
    SELECT sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries INTO a FROM dpsql_ledger
        WHERE dataset = NEW.dataset AND analyst = NEW.analyst ORDER BY id DESC LIMIT 1;
    SELECT epsilon, delta, rho, selection_delta, queries INTO t FROM dpsql_ledger_totals
        WHERE dataset = NEW.dataset AND analyst = NEW.analyst;
    SELECT ds_epsilon, ds_delta, ds_rho, ds_selection_delta, ds_queries INTO d FROM dpsql_ledger
        WHERE dataset = NEW.dataset ORDER BY id DESC LIMIT 1;
    SELECT sum(epsilon) AS epsilon, sum(delta) AS delta, sum(rho) AS rho, sum(selection_delta) AS selection_delta,
           sum(queries) AS queries INTO s FROM dpsql_ledger_totals WHERE dataset = NEW.dataset;
    NEW.sum_epsilon := GREATEST(a.sum_epsilon, t.epsilon, 0) + NEW.epsilon;
    NEW.sum_delta := GREATEST(a.sum_delta, t.delta, 0) + NEW.delta;
    NEW.sum_rho := GREATEST(a.sum_rho, t.rho, 0) + NEW.rho;
    NEW.sum_selection_delta := GREATEST(a.sum_selection_delta, t.selection_delta, 0)
        + COALESCE(NEW.selection_delta, NEW.delta);
    NEW.sum_queries := GREATEST(a.sum_queries, t.queries, 0) + 1;
    NEW.ds_epsilon := GREATEST(d.ds_epsilon, s.epsilon, 0) + NEW.epsilon;
    NEW.ds_delta := GREATEST(d.ds_delta, s.delta, 0) + NEW.delta;
    NEW.ds_rho := GREATEST(d.ds_rho, s.rho, 0) + NEW.rho;
    NEW.ds_selection_delta := GREATEST(d.ds_selection_delta, s.selection_delta, 0)
        + COALESCE(NEW.selection_delta, NEW.delta);
    NEW.ds_queries := GREATEST(d.ds_queries, s.queries, 0) + 1;
    INSERT INTO dpsql_ledger_totals AS x (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta)
        VALUES (NEW.dataset, NEW.analyst, NEW.sum_epsilon, NEW.sum_delta, NEW.sum_rho, NEW.sum_queries, NEW.at,
                NEW.sum_selection_delta)
        ON CONFLICT (dataset, analyst) DO UPDATE SET epsilon = excluded.epsilon, delta = excluded.delta,
            rho = excluded.rho, queries = excluded.queries, last_at = excluded.last_at,
            selection_delta = excluded.selection_delta;
    RETURN NEW;
END
$fn$;
DO $do$
BEGIN
    -- A SECURITY DEFINER function resolves names in this schema only (never the caller's temporary tables).
    EXECUTE format('ALTER FUNCTION dpsql_ledger_charge() SET search_path = %I, pg_temp', current_schema());
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'dpsql_ledger_charge' AND tgrelid = 'dpsql_ledger'::regclass) THEN
        CREATE TRIGGER dpsql_ledger_charge BEFORE INSERT ON dpsql_ledger
            FOR EACH ROW EXECUTE FUNCTION dpsql_ledger_charge();
    END IF;
END
$do$;
ALTER TABLE dpsql_ledger_levers DROP CONSTRAINT IF EXISTS dpsql_ledger_levers_kind_check;
ALTER TABLE dpsql_ledger_levers ADD CONSTRAINT dpsql_ledger_levers_kind_check
    CHECK (kind IN ('grant', 'revoke', 'freeze', 'unfreeze', 'prune'));
-- Only free refusals and cache hits are ever deleted, after a curator's prune row later than them.
CREATE OR REPLACE FUNCTION dpsql_audit_delete_guard() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF OLD.charge_id IS NULL AND OLD.outcome IN ('refused', 'cache hit') AND EXISTS (
        SELECT 1 FROM dpsql_ledger_levers p WHERE p.dataset = OLD.dataset AND p.kind = 'prune'
        AND p.at > COALESCE(OLD.last_at, OLD.at)) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'the audit trail is append-only';
END
$fn$;
DROP TRIGGER IF EXISTS dpsql_audit_no_delete ON dpsql_audit;
CREATE TRIGGER dpsql_audit_no_delete BEFORE DELETE ON dpsql_audit
    FOR EACH ROW EXECUTE FUNCTION dpsql_audit_delete_guard();
-- The result cache beside the ledger (dpsql.cache, same definition), created by the ledger's owner too so that
-- a ledger-writer role, which may not create tables, finds it.
CREATE TABLE IF NOT EXISTS dpsql_result_cache
    (key TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, result BYTEA NOT NULL);
COMMENT ON TABLE dpsql_ledger IS 'dpsql privacy ledger, schema 5';  -- _PG_SCHEMA_MARK
"""


#: What schema 5's script writes last: a ledger with it needs no DDL (``COMMENT`` is readable by every role).
_PG_SCHEMA_MARK = "dpsql privacy ledger, schema 5"


def _pg_schema_current(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT obj_description(to_regclass('dpsql_ledger'), 'pg_class')").fetchone()
    return row is not None and row[0] == _PG_SCHEMA_MARK


class PostgresLedger(_SQLLedger):
    """Ledger in a PostgreSQL table, in the DSN's schema; one connection per thread."""

    def __init__(self, conninfo: str) -> None:
        self.url = conninfo
        self._lock = threading.Lock()
        self._local = threading.local()
        self._connections: list[psycopg.Connection[Any]] = []
        self._pid = os.getpid()
        self._closed = False
        self._conn()  # connects and creates the tables, so a bad DSN fails at open

    @staticmethod
    def open_conninfo(conninfo: str) -> PostgresLedger:
        """Open with any libpq conninfo (``host=… port=…`` as well as a URL)."""
        return PostgresLedger(conninfo)

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in self.url:
            kwargs["connect_timeout"] = 10
        try:
            conn = psycopg.connect(self.url, **kwargs)
        except psycopg.Error as exc:
            raise _unavailable("cannot connect to the ledger database", exc) from exc
        try:
            # A stuck peer holding the dataset lock must not hang every query: time out, fail closed.
            conn.execute("SET lock_timeout = '30s'")
            if not _pg_schema_current(conn):  # a least-privilege role never runs DDL (it could not)
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_PG_LOCK_NAMESPACE,))
                    conn.execute(_PG_SCHEMA)
                    # the owner creates the installation key, so a writer role needs no INSERT on the meta table
                    conn.execute(
                        "INSERT INTO dpsql_ledger_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
                        (_INSTALLATION_KEY, secrets.token_hex(32)),
                    )
        except psycopg.Error as exc:
            conn.close()
            raise _unavailable("cannot create the ledger tables", exc) from exc
        return conn

    def _conn(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise _unavailable("the ledger is closed")
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._local = threading.local()
            self._connections = []
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = self._connect()
            with self._lock:
                self._connections.append(conn)
            self._local.conn = conn
        return conn

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        """Forget a connection after an error; the next call reconnects."""
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        with suppress(Exception):  # already failing closed
            conn.close()

    _UPSERT_TOTALS_SQL = None  # the insert trigger (SECURITY DEFINER) sets the totals from the charge row

    @contextmanager
    def _reservation(self, dataset: str) -> Iterator[Execute]:
        import psycopg

        conn = self._conn()
        try:
            with conn.transaction():
                # The lock serialises every reserve on this dataset until COMMIT; under READ
                # COMMITTED the next statement's snapshot then sees every earlier charge.
                conn.execute(
                    "SELECT set_config('synchronous_commit', 'on', true), pg_advisory_xact_lock(%s, hashtext(%s))",
                    (_PG_LOCK_NAMESPACE, dataset),
                )
                yield conn.execute
        except psycopg.Error as exc:
            self._drop(conn)
            raise _unavailable("cannot record a charge", exc) from exc

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s")

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return self._fetch(self._sql(sql), params)

    @contextmanager
    def _append(self) -> Iterator[Execute]:
        import psycopg

        conn = self._conn()
        try:
            with conn.transaction():
                yield conn.execute
        except psycopg.Error as exc:
            self._drop(conn)
            raise _unavailable("cannot write the audit trail", exc) from exc

    def _insert_id(self, execute: Execute, sql: str, params: tuple[Any, ...]) -> int:
        row = execute(sql + " RETURNING id", params).fetchone()
        assert row is not None
        return int(row[0])

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        import psycopg

        conn = self._conn()
        try:
            return conn.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            self._drop(conn)
            raise _unavailable("cannot read the ledger", exc) from exc

    def _meta_setdefault(self, key: str, value: str) -> str:
        import psycopg

        rows = self._fetch("SELECT value FROM dpsql_ledger_meta WHERE key = %s", (key,))
        if rows:  # read first: a ledger-writer role may read the key, never write the table
            return str(rows[0][0])
        conn = self._conn()
        try:
            conn.execute(
                "INSERT INTO dpsql_ledger_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING", (key, value)
            )
        except psycopg.Error as exc:
            self._drop(conn)
            raise _unavailable("cannot write the ledger", exc) from exc
        rows = self._fetch("SELECT value FROM dpsql_ledger_meta WHERE key = %s", (key,))
        return str(rows[0][0])

    def charges(self, dataset: str, analyst: str | None = None, *, limit: int = 100) -> list[ChargeRecord]:
        sql = (
            "SELECT id, at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta "
            "FROM dpsql_ledger WHERE dataset = %s"
        )
        params: tuple[Any, ...] = (dataset,)
        if analyst is not None:
            sql += " AND analyst = %s"
            params += (analyst,)
        sql += " ORDER BY id DESC LIMIT %s"
        return [_record(row) for row in self._fetch(sql, (*params, limit))]

    def close(self) -> None:
        self._before_close()
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            with suppress(Exception):  # closing is best effort
                conn.close()


# --- least privilege: warn when dpsql holds more than it needs ----------------------------------

#: The ledger's tables (and the result cache beside it): owned by a ledger-owner role, never by the server's.
LEDGER_TABLES = (
    "dpsql_ledger",
    "dpsql_ledger_totals",
    "dpsql_ledger_levers",
    "dpsql_audit",
    "dpsql_ledger_meta",
    "dpsql_result_cache",
)
_ROLES_README = 'README "Least-privilege database roles"'


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def pg_role_warnings(
    query: Callable[[str], Sequence[Sequence[Any]]], what: str, tables: Sequence[str], should_be: str
) -> list[str]:
    """One warning line when the connection ``query`` runs on is a superuser, else one when its role owns
    (or is a member of the owner of) any of ``tables``: either can disable triggers, or rewrite and delete
    rows, which is all the ledger's integrity rests on. ``query`` runs one parameterless SQL statement."""
    user, superuser = query("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")[0]
    if superuser:
        return [
            f'{what} connects as role "{user}", a superuser: it can disable the ledger\'s triggers and rewrite '
            f"any charge, total or audit row; connect as {should_be} ({_ROLES_README})"
        ]
    names = ", ".join(_sql_literal(t) for t in tables)
    owned = query(
        f"SELECT t FROM unnest(ARRAY[{names}]::text[]) WITH ORDINALITY AS u(t, n) "
        "JOIN pg_class c ON c.oid = to_regclass(t) WHERE pg_has_role(current_user, c.relowner, 'USAGE') ORDER BY n"
    )
    if not owned:
        return []
    listed = ", ".join(str(row[0]) for row in owned)
    return [
        f'{what} connects as role "{user}", owner of {listed}: an owner can disable triggers and rewrite or '
        f"delete rows; connect as {should_be} ({_ROLES_README})"
    ]


def serve_role_warnings(engine: Any) -> list[str]:
    """The warnings ``dpsql serve`` logs at start for its PostgreSQL ledger and data connections
    (:func:`pg_role_warnings`); a check that cannot run is skipped (it never stops a start)."""
    warnings: list[str] = []
    ledger = engine.ledger
    if isinstance(ledger, PostgresLedger):
        try:
            warnings += pg_role_warnings(
                lambda sql: ledger._fetch(sql, ()),
                "the privacy ledger",
                LEDGER_TABLES,
                "a ledger-writer role such as dpsql_ledger_writer (INSERT on the charges and the audit trail only)",
            )
        except Exception as exc:  # a warning, never a reason not to start
            log.debug("ledger role check skipped: %s", exc)
    backend = engine.backend
    if getattr(backend, "dialect", None) == "postgres":
        sources = sorted({table.source or name for name, table in engine.policy.tables.items()})
        try:
            warnings += pg_role_warnings(
                lambda sql: backend.execute(sql)[1],
                "the data database",
                sources,
                "a read-only role such as dpsql_data_reader (SELECT on the served tables only)",
            )
        except Exception as exc:
            log.debug("data role check skipped: %s", exc)
    return warnings


def warn_about_roles(engine: Any) -> None:
    """Log each of :func:`serve_role_warnings` as one WARNING line (``dpsql serve`` calls it at start)."""
    for warning in serve_role_warnings(engine):
        log.warning("%s", warning)
