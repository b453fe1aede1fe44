"""Persistent privacy accountant: every charge is durably committed *before* a result leaves.

The ledger is the one place where privacy loss is remembered, so it fails closed: if a
charge cannot be checked and committed (corrupt file, read-only disk, unreachable server)
the caller gets :class:`~dpsql.errors.LedgerUnavailable` and must not release anything.
There is deliberately no API to delete or refund a charge.

Two stores share one contract (:mod:`~dpsql.ledger.base`, written once over the primitives of
:mod:`~dpsql.ledger.store`): SQLite (``sqlite:///abs/path.sqlite``, the embedded default:
:mod:`~dpsql.ledger.sqlite`) and PostgreSQL (``postgresql://…``: :mod:`~dpsql.ledger.postgres`).
Each reservation checks the budgets and inserts the charge and the statement's audit row in one
transaction that holds the dataset's write lock.

Each charge row is the audit log; a small ``…_totals`` table, updated in the same transaction, keeps
per-(dataset, analyst) sums so a reserve costs O(1) however long the history grows. Schema 5 makes
the append-only rows the authority on what was spent (:mod:`~dpsql.ledger.integrity`): each row
carries its analyst's and its dataset's sums after it, a reservation charges against the larger of
those and the totals, and ``dpsql ledger verify`` re-adds every row. Dataset totals sum *all*
analysts, since analysts may collude.

Composition, conversion and the budget checks are :mod:`dpsql.accountant`'s; the ledger stores
what it needs (ε, δ, ρ and selection δ per charge) and runs its checks inside the reservation.
The curator's grants, revokes, freezes and prunes are append-only rows (:mod:`~dpsql.ledger.levers`);
every statement leaves an audit row (:mod:`~dpsql.ledger.audit`, read back by
:mod:`~dpsql.ledger.audit_report`); :mod:`~dpsql.ledger.roles` warns when a PostgreSQL role holds
more than it needs. Older ledgers are migrated on open, conservatively (never an undercount).
"""

from __future__ import annotations

from dpsql.accountant import (
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
from dpsql.ledger.base import MEMORY_LEDGER_URLS, Ledger, default_ledger, dpsql_home, resolve_ledger_url
from dpsql.ledger.postgres import PostgresLedger
from dpsql.ledger.records import (
    GRANT_CEILING,
    LEVER_KINDS,
    AnalystSpent,
    AuditEntry,
    Charge,
    ChargeRecord,
    LeverEvent,
    Levers,
    dataset_charge,
    frozen_error,
    min_remaining,
)
from dpsql.ledger.roles import LEDGER_TABLES, pg_role_warnings, serve_role_warnings, warn_about_roles
from dpsql.ledger.sqlite import SQLiteLedger

__all__ = [
    "GRANT_CEILING",
    "LEDGER_TABLES",
    "LEVER_KINDS",
    "MEMORY_LEDGER_URLS",
    "Accounting",  # the accountant's names, re-exported for the ledger's callers
    "Allowance",
    "AnalystSpent",
    "AuditEntry",
    "BudgetLike",
    "Charge",
    "ChargeRecord",
    "Cost",
    "Ledger",
    "LeverEvent",
    "Levers",
    "PostgresLedger",
    "Remaining",
    "SQLiteLedger",
    "Spent",
    "check_budget",
    "dataset_charge",
    "default_ledger",
    "dpsql_home",
    "frozen_error",
    "max_rho",
    "min_remaining",
    "pg_role_warnings",
    "remaining_budget",
    "resolve_ledger_url",
    "serve_role_warnings",
    "warn_about_roles",
    "zcdp_epsilon",
]
