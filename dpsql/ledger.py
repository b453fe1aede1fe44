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


#: Kinds of curator rows in ``dpsql_ledger_levers``.
LEVER_KINDS = ("grant", "freeze", "unfreeze")

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
    ) -> Remaining:
        """What is left of ``budget`` (plus the analyst's grants) given what the analyst (or the
        dataset) has spent."""
        if analyst is not None:
            budget = self.levers(dataset, analyst).limit(budget)
        return remaining_budget(
            self.spent(dataset, analyst),
            budget,
            accounting,
            rho_delta=rho_delta,
        )

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


_SQLITE_SCHEMA = """
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
    selection_delta REAL CHECK (selection_delta >= 0)  -- NULL: recorded before schema 2 (count delta)
);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_owner ON dpsql_ledger (dataset, analyst, id);
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
CREATE TABLE IF NOT EXISTS dpsql_ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Schema 3: the curator's levers and the audit trail (new tables only: nothing to migrate).
CREATE TABLE IF NOT EXISTS dpsql_ledger_levers (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    at       TEXT    NOT NULL,
    dataset  TEXT    NOT NULL,
    analyst  TEXT    NOT NULL,
    kind     TEXT    NOT NULL CHECK (kind IN ('grant', 'freeze', 'unfreeze')),
    epsilon  REAL    NOT NULL CHECK (epsilon >= 0),
    delta    REAL    NOT NULL CHECK (delta >= 0 AND delta < 1),
    by_user  TEXT    NOT NULL,
    reason   TEXT    NOT NULL
);
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
CREATE TRIGGER IF NOT EXISTS dpsql_audit_no_delete BEFORE DELETE ON dpsql_audit
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
INSERT INTO dpsql_ledger_meta (key, value) VALUES ('schema', '4')
    ON CONFLICT (key) DO UPDATE SET value = excluded.value;
COMMIT;
"""

# Schema 1 → 2 (run inside the BEGIN IMMEDIATE of _SQLITE_SCHEMA's successor, after re-checking).
# Old totals take their whole recorded δ as selection δ: an upper bound, so never an undercount.
_SQLITE_MIGRATE_2 = (
    "ALTER TABLE dpsql_ledger ADD COLUMN selection_delta REAL CHECK (selection_delta >= 0)",
    "ALTER TABLE dpsql_ledger_totals ADD COLUMN selection_delta REAL NOT NULL DEFAULT 0",
    "UPDATE dpsql_ledger_totals SET selection_delta = delta",
)

