"""Parsing and parameter binding: SQL text in, one sqlglot statement out.

Only PostgreSQL syntax is accepted (the dialect analysts' clients speak). Parameters
(``$1`` from the wire protocol, ``%s``/``%(name)s`` from DB-API) are replaced by typed
literals before analysis, so the analyzer only ever sees constants.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import ParseError, TokenError

from dpsql.errors import DataError, StatementTooComplex, SyntaxError_, UndefinedParameter

logging.getLogger("sqlglot").setLevel(logging.ERROR)

Params = Sequence[Any] | Mapping[str, Any] | None


@functools.cache
def dialect(name: str) -> Dialect:
    """One shared instance per sqlglot dialect (a dialect name is resolved to a new instance on every call)."""
    return Dialect.get_or_raise(name)


def parse_statement(sql: str) -> exp.Expression:
    """Parse exactly one statement; syntax errors become SQLSTATE 42601."""
    try:
        statements = [s for s in sqlglot.parse(sql, read=dialect("postgres")) if s is not None]
    except (ParseError, TokenError) as exc:
        raise _syntax_error(sql, exc) from None
    except RecursionError:
        raise too_complex() from None
    if not statements:
        raise SyntaxError_("empty query", hint="Send one SELECT statement.")
    if len(statements) > 1:
        raise SyntaxError_(
            "cannot insert multiple commands into a prepared statement",
            hint="dpsql runs one statement per query; send them one at a time.",
        )
    return statements[0]


_STATEMENT_KEYWORDS = frozenset(
    [
        "select",
        "with",
        "values",
        "table",
        "insert",
        "update",
        "delete",
        "merge",
        "create",
        "drop",
        "alter",
        "truncate",
        "copy",
        "set",
        "show",
        "reset",
        "begin",
        "start",
        "commit",
        "end",
        "rollback",
        "savepoint",
        "release",
        "explain",
        "analyze",
        "vacuum",
        "grant",
        "revoke",
        "prepare",
        "execute",
        "deallocate",
        "declare",
        "fetch",
        "close",
        "listen",
        "unlisten",
        "notify",
        "discard",
        "lock",
        "call",
        "do",
        "comment",
    ]
)


def too_complex() -> StatementTooComplex:
    return StatementTooComplex(
        "statement is too complex", hint="Nest fewer expressions; split the predicate into simpler queries."
    )


def _syntax_error(sql: str, exc: Exception) -> SyntaxError_:
    first_word = sql.lstrip().split(None, 1)[0] if sql.strip() else ""
    if first_word.isalpha() and first_word.lower() not in _STATEMENT_KEYWORDS:
        return SyntaxError_(f'syntax error at or near "{first_word}"', position=sql.index(first_word) + 1)
    errors = getattr(exc, "errors", None) or []
    first = errors[0] if errors else {}
    token = (first.get("highlight") or "").strip()
    line, col = first.get("line"), first.get("col")
    position = None
    if line and col:
        lines = sql.splitlines(keepends=True)
        position = sum(len(x) for x in lines[: line - 1]) + max(int(col) - len(token), 0) + 1
    where = f' at or near "{token}"' if token else " at end of input"
    return SyntaxError_(f"syntax error{where}", position=position)


def literal_for(value: Any) -> exp.Expression:
    """A sqlglot literal for a Python parameter value (as psycopg would adapt it)."""
    if value is None:
        return exp.Null()
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int | float | decimal.Decimal):
        if isinstance(value, float | decimal.Decimal) and not math.isfinite(value):
            raise DataError(f'parameter value out of range: "{value}"', sqlstate="22003")
        return exp.Literal.number(value) if value >= 0 else exp.Neg(this=exp.Literal.number(-value))
    if isinstance(value, dt.datetime):
        return exp.cast(exp.Literal.string(value.isoformat(sep=" ")), exp.DataType.Type.TIMESTAMP)
    if isinstance(value, dt.date):
        return exp.cast(exp.Literal.string(value.isoformat()), exp.DataType.Type.DATE)
    if isinstance(value, str):
        return exp.Literal.string(value)
    if isinstance(value, list | tuple):
        return exp.Tuple(expressions=[literal_for(v) for v in value])
    raise UndefinedParameter(f"cannot adapt parameter of type {type(value).__name__}")


def bind_parameters(tree: exp.Expression, params: Params) -> exp.Expression:
    """Replace ``$n``, ``%s`` and ``%(name)s`` placeholders with literals."""
    nodes = list(tree.find_all(exp.Parameter, exp.Placeholder))
    if not nodes:
        if params:
            raise UndefinedParameter(
                f"the query has no parameters but {len(params)} were supplied",
                hint="Use $1, %s or %(name)s placeholders.",
            )
        return tree
    tree = tree.copy()
    positional = iter(params) if isinstance(params, Sequence) and not isinstance(params, str) else None
    for node in tree.find_all(exp.Parameter, exp.Placeholder):
        node.replace(literal_for(_parameter_value(node, params, positional)))
    return tree


_MISSING = object()


def _parameter_value(node: exp.Expression, params: Params, positional: Any) -> Any:
    if isinstance(node, exp.Parameter):
        index = int(node.this.this) if isinstance(node.this, exp.Literal) else 0
        if not isinstance(params, Sequence) or not 1 <= index <= len(params):
            raise UndefinedParameter(f"there is no parameter ${index}")
        return params[index - 1]
    name = node.this.name if isinstance(node.this, exp.Expression) else (node.this or "")
    if name:
        if not isinstance(params, Mapping) or name not in params:
            raise UndefinedParameter(f'there is no parameter "%({name})s"')
        return params[name]
    value = next(positional, _MISSING) if positional is not None else _MISSING
    if value is _MISSING:
        raise UndefinedParameter("the query has more placeholders than parameters supplied")
    return value
