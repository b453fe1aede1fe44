"""The ledger's contract, written once for both stores: reserve (check and charge in one transaction,
with the statement's audit row), what was spent and remains, the audit rows, the installation key.

A store (:mod:`dpsql.ledger.sqlite`, :mod:`dpsql.ledger.postgres`) supplies the primitives of
:class:`~dpsql.ledger.store.Store` only, and registers its URL schemes in :data:`STORES`.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from dpsql.accountant import (
    ACCOUNTINGS,
    Accounting,
    Allowance,
    BudgetLike,
    Cost,
    Remaining,
    Spent,
    check_budget,
    remaining_budget,
)
from dpsql.errors import LedgerUnavailable, PrivacyBudgetExhausted
from dpsql.ledger import loss_state
from dpsql.ledger.audit import charged_entry
from dpsql.ledger.integrity import (
    ANCHORS_SQL,
    ROWS_SQL,
    anchor_of,
    anchors,
    reconciled,
    require_finite,
    verify,
)
from dpsql.ledger.levers import LEVERS_SQL, CuratorLevers, levers_of
from dpsql.ledger.loss_state import Kept
from dpsql.ledger.records import (
    AnalystSpent,
    AuditEntry,
    Charge,
    ChargeRecord,
    Levers,
    audit_entry,
    charge_record,
    frozen_error,
    min_remaining,
    parse_ts,
    pld_remaining,
    spent_of,
)
from dpsql.ledger.signing import read_signing_key, signing_key_path
from dpsql.ledger.store import HINT_UNAVAILABLE, INSTALLATION_KEY, Execute, unavailable
from dpsql.pld_state import Composed, check_composed, quantised

#: Ledger URLs that ask explicitly for a throwaway in-memory ledger (a fresh budget per engine).
MEMORY_LEDGER_URLS = ("memory", "sqlite:///:memory:")

#: URL scheme (before ``://``) → the store that opens such a URL; each store's module registers its own,
#: and ``dpsql.ledger`` imports every store, so the table is full before any ledger is opened.
STORES: dict[str, Callable[[str], Ledger]] = {}


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
# Each analyst's totals next to the sums and the cost on their last charge row.
_SUMMARY_SQL = (
    "SELECT t.analyst, t.epsilon, t.delta, t.rho, t.queries, t.last_at, t.selection_delta, "
    "l.id, l.sum_epsilon, l.sum_delta, l.sum_rho, l.sum_queries, l.sum_selection_delta, "
    "l.epsilon, l.delta, l.rho, l.selection_delta "
    "FROM dpsql_ledger_totals t LEFT JOIN dpsql_ledger l ON l.id = "
    "(SELECT MAX(m.id) FROM dpsql_ledger m WHERE m.dataset = t.dataset AND m.analyst = t.analyst) "
    "WHERE t.dataset = ? ORDER BY t.analyst"
)
_SELECT_CHARGES_SQL = (
    "SELECT id, at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, selection_delta "
    "FROM dpsql_ledger WHERE dataset = ?"
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


_CLAIM_SQL = "INSERT INTO dpsql_ledger_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"


@dataclass
class _BudgetCheck:
    """The budget check of one :meth:`Ledger.reserve`, run inside its transaction (a freeze or grant
    committed before it counts). What it learns is read by the reservation afterwards: the analyst's
    limit with the curator's grants, and under ``pld`` the composed ε and states with this charge."""

    dataset: str
    analyst: str
    cost: Cost
    recorded: Cost
    accounting: Accounting
    rho_delta: float | None
    analyst_budget: BudgetLike
    dataset_budget: BudgetLike
    limit: Allowance
    #: under pld: the composed ε this charge brings the analyst and the dataset to
    composed: list[float] = field(default_factory=list)
    #: under pld: the analyst's and the dataset's states with this charge
    kept: list[Composed] = field(default_factory=list)

    def __call__(
        self, analyst_spent: Spent, dataset_spent: Spent, levers: Levers, states: tuple[Kept, Kept] | None
    ) -> None:
        if levers.frozen:
            raise frozen_error(self.analyst)
        self.limit = levers.limit(self.analyst_budget)
        require_finite("analyst", self.analyst, analyst_spent + self.cost)
        require_finite("dataset", self.dataset, dataset_spent + self.cost)
        if states is not None:
            # the composed state of every charge so far (kept incrementally), untagged: the generic PLD of
            # each (ε, δ) bounds any mechanism; the reconciled sums cover whatever the state lacks
            mine = check_composed(
                who="analyst",
                name=self.analyst,
                composed=states[0].composed,
                recorded=analyst_spent,
                cost=self.recorded,
                budget=self.limit,
            )
            everyone = check_composed(
                who="dataset",
                name=self.dataset,
                composed=states[1].composed,
                recorded=dataset_spent,
                cost=self.recorded,
                budget=self.dataset_budget,
            )
            self.composed[:], self.kept[:] = [mine[0], everyone[0]], [mine[1], everyone[1]]
            return
        common: dict[str, Any] = {"cost": self.cost, "accounting": self.accounting, "rho_delta": self.rho_delta}
        check_budget(who="analyst", name=self.analyst, spent=analyst_spent, budget=self.limit, **common)
        check_budget(who="dataset", name=self.dataset, spent=dataset_spent, budget=self.dataset_budget, **common)


