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
differentially private. Each client gets its own shadow connection, logged in as a
non-superuser role named after the analyst with ``default_transaction_read_only``, so that
``current_user``, ``has_table_privilege`` and friends answer as they would on a real server
while superuser-only functions (``pg_read_file``…) stay out of reach.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlglot
from sqlglot import exp

from dpsql.analyze.parse import too_complex
from dpsql.errors import Error, FeatureNotSupported
from dpsql.policy import PG_TYPE_NAMES, Policy, TablePolicy

from .protocol import FieldDescription
from .sqltext import first_word, identifiers

log = logging.getLogger("dpsql.server.catalog")

Route = Literal["catalog", "engine", "mixed", "tableless"]
CATALOG_SCHEMAS = frozenset({"pg_catalog", "information_schema"})
_READ_ONLY_HEADS = frozenset({"select", "with", "values", "table"})
_SHADOW_SUPERUSER = "postgres"


class CatalogUnavailable(FeatureNotSupported):
    def __init__(self) -> None:
        super().__init__(
            "catalog queries are not available: the metadata server could not be started",
            hint="DP queries on the policy tables still work; start dpsql with a catalog_dsn.",
        )


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


def _table_ddl(name: str, table: TablePolicy) -> list[str]:
    cols = [
        f"{_ident(col)} {PG_TYPE_NAMES[c.type]}{'' if c.nullable else ' NOT NULL'}"
        for col, c in table.columns.items()
        if not c.identifier
    ]
    stmts = [f"CREATE TABLE public.{_ident(name)} ({', '.join(cols)})"]
    if table.description:
        stmts.append(f"COMMENT ON TABLE public.{_ident(name)} IS {_literal(table.description)}")
    for col, c in table.columns.items():
        if c.description and not c.identifier:
            stmts.append(f"COMMENT ON COLUMN public.{_ident(name)}.{_ident(col)} IS {_literal(c.description)}")
    return stmts


def shadow_role(analyst: str) -> str:
    """The shadow role an analyst logs in as (never the superuser)."""
    return "dpsql_analyst" if analyst == _SHADOW_SUPERUSER else analyst


def shadow_roles(policy: Policy) -> list[str]:
    return sorted({shadow_role(a.name) for a in policy.analysts} | {"dpsql_analyst"})


def role_statements(role: str) -> list[str]:
    """A login role that can read the (empty) tables and nothing more."""
    return [
        f"ALTER ROLE {_ident(role)} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE",
        f"ALTER ROLE {_ident(role)} SET default_transaction_read_only = on",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {_ident(role)}",
    ]


def schema_statements(policy: Policy) -> list[str]:
    """DDL that recreates the policy's published schema, empty, readable by every analyst role."""
    stmts: list[str] = [
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        f"REVOKE TEMPORARY ON DATABASE {_ident(policy.dataset)} FROM PUBLIC",
    ]
    for name, table in policy.tables.items():
        stmts.extend(_table_ddl(name, table))
    for role in shadow_roles(policy):
        stmts.extend(role_statements(role))
    return stmts


@dataclass(slots=True)
class ShadowResult:
    fields: list[FieldDescription] | None
    rows: list[tuple[bytes | None, ...]]
    tag: str


