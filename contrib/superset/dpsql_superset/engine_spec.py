"""Superset engine spec for dpsql: PostgreSQL's, minus what makes Superset ask for raw rows.

dpsql answers every chart as a PostgreSQL server would, but only with differentially private
aggregates: raw rows never leave (42803), every answered statement is charged ε before its noisy
rows leave, and a statement that cannot return rows (``LIMIT 0``, a false WHERE) is answered from
the policy alone, for free. Superset's PostgreSQL spec works against it, except where Superset's
*own* habits need raw rows or waste budget. Each override below exists for one of those reasons:

- :meth:`get_column_description_limit_size` → 0. Superset learns a SQL (virtual) dataset's columns
  by running ``<dataset SQL> LIMIT 1`` (``get_columns_description``). Over a row-level dataset that
  is one raw row, refused for good, so the dataset gets no columns and none of its charts work;
  over an aggregate dataset it is a charged query. ``LIMIT 0`` gives the same cursor description
  (names and types), and dpsql answers it without touching data: free, and identical on two
  databases differing in one person (only the policy decides it). The adhoc-column type probe
  (``… WHERE false``) goes through the same function and gets ``LIMIT 0`` too.
- :meth:`select_star` lists the synced columns with ``LIMIT 0``. SQL Lab's data preview and the
  "SELECT *" it offers would be refused (42803): a ``SELECT *`` releases rows, and ``*`` would also
  name identifier columns. The explicit column list with ``LIMIT 0`` shows the table's shape, free.
  A SQL (virtual) dataset names no real table: its dataset payload gets ``SELECT * … LIMIT 0``
  instead of an HTTP 500 from the failed column lookup.
- ``_time_grain_expressions``: only the ``DATE_TRUNC`` units dpsql derives a public domain for
  (hour, day, week, month, quarter, year). PostgreSQL's second/minute grains and the 5/10/15/30
  minute ``FLOOR(EXTRACT(…))`` arithmetic are refused (0A000), so they are not offered at all.
- ``custom_errors`` and :meth:`parse_error_exception`: dpsql's refusals (53P01 budget exhausted,
  42803 raw rows, 0A000 unsupported shape, 54000 too many groups) become messages that say what to
  do in Superset; any other dpsql error shows its own message, DETAIL and HINT with its SQLSTATE.
  Superset shows a chart's failure from the exception's text, not from ``custom_errors`` (which only
  SQL Lab and the connection dialog use), so the same table rewrites the exception raised for a chart
  too. SQL Lab hands ``extract_errors`` the *text* of its own exception (``dpsql error: <SQLSTATE>:
  …``), not an exception, so the SQLSTATE is read from either. The messages are built from dpsql's
  message alone, which is itself a function of the query, the policy and budget figures, never of
  the data.
- ``supports_file_upload = False``: dpsql refuses every write (25006); CSV upload cannot work.
- :meth:`estimate_statement_cost`: SQL Lab's "estimate cost" runs ``EXPLAIN``, which dpsql answers
  for free with the ε, δ and mechanism the statement would really be charged and the ± it would get
  (ε = 0 and where from when it would be answered from released values: the result cache, a synopsis,
  earlier releases' cells; how much wider a synopsis's ± are); PostgreSQL's parser looked for
  ``cost=…`` and found nothing.
- :meth:`execute` and :meth:`handle_cursor`: dpsql says what each answer cost and how accurate it is
  in NOTICEs (``dpsql: charged ε=…; remaining ε=…``, ``dpsql: 95% CI half-widths: …``), which
  psycopg2 collects on ``connection.notices`` and Superset never reads. Superset 6.1 has no place in
  its UI for a successful statement's server messages (SQL Lab's status text is cleared on success;
  a chart shows only its rows), so the spec puts them where Superset keeps per-query facts: every
  statement's notices are logged through this module's logger (Superset's log: which database, what
  was charged), and a SQL Lab statement's are stored in its query's ``extra`` as ``dpsql_notices``
  (returned with the results by ``/api/v1/sqllab/execute/``, kept in Superset's ``query`` table). What a
  user *sees* is the ``?show_intervals=on`` URI switch (``<col>_ci95`` columns, see the dialect) and
  the free ``SELECT * FROM dpsql_budget`` in SQL Lab (ε spent and remaining). The notices
  are what dpsql sends every client: figures of the query, the policy, the budget and released
  values, never of the data beyond the released answer.

Kept from PostgreSQL on purpose (dpsql answers them): sub-queries and CTEs (a filter-only one is
inlined, an aggregate one is post-processed for free), joins with public tables, aliases in ORDER
BY, ORDER BY an aggregate not selected, ``TO_DATE``/``TO_TIMESTAMP`` time-range bounds (folded at
analysis), ``pg_backend_pid()`` for SQL Lab's query ids, ``SET search_path``.

Not fixable here: Explore's "Samples" pane and drill-to-detail send a ``COUNT(*)`` (charged, then
cached by dpsql) and a row-level query (refused, free); Superset gives an engine spec no hook to
turn them off. Remove the "can samples on Datasource" permission from the analysts' role instead.
"""

