"""Apache Spark SQL backend: an in-process local session or a cluster through Spark Connect.

``spark://local[N][/database][?spark.conf=value&…]`` starts (once per process: Spark allows one
SparkContext) a local session for development and tests; every backend gets its own
``newSession()`` so temporary views and the current database stay separate.
``sc://host:port[/;token=…]`` talks to a Spark Connect server (``start-connect-server.sh``).

Spark has no read-only transactions: a query runs only as sqlglot's rendering of a tree checked to
be one SELECT, with Spark's differences from PostgreSQL/DuckDB fixed on the way (see
:mod:`dpsql.backends.spark_sql`). Queries dpsql builds are rendered once (:meth:`SparkBackend.render`).

pyspark is optional (``pip install 'dpsql[spark]'``) and only imported when a Spark URL is opened.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import parse_qsl

import sqlglot
from sqlglot import exp

from dpsql.backends.base import (
    QUERY_FAILED,
    SQL_TYPE,
    BackendBase,
    WriteCatalog,
    cancellable,
    log_database_error,
    normalize_rows,
    redact_url,
)
from dpsql.backends.spark_sql import (
    DIALECT,
    PreparedQuery,
    prepare_query,
    prepare_tree,
    resolve_sources,
    split_statements,
    with_sources,
)
from dpsql.errors import BackendError, Error
from dpsql.lru import LRU

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "SparkBackend",
    "parse_url",
    "prepare_query",
    "redact",
    "resolve_sources",
    "spark_column_type",
    "spark_ident",
    "split_statements",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dpsql[spark]' (pyspark 4 with Spark Connect; local mode needs Java 17+)"
START_FAILED = "could not start Spark"
CONNECT_FAILED = "could not connect to Spark"
_LOAD_CHUNK = 200_000
#: Spark Connect retries: 0.1 + 0.3 + 0.9 + 2.7 s of back-off, then the query fails.
CONNECT_RETRY = {"max_retries": 4, "initial_backoff": 100, "backoff_multiplier": 3.0, "max_backoff": 5000}
_LOG_LIMIT = 4000
_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)(,\d+)?\])?$")
_DATABASE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --- URLs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SparkTarget:
    """Where a Spark URL points: a local master (with database and confs) or a Connect URL."""

    connect: str | None = None
    master: str = "local[*]"
    database: str | None = None
    conf: dict[str, str] = field(default_factory=dict)

    @property
    def cores(self) -> int:
        match = _LOCAL_MASTER.match(self.master)
        count = match.group(2) if match else None
        return int(count) if count and count != "*" else os.cpu_count() or 1


def parse_url(url: str) -> SparkTarget:
    """``spark://local[N][/db][?k=v&…]`` or ``sc://host:port[/;k=v…]`` (passed to Spark Connect as is)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() == "sc":
        if not rest:
            raise BackendError("a Spark Connect URL needs a host", hint="use sc://host:15002")
        return SparkTarget(connect=url)
    head, _, query = rest.partition("?")
    master, _, database = head.partition("/")
    if not _LOCAL_MASTER.match(master):
        raise BackendError(
            f"unsupported Spark master {master!r}",
            hint="spark://local[N] runs Spark in-process; reach a cluster through Spark Connect: sc://host:15002",
        )
    if database and not _DATABASE.match(database):
        raise BackendError(f"invalid Spark database name {database!r}")
    try:
        conf = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise BackendError("invalid Spark settings in the URL", hint="spark://local[N]/db?spark.key=value&…") from None
    return SparkTarget(master=master, database=database or None, conf=conf)


def redact(url: str) -> str:
    """Passwords and Spark Connect tokens masked, for logs and reprs."""
    return re.sub(r"(;\s*token\s*=)[^;]*", r"\1***", redact_url(url), flags=re.IGNORECASE)


def spark_ident(name: str) -> str:
    """Backtick-quote a possibly qualified name (``db.table``)."""
    parts = name.split(".")
    if not all(parts):
        raise BackendError(f"invalid identifier {name!r}")
    return ".".join("`" + part.replace("`", "``") + "`" for part in parts)


