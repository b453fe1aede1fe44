"""DuckDB backend: one database object, one cursor (= connection) per call, so threads never share state."""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import Any, Self

import duckdb
import numpy as np
from sqlglot import exp

from dpsql.backends.base import (
    QUERY_FAILED,
    BackendBase,
    RowHash,
    TopRows,
    WriteCatalog,
    cancellable,
    column_defs,
    information_schema_columns,
    information_schema_tables,
    log_database_error,
    normalize_rows,
    quote_ident,
    quote_literal,
    redact_url,
    timed_out,
)
from dpsql.errors import BackendError

log = logging.getLogger(__name__)

_LOAD_CHUNK = 200_000

#: Group-by keys whose statistics span at most 2^18 values are aggregated in a perfect hash table (an
#: array index) instead of a hash table. Person-level queries group by the privacy unit, whose ids are
#: usually dense integers: 10^7 rows over 10^5 users aggregate in half the time (DuckDB's default, 12
#: bits, stops at 4,096 ids). 18 bits bounds the array at 262,144 slots of aggregate state per thread.
PERFECT_HASH_BITS = 18


def _database_path(url: str) -> str:
    """``duckdb://`` and ``duckdb:///:memory:`` → ``:memory:``; ``duckdb:///abs/p.duckdb`` → the path."""
    rest = url.split(":", 1)[1]
    rest = rest[2:] if rest.startswith("//") else rest
    if rest in ("", "/", ":memory:", "/:memory:"):
        return ":memory:"
    return rest