# Superset declares its spec settings as plain class attributes that subclasses replace (not ClassVar).
# ruff: noqa: RUF012

from __future__ import annotations

import logging
import re
from re import Pattern
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError
from sqlglot.dialects.dialect import Dialects
from superset.constants import TimeGrain
from superset.db_engine_specs.base import DatabaseCategory
from superset.db_engine_specs.exceptions import SupersetDBAPIError
from superset.db_engine_specs.postgres import PostgresEngineSpec
from superset.errors import SupersetErrorType
from superset.sql.parse import SQLGLOT_DIALECTS

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import Dialect
    from superset.models.core import Database
    from superset.models.sql_lab import Query
    from superset.sql.parse import Table
    from superset.superset_typing import ResultSetColumnType

# Superset parses and formats SQL per engine with sqlglot; "dpsql" is PostgreSQL's dialect. (The same
# as SQLGLOT_DIALECTS_EXTENSIONS = {"dpsql": Dialects.POSTGRES} in superset_config.py, done here so
# installing the package is enough. This module is imported whenever Superset resolves a spec.)
SQLGLOT_DIALECTS.setdefault("dpsql", Dialects.POSTGRES)

logger = logging.getLogger(__name__)

#: The query ``extra`` key a SQL Lab statement's dpsql NOTICEs are stored under.
NOTICES_KEY = "dpsql_notices"


def _notices_of(cursor: Any) -> list[str] | None:
    """The server messages psycopg2 collected on the cursor's connection (None: not psycopg2)."""
    notices = getattr(getattr(cursor, "connection", None), "notices", None)
    return notices if isinstance(notices, list) else None


class DpsqlRefusal(SupersetDBAPIError):
    """A dpsql refusal with the friendly text as message; the driver's error stays its ``__cause__``."""

    status = 400


def _refusal(text: str, cause: Exception) -> DpsqlRefusal:
    refusal = DpsqlRefusal(text)
    refusal.__cause__ = cause
    return refusal


def sqlstate_of(ex: object) -> tuple[str, str] | None:
    """(SQLSTATE, server's message with DETAIL/HINT) of a dpsql error, or None.

    ``ex`` is the psycopg2 error under Superset's and SQLAlchemy's wrappers (charts, the connection
    dialog), or *text*: SQL Lab reports a failed statement by calling ``extract_errors(str(ex))``
    on the message :meth:`DpsqlEngineSpec.extract_error_message` made, ``dpsql error: 53P01: …``.
    """
    if isinstance(ex, str):
        found = _CODED.match(ex.strip())
        return None if found is None else (found.group("code"), found.group("message"))
    seen: object = ex
    for _ in range(10):
        if not isinstance(seen, BaseException):
            return None
        code = getattr(seen, "pgcode", None)
        if code:
            return str(code), str(seen).strip()
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return None


#: Text made by extract_error_message (``dpsql error: <SQLSTATE>: <message>``), or without the prefix.
_CODED = re.compile(r"^(?:dpsql error: )?(?P<code>[0-9A-Z]{5}): (?P<message>.*)$", re.S)


BUDGET_EXHAUSTED = re.compile(r'^53P01: privacy budget exhausted for (?P<who>analyst|dataset) "(?P<name>[^"]*)"')
RAW_ROWS = re.compile(r"^42803: (?P<reason>[^\n]*)")
TOO_MANY_GROUPS = re.compile(r"^54000: GROUP BY key (?P<key>.*?) would release (?P<groups>\d+) groups")
NOT_SUPPORTED = re.compile(r"^0A000: (?P<reason>[^\n]*)")