# --- Types for load_rows ----------------------------------------------------------------------


def spark_column_type(sql_type: str) -> tuple[str, str]:
    """(Spark DDL type, Arrow type spec) for a SQL column type as the demo/test loaders write it."""
    if not SQL_TYPE.match(sql_type.strip()):
        raise BackendError(f"invalid column type {sql_type!r}")
    try:
        dtype = exp.DataType.build(sql_type.strip(), dialect="postgres")
    except (sqlglot.errors.SqlglotError, ValueError):
        raise BackendError(f"unsupported column type {sql_type!r}") from None
    type_ = dtype.this
    t = exp.DataType.Type
    simple = {
        t.TINYINT: ("TINYINT", "int8"),
        t.SMALLINT: ("SMALLINT", "int16"),
        t.INT: ("INT", "int32"),
        t.BIGINT: ("BIGINT", "int64"),
        t.FLOAT: ("FLOAT", "float32"),
        t.DOUBLE: ("DOUBLE", "float64"),
        t.BOOLEAN: ("BOOLEAN", "bool"),
        t.DATE: ("DATE", "date32"),
        t.TIMESTAMP: ("TIMESTAMP_NTZ", "timestamp"),  # PostgreSQL's TIMESTAMP has no time zone
        t.TIMESTAMPNTZ: ("TIMESTAMP_NTZ", "timestamp"),
        t.TIMESTAMPTZ: ("TIMESTAMP", "timestamptz"),
        t.TEXT: ("STRING", "string"),
        t.VARCHAR: ("STRING", "string"),
        t.CHAR: ("STRING", "string"),
        t.NAME: ("STRING", "string"),
        t.VARBINARY: ("BINARY", "binary"),
        t.BINARY: ("BINARY", "binary"),
    }
    if type_ in simple:
        return simple[type_]
    if type_ == t.DECIMAL:
        params = [int(p.name) for p in dtype.expressions]
        precision, scale = (params + [38, 10][len(params) :])[:2] if params else (38, 10)
        if len(params) == 1:
            scale = 0
        return f"DECIMAL({precision},{scale})", f"decimal:{precision}:{scale}"
    raise BackendError(f"unsupported column type {sql_type!r} for Spark")


def _arrow_type(spec: str) -> pa.DataType:
    import pyarrow as pa

    if spec.startswith("decimal:"):
        _, precision, scale = spec.split(":")
        return pa.decimal128(int(precision), int(scale))
    return {
        "int8": pa.int8(),
        "int16": pa.int16(),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float32": pa.float32(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "date32": pa.date32(),
        "timestamp": pa.timestamp("us"),
        "timestamptz": pa.timestamp("us", tz="UTC"),
        "string": pa.string(),
        "binary": pa.binary(),
    }[spec]


# --- The process's local Spark ----------------------------------------------------------------


class _LocalSpark:
    """Spark allows one SparkContext per process: every ``spark://local`` backend shares it (refcounted)."""

    lock = threading.Lock()
    root: Any = None
    users = 0
    master: str | None = None
    warehouse: str | None = None

    @classmethod
    def acquire(cls, target: SparkTarget) -> Any:
        with cls.lock:
            if cls.root is None:
                cls.root, cls.warehouse = _start_local(target)
                cls.master = target.master
            elif target.master != cls.master or target.conf:
                log.warning(
                    "Spark is already running in this process as %s; reusing it (%s and its settings ignored)",
                    cls.master,
                    target.master,
                )
            cls.users += 1
            return cls.root

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users > 0 or cls.root is None:
                return
            root, warehouse, cls.root, cls.warehouse, cls.master = cls.root, cls.warehouse, None, None, None
        try:
            root.stop()
        except Exception as exc:  # stopping must not mask the caller's own outcome
            log.warning("stopping Spark failed: %s", exc)
        if warehouse:
            shutil.rmtree(warehouse, ignore_errors=True)