_UPSERT_TOTALS = """
INSERT INTO dpsql_ledger_totals (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta)
VALUES (?, ?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (dataset, analyst) DO UPDATE SET
    epsilon = epsilon + excluded.epsilon,
    delta   = delta + excluded.delta,
    rho     = rho + excluded.rho,
    queries = queries + 1,
    last_at = excluded.last_at,
    selection_delta = selection_delta + excluded.selection_delta
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
    "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

#: ``execute(sql, params)`` inside a reservation's transaction: returns a DB-API cursor.
Execute = Callable[[str, tuple[Any, ...]], Any]

# Grants summed, and the latest freeze/unfreeze: curator rows are few, so no derived state to keep.
# Each row is clamped first (inf, NaN or a huge ε written by an older version count as the ceiling),
# so the sum stays finite and PostgreSQL's float overflow error can never make every read fail.
_LEVERS_SQL = (
    "SELECT COALESCE(SUM(CASE WHEN epsilon <= 1e6 THEN epsilon ELSE 1e6 END), 0), "
    "COALESCE(SUM(CASE WHEN delta < 1 THEN delta ELSE 1 END), 0), "
    "(SELECT kind FROM dpsql_ledger_levers WHERE dataset = ? AND analyst = ? "
    "AND kind IN ('freeze', 'unfreeze') ORDER BY id DESC LIMIT 1) "
    "FROM dpsql_ledger_levers WHERE dataset = ? AND analyst = ? AND kind = 'grant'"
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
    epsilon = _clamped(row[0], GRANT_CEILING.epsilon)
    delta = _clamped(row[1], GRANT_CEILING.delta)
    grant = Allowance(epsilon, delta) if epsilon or delta else NO_GRANT
    return Levers(grant, row[2] == "freeze")


def _clamped(value: Any, ceiling: float) -> float:
    number = float(value or 0.0)
    return ceiling if not number <= ceiling else max(number, 0.0)  # NaN and inf: the ceiling


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
        number = float(value)
        return number if number >= 0 else math.inf

    return Spent(clean(epsilon), clean(delta), clean(rho), int(queries), clean(selection_delta))


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

    _UPSERT_TOTALS_SQL: str

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
            rows = execute(self._sql(_TOTALS_SQL), (dataset,)).fetchall()
            analyst_spent, dataset_spent = _split_totals(rows, analyst)
            levers = _levers(execute(self._sql(_LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone())
            check(analyst_spent, dataset_spent, levers)  # refuses (42501, 53P01) before anything is written
            charge = (stamp, dataset, analyst, fingerprint, eps, delta, rho, accounting, sel)
            charge_id = self._insert_id(execute, self._sql(_INSERT_CHARGE_SQL), charge)
            execute(self._UPSERT_TOTALS_SQL, (dataset, analyst, eps, delta, rho, stamp, sel))
            row = replace(audit, charge_id=charge_id)
            audit_id = self._insert_id(execute, self._sql(_INSERT_AUDIT_SQL), self._audit_params(row))
        return charge_id, audit_id, analyst_spent + cost, dataset_spent + cost


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

    def summary(self, dataset: str) -> list[AnalystSpent]:
        conn = self._conn()
        with self._turn():
            try:
                rows = conn.execute(
                    "SELECT analyst, epsilon, delta, rho, queries, last_at, selection_delta FROM dpsql_ledger_totals "
                    "WHERE dataset = ? ORDER BY analyst",
                    (dataset,),
                ).fetchall()
            except sqlite3.Error as exc:
                raise _unavailable(f"cannot read {self.path!r}", exc) from exc
        return [AnalystSpent(r[0], _spent(r[1], r[2], r[3], r[4], r[6]), _parse_ts(r[5])) for r in rows]

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


def _split_totals(rows: list[Any], analyst: str) -> tuple[Spent, Spent]:
    """(analyst's totals, dataset's totals over every analyst) from per-analyst total rows."""
    per_analyst = {row[0]: _spent(row[1], row[2], row[3], row[4], row[5]) for row in rows}
    return per_analyst.get(analyst, Spent()), Spent.total(per_analyst.values())


def _record(row: Any) -> ChargeRecord:
    return ChargeRecord(
        id=int(row[0]),
        at=_parse_ts(row[1]),
        dataset=row[2],
        analyst=row[3],
        fingerprint=row[4],
        # a charge recorded before selection_delta existed counts its whole δ (conservative)
        cost=Cost(float(row[5]), float(row[6]), float(row[7]), float(row[6] if row[9] is None else row[9])),
        accounting=row[8],
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
    kind     text             NOT NULL CHECK (kind IN ('grant', 'freeze', 'unfreeze')),
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
"""

_PG_UPSERT_TOTALS = """
INSERT INTO dpsql_ledger_totals AS t (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta)
VALUES (%s, %s, %s, %s, %s, 1, %s, %s)
ON CONFLICT (dataset, analyst) DO UPDATE SET
    epsilon = t.epsilon + excluded.epsilon,
    delta   = t.delta + excluded.delta,
    rho     = t.rho + excluded.rho,
    queries = t.queries + 1,
    last_at = excluded.last_at,
    selection_delta = t.selection_delta + excluded.selection_delta
"""


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
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_PG_LOCK_NAMESPACE,))
                conn.execute(_PG_SCHEMA)
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

    _UPSERT_TOTALS_SQL = _PG_UPSERT_TOTALS

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

    def summary(self, dataset: str) -> list[AnalystSpent]:
        rows = self._fetch(
            "SELECT analyst, epsilon, delta, rho, queries, last_at, selection_delta FROM dpsql_ledger_totals "
            "WHERE dataset = %s ORDER BY analyst",
            (dataset,),
        )
        return [AnalystSpent(r[0], _spent(r[1], r[2], r[3], r[4], r[6]), r[5]) for r in rows]

    def _meta_setdefault(self, key: str, value: str) -> str:
        import psycopg

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
