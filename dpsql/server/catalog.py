"""Metadata queries (psql ``\\d``, pgcli, SQLAlchemy's inspector, JDBC, asyncpg introspection).

Clients discover schemas by querying ``pg_catalog`` and ``information_schema``. Re-implementing
those catalogs would never be complete, so they are answered by a *shadow* PostgreSQL that holds
empty copies of the exposed tables: the policy's non-identifier columns with their SQL types,
NOT NULL where declared, and the policy descriptions as comments. The shadow never receives data,
so everything it can say is schema the policy already publishes.

Deliberate consequence: statistics views (``pg_stats``, ``pg_class.reltuples``,
``pg_stat_user_tables``…) report empty tables. Real row counts or histograms would be
non-private releases, so "empty" is the only safe answer.

Routing (:func:`classify`): a SELECT whose relations are all in ``pg_catalog`` /
``information_schema`` / ``pg_*`` goes to the shadow; one that names a policy table goes to the
engine; one that mixes both is refused (0A000) because the catalog side would not be
differentially private. Catalog statements run on pooled shadow connections, all logged in as
one non-superuser role (:data:`ANALYST_ROLE`) with ``default_transaction_read_only``, so
``has_table_privilege`` and friends answer as they would on a real server while superuser-only
functions (``pg_read_file``…) stay out of reach, and no analyst's name exists on the shadow for
another to list (``pg_roles``, ``\\du``, the ACLs ``\\l`` shows).

Every exchange with the shadow has a deadline (:class:`ShadowSession`): the statement is sent
without blocking, and a shadow that stops reading or answering is given up on (cancelled, its
connection dropped), so it can never hold a worker slot or a pooled connection for good.

Hardening (see :mod:`dpsql.server.shadow_guard` and :mod:`dpsql.local_postgres`): every statement
sent to the shadow passes a function allow-list and an activity-view deny-list first (42501 with
a hint otherwise); roles log in with random per-start SCRAM passwords over a 0700 unix socket
(no TCP), run read-only with a 5 s statement timeout, and have large-object, advisory-lock,
notification and other-session functions and views revoked. A local shadow is supervised
(restarted when it dies; 08006/57P03 in between) and dies with dpsql (watchdog).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import sqlglot
from sqlglot import exp

from dpsql.analyze.parse import too_complex
from dpsql.errors import (
    CannotConnectNow,
    CatalogUnavailable,
    ConnectionFailure,
    Error,
    FeatureNotSupported,
    ProgramLimitExceeded,
    QueryCanceled,
    relay,
)
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, Policy, TablePolicy

from .protocol import FieldDescription
from .shadow_guard import check_catalog_sql
from .sqltext import first_word, identifiers

log = logging.getLogger("dpsql.server.catalog")

Route = Literal["catalog", "engine", "mixed", "tableless"]
CATALOG_SCHEMAS = frozenset({"pg_catalog", "information_schema"})
_READ_ONLY_HEADS = frozenset({"select", "with", "values", "table"})


# --- routing -------------------------------------------------------------------------------------


def _is_catalog_table(table: exp.Table) -> bool:
    schema, name = table.db.lower(), table.name.lower()
    return schema in CATALOG_SCHEMAS or (not schema and name.startswith("pg_"))


def _is_policy_table(table: exp.Table, policy: Policy) -> bool:
    return table.db.lower() in ("", "public") and policy.table(table.name) is not None


def _decide(has_catalog: bool, has_policy: bool, has_other: bool) -> Route:
    if has_policy:
        return "mixed" if has_catalog else "engine"
    if has_catalog:
        return "catalog"
    return "engine" if has_other else "tableless"


def _classify_tokens(sql: str, policy: Policy) -> Route:
    """Fallback when sqlglot cannot parse (psql's OPERATOR(pg_catalog.~) and the like)."""
    words = set(identifiers(sql))
    has_policy = any(policy.table(w) is not None for w in words)
    has_catalog = any(w in CATALOG_SCHEMAS or w.startswith("pg_") for w in words)
    return _decide(has_catalog, has_policy, has_other=not has_catalog)


def classify(sql: str, policy: Policy) -> Route:
    """Where a statement goes: the shadow catalog, the DP engine, refused (mixed), or no table at all."""
    if first_word(sql) not in _READ_ONLY_HEADS:
        return "engine"  # DDL/DML/anything else: the engine refuses it with the right SQLSTATE
    try:
        tree = sqlglot.parse_one(sql, read="postgres")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return _classify_tokens(sql, policy)
    except RecursionError:
        raise too_complex() from None
    if tree is None:
        return "tableless"
    if tree.find(exp.Insert, exp.Update, exp.Delete, exp.Merge, exp.Into):
        return "engine"  # writes (even inside a CTE or SELECT INTO) are the engine's to refuse
    ctes = {cte.alias_or_name.lower() for cte in tree.find_all(exp.CTE)}
    has_catalog = has_policy = has_other = False
    for table in tree.find_all(exp.Table):
        if not table.name:
            has_catalog = has_catalog or isinstance(table.this, exp.Anonymous)  # pg_get_keywords() etc.
            continue
        if not table.db and table.name.lower() in ctes:
            continue
        if _is_catalog_table(table):
            has_catalog = True
        elif _is_policy_table(table, policy):
            has_policy = True
        else:
            has_other = True
    return _decide(has_catalog, has_policy, has_other)


def refuse_mixed() -> Error:
    return FeatureNotSupported(
        "queries that combine policy tables with system catalogs are not supported",
        hint="Query the catalogs and the data in separate statements.",
    )


# --- the shadow server --------------------------------------------------------------------------


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _table_ddl(name: str, table: TablePolicy, policy: Policy | None = None) -> list[str]:
    cols = [
        f"{_ident(col)} {PG_TYPE_NAMES[c.type]}{'' if c.nullable else ' NOT NULL'}"
        for col, c in table.columns.items()
        if not c.identifier
    ]
    stmts = [f"CREATE TABLE public.{_ident(name)} ({', '.join(cols)})"]
    comment = table_comment(name, table, policy)
    if comment:
        stmts.append(f"COMMENT ON TABLE public.{_ident(name)} IS {_comment(comment)}")
    for col, c in table.columns.items():
        if not c.identifier:
            stmts.append(f"COMMENT ON COLUMN public.{_ident(name)}.{_ident(col)} IS {_comment(column_comment(c))}")
    return stmts


#: A domain with at most this many values is listed in its column's comment (else only counted).
COMMENT_DOMAIN_VALUES = 8


def _comment(text: str) -> str:
    """A comment as a string literal: quotes doubled (standard_conforming_strings), NUL removed (no
    PostgreSQL text holds it), so no policy text can end the literal or fail the shadow's start."""
    return _literal(text.replace("\x00", ""))


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
    ref = table.references
    if table.privacy_unit is not None:
        parts.append(f"privacy unit: {name}.{table.privacy_unit}")
    elif ref is not None:
        target = policy.tables.get(ref.table) if policy is not None else None
        unit = target.privacy_unit if target is not None and target.privacy_unit else ref.to
        parts.append(f"privacy unit: {ref.table}.{unit} (through {ref.column})")
    else:
        parts.append("privacy unit: one row (each row is one person)")
    if table.privacy_unit is not None or ref is not None:
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
#: How much longer than its statement timeout the shadow may take to answer before dpsql gives up
#: on the exchange (cancel, then drop the connection): sending, queueing, reading the result.
EXCHANGE_SLACK = 5.0
#: Shadow connections the analysts' role may hold: a backstop, the catalog pool is the real bound.
ROLE_CONNECTION_LIMIT = 100


def role_statements(
    role: str, database: str, password: str | None = None, timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
) -> list[str]:
    """A login role that can read the (empty) tables and the catalogs, and nothing more."""
    pw = f" PASSWORD {_literal(password)}" if password is not None else ""
    r = _ident(role)
    return [
        f"ALTER ROLE {r} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
        f"CONNECTION LIMIT {ROLE_CONNECTION_LIMIT}{pw}",
        f"ALTER ROLE {r} SET default_transaction_read_only = on",
        f"ALTER ROLE {r} SET statement_timeout = {int(timeout_ms)}",
        f"ALTER ROLE {r} SET lock_timeout = {int(timeout_ms)}",
        f"ALTER ROLE {r} SET idle_in_transaction_session_timeout = 60000",
        f"ALTER ROLE {r} SET temp_file_limit = '64MB'",
        f"GRANT CONNECT ON DATABASE {_ident(database)} TO {r}",
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
        f"REVOKE ALL ON DATABASE {_ident(policy.dataset)} FROM PUBLIC",
    ]
    for name, table in policy.tables.items():
        stmts.extend(_table_ddl(name, table, policy))
    stmts.extend(_budget_view_ddl(policy))
    return stmts


def _budget_view_ddl(policy: Policy) -> list[str]:
    """An empty ``dpsql_budget`` view, so BI tools' schema sync lists it; reading it goes to the engine,
    which answers the analyst's own row (:mod:`dpsql.budget_view`)."""
    from dpsql.budget_view import BUDGET_COLUMNS, BUDGET_RELATION

    if policy.table(BUDGET_RELATION) is not None:
        return []
    cols = ", ".join(f"NULL::{type_} AS {_ident(name)}" for name, type_ in BUDGET_COLUMNS)
    view = f"public.{_ident(BUDGET_RELATION)}"
    return [
        f"CREATE VIEW {view} AS SELECT {cols} WHERE false",
        f"COMMENT ON VIEW {view} IS {_literal('Your own privacy budget: spent, remaining, total (dpsql)')}",
    ]


def _revocations(conn: Any) -> list[str]:
    """REVOKEs of dangerous built-ins from PUBLIC in the connected database (grants are per database)."""
    stmts = [f"REVOKE EXECUTE ON FUNCTION {row[0]} FROM PUBLIC" for row in conn.execute(_REVOKED_FUNCTIONS_SQL)]
    stmts += [f"REVOKE ALL ON {row[0]} FROM PUBLIC" for row in conn.execute(_REVOKED_VIEWS_SQL)]
    return stmts


@dataclass(slots=True)
class ShadowResult:
    fields: list[FieldDescription] | None
    rows: list[tuple[bytes | None, ...]]
    tag: str


def connection_lost() -> Error:
    return ConnectionFailure(
        "connection to the catalog server was lost",
        hint="Retry the statement: dpsql reconnects to its catalog server (restarting it if needed).",
    )


def catalog_restarting() -> Error:
    return CannotConnectNow(
        "the catalog server is restarting",
        hint="Retry in a few seconds; DP queries on the policy tables are not affected.",
    )


class CatalogShadow:
    """The shadow PostgreSQL: started (or reached via ``catalog_dsn``) once, one connection per client.

    A local shadow is supervised: a monitor thread notices when its postmaster dies and starts a
    fresh one (new datadir, new passwords, schema recreated); meanwhile catalog queries fail with
    08006/57P03 and then succeed again. Roles get random per-start passwords; the superuser's
    password (in ``_base_dsn``) never leaves this object.
    """

    def __init__(
        self, policy: Policy, dsn: str | None = None, statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
    ) -> None:
        self.policy = policy
        self._given_dsn = dsn
        self._local: Any = None
        self._base_dsn: str | None = None
        self._passwords: dict[str, str] = {}
        self.statement_timeout_ms = statement_timeout_ms
        self.server_version: str | None = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._started = False
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def database(self) -> str:
        return self.policy.dataset

    @property
    def local(self) -> Any:
        """The running :class:`~dpsql.local_postgres.LocalPostgres`, if dpsql started it (tests, operators)."""
        return self._local

    def start(self) -> None:
        """Start the local server (unless a DSN was given) and create the empty schema; idempotent."""
        with self._lock:
            if self._started:
                return
            self._launch()
            self._started = True
        if self._given_dsn is None:
            self._monitor = threading.Thread(target=self._supervise, name="dpsql-catalog-monitor", daemon=True)
            self._monitor.start()

    def _launch(self) -> None:
        """(Re)start the local server or reach the given one, and prepare it; sets ``_ready``."""
        import secrets

        if self._given_dsn is None:
            from dpsql.local_postgres import start_local_postgres

            local = start_local_postgres()
            # atexit runs last-registered first: stop supervising before the server's own atexit stop,
            # so a process that exits without stop() does not restart its shadow on the way out
            atexit.unregister(self._stopping.set)
            atexit.register(self._stopping.set)
            base = local.dsn
            passwords = {role: secrets.token_hex(24) for role in shadow_roles(self.policy)}
        else:
            local, base, passwords = None, self._given_dsn, {}
        try:
            self._create_schema(base, passwords, own_cluster=local is not None)
        except Exception:
            if local is not None:
                local.stop()
            raise
        self._local, self._base_dsn, self._passwords = local, base, passwords
        self._ready.set()

    def _supervise(self) -> None:
        backoff = 0.5
        while not self._stopping.wait(0.25):
            local = self._local
            if local is None or local.alive():
                backoff = 0.5
                continue
            log.warning("catalog server died (exit code %s); restarting it", local.process.poll())
            self._ready.clear()
            with self._lock:
                if self._stopping.is_set():
                    return
                local.stop()
                self._local = None
                try:
                    self._launch()
                    self.restarts += 1
                except Exception as exc:
                    log.warning("catalog server restart failed (retrying in %.1fs): %s", backoff, exc)
                    self._local = local  # dead: the next round retries
                    local._stopped = True
            if not self._ready.is_set():
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _create_schema(self, base: str, passwords: dict[str, str], own_cluster: bool) -> None:
        import psycopg
        from psycopg.conninfo import make_conninfo

        with psycopg.connect(base, autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if exists is None:
                conn.execute(f"CREATE DATABASE {_ident(self.database)}")
            self.server_version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            if exists is not None and not own_cluster:
                return  # an operator-provided catalog that was prepared before
            for role in shadow_roles(self.policy):
                with contextlib.suppress(psycopg.errors.DuplicateObject):
                    conn.execute(f"CREATE ROLE {_ident(role)}")
            if own_cluster:
                for db in ("postgres", "template1"):
                    conn.execute(f"REVOKE ALL ON DATABASE {_ident(db)} FROM PUBLIC")
                for stmt in _revocations(conn):
                    conn.execute(stmt)
        with psycopg.connect(make_conninfo(base, dbname=self.database), autocommit=True, connect_timeout=10) as conn:
            stmts = schema_statements(self.policy) + _revocations(conn)
            for role in shadow_roles(self.policy):
                stmts += role_statements(role, self.database, passwords.get(role), self.statement_timeout_ms)
            for stmt in stmts:
                conn.execute(stmt)

    @property
    def available(self) -> bool:
        return self._started and not self._stopping.is_set()

    def connect(self, analyst: str) -> ShadowSession:
        """A session that (re)connects lazily as the analyst's shadow role."""
        if not self.available:
            raise CatalogUnavailable()
        session = ShadowSession(lambda: self._connect_raw(analyst), self.statement_timeout_ms / 1000 + EXCHANGE_SLACK)
        session.reconnect()
        return session

    def _connect_raw(self, analyst: str) -> Any:
        import psycopg
        from psycopg.conninfo import make_conninfo

        if not self.available:
            raise CatalogUnavailable()
        if not self._ready.wait(15):
            raise catalog_restarting()
        role = shadow_role(analyst)
        extra: dict[str, Any] = {"password": self._passwords[role]} if role in self._passwords else {}
        timeout = int(self.statement_timeout_ms)
        dsn = make_conninfo(
            self._base_dsn or "",
            dbname=self.database,
            user=role,
            application_name="dpsql-catalog",
            connect_timeout=10,
            options=f"-c statement_timeout={timeout} -c default_transaction_read_only=on",
            **extra,
        )
        try:
            return psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            log.warning("catalog connection failed: %s", exc)
            raise (catalog_restarting() if not self._ready.is_set() else connection_lost()) from None

    def stop(self) -> None:
        self._stopping.set()
        self._ready.clear()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=30)
        with self._lock:
            self._base_dsn = None
            if self._local is not None:
                self._local.stop()
                self._local = None


def _shadow_error(res: Any) -> Error:
    from psycopg.pq import DiagnosticField as F

    def field(code: Any) -> str | None:
        value = res.error_field(code)
        return value.decode("utf-8", "replace") if value else None

    position = field(F.STATEMENT_POSITION)
    return relay(
        field(F.SQLSTATE) or "58000",  # a client-side libpq failure: never XX000
        field(F.MESSAGE_PRIMARY) or "catalog query failed",
        detail=field(F.MESSAGE_DETAIL),
        hint=field(F.MESSAGE_HINT),
        position=int(position) if position and position.isdigit() else None,
    )


def _SQLSTATE_FIELD() -> Any:
    from psycopg.pq import DiagnosticField

    return DiagnosticField.SQLSTATE


def _fields(res: Any, formats: Sequence[int]) -> list[FieldDescription]:
    out = []
    for i in range(res.nfields):
        out.append(
            FieldDescription(
                name=(res.fname(i) or b"").decode("utf-8"),
                type_oid=res.ftype(i),
                type_size=res.fsize(i),
                type_mod=res.fmod(i),
                table_oid=res.ftable(i),
                column_attr=res.ftablecol(i),
                format=formats[i] if i < len(formats) else 0,
            )
        )
    return out


class _GiveUp(Exception):
    """The exchange in progress is abandoned: ``expired`` at its deadline, else cancelled."""

    def __init__(self, expired: bool) -> None:
        super().__init__()
        self.expired = expired


class ShadowSession:
    """One pooled connection to the shadow; blocking calls (run them in a thread).

    Every statement passes :func:`~dpsql.server.shadow_guard.check_catalog_sql` first. A lost
    connection (shadow killed or restarted) is reported as 08006 and re-established on next use.

    The connection is non-blocking (as psycopg makes it): a statement larger than the socket's
    buffer is only sent as the shadow reads it, so it is flushed here, and every wait (sending, the
    result) is a ``select`` with a deadline: ``timeout`` seconds for the whole exchange (the shadow's
    own statement timeout plus some slack), sooner when :meth:`cancel` is called. A shadow that
    does not answer is sent a cancel and given :data:`CANCEL_GRACE` seconds; then the connection is
    closed (the pool discards it) and the call fails with 57014, so the worker and the pooled
    connection always come back.
    """

    def __init__(
        self, connect: Callable[[], Any], timeout: float = DEFAULT_STATEMENT_TIMEOUT_MS / 1000 + EXCHANGE_SLACK
    ) -> None:
        self._connect = connect
        self._conn: Any = None
        self.timeout = timeout
        # libpq connections are not thread-safe; an abandoned (timed-out) call may still be running.
        self._lock = threading.Lock()
        #: Set by :meth:`cancel` (any thread): the exchange in progress stops waiting.
        self._stop = threading.Event()
        self._running = False

    def reconnect(self) -> None:
        with self._lock:
            self._ensure()

    def _ensure(self) -> Any:
        from psycopg.pq import ConnStatus

        conn = self._conn
        if conn is None or conn.closed or conn.pgconn.status != ConnStatus.OK:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            self._conn = None
            self._conn = self._connect()
        return self._conn

    def close(self) -> None:
        self.cancel()
        with self._lock, contextlib.suppress(Exception):
            if self._conn is not None:
                self._conn.close()

    def arm(self) -> None:
        """Before a call that :meth:`cancel` may stop (a cancel before this one is forgotten)."""
        self._stop.clear()

    def cancel(self) -> None:
        """Stop the exchange in progress (safe from any thread): the shadow is asked to cancel it and
        the thread running it stops waiting (see the class docstring)."""
        self._stop.set()
        if self._running:
            _cancel_request(self._conn)

    def _check(self, res: Any) -> Any:
        from psycopg.pq import ConnStatus, ExecStatus

        if res.status in (ExecStatus.FATAL_ERROR, ExecStatus.NONFATAL_ERROR, ExecStatus.BAD_RESPONSE):
            if self._conn.pgconn.status != ConnStatus.OK:
                code = res.error_field(_SQLSTATE_FIELD())
                if not code or code.startswith((b"57P", b"08", b"XX")):
                    raise connection_lost()
            raise _shadow_error(res)
        if res.status not in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK, ExecStatus.EMPTY_QUERY):
            raise FeatureNotSupported("this statement is not supported on the catalog")
        return res

    # -- one exchange, always bounded ----------------------------------------------------------------

    def _exchange(self, body: Callable[[Any, float], _T]) -> _T:
        """Run ``body(pgconn, deadline)`` on the connection; give up at the deadline or on cancel."""
        conn = self._ensure()
        self._running = True
        try:
            return body(conn.pgconn, time.monotonic() + self.timeout)
        except _GiveUp as why:
            self._give_up(conn, why.expired)
            if why.expired:
                raise QueryCanceled(
                    "canceling statement due to statement timeout",
                    hint=f"The catalog server did not answer within {self.timeout:g} s.",
                ) from None
            raise QueryCanceled("canceling statement due to user request") from None
        finally:
            self._running = False

    def _give_up(self, conn: Any, expired: bool) -> None:
        """After a cancel: keep the connection if the shadow ends the statement within the grace, else
        close it (half a statement sent, or a shadow that does not answer, cannot be reused)."""
        if expired:
            _cancel_request(conn)
        pgconn = conn.pgconn
        grace = time.monotonic() + CANCEL_GRACE
        with contextlib.suppress(Exception):
            if pgconn.flush() == 0:
                while self._next_result(pgconn, grace, stoppable=False) is not None:
                    pass
                return
        log.warning("catalog connection dropped: the catalog server did not finish a cancelled statement in time")
        with contextlib.suppress(Exception):
            conn.close()

    def _wait(self, pgconn: Any, deadline: float, write: bool = False, stoppable: bool = True) -> None:
        """Until the socket is readable (or writable, with ``write``): never past ``deadline``, and no
        longer once :meth:`cancel` was called (``select`` releases the GIL, so other threads run)."""
        sock = pgconn.socket
        while True:
            if stoppable and self._stop.is_set():
                raise _GiveUp(expired=False)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _GiveUp(expired=stoppable)
            readable, writable, _ = select.select([sock], [sock] if write else [], [], min(left, _POLL))
            if readable or writable:
                return

    def _flush(self, pgconn: Any, deadline: float) -> None:
        """Send what libpq still holds of the statement (it is larger than the socket's buffer)."""
        while pgconn.flush() != 0:
            self._wait(pgconn, deadline, write=True)
            pgconn.consume_input()  # libpq: input that arrives meanwhile must be read to make progress

    def _next_result(self, pgconn: Any, deadline: float, stoppable: bool = True) -> Any:
        """``PQgetResult`` once it will not block (psycopg's ``get_result`` would hold the GIL while
        libpq waits, and wait without a deadline)."""
        while pgconn.is_busy():
            self._wait(pgconn, deadline, stoppable=stoppable)
            pgconn.consume_input()
        return pgconn.get_result()

    def _last_result(self, pgconn: Any, deadline: float) -> Any:
        result = None
        while (res := self._next_result(pgconn, deadline)) is not None:
            if result is None:
                result = res
        return result

    # -- the calls -------------------------------------------------------------------------------------

    def describe(self, sql: str, param_oids: Sequence[int]) -> tuple[list[int], list[FieldDescription] | None]:
        """Parameter types and result columns, via an unnamed prepared statement on the shadow."""
        check_catalog_sql(sql)
        with self._lock:
            return self._exchange(lambda pgconn, deadline: self._describe(pgconn, deadline, sql, param_oids))

    def _describe(
        self, pgconn: Any, deadline: float, sql: str, param_oids: Sequence[int]
    ) -> tuple[list[int], list[FieldDescription] | None]:
        pgconn.send_prepare(b"", sql.encode("utf-8"), list(param_oids) or None)
        self._flush(pgconn, deadline)
        self._check(self._last_result(pgconn, deadline))
        pgconn.send_describe_prepared(b"")
        self._flush(pgconn, deadline)
        res = self._check(self._last_result(pgconn, deadline))
        params = [res.param_type(i) for i in range(res.nparams)]
        return params, (_fields(res, []) if res.nfields else None)

    def execute(
        self,
        sql: str,
        params: Sequence[bytes | None] = (),
        param_oids: Sequence[int] = (),
        param_formats: Sequence[int] = (),
        result_formats: Sequence[int] = (),
        *,
        reserve: Callable[[int], None] | None = None,
    ) -> ShadowResult:
        """Run one statement; values come back already encoded in the requested per-column formats.

        ``reserve`` is called with the bytes of the rows as they are read (in steps of 1 MiB, then
        the rest); when it raises, the statement is cancelled and its rows dropped (see
        :mod:`.memory`: the session's, the analyst's or the server's memory is full)."""
        sets = check_catalog_sql(sql)
        with self._lock:
            try:
                return self._exchange(
                    lambda pgconn, deadline: self._execute(
                        pgconn, deadline, sql, params, param_oids, param_formats, result_formats, reserve
                    )
                )
            finally:
                if sets:
                    self._reset()

    def _reset(self) -> None:
        """``RESET ALL`` after a statement that called ``set_config``: the connection is pooled, so
        one analyst's settings (search_path, application_name…) must not reach the next one's
        statements. A connection that cannot be reset is closed (the pool discards it)."""

        def reset(pgconn: Any, deadline: float) -> None:
            pgconn.send_query(b"RESET ALL")
            self._flush(pgconn, deadline)
            self._check(self._last_result(pgconn, deadline))

        if self._conn is None or self._conn.closed:
            return  # a new connection starts with the defaults
        try:
            self.arm()  # even after a cancel: the reset itself is short and bounded
            self._exchange(reset)
        except Exception as exc:
            log.warning("catalog connection dropped: its settings could not be reset: %s", exc)
            with contextlib.suppress(Exception):
                self._conn.close()

    def _execute(
        self,
        pgconn: Any,
        deadline: float,
        sql: str,
        params: Sequence[bytes | None],
        param_oids: Sequence[int],
        param_formats: Sequence[int],
        result_formats: Sequence[int],
        reserve: Callable[[int], None] | None = None,
    ) -> ShadowResult:
        wanted = set(result_formats) or {0}
        param_formats = _expand_formats(param_formats, len(params)) if params else []

        def run(fmt: int) -> tuple[Any, list[tuple[bytes | None, ...]]]:
            pgconn.send_query_params(
                sql.encode("utf-8"),
                list(params),
                list(param_oids[: len(params)]) or None,
                param_formats or None,
                result_format=fmt,
            )
            self._flush(pgconn, deadline)
            return self._fetch_capped(pgconn, deadline, reserve)

        by_format = {fmt: run(fmt) for fmt in sorted(wanted)}
        first, first_rows = next(iter(by_format.values()))
        tag = (first.command_status or b"").decode("ascii")
        if first.nfields == 0:
            return ShadowResult(None, [], tag)
        formats = _expand_formats(result_formats, first.nfields)
        rows = [tuple(by_format[formats[c]][1][r][c] for c in range(first.nfields)) for r in range(len(first_rows))]
        return ShadowResult(_fields(first, formats), rows, tag)

    def _fetch_capped(
        self, pgconn: Any, deadline: float, reserve: Callable[[int], None] | None = None
    ) -> tuple[Any, list[tuple[bytes | None, ...]]]:
        """The sent statement's rows, read one at a time (libpq single-row mode) so a result larger
        than :data:`MAX_CATALOG_RESULT_ROWS` rows or :data:`MAX_CATALOG_RESULT_BYTES`, or one that
        ``reserve`` refuses, is cancelled before it is held in memory (a cross join of catalog
        tables can produce gigabytes in the shadow's 5 s). Returns the final result (status,
        fields, command tag) and the rows."""
        from psycopg.pq import ExecStatus

        pgconn.set_single_row_mode()
        rows: list[tuple[bytes | None, ...]] = []
        size, reserved, final, failure = 0, 0, None, None
        refusal: Error | None = None
        while (res := self._next_result(pgconn, deadline)) is not None:
            if res.status == ExecStatus.SINGLE_TUPLE:
                if refusal is not None:
                    continue  # draining after the cancel
                row = tuple(res.get_value(0, c) for c in range(res.nfields))
                # what the row costs in Python (as :func:`.memory.row_size`, inlined: this loop is hot):
                # each value a bytes object (33 bytes + its data), the tuple, its slot in the list
                size += sum(len(v) + 40 for v in row if v is not None) + 8 * len(row) + 56
                rows.append(row)
                if len(rows) > MAX_CATALOG_RESULT_ROWS or size > MAX_CATALOG_RESULT_BYTES:
                    refusal = ProgramLimitExceeded(
                        f"catalog result exceeds {MAX_CATALOG_RESULT_ROWS} rows or {MAX_CATALOG_RESULT_BYTES >> 20} MB",
                        hint="Catalog queries return the schema of the exposed tables; narrow the query.",
                    )
                elif reserve is not None and size - reserved >= _RESERVE_STEP:
                    try:
                        reserve(size - reserved)
                        reserved = size
                    except Error as exc:
                        refusal = exc
                if refusal is not None:
                    rows.clear()
                    _cancel_request(self._conn)
            elif final is None and failure is None:
                try:
                    final = self._check(res)
                except Error as exc:
                    failure = exc
        if refusal is not None:
            raise refusal
        if failure is not None:
            raise failure
        assert final is not None
        if reserve is not None:
            reserve(size - reserved)
        return final, rows