#: SQLSTATE-prefixed dpsql messages (see DpsqlEngineSpec._extract_error_message) → what Superset shows.
DPSQL_ERRORS: dict[Pattern[str], tuple[str, SupersetErrorType, dict[str, Any]]] = {
    BUDGET_EXHAUSTED: (
        'The privacy budget of %(who)s "%(name)s" cannot cover this query, so dpsql did not run it and '
        "charged nothing (SQLSTATE 53P01). Ask the data curator for more budget, or lower the ε per "
        "query (?epsilon= in the dpsql:// URI).",
        SupersetErrorType.QUERY_SECURITY_ACCESS_ERROR,
        {},
    ),
    RAW_ROWS: (
        "dpsql releases aggregates only, never individual rows (SQLSTATE 42803: %(reason)s). Give "
        "the chart a metric (COUNT, SUM, AVG, …) and group by columns; for a distribution, use a "
        "bar chart over a bucket such as FLOOR(col / 10) * 10 instead of a histogram.",
        SupersetErrorType.QUERY_SECURITY_ACCESS_ERROR,
        {},
    ),
    TOO_MANY_GROUPS: (
        "This chart would have %(groups)s groups for %(key)s, more than dpsql releases in one "
        "answer (SQLSTATE 54000). Choose a coarser time grain or bucket, or narrow the time range.",
        SupersetErrorType.GENERIC_DB_ENGINE_ERROR,
        {},
    ),
    NOT_SUPPORTED: (
        "dpsql does not answer this query shape (SQLSTATE 0A000: %(reason)s). Simplify the chart: "
        "no series limit, simple metrics over declared columns, time grains from hour to year.",
        SupersetErrorType.GENERIC_DB_ENGINE_ERROR,
        {},
    ),
}


#: Any other dpsql error: its own message, DETAIL and HINT, with the SQLSTATE (the PostgreSQL-style error as is).
OTHER_ERROR = re.compile(r"^(?P<code>[0-9A-Z]{5}): (?P<message>.*?)\s*$", re.S)
OTHER: tuple[str, SupersetErrorType, dict[str, Any]] = (
    "dpsql: %(message)s (SQLSTATE %(code)s)",
    SupersetErrorType.GENERIC_DB_ENGINE_ERROR,
    {},
)


