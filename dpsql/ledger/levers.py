"""The curator's levers: grant, revoke, freeze, unfreeze and the audited prune (``dpsql_ledger_levers``).

Each action is a new append-only row (who, when, why); nothing is ever changed or removed. An
analyst's limit is the policy's budget plus the sum of their grants net of revokes, and both the
limit and the freeze are read inside each reservation (:func:`levers_of` over :data:`LEVERS_SQL`),
so a running server obeys a lever at once. Levers are written under the dataset's reservation lock:
each is ordered with every charge, and the checks that refuse one read the same transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from dpsql.accountant import NO_GRANT, Accounting, Allowance, BudgetLike, Cost, check_budget
from dpsql.errors import InvalidParameterValue, PrivacyBudgetExhausted
from dpsql.ledger.records import GRANT_CEILING, LeverEvent, Levers, frozen_error, lever_event, number
from dpsql.ledger.store import Execute, Store, ts

# Grants summed, and the latest freeze/unfreeze: curator rows are few, so no derived state to keep.
# Each row is clamped first (inf, NaN or a huge ε written by an older version count as the ceiling),
# so the sum stays finite and PostgreSQL's float overflow error can never make every read fail.
# Revokes are summed apart and taken off the grants (a revoke row clamped the same way only takes more back).
LEVERS_SQL = (
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


def levers_of(row: Any) -> Levers:
    """The levers from :data:`LEVERS_SQL`'s row; sums beyond :data:`GRANT_CEILING` (only rows written
    before grants were capped can get there) read as the ceiling, never as an error."""
    if row is None:
        return Levers()
    # Net of revokes, never below zero (a revoke takes back grants only; a bad row cannot make it negative).
    epsilon = max(_clamped(row[0], GRANT_CEILING.epsilon) - _clamped(row[3], GRANT_CEILING.epsilon), 0.0)
    delta = max(_clamped(row[1], GRANT_CEILING.delta) - _clamped(row[4], GRANT_CEILING.delta), 0.0)
    grant = Allowance(epsilon, delta) if epsilon or delta else NO_GRANT
    return Levers(grant, row[2] == "freeze")


def _clamped(value: Any, ceiling: float) -> float:
    read = number(value or 0.0)
    return ceiling if not read <= ceiling else max(read, 0.0)  # NaN and inf: the ceiling


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


class CuratorLevers(Store):
    """The levers of :class:`dpsql.ledger.Ledger` (append-only rows, written under the reservation lock)."""

    def levers(self, dataset: str, analyst: str) -> Levers:
        """The analyst's grants and freeze state, read now (no cache: a curator's change takes effect
        on the next query of every running process)."""
        rows = self._read(LEVERS_SQL, (dataset, analyst, dataset, analyst))
        return levers_of(rows[0] if rows else None)

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
            granted = levers_of(execute(self._sql(LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone()).grant
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
            levers = levers_of(execute(self._sql(LEVERS_SQL), (dataset, analyst, dataset, analyst)).fetchone())
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
                f"invalid prune: {ts(before)} is in the future", hint="Prune rows before a past date or time."
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
            text = f"{reason} (audit rows of free refusals and cache hits before {ts(before)}: {count} deleted)"
            row = (self._timestamp(now), dataset, "", "prune", 0.0, 0.0, by, text)
            event_id = self._insert_id(execute, self._sql(_INSERT_LEVER_SQL), row)
            execute(self._sql("DELETE " + where), params)
        return LeverEvent(event_id, now, dataset, "", "prune", 0.0, 0.0, by, text), count

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
        sql = _SELECT_LEVERS_SQL
        params: tuple[Any, ...] = (dataset,)
        if analyst is not None:
            sql, params = sql + " AND analyst = ?", (*params, analyst)
        if since is not None:
            sql, params = sql + " AND at >= ?", (*params, since)
        return [lever_event(row) for row in self._read(sql + " ORDER BY id DESC LIMIT ?", (*params, limit))]