class Claimed(Exception):
    """A reservation's claim (:meth:`Ledger.reserve`) was already in the ledger: nothing was charged."""


class Ledger(CuratorLevers):
    """A durable, concurrency-safe privacy ledger; open with :meth:`Ledger.open`."""

    #: Whether :meth:`signing_key` comes from outside the database (a store with roles: PostgreSQL).
    external_signing_key: ClassVar[bool] = False

    @staticmethod
    def open(url: str) -> Ledger:
        """``sqlite:///abs/path.sqlite``, ``sqlite:///:memory:`` (or ``memory``) or ``postgresql://…``."""
        if url == "memory":
            url = "sqlite:///:memory:"
        store = STORES.get(url.partition("://")[0]) if "://" in url else None
        if store is None:
            raise LedgerUnavailable(
                "privacy ledger unavailable: unsupported ledger URL scheme",
                detail="Use sqlite:///<absolute path> or postgresql://…",
                hint=HINT_UNAVAILABLE,
            )
        return store(url)

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
        claim: tuple[str, str] | None = None,
    ) -> Charge:
        """Atomically check both budgets and durably record the charge, or raise.

        ``claim`` (key, value): a row of the meta table written in the charge's transaction, first: when
        the key is already there, nothing is charged and :class:`Claimed` is raised — what makes one
        synopsis release charged exactly once however many builds race (:mod:`dpsql.curator.synopsis_cli`).

        Raises :class:`PrivacyBudgetExhausted` (nothing recorded) or
        :class:`LedgerUnavailable` (nothing may be released). Under ``pld`` the check composes every
        charge recorded for the analyst (and for the dataset) with this one by PLD
        (:func:`dpsql.pld.check_pld_budget`); what is recorded is the same under every accounting.
        """
        if accounting not in ACCOUNTINGS:
            raise ValueError(f"unknown accounting {accounting!r}")
        if accounting == "pld":  # on the documented grid, rounded up: what PLD composes, and what is charged
            cost = quantised(cost)
        rho = cost.zcdp_rho() if accounting == "zcdp" else self._recorded_rho(cost)
        recorded = Cost(cost.epsilon, cost.delta, rho, cost.selection_delta)
        now = dt.datetime.now(dt.UTC)
        # The statement's audit row, written in the charge's transaction: a charge never lacks one.
        audit_row = charged_entry(dataset, analyst, fingerprint, cost, now)
        check = _BudgetCheck(
            dataset,
            analyst,
            cost,
            recorded,
            accounting,
            rho_delta,
            analyst_budget,
            dataset_budget,
            Allowance.of(analyst_budget),
        )
        charge_id, audit_id, analyst_spent, dataset_spent = self._reserve(
            dataset=dataset,
            analyst=analyst,
            fingerprint=fingerprint,
            cost=recorded,
            accounting=accounting,
            at=now,
            check=check,
            audit=audit_row,
            kept=check.kept,
            claim=claim,
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
            analyst_limit=check.limit,
            audit_id=audit_id,
            dataset_limit=Allowance.of(dataset_budget),
            composed=(check.composed[0], check.composed[1]) if check.composed else None,
        )

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
        check: Callable[[Spent, Spent, Levers, tuple[Kept, Kept] | None], None],
        audit: AuditEntry,
        kept: Sequence[Composed] = (),
        claim: tuple[str, str] | None = None,
    ) -> tuple[int, int, Spent, Spent]:
        """The reservation, in one transaction that holds the dataset's write lock: read the spending and
        the levers (under pld also the composed states, brought up to date) → ``check`` them (raises to
        refuse) → insert the charge with its sums → set the totals (here or by the store's trigger) → under
        pld store ``kept``, the states with this charge that ``check`` composed → insert the statement's audit
        row → commit."""
        stamp = self._timestamp(at)
        eps, delta, rho, sel = cost.epsilon, cost.delta, cost.rho, cost.selection_delta
        with self._reservation(dataset) as execute:
            if claim is not None and not execute(self._sql(_CLAIM_SQL), claim).rowcount:
                raise Claimed(claim[0])  # rolls back: nothing written, nothing charged
            analyst_spent, dataset_spent = self._spent_in(execute, dataset, analyst)
            levers = levers_of(execute(self._sql(LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone())
            states = self._states_in(execute, dataset, analyst) if accounting == "pld" else None
            check(analyst_spent, dataset_spent, levers, states)  # refuses (42501, 53P01) before anything is written
            mine, all_ = analyst_spent + cost, dataset_spent + cost
            sums = (mine.epsilon, mine.delta, mine.rho, mine.selection_delta, mine.queries)
            ds_sums = (all_.epsilon, all_.delta, all_.rho, all_.selection_delta, all_.queries)
            charge = (stamp, dataset, analyst, fingerprint, eps, delta, rho, accounting, sel, *sums, *ds_sums)
            charge_id = self._insert_id(execute, self._sql(_INSERT_CHARGE_SQL), charge)
            upsert = self.dialect.upsert_totals
            if upsert is not None:  # PostgreSQL: the insert trigger sets the totals
                execute(upsert, (dataset, analyst, *sums[:3], mine.queries, stamp, sums[3]))
            held = self._keep_states(execute, dataset, analyst, kept, charge_id) if states is not None else []
            row = replace(audit, charge_id=charge_id)
            audit_id = self._insert_id(execute, self._sql(_INSERT_AUDIT_SQL), self._audit_params(row))
        for scope, name, state, stored in held:  # committed: this process now holds them
            loss_state.remember(self.url, dataset, scope, name, state, stored)
        return charge_id, audit_id, mine, all_

    def _spent_in(self, execute: Execute, dataset: str, analyst: str) -> tuple[Spent, Spent]:
        """(analyst's, dataset's) spending inside a transaction: totals reconciled with the charge rows."""
        rows = execute(self._sql(_TOTALS_SQL), (dataset,)).fetchall()
        per_analyst = {row[0]: spent_of(row[1], row[2], row[3], row[4], row[5]) for row in rows}
        params = ((dataset, analyst), (dataset,))
        mine, everyone = anchors(
            execute(self._sql(ANCHORS_SQL), (dataset, analyst, dataset)).fetchall(),
            lambda kind: execute(self._sql(ROWS_SQL[kind]), params[kind]).fetchone(),
        )
        return (
            reconciled(self.url, dataset, f'analyst "{analyst}"', per_analyst.get(analyst), mine),
            reconciled(self.url, dataset, "the dataset", Spent.total(per_analyst.values()), everyone),
        )

    def _states_in(self, execute: Execute, dataset: str, analyst: str) -> tuple[Kept, Kept]:
        """(analyst's, dataset's) composed PLD state, up to the last charge row (see :mod:`.loss_state`)."""
        return loss_state.load(
            lambda sql, params: execute(self._sql(sql), params).fetchall(),
            self.url,
            self.signing_key(),
            dataset,
            analyst,
            ("analyst", analyst),
        )

    def _keep_states(
        self, execute: Execute, dataset: str, analyst: str, kept: Sequence[Composed], charge_id: int
    ) -> list[tuple[str, str, Kept, bool]]:
        """The states with the new charge composed in, stored (signed) in the reservation's transaction when
        due (:func:`.loss_state.due`); what this process then holds once it commits (:func:`.loss_state.remember`)."""
        key, sql = self.signing_key(), self._sql(loss_state.UPSERT_SQL)
        held = []
        for scope, name, state in zip((loss_state.ANALYST, loss_state.DATASET), (analyst, ""), kept, strict=True):
            after = Kept(state, charge_id)
            store = loss_state.due(self.url, dataset, scope, name, after)
            if store:
                execute(sql, loss_state.row(key, dataset, scope, name, after))
            held.append((scope, name, after, store))
        return held

    def signing_key(self) -> bytes:
        """The key of what the ledger writer must not forge (see :mod:`.signing`): the installation key for
        a SQLite ledger, the signing-key file outside the database for a PostgreSQL one (read once)."""
        key: bytes | None = getattr(self, "_signing_key", None)
        if key is None:
            external = self.external_signing_key
            key = read_signing_key(signing_key_path(dpsql_home())) if external else self.installation_key()
            self._signing_key = key
        return key

    def summary(self, dataset: str) -> list[AnalystSpent]:
        """Per-analyst spending on ``dataset``, sorted by analyst name (for ``dpsql budget``)."""
        rows = self._read(_SUMMARY_SQL, (dataset,))
        out = []
        for r in rows:
            totals = spent_of(r[1], r[2], r[3], r[4], r[6])
            last = None if r[7] is None else r[8:17]
            anchor = anchor_of(last, partial(self._read_one, ROWS_SQL[0], (dataset, r[0])))
            spent = reconciled(self.url, dataset, f'analyst "{r[0]}"', totals, anchor)
            out.append(AnalystSpent(r[0], spent, parse_ts(r[5])))
        return out

    def _read_one(self, sql: str, params: tuple[Any, ...]) -> Any:
        """The first row ``sql`` reads (an aggregate's only one)."""
        return self._read(sql, params)[0]

    def spent(self, dataset: str, analyst: str | None = None) -> Spent:
        """Totals for one analyst, or for the whole dataset (all analysts) when ``analyst`` is None; each
        reconciled with the append-only charge rows (the larger wins)."""
        rows = self.summary(dataset)
        params = ((dataset, analyst or ""), (dataset,))
        mine, everyone = anchors(
            self._read(ANCHORS_SQL, (dataset, analyst or "", dataset)),
            lambda kind: self._read(ROWS_SQL[kind], params[kind])[0],
        )
        if analyst is None:
            return reconciled(self.url, dataset, "the dataset", Spent.total(r.spent for r in rows), everyone)
        own = next((r.spent for r in rows if r.analyst == analyst), None)
        return reconciled(self.url, dataset, f'analyst "{analyst}"', own, mine)

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
        can really spend: :func:`min_remaining`).

        Under ``pld`` the ε left is ε_budget − the loss composed by PLD so far (at the budget's δ), not
        an additive allowance: PLDs do not compose by addition (the next ε = 0.03 charge may add less
        than 0.03), so only the reservation's check says whether it fits; the δ left is δ_budget − Σδ."""
        if analyst is not None:
            budget = self.levers(dataset, analyst).limit(budget)
        left = self._left(dataset, analyst, budget, accounting, rho_delta)
        if analyst is None or dataset_budget is None:
            return left
        everyone = self._left(dataset, None, dataset_budget, accounting, rho_delta)
        return min_remaining(left, everyone)

    def _left(
        self, dataset: str, analyst: str | None, budget: BudgetLike, accounting: Accounting, rho_delta: float | None
    ) -> Remaining:
        spent = self.spent(dataset, analyst)
        if accounting != "pld":
            return remaining_budget(spent, budget, accounting, rho_delta=rho_delta)
        try:
            mine, everyone = loss_state.load(
                self._read, self.url, self.signing_key(), dataset, analyst or "", ("analyst", analyst or "")
            )
        except PrivacyBudgetExhausted:  # a corrupt charge row reads as a spent budget
            return Remaining(0.0, 0.0, 0.0)
        kept = mine if analyst is not None else everyone
        return pld_remaining(kept.composed.covering(spent).epsilon(budget.delta), spent, budget)

    def charges(self, dataset: str, analyst: str | None = None, *, limit: int = 100) -> list[ChargeRecord]:
        """Most recent charges first, for auditing."""
        sql = _SELECT_CHARGES_SQL
        params: tuple[Any, ...] = (dataset,)
        if analyst is not None:
            sql, params = sql + " AND analyst = ?", (*params, analyst)
        return [charge_record(row) for row in self._read(sql + " ORDER BY id DESC LIMIT ?", (*params, limit))]

    def verify(self, dataset: str | None = None) -> list[str]:
        """Check the whole ledger against itself; one line per problem (none: consistent). See
        :func:`dpsql.ledger.integrity.verify` and :func:`dpsql.ledger.loss_state.verify_states`: O(charges),
        for ``dpsql ledger verify`` only."""
        return verify(self._read, dataset) + loss_state.verify_states(self._read, dataset)

    # -- the audit trail (append-only but for the two updates its triggers allow) -----------------------

    def record_audit(self, entries: list[AuditEntry]) -> None:
        """Append audit rows in one transaction."""
        self.write_audit(entries)

    def write_audit(
        self,
        inserts: Sequence[AuditEntry],
        finals: Sequence[AuditEntry] = (),
        repeats: Sequence[tuple[int, int, dt.datetime]] = (),
    ) -> list[int]:
        """One transaction of :class:`dpsql.ledger.audit.AuditTrail`'s writer: append ``inserts`` (their ids
        are returned, in order), finalise the ``charged`` rows named by ``finals`` (``id``: the row written
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
        return [audit_entry(row) for row in rows]

    # -- released synopses (dpsql.synopsis), append-only rows of the meta table --------------------------

    def add_synopsis(self, key: str, document: str) -> bool:
        """Store one released synopsis under ``key`` (never overwritten: a refresh is a new key); whether
        this call stored it."""
        return self._meta_setdefault(key, document) == document

    def synopsis_keys(self, prefix: str) -> list[str]:
        """The keys of the stored synopses starting with ``prefix``, in order."""
        sql = "SELECT key FROM dpsql_ledger_meta WHERE substr(key, 1, ?) = ? ORDER BY key"
        return [str(r[0]) for r in self._read(sql, (len(prefix), prefix))]

    def synopsis_document(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM dpsql_ledger_meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

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
                key = bytes.fromhex(self._meta_setdefault(INSTALLATION_KEY, candidate))
            except ValueError as exc:
                raise unavailable("the installation key in the ledger is corrupt", exc) from exc
            self._installation_key = key
        return key