class DpsqlEngineSpec(PostgresEngineSpec):
    """``dpsql://`` databases: see the module docstring for why each override exists."""

    engine = "dpsql"
    engine_name = "dpsql (differential privacy)"
    engine_aliases: set[str] = set()  # never "postgresql": plain PostgreSQL keeps its own spec
    default_driver = "psycopg2"
    drivers = {"psycopg2": "psycopg2 (PostgreSQL wire protocol)"}
    sqlalchemy_uri_placeholder = "dpsql://analyst:password@host:6543/dataset?epsilon=0.5"
    metadata = {
        "description": "dpsql: differentially private SQL over DuckDB or PostgreSQL; answers aggregates only.",
        "categories": [DatabaseCategory.QUERY_ENGINES, DatabaseCategory.OPEN_SOURCE],
        "pypi_packages": ["dpsql-superset"],
        "connection_string": "dpsql://{username}:{password}@{host}:{port}/{database}",
        "default_port": 6543,
    }

    supports_file_upload = False
    # Supported by dpsql, stated so a reader need not check PostgreSQL's defaults.
    allows_subqueries = True
    allows_joins = True
    allows_alias_in_select = True
    allows_alias_in_orderby = True
    allows_hidden_orderby_agg = True
    allows_cte_in_subquery = True

    _time_grain_expressions = {
        None: "{col}",
        TimeGrain.HOUR: "DATE_TRUNC('hour', {col})",
        TimeGrain.DAY: "DATE_TRUNC('day', {col})",
        TimeGrain.WEEK: "DATE_TRUNC('week', {col})",
        TimeGrain.WEEK_STARTING_MONDAY: "DATE_TRUNC('week', {col})",  # PostgreSQL's weeks start on Monday
        TimeGrain.MONTH: "DATE_TRUNC('month', {col})",
        TimeGrain.QUARTER: "DATE_TRUNC('quarter', {col})",
        TimeGrain.YEAR: "DATE_TRUNC('year', {col})",
    }

    #: dpsql's refusals first, then PostgreSQL's connection and syntax messages, then any other
    #: SQLSTATE-coded error with its own text (never Superset's "'str' object has no attribute …").
    custom_errors: dict[Pattern[str], tuple[str, SupersetErrorType, dict[str, Any]]] = {
        **DPSQL_ERRORS,
        **PostgresEngineSpec.custom_errors,
        OTHER_ERROR: OTHER,
    }

    @classmethod
    def get_column_description_limit_size(cls) -> int:
        """``LIMIT 0``: column names and types without a row (free in dpsql; ``LIMIT 1`` is a raw row)."""
        return 0

    @classmethod
    def select_star(  # pylint: disable=too-many-arguments
        cls,
        database: Database,
        table: Table,
        dialect: Dialect,
        limit: int = 100,
        show_cols: bool = False,
        indent: bool = True,
        latest_partition: bool = True,
        cols: list[ResultSetColumnType] | None = None,
    ) -> str:
        """The table's columns, ``LIMIT 0``: ``SELECT *`` and any row limit > 0 would be refused (42803).

        The columns come from the catalog. A SQL (virtual) dataset is named like a table that does not
        exist: Superset's dataset payload (``SqlaTable.select_star``, asked with ``show_cols=False,
        latest_partition=False`` precisely so that nothing is inspected) must not fail then, or every
        Explore/dataset request of that dataset is an HTTP 500. Those callers get ``SELECT * … LIMIT 0``
        when the catalog has no such table (what PostgreSQL's spec writes, without the rows); SQL Lab's
        table preview (``latest_partition=True``) still gets ``NoSuchTableError``, which Superset's API
        turns into its 404 "Table not found".
        """
        if not cols:
            try:
                cols = database.get_columns(table)
            except SQLAlchemyError:
                if latest_partition or show_cols:
                    raise
                cols = []
        return super().select_star(
            database, table, dialect, limit=0, show_cols=bool(cols), indent=indent, latest_partition=False, cols=cols
        )

    @classmethod
    def _extract_error_message(cls, ex: Exception) -> str:
        """``<SQLSTATE>: <server message>`` for dpsql's errors, so ``custom_errors`` match on the code."""
        found = sqlstate_of(ex)
        if found is None:
            return super()._extract_error_message(ex)
        return f"{found[0]}: {found[1]}"

    @classmethod
    def parse_error_exception(cls, exception: Exception) -> Exception:
        """A dpsql error is raised with readable text (what a chart shows): the friendly message of a
        refusal listed in ``DPSQL_ERRORS``, else dpsql's own message, DETAIL and HINT with its SQLSTATE.
        The driver's error stays the ``__cause__``."""
        found = sqlstate_of(exception)
        if found is None:
            return exception
        raw = f"{found[0]}: {found[1]}"
        for regex, (message, _error_type, _extra) in DPSQL_ERRORS.items():
            if match := regex.search(raw):
                return _refusal(message % match.groupdict(), exception)
        if match := OTHER_ERROR.search(raw):
            return _refusal(OTHER[0] % match.groupdict(), exception)
        return exception

    @classmethod
    def execute(cls, cursor: Any, query: str, database: Database, **kwargs: Any) -> None:
        """PostgreSQL's execute, then the statement's dpsql NOTICEs logged (charge, intervals).

        The connection's notice list is emptied first, so what is read afterwards belongs to this
        statement alone (psycopg2 keeps the last 50 of a connection, whatever statement sent them).
        """
        notices = _notices_of(cursor)
        if notices is not None:
            del notices[:]
        super().execute(cursor, query, database, **kwargs)
        for notice in _notices_of(cursor) or []:
            logger.info("dpsql notice (database %s): %s", database.database_name, notice.strip())

    @classmethod
    def handle_cursor(cls, cursor: Any, query: Query) -> None:
        """SQL Lab: keep the statement's dpsql NOTICEs in the query's ``extra`` (``dpsql_notices``).

        Called right after :meth:`execute` on the same cursor; a script's statements add up in order.
        """
        super().handle_cursor(cursor, query)
        fresh = [n.strip() for n in _notices_of(cursor) or []]
        if fresh:
            query.set_extra_json_key(NOTICES_KEY, [*(query.extra.get(NOTICES_KEY) or []), *fresh])

    @classmethod
    def get_allow_cost_estimate(cls, extra: dict[str, Any]) -> bool:
        return True

    @classmethod
    def estimate_statement_cost(cls, database: Database, statement: str, cursor: Any) -> dict[str, Any]:
        """dpsql's ``EXPLAIN`` (free): the ε, δ and mechanism the statement would really be charged (0 when
        it would be answered from released values: then where from, and how much wider a synopsis's ± is)."""
        cursor.execute(f"EXPLAIN {statement}")
        plan = [str(row[0]) for row in cursor.fetchall()]
        head = re.search(r"mechanism=(\S+) epsilon=(\S+) delta=([^\s)]+)", plan[0] if plan else "")
        if head is None:
            return {"plan": " / ".join(line.strip() for line in plan[:3])}
        cost: dict[str, Any] = {"epsilon": head.group(2), "delta": head.group(3), "mechanism": head.group(1)}
        for line in plan[1:3]:
            label, _, text = line.strip().partition(": ")
            if label in ("Free", "Wider"):
                cost[label.lower()] = text
        intervals = [
            f"{m.group(1)} {m.group(2)}"
            for line in plan
            if (m := re.match(r"\s*Output (\S+): .*?\b(ci95=\S+|ci95 per row)", line))
        ]
        if intervals:
            cost["ci95"] = ", ".join(intervals)
        return cost