class DuckDBBackend(BackendBase):
    schemes = ("duckdb",)
    dialect = "duckdb"
    #: While open, the file is locked against other writers; between openings its size and modification
    #: time (and its WAL's) are in the stamp. An in-memory database is private to this object.
    sees_outside_writes = True
    information_schema = True
    pg_roles = False
    #: DuckDB's HASH orders a heavy unit's cells an order of magnitude cheaper than md5, and MIN_BY
    #: keeps a unit's first rows in one aggregation (measured with bench/person.py).
    row_hash: RowHash = "duckdb"
    top_rows: TopRows = "min_by"

    def __init__(self, url: str, *, statement_timeout_ms: int | None = None, read_only: bool = False) -> None:
        self.url = url
        self.path = _database_path(url)
        self.statement_timeout_ms = statement_timeout_ms
        #: A file opened without the write lock (never an in-memory database, which starts empty).
        self.read_only = read_only and self.path != ":memory:"
        try:
            try:
                self._db = duckdb.connect(self.path, read_only=self.read_only)
            except duckdb.ConnectionException:
                if not self.read_only:
                    raise
                # this process already holds the file for writing (DuckDB shares one instance per
                # process and configuration): share that instance; other processes are locked out anyway
                self.read_only = False
                self._db = duckdb.connect(self.path)
            self._db.execute(f"SET GLOBAL perfect_ht_threshold = {PERFECT_HASH_BITS}")
        except duckdb.IOException as exc:
            log.warning("cannot open DuckDB database %s: %s", self.path, exc)
            lock = "lock" in str(exc).lower()
            raise BackendError(
                "could not open the database" + (": another process holds it for writing" if lock else ""),
                hint="Only one process may open a DuckDB file for writing (randomized-response INSERTs); "
                "readers share it."
                if lock
                else None,
            ) from None
        except duckdb.Error as exc:
            log.warning("cannot open DuckDB database %s: %s", self.path, exc)
            raise BackendError("could not open the database") from None
        self._closed = False
        #: Bumped before every write through this object; DuckDB locks the file (shared by readers,
        #: exclusive to a writer), so no other process can change the data behind it while it is open.
        self.data_version = 0
        self._ranges: dict[tuple[int, str, tuple[str, ...]], dict[str, tuple[Any, Any]]] = {}

    @classmethod
    def from_url(cls, url: str, *, statement_timeout_ms: int | None, pool_size: int, read_only: bool) -> Self:
        """``read_only`` opens a file without its write lock (several processes read it at once);
        every statement also runs in a READ ONLY transaction. There is no pool: one cursor per call."""
        return cls(url, statement_timeout_ms=statement_timeout_ms, read_only=read_only)

    def __repr__(self) -> str:
        return f"DuckDBBackend({redact_url(self.url)!r})"

    @property
    def in_memory(self) -> bool:
        return self.path == ":memory:"

    def identity(self) -> str:
        """A file: its resolved path. In memory: a token of this object (nothing is shared)."""
        if self.in_memory:
            return self.object_identity()
        return f"duckdb:{os.path.realpath(self.path)}"

    def data_stamp(self) -> str:
        """The write counter, plus for a file its size and modification time and its WAL's: a write made
        by another process between two openings (a cache entry outlives the process) moves them."""
        parts = [str(self.data_version)]
        if not self.in_memory:
            for name in (self.path, self.path + ".wal"):
                try:
                    stat = os.stat(name)
                    parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
                except OSError:
                    parts.append("-")
        return ":".join(parts)

    def catalog_where(self, table: str) -> str:
        """DuckDB identifiers are case-insensitive: so is the match."""
        *schema, name = table.split(".")
        schema_sql = quote_literal(schema[-1]) if schema else "current_schema()"
        return f"lower(table_name) = lower({quote_literal(name)}) AND lower(table_schema) = lower({schema_sql})"

    def tables(self) -> list[str]:
        return information_schema_tables(self)

    def columns(self, table: str) -> dict[str, str] | None:
        return information_schema_columns(self, table)

    def write_catalog(self, table: str) -> WriteCatalog:
        """Keys and unique indexes from DuckDB's own catalog functions (DuckDB has no triggers or rules)."""
        name = table.replace("'", "''")
        _, rows = self.execute(
            "SELECT constraint_type, constraint_column_names FROM duckdb_constraints() "
            f"WHERE table_name = '{name}' AND constraint_type IN ('PRIMARY KEY', 'UNIQUE', 'FOREIGN KEY')"
        )
        keys: list[tuple[str, list[str] | None]] = [(constraint, list(columns)) for constraint, columns in rows]
        _, rows = self.execute(f"SELECT expressions FROM duckdb_indexes() WHERE table_name = '{name}' AND is_unique")
        for (expressions,) in rows:
            text = str(expressions).strip("[]")
            parts = [p.strip().strip('"') for p in text.split(",")]
            simple = all(re.fullmatch(r"\w+", p) for p in parts)
            keys.append(("unique index", parts if simple else None))
        _, rows = self.execute(f"SELECT column_name, column_default FROM duckdb_columns() WHERE table_name = '{name}'")
        return WriteCatalog(keys, {c: d for c, d in rows}, [])

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        if self._closed:
            raise BackendError("the database backend is closed")
        return self._db.cursor()

    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One statement, in a READ ONLY transaction, interrupted after ``statement_timeout_ms``."""
        cur = self._cursor()
        timer: threading.Timer | None = None
        try:
            statements = cur.extract_statements(sql)
            if len(statements) != 1:
                raise BackendError("the database backend runs exactly one statement per query")
            with cancellable(cur.interrupt):
                cur.execute("BEGIN TRANSACTION READ ONLY")
                if self.statement_timeout_ms:
                    timer = threading.Timer(self.statement_timeout_ms / 1000, cur.interrupt)
                    timer.daemon = True
                    timer.start()
                cur.execute(statements[0])  # parsed once (a rewritten statement's parse costs milliseconds)
                names = [d[0] for d in cur.description or ()]
                rows = normalize_rows(cur.fetchall())
            return names, rows
        except duckdb.InterruptException as exc:
            log_database_error("DuckDB query interrupted", exc)
            raise timed_out() from None
        except duckdb.Error as exc:
            log_database_error("DuckDB query failed", exc)
            raise BackendError(QUERY_FAILED) from None
        finally:
            if timer is not None:
                timer.cancel()
            cur.close()  # closing the cursor discards its open read-only transaction

    def execute_script(self, sql: str) -> None:
        self._bump()
        cur = self._cursor()
        try:
            cur.execute(sql)
        except duckdb.Error as exc:
            log_database_error("DuckDB script failed", exc)
            raise BackendError(QUERY_FAILED) from None
        finally:
            cur.close()

    def load_rows(
        self,
        table: str,
        columns: list[tuple[str, str]],
        rows: Iterable[tuple[Any, ...]],
        *,
        replace: bool = False,
    ) -> None:
        """Create the table and insert through DuckDB's numpy scan, chunk by chunk (fast, no pandas)."""
        self._bump()
        target = quote_ident(table)
        ddl = f"CREATE {'OR REPLACE ' if replace else ''}TABLE {target} ({column_defs(columns)})"
        names = [f"c{i}" for i in range(len(columns))]
        cur = self._cursor()
        try:
            cur.execute("BEGIN TRANSACTION")
            cur.execute(ddl)
            it = iter(rows)
            while chunk := list(itertools.islice(it, _LOAD_CHUNK)):
                data: dict[str, np.ndarray] = {}
                selected = []
                for name, values in zip(names, zip(*chunk, strict=True), strict=True):
                    data[name] = np.empty(len(chunk), dtype=object)
                    data[name][:] = values
                    selected.append(name)
                    # DuckDB's numpy scan reads NaN as NULL: a mask column puts the NaNs back.
                    nan = np.fromiter((isinstance(v, float) and v != v for v in values), bool, len(chunk))
                    if nan.any():
                        data[f"nan_{name}"] = nan
                        selected[-1] = f"CASE WHEN nan_{name} THEN 'NaN'::DOUBLE ELSE {name} END"
                # Infer source types from the whole chunk, not a sample (nulls first must not mislead).
                cur.execute(f"SET pandas_analyze_sample = {len(chunk)}")
                cur.register("_dpsql_load", data)
                try:
                    cur.execute(f"INSERT INTO {target} SELECT {', '.join(selected)} FROM _dpsql_load")
                finally:
                    cur.unregister("_dpsql_load")
            cur.execute("COMMIT")
        except (duckdb.Error, ValueError) as exc:
            log_database_error(f"DuckDB load into {table} failed", exc)
            raise BackendError(QUERY_FAILED) from None
        finally:
            cur.close()

    def _bump(self) -> None:
        self.data_version += 1
        self._ranges.clear()

    def proven_ranges(self, table: str, columns: list[str]) -> dict[str, tuple[Any, Any]]:
        """(min, max) that DuckDB's table statistics guarantee for each column of a base table.

        Statistics are conservative (widened on insert/update, never narrowed on delete), so every
        stored value lies inside. Views and external files are not trusted (their data can change
        without a write through this object). Empty tables and unknown columns give no entry.
        """
        key = (self.data_version, table, tuple(columns))
        cached = self._ranges.get(key)
        if cached is not None:
            return cached
        found: dict[str, tuple[Any, Any]] = {}
        target = exp.to_table(table)
        cur = self._cursor()
        try:
            base = cur.execute(
                "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
                "AND schema_name = COALESCE(?, current_schema()) AND table_name = ?",
                [target.db or None, target.name],
            ).fetchone()
            if base and base[0] == 1:
                stats = ", ".join(f"stats({quote_ident(c)})" for c in columns)
                row = cur.execute(f"SELECT {stats} FROM {target.sql('duckdb')} LIMIT 1").fetchone()
                for column, info in zip(columns, row or (), strict=False):
                    low, high = (info or {}).get("min"), (info or {}).get("max")
                    if low is not None and high is not None:
                        found[column] = (low, high)
        except duckdb.Error as exc:
            log.info("no statistics for %s: %s", table, exc)
            found = {}
        finally:
            cur.close()
        self._ranges[key] = found
        return found

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._db.close()
