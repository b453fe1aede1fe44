"""The embedded store: a WAL-mode SQLite file, one long-lived connection per thread.

``synchronous=FULL`` and ``BEGIN IMMEDIATE``: the check-then-insert of a reservation is serialised
across threads *and* processes sharing the file, and each commit is fsync'd before a result leaves.
The schema's triggers keep charges and curator rows append-only and the audit trail append-only but
for its two updates; older files are migrated on open (each step re-checked under the write lock,
since another process may be opening the same file).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, ClassVar

from dpsql.errors import LedgerUnavailable
from dpsql.ledger.base import STORES, Ledger
from dpsql.ledger.store import HINT_UNAVAILABLE, Dialect, Execute, unavailable

_SQLITE_BUSY_TIMEOUT_S = 30.0

#: The curator's rows (schema 5: revoke and prune added to the kinds).
_SQLITE_LEVERS_TABLE = """CREATE TABLE IF NOT EXISTS dpsql_ledger_levers (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    at       TEXT    NOT NULL,
    dataset  TEXT    NOT NULL,
    analyst  TEXT    NOT NULL,
    kind     TEXT    NOT NULL CHECK (kind IN ('grant', 'revoke', 'freeze', 'unfreeze', 'prune')),
    epsilon  REAL    NOT NULL CHECK (epsilon >= 0),
    delta    REAL    NOT NULL CHECK (delta >= 0 AND delta < 1),
    by_user  TEXT    NOT NULL,
    reason   TEXT    NOT NULL
)"""

_SQLITE_SCHEMA = (
    """
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
    selection_delta REAL CHECK (selection_delta >= 0),  -- NULL: recorded before schema 2 (count delta)
    -- Schema 5: the analyst's and the dataset's sums after this charge (NULL: recorded before schema 5)
    sum_epsilon REAL, sum_delta REAL, sum_rho REAL, sum_selection_delta REAL, sum_queries INTEGER,
    ds_epsilon  REAL, ds_delta  REAL, ds_rho  REAL, ds_selection_delta  REAL, ds_queries  INTEGER
);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_owner ON dpsql_ledger (dataset, analyst, id);
CREATE INDEX IF NOT EXISTS dpsql_ledger_by_dataset ON dpsql_ledger (dataset, id);
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
-- Schema 5: a charge is finite (text, inf and NaN, which SQLite stores as NULL, are refused).
CREATE TRIGGER IF NOT EXISTS dpsql_ledger_finite BEFORE INSERT ON dpsql_ledger
WHEN NOT (NEW.epsilon <= 1.7976931348623157e308 AND NEW.delta < 1 AND NEW.rho <= 1.7976931348623157e308
          AND COALESCE(NEW.selection_delta, 0) < 1)
