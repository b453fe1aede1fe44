"""The shadow catalog's contents: the empty published schema, its comments, the analysts' role.

The shadow holds empty copies of the exposed tables (the policy's non-identifier columns with
their SQL types, NOT NULL where declared) and the policy's descriptions as comments: nothing in
it is more than the policy already publishes to every analyst. Analysts log in as one shared,
read-only, non-superuser role (:data:`ANALYST_ROLE`), and the built-ins that would reach other
sessions, files or large objects are revoked from PUBLIC (see :mod:`.catalog` for why).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from dpsql.budget_view import BUDGET_COLUMNS, BUDGET_RELATION
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, Policy, TablePolicy


def quote_ident(name: str) -> str:
    """An SQL identifier, quoted (``"`` doubled)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    """An SQL string literal (``'`` doubled; the shadow has standard_conforming_strings on)."""
    return "'" + text.replace("'", "''") + "'"


def _table_ddl(name: str, table: TablePolicy, policy: Policy | None = None) -> list[str]:
    cols = [
        f"{quote_ident(col)} {PG_TYPE_NAMES[c.type]}{'' if c.nullable else ' NOT NULL'}"
        for col, c in table.columns.items()
        if not c.identifier
    ]
    stmts = [f"CREATE TABLE public.{quote_ident(name)} ({', '.join(cols)})"]
    comment = table_comment(name, table, policy)
    if comment:
        stmts.append(f"COMMENT ON TABLE public.{quote_ident(name)} IS {_comment(comment)}")
    for col, c in table.columns.items():
        if not c.identifier:
            stmts.append(
                f"COMMENT ON COLUMN public.{quote_ident(name)}.{quote_ident(col)} IS {_comment(column_comment(c))}"
            )
    return stmts


#: A domain with at most this many values is listed in its column's comment (else only counted).
COMMENT_DOMAIN_VALUES = 8


def _comment(text: str) -> str:
    """A comment as a string literal: quotes doubled (standard_conforming_strings), NUL removed (no
    PostgreSQL text holds it), so no policy text can end the literal or fail the shadow's start."""
    return quote_literal(text.replace("\x00", ""))


def _shown(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.date):
        return value.isoformat(sep=" ") if isinstance(value, dt.datetime) else value.isoformat()
    return str(value)


def column_comment(column: ColumnPolicy) -> str:
    """What ``\\d+`` shows for a column: its description, then what the policy declares about its
    values (``bounds [0, 110]; not null``, ``domain: Female, Male; nullable``). Policy only: all of it
    is published to every analyst already (EXPLAIN, NOTICEs, released group keys)."""
    parts = [column.description] if column.description else []
    if column.bounded:
        parts.append(f"bounds [{_shown(column.lower)}, {_shown(column.upper)}]")
    values = column.values
    if values is not None:
        if len(values) <= COMMENT_DOMAIN_VALUES:
            parts.append("domain: " + ", ".join(_shown(v) for v in values))
        else:
            parts.append(f"domain: {len(values)} values")
    if column.randomized_response is not None:
        parts.append(f"randomized response (ε={column.randomized_response.epsilon:g})")
    parts.append("nullable" if column.nullable else "not null")
    return "; ".join(parts)


def table_comment(name: str, table: TablePolicy, policy: Policy | None = None) -> str:
    """What ``\\d+`` shows for a table: its description, who is protected and the caps on each
    person's rows (the bias an answer's ± leaves out comes from them)."""
    parts = [table.description] if table.description else []
    if table.public:
        parts.append("public: read without noise")
        return "; ".join(parts)
    path = policy.unit_path(name) if policy is not None else None
    if path is not None:
        ref = table.references
        hops = f" → {' → '.join(path.chain[1:])}" if len(path.chain) > 2 else ""
        through = f" (through {ref.column}{hops})" if ref is not None and table.privacy_unit is None else ""
        parts.append(f"privacy unit: {path.person}{through}")
    else:
        parts.append("privacy unit: one row (each row is one person)")
    if path is not None:
        parts.append(f"max_rows_per_unit {table.max_rows_per_unit}")
        if table.max_groups_per_unit is not None:
            parts.append(f"max_groups_per_unit {table.max_groups_per_unit}")
    return "; ".join(parts)


#: The one role every analyst's catalog queries run as on the shadow.
ANALYST_ROLE = "dpsql_analyst"


def shadow_role(analyst: str) -> str:
    """The shadow role an analyst logs in as: the same for all. Roles are cluster-wide and visible to
    every role (``pg_roles``, ACLs in ``\\l``, ``::regrole``, ``pg_has_role``), so a role per analyst
    would list every analyst's name to any of them; with one shared role there is no name to find."""
    del analyst
    return ANALYST_ROLE


def shadow_roles(policy: Policy) -> list[str]:
    del policy
    return [ANALYST_ROLE]


#: Per-statement limit on the shadow (role default and connection option); overridable per instance.
DEFAULT_STATEMENT_TIMEOUT_MS = 5000
#: Shadow connections the analysts' role may hold: a backstop, the catalog pool is the real bound.
ROLE_CONNECTION_LIMIT = 100


def role_statements(
    role: str, database: str, password: str | None = None, timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
) -> list[str]:
    """A login role that can read the (empty) tables and the catalogs, and nothing more."""
    pw = f" PASSWORD {quote_literal(password)}" if password is not None else ""
    r = quote_ident(role)
    return [
        f"ALTER ROLE {r} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
        f"CONNECTION LIMIT {ROLE_CONNECTION_LIMIT}{pw}",
        f"ALTER ROLE {r} SET default_transaction_read_only = on",
        f"ALTER ROLE {r} SET statement_timeout = {int(timeout_ms)}",
        f"ALTER ROLE {r} SET lock_timeout = {int(timeout_ms)}",
        f"ALTER ROLE {r} SET idle_in_transaction_session_timeout = 60000",
        f"ALTER ROLE {r} SET temp_file_limit = '64MB'",
        f"GRANT CONNECT ON DATABASE {quote_ident(database)} TO {r}",
        f"GRANT USAGE ON SCHEMA public TO {r}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {r}",
    ]


#: Functions no analyst role may execute on the shadow (PUBLIC has EXECUTE on them by default):
#: large-object I/O, advisory locks, notifications, signalling backends, other sessions' activity.
_REVOKED_FUNCTIONS_SQL = r"""
SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
WHERE p.pronamespace = 'pg_catalog'::regnamespace AND (
  p.proname ~ '^(lo_|pg_advisory|pg_try_advisory|pg_stat_get_backend_|pg_stat_get_progress|pg_sleep_)'
  OR p.proname IN ('loread', 'lowrite', 'pg_notify', 'pg_terminate_backend', 'pg_cancel_backend',
                   'pg_stat_get_activity', 'pg_lock_status', 'pg_blocking_pids',
                   'pg_safe_snapshot_blocking_pids', 'pg_isolation_test_session_is_blocked',
                   'pg_stat_get_db_numbackends', 'pg_stat_get_wal_receiver', 'pg_stat_get_subscription',
                   'pg_show_all_file_settings', 'pg_current_logfile', 'pg_ls_dir', 'pg_read_file',
                   'pg_read_binary_file', 'pg_stat_file', 'pg_ls_logdir', 'pg_ls_waldir', 'pg_ls_tmpdir',
                   'pg_ls_archive_statusdir', 'pg_get_backend_memory_contexts', 'pg_get_shmem_allocations'))
"""

#: Views over other sessions' activity (they run with their owner's rights, so revoke the views too).
_REVOKED_VIEWS_SQL = r"""
SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
WHERE c.relnamespace = 'pg_catalog'::regnamespace AND c.relkind = 'v' AND (
  (c.relname ~ '^pg_stat(io)?_' AND c.relname NOT IN
     ('pg_stat_user_tables', 'pg_statio_user_tables', 'pg_stat_user_indexes', 'pg_statio_user_indexes'))
  OR c.relname IN ('pg_locks', 'pg_prepared_xacts', 'pg_replication_slots', 'pg_replication_origin_status'))
"""


def schema_statements(policy: Policy) -> list[str]:
    """DDL that recreates the policy's published schema, empty (roles are granted separately)."""
    stmts: list[str] = [
        "REVOKE ALL ON SCHEMA public FROM PUBLIC",
        f"REVOKE ALL ON DATABASE {quote_ident(policy.dataset)} FROM PUBLIC",
    ]
    for name, table in policy.tables.items():
        stmts.extend(_table_ddl(name, table, policy))
    stmts.extend(_budget_view_ddl(policy))
    return stmts


def _budget_view_ddl(policy: Policy) -> list[str]:
    """An empty ``dpsql_budget`` view, so BI tools' schema sync lists it; reading it goes to the engine,
    which answers the analyst's own row (:mod:`dpsql.budget_view`)."""
    if policy.table(BUDGET_RELATION) is not None:
        return []
    cols = ", ".join(f"NULL::{type_} AS {quote_ident(name)}" for name, type_ in BUDGET_COLUMNS)
    view = f"public.{quote_ident(BUDGET_RELATION)}"
    return [
        f"CREATE VIEW {view} AS SELECT {cols} WHERE false",
        f"COMMENT ON VIEW {view} IS {quote_literal('Your own privacy budget: spent, remaining, total (dpsql)')}",
    ]


def revocations(conn: Any) -> list[str]:
    """REVOKEs of dangerous built-ins from PUBLIC in the connected database (grants are per database)."""
    stmts = [f"REVOKE EXECUTE ON FUNCTION {row[0]} FROM PUBLIC" for row in conn.execute(_REVOKED_FUNCTIONS_SQL)]
    stmts += [f"REVOKE ALL ON {row[0]} FROM PUBLIC" for row in conn.execute(_REVOKED_VIEWS_SQL)]
    return stmts
