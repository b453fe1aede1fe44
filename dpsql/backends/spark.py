"""Apache Spark SQL backend: an in-process local session or a cluster through Spark Connect.

``spark://local[N][/database][?spark.conf=value&…]`` starts (once per process: Spark allows one
SparkContext) a local session for development and tests; every backend gets its own
``newSession()`` so temporary views and the current database stay separate.
``sc://host:port[/;token=…]`` talks to a Spark Connect server (``start-connect-server.sh``).

Spark has no read-only transactions, so :func:`prepare_query` parses each statement with sqlglot,
refuses anything but one SELECT and runs the SQL *sqlglot* regenerated (no parser differential can
smuggle a second statement through). It also makes Spark compute what PostgreSQL/DuckDB compute:

* policy ``source:`` names: ``db.table`` / ``catalog.db.table`` become multi-part names and
  ``parquet:/path`` (or ``orc:``) a temporary view registered once per backend;
* ``EXTRACT(DOW …)`` is 0–6 from Sunday (Spark counts 1–7), ``ISODOW`` is Spark's ``DAYOFWEEK_ISO``;
* inside ``MD5(…)`` (the contribution-bounding row order) doubles are rendered as DuckDB does
  (Python's ``repr``: ``1e-05``, ``12345678.9``) rather than Java's ``1.0E-5`` / ``1.23456789E7``.

pyspark is optional (``pip install 'dpsql[spark]'``) and only imported when a Spark URL is opened.
"""

from __future__ import annotations

import functools
import hashlib
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
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import TokenType

from dpsql.backends import (
    _SQL_TYPE,
    QUERY_FAILED,
    BackendDefaults,
    cancellable,
    log_database_error,
    normalize_rows,
    redact_url,
)
from dpsql.errors import BackendError, Error, InsufficientPrivilege, ReadOnlyViolation

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

DIALECT = "spark"
INSTALL_HINT = "pip install 'dpsql[spark]' (pyspark 4 with Spark Connect; local mode needs Java 17+)"
START_FAILED = "could not start Spark"
CONNECT_FAILED = "could not connect to Spark"
_LOAD_CHUNK = 200_000
#: Spark Connect retries: 0.1 + 0.3 + 0.9 + 2.7 s of back-off, then the query fails.
CONNECT_RETRY = {"max_retries": 4, "initial_backoff": 100, "backoff_multiplier": 3.0, "max_backoff": 5000}
_LOG_LIMIT = 4000
_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)(,\d+)?\])?$")
_DATABASE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Self-describing file formats a policy ``source:`` may name as ``format:path``.
FILE_FORMATS = ("parquet", "orc")
#: Spark functions that call arbitrary JVM methods: never part of a query dpsql generates.
_FORBIDDEN_FUNCTIONS = {"reflect", "java_method", "try_reflect"}
_NOT_READ_ONLY = (
    exp.Insert,
    exp.Update,
    exp.Delete,
    exp.Merge,
    exp.Create,
    exp.Drop,
    exp.Alter,
    exp.Command,
    exp.Set,
    exp.Use,
    exp.Cache,
    exp.Uncache,
    exp.Refresh,
    exp.LoadData,
)


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


# --- Queries: refuse, then make Spark compute what PostgreSQL/DuckDB compute -------------------


@dataclass(frozen=True, slots=True)
class PreparedQuery:
    sql: str
    #: File sources to register as temporary views first: view name → (format, path).
    files: dict[str, tuple[str, str]]
    #: An aggregate without GROUP BY: one row, so collecting it at once is cheapest.
    one_row: bool


def prepare_query(sql: str) -> PreparedQuery:
    """Parse (Spark dialect), refuse all but one read-only SELECT, apply the Spark fixes."""
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except sqlglot.errors.SqlglotError as exc:
        log_database_error("Spark query refused, unparsable", exc)
        raise BackendError(QUERY_FAILED) from None
    if len(statements) != 1:
        raise BackendError("the database backend runs exactly one statement per query")
    tree = statements[0]
    if not isinstance(tree, exp.Query) or tree.find(*_NOT_READ_ONLY) is not None:
        raise ReadOnlyViolation("the Spark backend runs only SELECT statements")
    for func in tree.find_all(exp.Anonymous):
        if func.name.lower() in _FORBIDDEN_FUNCTIONS:
            raise InsufficientPrivilege(f"function {func.name} is not allowed")
    files = resolve_sources(tree)
    _postgres_date_parts(tree)
    _duckdb_double_text(tree)
    one_row = (
        isinstance(tree, exp.Select)
        and not tree.args.get("group")
        and not tree.args.get("limit")
        and not tree.args.get("offset")
        and bool(tree.expressions)
        and all(p.find(exp.AggFunc) is not None for p in tree.expressions)
    )
    return PreparedQuery(tree.sql(dialect=DIALECT), files, one_row)