BEGIN SELECT RAISE(ABORT, 'privacy ledger charges are finite numbers'); END;
-- A charge (a finite one: the trigger above refuses the rest) carries its running sums, each at least the
-- last row's plus its own cost, as dpsql writes them (the larger of the totals and the last sums, plus the
-- cost: float addition is monotone). A hand-written row with NULL or lowered sums is refused, so it cannot
-- make a lowered total look right; readers never trust such sums either (integrity.trusted_sums).
CREATE TRIGGER IF NOT EXISTS dpsql_ledger_sums BEFORE INSERT ON dpsql_ledger
WHEN NEW.epsilon <= 1.7976931348623157e308 AND NEW.delta < 1 AND NEW.rho <= 1.7976931348623157e308
     AND COALESCE(NEW.selection_delta, 0) < 1 AND NOT COALESCE(
    NEW.sum_epsilon >= NEW.epsilon AND NEW.sum_delta >= NEW.delta AND NEW.sum_rho >= NEW.rho
    AND NEW.sum_selection_delta >= COALESCE(NEW.selection_delta, NEW.delta) AND NEW.sum_queries >= 1
    AND NEW.ds_epsilon >= NEW.epsilon AND NEW.ds_delta >= NEW.delta AND NEW.ds_rho >= NEW.rho
    AND NEW.ds_selection_delta >= COALESCE(NEW.selection_delta, NEW.delta) AND NEW.ds_queries >= 1
    AND NOT EXISTS (SELECT 1 FROM dpsql_ledger p WHERE p.id = (
            SELECT MAX(id) FROM dpsql_ledger WHERE dataset = NEW.dataset AND analyst = NEW.analyst)
        AND NOT (NEW.sum_epsilon >= COALESCE(p.sum_epsilon, 0) + NEW.epsilon
                 AND NEW.sum_delta >= COALESCE(p.sum_delta, 0) + NEW.delta
                 AND NEW.sum_rho >= COALESCE(p.sum_rho, 0) + NEW.rho
                 AND NEW.sum_queries > COALESCE(p.sum_queries, 0)))
    AND NOT EXISTS (SELECT 1 FROM dpsql_ledger p WHERE p.id = (
            SELECT MAX(id) FROM dpsql_ledger WHERE dataset = NEW.dataset)
        AND NOT (NEW.ds_epsilon >= COALESCE(p.ds_epsilon, 0) + NEW.epsilon
                 AND NEW.ds_delta >= COALESCE(p.ds_delta, 0) + NEW.delta
                 AND NEW.ds_rho >= COALESCE(p.ds_rho, 0) + NEW.rho
                 AND NEW.ds_queries > COALESCE(p.ds_queries, 0))), 0)
BEGIN SELECT RAISE(ABORT, 'privacy ledger charges carry their running sums'); END;
CREATE TABLE IF NOT EXISTS dpsql_ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Schema 3: the curator's levers and the audit trail (new tables only: nothing to migrate).
"""
    + _SQLITE_LEVERS_TABLE
    + """;
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
-- Schema 5: only free refusals and cache hits are ever deleted, after a curator's prune row that is
-- later than them (see Ledger.prune_audit); a charged or answered statement's row never is.
DROP TRIGGER IF EXISTS dpsql_audit_no_delete;
CREATE TRIGGER dpsql_audit_no_delete BEFORE DELETE ON dpsql_audit
WHEN NOT (OLD.charge_id IS NULL AND OLD.outcome IN ('refused', 'cache hit') AND EXISTS (
    SELECT 1 FROM dpsql_ledger_levers p WHERE p.dataset = OLD.dataset AND p.kind = 'prune'
    AND p.at > COALESCE(OLD.last_at, OLD.at)))
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
-- Schema 6: pld accounting's composed state per analyst and per dataset (dpsql.ledger.loss_state), signed.
CREATE TABLE IF NOT EXISTS dpsql_ledger_pld (
    dataset  TEXT    NOT NULL,
    scope    TEXT    NOT NULL CHECK (scope IN ('analyst', 'dataset')),
    analyst  TEXT    NOT NULL,
    through  INTEGER NOT NULL,
    queries  INTEGER NOT NULL,
    epsilon  REAL    NOT NULL,
    delta    REAL    NOT NULL,
    selection_delta REAL NOT NULL,
    state    BLOB    NOT NULL,
    mac      TEXT    NOT NULL,
    PRIMARY KEY (dataset, scope, analyst)
);
-- A real write on every open: a read-only file or directory fails here, not mid-query.
INSERT INTO dpsql_ledger_meta (key, value) VALUES ('schema', '6')
    ON CONFLICT (key) DO UPDATE SET value = excluded.value;
COMMIT;
"""
)

# Schema 1 → 2 (run inside the BEGIN IMMEDIATE of _SQLITE_SCHEMA's successor, after re-checking).
# Old totals take their whole recorded δ as selection δ: an upper bound, so never an undercount.
_SQLITE_MIGRATE_2 = (
    "ALTER TABLE dpsql_ledger ADD COLUMN selection_delta REAL CHECK (selection_delta >= 0)",
    "ALTER TABLE dpsql_ledger_totals ADD COLUMN selection_delta REAL NOT NULL DEFAULT 0",
    "UPDATE dpsql_ledger_totals SET selection_delta = delta",
)

# Schema 5: the totals are set to the new charge row's sums (never incremented on their own).
_UPSERT_TOTALS = """
INSERT INTO dpsql_ledger_totals (dataset, analyst, epsilon, delta, rho, queries, last_at, selection_delta)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (dataset, analyst) DO UPDATE SET
    epsilon = excluded.epsilon,
    delta   = excluded.delta,
    rho     = excluded.rho,
    queries = excluded.queries,
    last_at = excluded.last_at,
    selection_delta = excluded.selection_delta
