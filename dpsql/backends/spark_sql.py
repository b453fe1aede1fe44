"""Spark SQL as dpsql generates it: checked read-only, then made to compute what PostgreSQL/DuckDB compute.

Spark has no read-only transactions, so a query runs only as sqlglot's rendering of a tree that
:func:`prepare_tree` checked to be one SELECT (trees dpsql built are rendered once, by
:meth:`dpsql.backends.spark.SparkBackend.render`; other text is parsed first, :func:`prepare_query`).
The fixes:

* policy ``source:`` names: ``db.table`` / ``catalog.db.table`` become multi-part names and
  ``parquet:/path`` (or ``orc:``) a temporary view registered once per backend;
* ``EXTRACT(DOW …)`` is 0–6 from Sunday (Spark counts 1–7), ``ISODOW`` is Spark's ``DAYOFWEEK_ISO``;
* inside ``MD5(…)`` (the contribution-bounding row order) doubles are rendered as DuckDB does
  (Python's ``repr``: ``1e-05``, ``12345678.9``) rather than Java's ``1.0E-5`` / ``1.23456789E7``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokenizer_core import TokenType

from dpsql.backends.base import QUERY_FAILED, log_database_error
from dpsql.errors import BackendError, InsufficientPrivilege, ReadOnlyViolation

DIALECT = "spark"
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


@dataclass(frozen=True, slots=True)
class PreparedQuery:
    sql: str
    #: File sources to register as temporary views first: view name → (format, path).
    files: dict[str, tuple[str, str]]
    #: An aggregate without GROUP BY: one row, so collecting it at once is cheapest.
    one_row: bool


def prepare_query(sql: str) -> PreparedQuery:
    """SQL text dpsql did not render itself (a test, a script): parse it (Spark dialect), then
    :func:`prepare_tree`."""
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except sqlglot.errors.SqlglotError as exc:
        log_database_error("Spark query refused, unparsable", exc)
        raise BackendError(QUERY_FAILED) from None
    if len(statements) != 1:
        raise BackendError("the database backend runs exactly one statement per query")
    return prepare_tree(statements[0])


def prepare_tree(tree: exp.Expr) -> PreparedQuery:
    """Refuse all but a read-only SELECT, apply the Spark fixes (in place) and generate its SQL once.

    The text Spark runs is always sqlglot's rendering of a tree checked here, so no parser
    differential can smuggle a second statement or a write through.
    """
    if not isinstance(tree, exp.Query) or tree.find(*_NOT_READ_ONLY) is not None:
        raise ReadOnlyViolation("the Spark backend runs only SELECT statements")
    for func in tree.find_all(exp.Anonymous):
        if func.name.lower() in _FORBIDDEN_FUNCTIONS:
            raise InsufficientPrivilege(f"function {func.name} is not allowed")
    files = resolve_sources(tree)
    _postgres_date_parts(tree)
    _duckdb_double_text(tree)
    _rounding_integer_casts(tree)
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


#: Integer types a cast rounds to on PostgreSQL and DuckDB (Spark truncates toward zero).
_INTEGER_TYPES = (exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT)
#: Operand types a cast to an integer must round first.
_FRACTIONAL_TYPES = (exp.DataType.Type.DOUBLE, exp.DataType.Type.FLOAT, exp.DataType.Type.DECIMAL)


def _rounding_integer_casts(tree: exp.Expr) -> None:
    """``CAST(x AS INTEGER)`` of a fractional ``x`` rounds half to even on PostgreSQL and DuckDB (12.7 → 13,
    12.5 → 12) but truncates on Spark (12): ``BROUND`` (half to even) first, so a SUM of such casts is the
    same sum on every backend. Operands dpsql generates are casts to DOUBLE (clamped values); others are
    left as they are."""
    for cast in list(tree.find_all(exp.Cast)):
        operand = cast.this
        if (
            cast.to.is_type(*_INTEGER_TYPES)
            and isinstance(operand, exp.Cast)
            and operand.to.is_type(*_FRACTIONAL_TYPES)
        ):
            operand.replace(exp.Anonymous(this="BROUND", expressions=[operand.copy()]))


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


def with_sources(statement: str) -> str:
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