class CatalogShadow:
    """The shadow PostgreSQL: started (or reached via ``catalog_dsn``) once, one connection per client."""

    def __init__(self, policy: Policy, dsn: str | None = None) -> None:
        self.policy = policy
        self._given_dsn = dsn
        self._local: Any = None
        self._base_dsn: str | None = None
        self.server_version: str | None = None
        self._lock = threading.Lock()

    @property
    def database(self) -> str:
        return self.policy.dataset

    def start(self) -> None:
        """Start the local server (unless a DSN was given) and create the empty schema; idempotent."""
        with self._lock:
            if self._base_dsn is not None:
                return
            if self._given_dsn is None:
                from dpsql.local_postgres import start_local_postgres

                self._local = start_local_postgres()
                base = self._local.dsn
            else:
                base = self._given_dsn
            try:
                self._create_schema(base)
            except Exception:
                self.stop()
                raise
            self._base_dsn = base

    def _create_schema(self, base: str) -> None:
        import psycopg
        from psycopg.conninfo import make_conninfo

        with psycopg.connect(base, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if exists is None:
                conn.execute(f"CREATE DATABASE {_ident(self.database)}")  # type: ignore[arg-type]
            self.server_version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            if exists is not None:
                return  # an operator-provided catalog that was prepared before
            for role in shadow_roles(self.policy):
                with contextlib.suppress(psycopg.errors.DuplicateObject):
                    conn.execute(f"CREATE ROLE {_ident(role)}")  # type: ignore[arg-type]
        with psycopg.connect(make_conninfo(base, dbname=self.database), autocommit=True) as conn:
            for stmt in schema_statements(self.policy):
                conn.execute(stmt)  # type: ignore[arg-type]

    @property
    def available(self) -> bool:
        return self._base_dsn is not None

    def connect(self, analyst: str) -> ShadowSession:
        import psycopg
        from psycopg.conninfo import make_conninfo

        if self._base_dsn is None:
            raise CatalogUnavailable()
        dsn = make_conninfo(
            self._base_dsn, dbname=self.database, user=shadow_role(analyst), application_name="dpsql-catalog"
        )
        return ShadowSession(psycopg.connect(dsn, autocommit=True))

    def stop(self) -> None:
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
    return Error(
        field(F.MESSAGE_PRIMARY) or "catalog query failed",
        sqlstate=field(F.SQLSTATE) or "XX000",
        detail=field(F.MESSAGE_DETAIL),
        hint=field(F.MESSAGE_HINT),
        position=int(position) if position and position.isdigit() else None,
    )


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


class ShadowSession:
    """One client's connection to the shadow; blocking calls (run them in a thread)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        # libpq connections are not thread-safe; an abandoned (timed-out) call may still be running.
        self._lock = threading.Lock()

    def close(self) -> None:
        self.cancel()
        with self._lock, contextlib.suppress(Exception):
            self._conn.close()

    def cancel(self) -> None:
        """Ask the shadow to cancel whatever this session is running (safe from any thread)."""
        with contextlib.suppress(Exception):
            self._conn.cancel()

    def _check(self, res: Any) -> Any:
        from psycopg.pq import ExecStatus

        if res.status in (ExecStatus.FATAL_ERROR, ExecStatus.NONFATAL_ERROR, ExecStatus.BAD_RESPONSE):
            raise _shadow_error(res)
        if res.status not in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK, ExecStatus.EMPTY_QUERY):
            raise FeatureNotSupported("this statement is not supported on the catalog")
        return res

    def describe(self, sql: str, param_oids: Sequence[int]) -> tuple[list[int], list[FieldDescription] | None]:
        """Parameter types and result columns, via an unnamed prepared statement on the shadow."""
        with self._lock:
            return self._describe(sql, param_oids)

    def _describe(self, sql: str, param_oids: Sequence[int]) -> tuple[list[int], list[FieldDescription] | None]:
        pgconn = self._conn.pgconn
        self._check(pgconn.prepare(b"", sql.encode("utf-8"), list(param_oids) or None))
        res = self._check(pgconn.describe_prepared(b""))
        params = [res.param_type(i) for i in range(res.nparams)]
        return params, (_fields(res, []) if res.nfields else None)

    def execute(
        self,
        sql: str,
        params: Sequence[bytes | None] = (),
        param_oids: Sequence[int] = (),
        param_formats: Sequence[int] = (),
        result_formats: Sequence[int] = (),
    ) -> ShadowResult:
        """Run one statement; values come back already encoded in the requested per-column formats."""
        with self._lock:
            return self._execute(sql, params, param_oids, param_formats, result_formats)

    def _execute(
        self,
        sql: str,
        params: Sequence[bytes | None],
        param_oids: Sequence[int],
        param_formats: Sequence[int],
        result_formats: Sequence[int],
    ) -> ShadowResult:
        pgconn = self._conn.pgconn
        wanted = set(result_formats) or {0}
        param_formats = _expand_formats(param_formats, len(params)) if params else []

        def run(fmt: int) -> Any:
            return self._check(
                pgconn.exec_params(
                    sql.encode("utf-8"),
                    list(params),
                    list(param_oids[: len(params)]) or None,
                    param_formats or None,
                    result_format=fmt,
                )
            )

        by_format = {fmt: run(fmt) for fmt in sorted(wanted)}
        first = next(iter(by_format.values()))
        tag = (first.command_status or b"").decode("ascii")
        if first.nfields == 0:
            return ShadowResult(None, [], tag)
        formats = _expand_formats(result_formats, first.nfields)
        rows = [
            tuple(by_format[formats[c]].get_value(r, c) for c in range(first.nfields)) for r in range(first.ntuples)
        ]
        return ShadowResult(_fields(first, formats), rows, tag)


def _expand_formats(formats: Sequence[int], n: int) -> list[int]:
    if not formats:
        return [0] * n
    if len(formats) == 1:
        return [formats[0]] * n
    return list(formats)