"""


def _sqlite_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})").fetchall()}


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """One migration step under the file's write lock (rolled back on any error)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
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
    with _immediate(conn):
        if "selection_delta" not in _sqlite_columns(conn, "dpsql_ledger_totals"):  # another opener may have won
            for statement in _SQLITE_MIGRATE_2:
                conn.execute(statement)


def _sqlite_migrate_audit(conn: sqlite3.Connection) -> None:
    """Schema 3 → 4: the audit's ``repeats`` and ``last_at`` columns (before the schema script, whose
    trigger names them); no-op on new or current files."""
    columns = _sqlite_columns(conn, "dpsql_audit")
    if not columns or "repeats" in columns:
        return
    with _immediate(conn):
        if "repeats" not in _sqlite_columns(conn, "dpsql_audit"):  # another opener may have won
            conn.execute("ALTER TABLE dpsql_audit ADD COLUMN repeats INTEGER NOT NULL DEFAULT 1")
            conn.execute("ALTER TABLE dpsql_audit ADD COLUMN last_at TEXT")


#: Schema 5's columns of ``dpsql_ledger``: the analyst's and the dataset's sums after each charge.
_SUM_COLUMNS = ("sum_epsilon", "sum_delta", "sum_rho", "sum_selection_delta", "sum_queries")
_DS_COLUMNS = ("ds_epsilon", "ds_delta", "ds_rho", "ds_selection_delta", "ds_queries")


def _sqlite_levers_old(conn: sqlite3.Connection) -> bool:
    """Whether the levers table predates schema 5 (its CHECK lacks the revoke and prune kinds)."""
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'dpsql_ledger_levers'").fetchone()
    return row is not None and "'revoke'" not in row[0]


def _sqlite_migrate_5(conn: sqlite3.Connection) -> None:
    """Schema 4 → 5: the charges' sums columns, and the levers' new kinds (SQLite cannot alter a CHECK,
    so that table is copied: same ids, same rows; its triggers and index come back with the schema)."""
    charges = _sqlite_columns(conn, "dpsql_ledger")
    levers_old = _sqlite_levers_old(conn)
    if (not charges or "sum_epsilon" in charges) and not levers_old:
        return
    with _immediate(conn):
        if charges and "sum_epsilon" not in _sqlite_columns(conn, "dpsql_ledger"):  # another opener may have won
            for column in (*_SUM_COLUMNS, *_DS_COLUMNS):
                kind = "INTEGER" if column.endswith("queries") else "REAL"
                conn.execute(f"ALTER TABLE dpsql_ledger ADD COLUMN {column} {kind}")
        if _sqlite_levers_old(conn):
            conn.execute(_SQLITE_LEVERS_TABLE.replace("dpsql_ledger_levers", "dpsql_ledger_levers_5"))
            conn.execute(
                "INSERT INTO dpsql_ledger_levers_5 (id, at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
                "SELECT id, at, dataset, analyst, kind, epsilon, delta, by_user, reason FROM dpsql_ledger_levers"
            )
            conn.execute("DROP TABLE dpsql_ledger_levers")
            conn.execute("ALTER TABLE dpsql_ledger_levers_5 RENAME TO dpsql_ledger_levers")