def resolve_sources(tree: exp.Expr) -> dict[str, tuple[str, str]]:
    """Policy ``source:`` names arrive as one quoted identifier; give them their Spark meaning.

    ``db.table``/``catalog.db.table`` → a multi-part name; ``parquet:/path`` → a temporary view
    (returned, to be registered) named after the path. Plain names are left alone.
    """
    files: dict[str, tuple[str, str]] = {}
    for table in tree.find_all(exp.Table):
        if table.args.get("db") or not isinstance(table.this, exp.Identifier):
            continue
        name = table.name
        fmt, sep, path = name.partition(":")
        if sep and fmt.lower() in FILE_FORMATS and path:
            view = f"dpsql_{fmt.lower()}_{hashlib.sha256(path.encode()).hexdigest()[:16]}"
            files[view] = (fmt.lower(), path)
            table.set("this", exp.to_identifier(view, quoted=True))
        elif "." in name:
            parts = name.split(".")
            if len(parts) > 3 or not all(parts):
                raise BackendError(f"invalid Spark table name {name!r}", hint="use table, db.table or catalog.db.table")
            idents = [exp.to_identifier(p, quoted=True) for p in parts]
            table.set("this", idents[-1])
            table.set("db", idents[-2])
            if len(idents) == 3:
                table.set("catalog", idents[0])
    return files


def _postgres_date_parts(tree: exp.Expr) -> None:
    """PostgreSQL's DOW is 0–6 from Sunday, Spark's 1–7; Spark spells ISODOW ``DAYOFWEEK_ISO``."""
    for node in list(tree.find_all(exp.Extract)):
        part = node.this.name.upper() if isinstance(node.this, exp.Var | exp.Identifier) else ""
        if part == "ISODOW":
            node.set("this", exp.var("DAYOFWEEK_ISO"))
        elif part in ("DOW", "DAYOFWEEK"):
            node.set("this", exp.var("DAYOFWEEK"))
            node.replace(exp.paren(exp.Sub(this=node.copy(), expression=exp.Literal.number(1)), copy=False))


_DOUBLE_TEXT_TEMPLATE = """
CASE WHEN TYPEOF(__v) NOT IN ('double', 'float') THEN CAST(__v AS STRING)
WHEN CAST(__v AS STRING) LIKE '%E%' THEN (LAYOUT)
WHEN CAST(__v AS STRING) = 'NaN' THEN 'nan'
WHEN CAST(__v AS STRING) = 'Infinity' THEN 'inf'
WHEN CAST(__v AS STRING) = '-Infinity' THEN '-inf'
ELSE CAST(__v AS STRING) END
"""  # flat, so Spark computes CAST(__v AS STRING) once per row (it is in the first condition and every branch)