_T = TypeVar("_T")
#: How often a wait on the shadow looks whether it was cancelled (seconds).
_POLL = 0.1
#: After a cancel, how long the shadow has to end the statement before its connection is dropped.
CANCEL_GRACE = 1.0


def _cancel_request(conn: Any) -> None:
    """Ask the shadow to cancel ``conn``'s statement, waiting at most a few seconds for it to listen."""
    if conn is None:
        return
    with contextlib.suppress(Exception):
        if hasattr(conn, "cancel_safe"):
            conn.cancel_safe(timeout=2 * CANCEL_GRACE)
        else:  # pragma: no cover - psycopg < 3.2
            conn.cancel()


#: Largest catalog result one statement may return (the shadow holds empty tables: real metadata
#: queries return far less; a cross join of catalog tables would otherwise fill the server's memory).
MAX_CATALOG_RESULT_ROWS = 100_000
MAX_CATALOG_RESULT_BYTES = 32 << 20  # as held in Python (values and tuples), not just the data
#: A catalog result's bytes are reserved (see :mod:`.memory`) in steps of this while it is read.
_RESERVE_STEP = 1 << 20


def _expand_formats(formats: Sequence[int], n: int) -> list[int]:
    if not formats:
        return [0] * n
    if len(formats) == 1:
        return [formats[0]] * n
    return list(formats)