def _create_private(path: str) -> None:
    """Create a new ledger file with mode 0600 (it holds the installation key; SQLite gives its
    -wal and -shm files the same mode). An existing file is left as the operator made it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise unavailable(f"cannot create {path!r}", exc) from exc
    os.close(fd)


class SQLiteLedger(Ledger):
    """Embedded ledger: one long-lived connection per thread on a WAL-mode SQLite file."""

    dialect: ClassVar[Dialect] = Dialect(
        placeholder="?", returning_id=False, text_timestamps=True, upsert_totals=_UPSERT_TOTALS
    )
    close_errors: ClassVar[tuple[type[BaseException], ...]] = (sqlite3.Error,)

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = "sqlite:///:memory:" if path == ":memory:" else f"sqlite://{path}"
        self._memory = path == ":memory:"
        self._init_pool()  # its lock also serialises the one :memory: connection
        if not self._memory:
            parent = os.path.dirname(path)
            if os.path.isdir(path):
                raise unavailable(f"{path!r} is a directory")
            if not os.path.isdir(parent):
                raise unavailable(f"directory {parent!r} does not exist")
            _create_private(path)
        try:
            conn = self._conn()
            row = conn.execute("PRAGMA quick_check").fetchone()
        except sqlite3.Error as exc:
            self.close()
            raise unavailable(f"cannot open {path!r}", exc) from exc
        except LedgerUnavailable:
            self.close()
            raise
        if row is None or row[0] != "ok":
            self.close()
            raise unavailable(f"{path!r} failed its integrity check")

    @classmethod
    def from_url(cls, url: str) -> SQLiteLedger:
        """``sqlite:///abs/path.sqlite`` or ``sqlite:///:memory:``."""
        path = url.removeprefix("sqlite://")
        if path != "/:memory:" and not path.startswith("/"):
            raise LedgerUnavailable(
                f"privacy ledger unavailable: {url!r} is not sqlite:///<absolute path>",
                hint=HINT_UNAVAILABLE,
            )
        return cls(":memory:" if path == "/:memory:" else path)

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=_SQLITE_BUSY_TIMEOUT_S,
                isolation_level=None,  # we issue BEGIN IMMEDIATE / COMMIT ourselves
                check_same_thread=False,  # only so that close() may close every thread's connection
            )
        except sqlite3.Error as exc:
            raise unavailable(f"cannot open {self.path!r}", exc) from exc
        try:
            if not self._memory:
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
                if mode is None or str(mode[0]).lower() != "wal":
                    raise unavailable(f"{self.path!r} cannot use write-ahead logging")
            conn.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            conn.execute("PRAGMA fullfsync=ON")  # F_FULLFSYNC on macOS; ignored elsewhere
            _sqlite_migrate(conn)
            _sqlite_migrate_audit(conn)
            _sqlite_migrate_5(conn)
            conn.executescript(_SQLITE_SCHEMA)
        except (sqlite3.Error, LedgerUnavailable) as exc:
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            conn.close()
            if isinstance(exc, LedgerUnavailable):
                raise
            raise unavailable(f"cannot open {self.path!r}", exc) from exc
        return conn

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = self._pooled()
        if conn is None:
            with self._lock:
                shared = self._pool.first() if self._memory else None
                conn = shared if shared is not None else self._pool.keep(self._connect(), locked=True)
            self._pool.use(conn)
        assert conn is not None
        return conn

    @contextmanager
    def _turn(self) -> Iterator[None]:
        # The single :memory: connection is shared by all threads, so they take turns.
        if self._memory:
            with self._lock:
                yield
        else:
            yield

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
                raise unavailable(f"cannot record a charge in {self.path!r}", exc) from exc

    @contextmanager
    def _append(self) -> Iterator[Execute]:
        # Same write lock as a reservation (SQLite has one writer); held for a few inserts only.
        with self._reservation("") as execute:
            yield execute

    def _read(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        conn = self._conn()
        params = self.dialect.params(params)
        with self._turn():
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise unavailable(f"cannot read {self.path!r}", exc) from exc

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
                raise unavailable(f"cannot write {self.path!r}", exc) from exc
        return str(row[0])


STORES["sqlite"] = SQLiteLedger.from_url