@functools.cache
def _double_text_template() -> exp.Expression:
    """Java's ``Double.toString`` re-laid out as Python's ``repr`` (what DuckDB prints).

    Java writes ``d.fffE±n`` outside [1e-3, 1e7) and positional otherwise; repr is positional for
    exponents in [-4, 16) and ``d.fffe±nn`` beyond. Digits are the same (shortest round-trip on
    Java 19+; Java 17 very rarely prints one digit more).
    """
    s = "CAST(__v AS STRING)"
    pattern = "'^(-?)([0-9])[.]([0-9]+)E(-?[0-9]+)$'"
    sign = f"REGEXP_EXTRACT({s}, {pattern}, 1)"
    frac = f"REGEXP_EXTRACT({s}, {pattern}, 3)"
    digits = f"(REGEXP_EXTRACT({s}, {pattern}, 2) || CASE WHEN {frac} = '0' THEN '' ELSE {frac} END)"
    e = f"CAST(REGEXP_EXTRACT({s}, {pattern}, 4) AS INT)"
    scientific = (
        f"{sign} || REGEXP_EXTRACT({s}, {pattern}, 2) || CASE WHEN {frac} = '0' THEN '' ELSE '.' || {frac} END"
        f" || 'e' || CASE WHEN {e} < 0 THEN '-' ELSE '+' END"
        f" || CASE WHEN ABS({e}) < 10 THEN '0' ELSE '' END || CAST(ABS({e}) AS STRING)"
    )
    layout = (
        f"CASE WHEN {e} < -4 OR {e} >= 16 THEN {scientific}"
        f" WHEN {e} < 0 THEN {sign} || '0.' || REPEAT('0', -{e} - 1) || {digits}"
        f" WHEN LENGTH({digits}) <= {e} + 1 THEN {sign} || {digits} || REPEAT('0', {e} + 1 - LENGTH({digits})) || '.0'"
        f" ELSE {sign} || SUBSTRING({digits}, 1, {e} + 1) || '.' || SUBSTRING({digits}, {e} + 2) END"
    )
    template = sqlglot.parse_one(_DOUBLE_TEXT_TEMPLATE.replace("LAYOUT", layout), read=DIALECT)
    assert isinstance(template, exp.Expression)
    return template


def _duckdb_double_text(tree: exp.Expr) -> None:
    """Inside MD5 (the row order of contribution bounding) render doubles like DuckDB.

    The order must not depend on the backend, or Spark would keep different rows of a person
    than DuckDB. ``TYPEOF`` is constant-folded, so other types pay nothing.
    """
    for md5 in list(tree.find_all(exp.MD5)):
        for cast in list(md5.find_all(exp.Cast)):
            if not cast.to.is_type(exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR):
                continue
            value = cast.this
            replacement = _double_text_template().copy()
            for placeholder in list(replacement.find_all(exp.Column)):
                if placeholder.name == "__v":
                    placeholder.replace(value.copy())
            cast.replace(replacement)


def split_statements(sql: str) -> list[str]:
    """Split a script on top-level semicolons (string literals and comments respected), text unchanged."""
    try:
        tokens = Dialect.get_or_raise(DIALECT).tokenize(sql)
    except sqlglot.errors.SqlglotError:
        return [sql.strip()] if sql.strip() else []
    parts, start = [], 0
    for token in tokens:
        if token.token_type == TokenType.SEMICOLON:
            parts.append(sql[start : token.start])
            start = token.end + 1
    parts.append(sql[start:])
    return [p.strip() for p in parts if p.strip()]


# --- Types for load_rows ----------------------------------------------------------------------


def spark_column_type(sql_type: str) -> tuple[str, str]:
    """(Spark DDL type, Arrow type spec) for a SQL column type as the demo/test loaders write it."""
    if not _SQL_TYPE.match(sql_type.strip()):
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


class SparkBackend(BackendDefaults):
    """Thread-safe: one Spark session per backend, each call tagged so a timeout cancels only its jobs."""

    dialect = DIALECT

    def __init__(self, url: str, *, statement_timeout_ms: int | None = None) -> None:
        self.url = url
        self.statement_timeout_ms = statement_timeout_ms
        self.target = parse_url(url)
        _import_pyspark()
        _quiet_pyspark_loggers()
        self._lock = threading.Lock()
        self._views: set[str] = set()
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

    def __repr__(self) -> str:
        return f"SparkBackend({redact(self.url)!r})"

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
        query = prepare_query(sql)
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
        """DDL/loading statements, one at a time (Spark runs one per call); demo data and tests only."""
        spark = self._session()
        try:
            for statement in split_statements(sql):
                spark.sql(_with_sources(statement))
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


def _with_sources(statement: str) -> str:
    """A script statement with dotted policy source names resolved (the randomized-response INSERT)."""
    if "." not in statement:
        return statement
    try:
        tree = sqlglot.parse_one(statement, read=DIALECT)
    except sqlglot.errors.SqlglotError:
        return statement
    if not isinstance(tree, exp.Insert):
        return statement
    before = tree.sql(dialect=DIALECT)
    if resolve_sources(tree):
        raise BackendError("cannot write to a file source")
    after = tree.sql(dialect=DIALECT)
    return after if after != before else statement