def _import_pyspark() -> None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise BackendError("Spark support is not installed", hint=INSTALL_HINT) from None


def _quiet_pyspark_loggers() -> None:
    """pyspark logs every SQL error (message included) at ERROR on its own handlers; we log it once, ourselves."""
    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)


def _start_local(target: SparkTarget) -> tuple[Any, str | None]:
    from pyspark.sql import SparkSession

    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise BackendError(START_FAILED, hint="Spark's local mode needs Java 17+ (java on PATH or JAVA_HOME)")
    warehouse = None
    conf = {
        "spark.app.name": "dpsql",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(max(1, target.cores)),
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.ansi.enabled": "true",  # errors, not silent NULLs, as PostgreSQL and DuckDB
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        **target.conf,
    }
    if conf["spark.driver.host"] == "127.0.0.1":
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # or the JVM resolves (and warns about) the hostname
    if "spark.sql.warehouse.dir" not in conf:  # not ./spark-warehouse in whatever directory we run from
        warehouse = tempfile.mkdtemp(prefix="dpsql-spark-")
        conf["spark.sql.warehouse.dir"] = warehouse
    builder = SparkSession.builder.master(target.master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        root = builder.getOrCreate()
        root.sparkContext.setLogLevel(os.environ.get("DPSQL_SPARK_LOG_LEVEL", "ERROR"))
    except Exception as exc:
        log.warning("cannot start local Spark %s: %s", target.master, str(exc)[:_LOG_LIMIT])
        if warehouse:
            shutil.rmtree(warehouse, ignore_errors=True)
        raise BackendError(START_FAILED, hint="Spark's local mode needs Java 17+ and pyspark 4") from None
    return root, warehouse


# --- The backend ------------------------------------------------------------------------------


#: SQL texts :meth:`SparkBackend.render` produced, kept with what running them needs (not parsed again).
_RENDERED_ENTRIES = 1024
_RENDERED_BYTES = 32 << 20


class SparkBackend(BackendBase):
    """Thread-safe: one Spark session per backend, each call tagged so a timeout cancels only its jobs."""

    schemes = ("spark", "sc")
    dialect = DIALECT
    #: Spark tables are files written by any job, and Spark keeps no cheap cluster-wide write counter:
    #: the stamp counts only writes through this object, so the result cache keeps Spark answers for a
    #: short window only (:data:`dpsql.cache.UNSEEN_WRITES_WINDOW`).
    sees_outside_writes = False
    #: No ``information_schema``: the curator's constraint and NOT NULL checks cannot run here (stored
    #: column types and table names come from Spark's own catalog instead).
    information_schema = False
    pg_roles = False

    def __init__(self, url: str, *, statement_timeout_ms: int | None = None) -> None:
        self.url = url
        self.statement_timeout_ms = statement_timeout_ms
        self.target = parse_url(url)
        _import_pyspark()
        _quiet_pyspark_loggers()
        self._lock = threading.Lock()
        self._views: set[str] = set()
        self._rendered: LRU[str, PreparedQuery] = LRU(_RENDERED_ENTRIES, _RENDERED_BYTES)
        self.data_version = 0  # writes through this object (scripts, loads)
        self._spark: Any = None
        self._closed = False
        self._local = self.target.connect is None
        if self._local:  # in-process: start now, so a missing Java fails at open
            root = _LocalSpark.acquire(self.target)
            try:
                self._spark = root.newSession()
                if self.target.database:
                    db = spark_ident(self.target.database)
                    self._spark.sql(f"CREATE DATABASE IF NOT EXISTS {db}")
                    self._spark.sql(f"USE {db}")
            except Exception as exc:
                _LocalSpark.release()
                log.warning("cannot open Spark session: %s", str(exc)[:_LOG_LIMIT])
                raise BackendError(START_FAILED) from None

    @classmethod
    def from_url(cls, url: str, *, statement_timeout_ms: int | None, pool_size: int, read_only: bool) -> Self:
        """Spark takes no lock at opening and runs nothing but checked SELECTs (:meth:`execute`), so
        ``read_only`` changes nothing; a session is not pooled."""
        return cls(url, statement_timeout_ms=statement_timeout_ms)

    def __repr__(self) -> str:
        return f"SparkBackend({redact(self.url)!r})"

    def identity(self) -> str:
        """A token of this object: a Spark URL does not tell which data it reads (a Connect server's
        catalog, a local session's warehouse), so answers are never shared with another process."""
        return self.object_identity()

    def data_stamp(self) -> str:
        """Writes through this object only (see :attr:`sees_outside_writes`)."""
        return str(self.data_version)

    def render(self, tree: exp.Expression, *, copy: bool = True) -> str:
        """Checked and fixed for Spark on the tree and generated once; :meth:`execute` then runs the
        text as rendered (while it is remembered) instead of parsing it again."""
        query = prepare_tree(tree.copy() if copy else tree)
        self._rendered.put(query.sql, query, len(query.sql))
        return query.sql

    def tables(self) -> list[str]:
        """Tables and views of the current database (this session's temporary views left out)."""
        spark = self._session()
        try:
            return sorted(t.name for t in spark.catalog.listTables() if not t.isTemporary)
        except Exception as exc:
            log_database_error("Spark catalog listing failed", exc)
            raise BackendError(QUERY_FAILED) from None

    def columns(self, table: str) -> dict[str, str] | None:
        """Column → Spark type name (``string``, ``bigint``…) of a policy source, read from its schema
        (analysis only, no job runs); the stored-type refusal applies on Spark as everywhere."""
        query = prepare_tree(exp.select("*").from_(exp.table_(table, quoted=True)))
        spark = self._session()
        try:
            self._register_files(spark, query.files)
            return dict(spark.sql(query.sql).dtypes) or None
        except Exception as exc:
            from pyspark.errors import AnalysisException

            log_database_error(f"Spark schema of {table} not readable", exc)
            if isinstance(exc, AnalysisException):  # no such table or path: absent, as on the other backends
                return None
            raise BackendError(QUERY_FAILED) from None

    def write_catalog(self, table: str) -> WriteCatalog | None:
        """Unknown: Spark's catalog does not say what a write would meet, so no INSERT is allowed."""
        return None

    def _session(self) -> Any:
        """The Spark session; a Connect one is created on first use (like the PostgreSQL pool)."""
        if self._closed:
            raise BackendError("the database backend is closed")
        if self._spark is not None:
            return self._spark
        with self._lock:
            if self._spark is None:
                from pyspark.sql.connect.session import SparkSession as ConnectSession

                try:
                    # The Connect class directly: the generic builder would flip pyspark into
                    # Connect mode for the whole process.
                    spark = ConnectSession(connection=self.url)
                    _fail_fast(spark)
                    spark.conf.set("spark.sql.session.timeZone", "UTC")
                    spark.conf.set("spark.sql.ansi.enabled", "true")
                except Exception as exc:
                    log.warning("cannot connect to Spark at %s: %s", redact(self.url), str(exc)[:_LOG_LIMIT])
                    raise BackendError(CONNECT_FAILED) from None
                self._spark = spark
        return self._spark

    def _register_files(self, spark: Any, files: dict[str, tuple[str, str]]) -> None:
        """Parquet/ORC sources become temporary views once (the file listing and schema are then cached)."""
        if files.keys() <= self._views:
            return
        with self._lock:
            for view, (fmt, path) in files.items():
                if view not in self._views:
                    spark.read.format(fmt).load(path).createOrReplaceTempView(view)
                    self._views.add(view)

    def _tagged(self, spark: Any) -> _Tag:
        return _Tag(spark, self.statement_timeout_ms)

    def execute(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One SELECT; grouped results are streamed partition by partition, not collected at once."""
        query = self._rendered.get(sql) or prepare_query(sql)
        spark = self._session()
        try:
            self._register_files(spark, query.files)
            with self._tagged(spark) as tag, cancellable(tag._interrupt):
                df = spark.sql(query.sql)
                names = list(df.columns)
                rows = df.collect() if query.one_row else df.toLocalIterator(prefetchPartitions=True)
                return names, normalize_rows(rows)
        except Error:  # BackendError of our own, or QueryCanceled from a client that gave up
            raise
        except Exception as exc:
            log_database_error("Spark query failed", exc)
            raise BackendError(QUERY_FAILED) from None

    def execute_script(self, sql: str) -> None:
        """DDL/loading statements, one at a time (Spark runs one per call): demo data, tests and
        randomized-response INSERTs."""
        self.data_version += 1
        spark = self._session()
        try:
            for statement in split_statements(sql):
                spark.sql(with_sources(statement))
        except BackendError:
            raise
        except Exception as exc:
            log_database_error("Spark script failed", exc)
            raise BackendError(QUERY_FAILED) from None

    def load_rows(
        self,
        table: str,
        columns: list[tuple[str, str]],
        rows: Iterable[tuple[Any, ...]],
        *,
        replace: bool = False,
    ) -> None:
        """Create a Parquet table, then append Arrow chunks (typed by the declared SQL types)."""
        import pyarrow as pa

        if not columns:
            raise BackendError("a table needs at least one column")
        self.data_version += 1
        target = spark_ident(table)
        types = [spark_column_type(sql_type) for _, sql_type in columns]
        defs = ", ".join(f"{spark_ident(name)} {ddl}" for (name, _), (ddl, _) in zip(columns, types, strict=True))
        schema = pa.schema([(f"c{i}", _arrow_type(spec)) for i, (_, spec) in enumerate(types)])
        spark = self._session()
        created = False
        try:
            if replace:
                spark.sql(f"DROP TABLE IF EXISTS {target}")
            spark.sql(f"CREATE TABLE {target} ({defs}) USING parquet")
            created = True
            for chunk in _chunks(rows):
                values = list(zip(*chunk, strict=True))
                if len(values) != len(columns):
                    raise ValueError(f"rows have {len(values)} values, the table {len(columns)} columns")
                arrays = [pa.array(v, type=t) for v, t in zip(values, schema.types, strict=True)]
                spark.createDataFrame(pa.Table.from_arrays(arrays, schema=schema)).write.insertInto(target)
        except Exception as exc:
            log_database_error(f"Spark load into {table} failed", exc)
            if created:
                try:
                    spark.sql(f"DROP TABLE IF EXISTS {target}")
                except Exception as drop_exc:
                    log.warning("dropping the half-loaded %s failed: %s", table, drop_exc)
            raise BackendError(QUERY_FAILED) from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            spark, self._spark = self._spark, None
        if self._local:
            _LocalSpark.release()
        elif spark is not None:
            try:
                spark.stop()
            except Exception as exc:
                log.warning("closing the Spark Connect session failed: %s", exc)


def _fail_fast(spark: Any) -> None:
    """Retry transient Connect errors for seconds, not pyspark's default ten minutes: a query waits on it."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    spark.client.set_retry_policies([DefaultPolicy(**CONNECT_RETRY)])  # type: ignore[arg-type]


class _Tag:
    """Tags the calling thread's Spark operations; after the timeout, interrupts exactly those."""

    def __init__(self, spark: Any, timeout_ms: int | None) -> None:
        self.spark = spark
        self.timeout_ms = timeout_ms
        self.tag = f"dpsql-{uuid.uuid4().hex}"
        self.timer: threading.Timer | None = None

    def __enter__(self) -> _Tag:
        self.spark.addTag(self.tag)
        if self.timeout_ms:
            self.timer = threading.Timer(self.timeout_ms / 1000, self._interrupt)
            self.timer.daemon = True
            self.timer.start()
        return self

    def _interrupt(self) -> None:
        try:
            self.spark.interruptTag(self.tag)
        except Exception as exc:
            log.warning("interrupting a Spark query failed: %s", exc)

    def __exit__(self, *exc_info: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.spark.removeTag(self.tag)


def _chunks(rows: Iterable[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, _LOAD_CHUNK)):
        yield chunk
