"""Metadata queries (psql ``\\d``, pgcli, SQLAlchemy's inspector, JDBC, asyncpg introspection).

The privacy argument and design notes: docs/internals.md, section dpsql/server/catalog.py.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import secrets
import threading
from typing import Any, Literal

import sqlglot
from sqlglot import exp

from dpsql.analyze.parse import too_complex
from dpsql.analyze.statement import Failed, Kind, Statement
from dpsql.backends.local_postgres import local_server_version, start_local_postgres
from dpsql.errors import CannotConnectNow, CatalogUnavailable, Error, FeatureNotSupported, StatementTooComplex
from dpsql.policy import Policy
from dpsql.sqltext import first_word, identifiers

from .shadow_schema import (
    DEFAULT_STATEMENT_TIMEOUT_MS,
    quote_ident,
    revocations,
    role_statements,
    schema_statements,
    shadow_role,
    shadow_roles,
)
from .shadow_session import EXCHANGE_SLACK, ShadowSession, connection_lost

log = logging.getLogger("dpsql.server.catalog")

#: Where a statement goes, the one route type from the wire on: nowhere (empty), answered here (local: a
#: session command; tableless), the shadow catalog, the DP engine (queries, EXPLAIN, INSERT), or refused (mixed).
Route = Literal["empty", "local", "tableless", "catalog", "engine", "mixed"]
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


def _route_by_tokens(sql: str, policy: Policy) -> Route:
    """Fallback when sqlglot cannot parse (psql's OPERATOR(pg_catalog.~) and the like)."""
    words = set(identifiers(sql))
    has_policy = any(policy.table(w) is not None for w in words)
    has_catalog = any(w in CATALOG_SCHEMAS or w.startswith("pg_") for w in words)
    return _decide(has_catalog, has_policy, has_other=not has_catalog)


def route_of(sql: str, policy: Policy) -> Route:
    """Where a statement goes: the shadow catalog, the DP engine, refused (mixed), or no table at all."""
    if first_word(sql) not in _READ_ONLY_HEADS:
        return "engine"  # DDL/DML/anything else: the engine refuses it with the right SQLSTATE
    try:
        tree = sqlglot.parse_one(sql, read="postgres")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return _route_by_tokens(sql, policy)
    except RecursionError:
        raise too_complex() from None
    return route_of_tree(tree, policy) if tree is not None else "tableless"


def route_of_statement(statement: Statement, policy: Policy) -> Route:
    """:func:`route_of` read from the statement the engine parsed and classified (no second parse)."""
    if statement.kind is not Kind.QUERY or first_word(statement.sql) not in _READ_ONLY_HEADS:
        return "engine"  # EXPLAIN, INSERT, DDL/DML: the engine answers or refuses them
    return route_of_tree(statement.tree, policy)


def route_of_refused(failed: Failed, policy: Policy) -> Route:
    """:func:`route_of` of a text the engine refused to classify, without parsing it again: read from its
    tree when the refusal came after parsing, else from its tokens (as :func:`route_of` routes text sqlglot
    cannot parse); a statement too deeply nested to parse is refused here, as there."""
    if first_word(failed.sql) not in _READ_ONLY_HEADS:
        return "engine"
    if failed.tree is not None:
        return route_of_tree(failed.tree, policy)
    if isinstance(failed.error, StatementTooComplex):
        failed.raise_again()
    return _route_by_tokens(failed.sql, policy)


def route_of_tree(tree: exp.Expr, policy: Policy) -> Route:
    """The route of a parsed read-only statement (the tree is only read)."""
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
        self._failed = False
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._starter: threading.Thread | None = None

    @property
    def database(self) -> str:
        return self.policy.dataset

    @property
    def local(self) -> Any:
        """The running :class:`~dpsql.backends.local_postgres.LocalPostgres`, if dpsql started it (tests, operators)."""
        return self._local

    def start(self, background: bool = False) -> None:
        """Start the local server (unless a DSN was given) and create the empty schema; idempotent.

        ``background`` (a local server only): return at once, with :attr:`server_version` read from the
        binaries, and start it in a thread (issue #37: ``dpsql serve`` listened only after initdb, 2-5 s
        per worker process). Catalog queries meanwhile wait for it (57P03 after 15 s, as PostgreSQL
        answers while it starts); if it cannot start they are refused with 0A000, as after a failed start."""
        if background and self._given_dsn is None:
            with self._lock:
                if self._started:
                    return
                self.server_version = local_server_version()
                self._started = True
                self._starter = threading.Thread(target=self._start_local, name="dpsql-catalog-start", daemon=True)
                self._starter.start()
            return
        with self._lock:
            if self._started:
                return
            self._launch()
            self._started = True
        if self._given_dsn is None:
            self._monitor = threading.Thread(target=self._supervise, name="dpsql-catalog-monitor", daemon=True)
            self._monitor.start()

    def _start_local(self) -> None:
        """The background start: launch, then supervise (unless stopped meanwhile)."""
        try:
            with self._lock:
                if self._stopping.is_set():
                    return
                self._launch()
                if self._stopping.is_set():
                    return  # stop() waits for this thread, then stops the server just launched
                self._monitor = threading.Thread(target=self._supervise, name="dpsql-catalog-monitor", daemon=True)
                self._monitor.start()
        except Exception as exc:
            log.warning("catalog server unavailable, catalog queries will be refused: %s", exc)
            self._failed = True
            self._ready.set()  # wake waiting catalog queries: they see it unavailable (0A000)

    def _launch(self) -> None:
        """(Re)start the local server or reach the given one, and prepare it; sets ``_ready``."""
        if self._given_dsn is None:
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
                conn.execute(f"CREATE DATABASE {quote_ident(self.database)}")
            self.server_version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            if exists is not None and not own_cluster:
                return  # an operator-provided catalog that was prepared before
            for role in shadow_roles(self.policy):
                with contextlib.suppress(psycopg.errors.DuplicateObject):
                    conn.execute(f"CREATE ROLE {quote_ident(role)}")
            if own_cluster:
                for db in ("postgres", "template1"):
                    conn.execute(f"REVOKE ALL ON DATABASE {quote_ident(db)} FROM PUBLIC")
                for stmt in revocations(conn):
                    conn.execute(stmt)
        with psycopg.connect(make_conninfo(base, dbname=self.database), autocommit=True, connect_timeout=10) as conn:
            stmts = schema_statements(self.policy) + revocations(conn)
            for role in shadow_roles(self.policy):
                stmts += role_statements(role, self.database, passwords.get(role), self.statement_timeout_ms)
            for stmt in stmts:
                conn.execute(stmt)

    @property
    def available(self) -> bool:
        return self._started and not self._failed and not self._stopping.is_set()

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
        if not self.available:
            raise CatalogUnavailable()
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
        if self._starter is not None and self._starter is not threading.current_thread():
            self._starter.join(timeout=120)  # a start in progress finishes, then is stopped below
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=30)
        with self._lock:
            self._base_dsn = None
            if self._local is not None:
                self._local.stop()
                self._local = None
