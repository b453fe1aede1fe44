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
from sqlglot.tokenizer_core import TokenType

from dpsql.errors import (
    NumericValueOutOfRange,
    ProgramLimitExceeded,
    StatementTooComplex,
    SyntaxError_,
    UndefinedParameter,
)

logging.getLogger("sqlglot").setLevel(logging.ERROR)

Params = Sequence[Any] | Mapping[str, Any] | None


@functools.cache
def dialect(name: str) -> Dialect:
    """One shared instance per sqlglot dialect (a dialect name is resolved to a new instance on every call)."""
    return Dialect.get_or_raise(name)


#: Longest statement text analysed (characters). Parsing is linear but not free, and it happens before
#: any charge: a cap keeps one client's statements from costing seconds of CPU (an IN list of 20,000
#: constants is ~120 kB).
MAX_STATEMENT_CHARS = 256 * 1024


def parse_statement(sql: str) -> exp.Expression:
    """Parse exactly one statement; syntax errors become SQLSTATE 42601."""
    if len(sql) > MAX_STATEMENT_CHARS:
        raise ProgramLimitExceeded(
            f"statement is too long ({len(sql)} characters; at most {MAX_STATEMENT_CHARS})",
            hint="Shorten the statement: fewer constants in IN lists, fewer aggregates.",
        )
    try:
        sql = number_placeholders(sql)
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
    statement = statements[0]
    assert isinstance(statement, exp.Expression)
    return statement


def skip_comments(sql: str) -> str:
    """``sql`` from its first token on: leading white space, ``-- …`` and (nested) ``/* … */`` comments
    dropped. ORMs and sqlcommenter prepend such comments; statements are classified after them."""
    i, n = 0, len(sql)
    while i < n:
        if sql[i].isspace():
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        else:
            break
    return sql[i:]


def number_placeholders(sql: str) -> str:
    """``%s`` and ``?`` rewritten as ``$1``, ``$2``, … in the order they stand in the text.

    Positional parameters must bind in source order. The parsed tree cannot give that order (a
    depth-first walk visits LIMIT before WHERE, a breadth-first one the outer AND before its left
    operand), so the placeholders are numbered on the token stream, before parsing; string literals
    and comments are tokens of their own and are left alone.
    """
    if "%" not in sql and "?" not in sql:
        return sql
    tokens = dialect("postgres").tokenize(sql)
    spans: list[tuple[int, int]] = []
    for i, token in enumerate(tokens):
        if token.token_type == TokenType.PLACEHOLDER and token.text == "?":
            spans.append((token.start, token.end))
        elif token.token_type == TokenType.MOD and i + 1 < len(tokens):
            following = tokens[i + 1]
            if following.text == "s" and following.start == token.end + 1 and following.token_type == TokenType.VAR:
                spans.append((token.start, following.end))
    if not spans:
        return sql
    if any(t.token_type == TokenType.PARAMETER for t in tokens):
        raise SyntaxError_("cannot mix $n placeholders with %s or ?", hint="Use one placeholder style per query.")
    parts, last = [], 0
    for n, (start, end) in enumerate(spans, 1):
        parts += [sql[last:start], f"${n}"]
        last = end + 1
    return "".join([*parts, sql[last:]])


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
            raise NumericValueOutOfRange(f'parameter value out of range: "{value}"')
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
    used = 0
    for node in list(tree.find_all(exp.Parameter, exp.Placeholder)):
        value, index = _parameter_value(node, params)
        used = max(used, index)
        node.replace(literal_for(value))
    if isinstance(params, Sequence) and not isinstance(params, str) and len(params) > used:
        raise UndefinedParameter(
            f"the query has {used} placeholder(s) but {len(params)} parameters were supplied",
            hint="Pass exactly one value per placeholder.",
        )
    return tree


def _parameter_value(node: exp.Expression, params: Params) -> tuple[Any, int]:
    """The value bound to one placeholder, and its 1-based position (0 for a named one)."""
    if isinstance(node, exp.Parameter):
        index = int(node.this.this) if isinstance(node.this, exp.Literal) else 0
        if not isinstance(params, Sequence) or isinstance(params, str) or not 1 <= index <= len(params):
            raise UndefinedParameter(
                f"there is no parameter ${index}",
                hint="The query has more placeholders than parameters supplied.",
            )
        return params[index - 1], index
    name = node.this.name if isinstance(node.this, exp.Expression) else (node.this or "")
    if not name or not isinstance(params, Mapping) or name not in params:
        raise UndefinedParameter(f'there is no parameter "%({name})s"')
    return params[name], 0


def params_key(params: Params) -> Any:
    """A hashable, order-independent key of bound parameters (plan and result caches)."""
    if params is None:
        return None
    if isinstance(params, dict):
        return tuple(sorted((k, repr(v)) for k, v in params.items()))
    return tuple(repr(v) for v in params)


def placeholder_value(pg_type: str) -> Any:
    """A stand-in value of a parameter's type: enough to plan a statement before it is bound."""
    return {"bigint": 0, "double precision": 0.0, "boolean": False, "date": dt.date(2000, 1, 1)}.get(pg_type, "")
