"""The server store: tables in the DSN's schema of a PostgreSQL database, one connection per thread.

A reservation is a transaction that takes ``pg_advisory_xact_lock`` on the dataset, reads the
totals, inserts the charge and commits with ``synchronous_commit = on``. A ``SECURITY DEFINER``
insert trigger computes each charge row's sums and sets the totals, so the server's role needs
INSERT on the charges only and can never lower a total (README: "Least-privilege database roles";
:func:`dpsql.ledger.roles.serve_role_warnings` warns when it holds more). The schema script runs
under the owner's role only: a ledger already at the current schema needs no DDL.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from dpsql.ledger.base import STORES, Ledger
from dpsql.ledger.store import INSTALLATION_KEY, Dialect, Execute, unavailable

if TYPE_CHECKING:
    import psycopg

# Two-key advisory lock namespace: ("dpsql", hashtext(dataset)); 0x64707371 is b"dpsq".
_PG_LOCK_NAMESPACE = 0x64707371

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
-- Schema 6: pld accounting's composed state per analyst and per dataset (dpsql.ledger.loss_state), signed with a
-- key outside the database: the writer role updates these rows, but cannot forge one that checks.
CREATE TABLE IF NOT EXISTS dpsql_ledger_pld (
    dataset  text             NOT NULL,
    scope    text             NOT NULL CHECK (scope IN ('analyst', 'dataset')),
    analyst  text             NOT NULL,
    through  bigint           NOT NULL,
    queries  bigint           NOT NULL,
    epsilon  double precision NOT NULL,
    delta    double precision NOT NULL,
    selection_delta double precision NOT NULL,
    state    bytea            NOT NULL,
    mac      text             NOT NULL,
    PRIMARY KEY (dataset, scope, analyst)
);
COMMENT ON TABLE dpsql_ledger IS 'dpsql privacy ledger, schema 6';  -- _PG_SCHEMA_MARK
"""


#: What schema 6's script writes last: a ledger with it needs no DDL (``COMMENT`` is readable by every role).
_PG_SCHEMA_MARK = "dpsql privacy ledger, schema 6"


def _pg_schema_current(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT obj_description(to_regclass('dpsql_ledger'), 'pg_class')").fetchone()
    return row is not None and row[0] == _PG_SCHEMA_MARK


class PostgresLedger(Ledger):
    """Ledger in a PostgreSQL table, in the DSN's schema; one connection per thread."""

    # No totals upsert: the insert trigger (SECURITY DEFINER) sets the totals from the charge row.
    dialect: ClassVar[Dialect] = Dialect(placeholder="%s", returning_id=True, text_timestamps=False)
    #: The writer role may read the installation key: what it must not forge is signed with a key outside.
    external_signing_key: ClassVar[bool] = True

    def __init__(self, conninfo: str) -> None:
        self.url = conninfo
        self._init_pool()
        self._conn()  # connects and creates the tables, so a bad DSN fails at open

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in self.url:
            kwargs["connect_timeout"] = 10
        try:
            conn = psycopg.connect(self.url, **kwargs)
        except psycopg.Error as exc:
            raise unavailable("cannot connect to the ledger database", exc) from exc
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
                        (INSTALLATION_KEY, secrets.token_hex(32)),
                    )
        except psycopg.Error as exc:
            conn.close()
            raise unavailable("cannot create the ledger tables", exc) from exc
        return conn

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = self._pooled()
        if conn is None or conn.closed or conn.broken:
            conn = self._pool.keep(self._connect())
        return conn

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        """Forget a connection after an error; the next call reconnects."""
        self._pool.drop(conn)

    @contextmanager
    def _transaction(self, failure: str, lock: str | None = None) -> Iterator[Execute]:
        """A transaction on this thread's connection; with ``lock``, holding that dataset's advisory lock.
        An error drops the connection and fails closed (``privacy ledger unavailable: <failure>``)."""
        import psycopg

        conn = self._conn()
        try:
            with conn.transaction():
                if lock is not None:
                    # The lock serialises every reserve on this dataset until COMMIT; under READ
                    # COMMITTED the next statement's snapshot then sees every earlier charge.
                    conn.execute(
                        "SELECT set_config('synchronous_commit', 'on', true), pg_advisory_xact_lock(%s, hashtext(%s))",
                        (_PG_LOCK_NAMESPACE, lock),
                    )
                yield conn.execute
        except psycopg.Error as exc:
            self._drop(conn)
            raise unavailable(failure, exc) from exc

    def _reservation(self, dataset: str) -> AbstractContextManager[Execute]:
        return self._transaction("cannot record a charge", lock=dataset)

    def _append(self) -> AbstractContextManager[Execute]:
        return self._transaction("cannot write the audit trail")

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return self._fetch(self._sql(sql), self.dialect.params(params))

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Run ``sql`` (``%s`` placeholders) and fetch every row; fail closed."""
        import psycopg

        conn = self._conn()
        try:
            return conn.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            self._drop(conn)
            raise unavailable("cannot read the ledger", exc) from exc

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
            raise unavailable("cannot write the ledger", exc) from exc
        rows = self._fetch("SELECT value FROM dpsql_ledger_meta WHERE key = %s", (key,))
        return str(rows[0][0])


STORES["postgresql"] = STORES["postgres"] = PostgresLedger
