"""Least privilege: warn when dpsql's PostgreSQL roles hold more than they need.

A PostgreSQL ledger's integrity rests on its triggers and on the server's role holding INSERT on the
charges and the audit trail only; a superuser or a table owner can disable triggers and rewrite rows.
A SQLite ledger's rests on its file's permissions, which a data-database superuser can get around
through the server's file access when both are on one host. So ``dpsql serve`` logs one WARNING line
per such connection at start (never a reason not to start), worded for the ledger it really has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dpsql.ledger.postgres import PostgresLedger

log = logging.getLogger("dpsql.ledger")

#: The ledger's tables (and the result cache beside it): owned by a ledger-owner role, never by the server's.
LEDGER_TABLES = (
    "dpsql_ledger",
    "dpsql_ledger_totals",
    "dpsql_ledger_levers",
    "dpsql_audit",
    "dpsql_ledger_meta",
    "dpsql_ledger_pld",
    "dpsql_result_cache",
)
_ROLES_README = 'README "Least-privilege database roles"'
#: What a superuser or an owner on the ledger's own connection can do (the default wording).
LEDGER_SUPERUSER_CAN = "disable the ledger's triggers and rewrite any charge, total or audit row"
LEDGER_OWNER_CAN = "disable triggers and rewrite or delete rows"


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def pg_role_warnings(
    query: Callable[[str], Sequence[Sequence[Any]]],
    what: str,
    tables: Sequence[str],
    should_be: str,
    *,
    superuser_can: str = LEDGER_SUPERUSER_CAN,
    owner_can: str = LEDGER_OWNER_CAN,
) -> list[str]:
    """One warning line when the connection ``query`` runs on is a superuser, else one when its role owns
    (or is a member of the owner of) any of ``tables``: either can disable triggers, or rewrite and delete
    rows, which is all the ledger's integrity rests on. ``superuser_can``/``owner_can`` say what that
    means for this connection. ``query`` runs one parameterless SQL statement."""
    user, superuser = query("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")[0]
    if superuser:
        return [
            f'{what} connects as role "{user}", a superuser: it can {superuser_can}; '
            f"connect as {should_be} ({_ROLES_README})"
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
        f'{what} connects as role "{user}", owner of {listed}: an owner can {owner_can}; '
        f"connect as {should_be} ({_ROLES_README})"
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
    if getattr(backend, "pg_roles", False):  # an engine without a data backend (a ledger-only check) has none
        sources = sorted({table.source or name for name, table in engine.policy.tables.items()})
        if isinstance(ledger, PostgresLedger):
            reach = f"{LEDGER_SUPERUSER_CAN} when the ledger is on the same server"
        else:  # a SQLite file: no triggers to disable, but the database server's file access
            reach = (
                "read and write files as the database server's operating-system user: a SQLite ledger on the "
                "same host is safe only while its file's permissions keep that user out (mode 0600, owned by "
                "the user dpsql serve runs as)"
            )
        try:
            warnings += pg_role_warnings(
                lambda sql: backend.execute(sql)[1],
                "the data database",
                sources,
                "a read-only role such as dpsql_data_reader (SELECT on the served tables only)",
                superuser_can=f"change any of the served rows and {reach}",
                owner_can="change or delete the served rows",
            )
        except Exception as exc:
            log.debug("data role check skipped: %s", exc)
    return warnings


def warn_about_roles(engine: Any) -> None:
    """Log each of :func:`serve_role_warnings` as one WARNING line (``dpsql serve`` calls it at start)."""
    for warning in serve_role_warnings(engine):
        log.warning("%s", warning)
