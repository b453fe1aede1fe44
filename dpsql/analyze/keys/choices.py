"""Keys that choose among given values: CASE with constant results, COALESCE, and predicates.

Their domain is the constants written in the query (plus the operands' domains for COALESCE, and
false/true/NULL for a predicate): it follows from the SQL and the policy alone.
"""

from __future__ import annotations

import functools

from sqlglot import exp

from dpsql.analyze.expressions import _exponent, checkpoint
from dpsql.analyze.keys.base import KeyContext, KeyExpr, finite_domain, literal_type, literal_value, promote
from dpsql.errors import DatatypeMismatch, FeatureNotSupported
from dpsql.pgtypes import PgType
from dpsql.policy import Scalar


def case(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``CASE [subject] WHEN … THEN <constant> … [ELSE <constant>] END``: its constants (NULL without ELSE)."""
    subject = node.this
    result = exp.Case()
    values: list[Scalar | None] = []
    for when in node.args.get("ifs") or []:
        checkpoint()
        condition = when.this if subject is None else exp.EQ(this=subject.copy(), expression=when.this.copy())
        values.append(_case_literal(when.args["true"]))
        # in place (Case.when copies the whole CASE by default: quadratic in the branches)
        result.when(keys.check_predicate(condition).copy(), when.args["true"].copy(), copy=False)
    default = node.args.get("default")
    values.append(None if default is None else _case_literal(default))
    if default is not None:
        result.else_(default.copy(), copy=False)
    present = [v for v in values if v is not None]
    pg_types = {type(v) for v in present}
    if pg_types <= {str}:
        pg_type: PgType = "text"
    elif pg_types <= {bool}:
        pg_type = "boolean"
    elif pg_types <= {int}:
        pg_type = "integer" if all(literal_type(v) == "integer" for v in present) else "bigint"  # type: ignore[arg-type]
    elif pg_types <= {int, float}:
        pg_type = "numeric"  # PostgreSQL types 2.5 as numeric; computed as a double
        present = [float(v) for v in present]  # type: ignore[arg-type]
        result = exp.cast(result, exp.DataType.Type.DOUBLE)  # type: ignore[assignment]
    else:
        raise DatatypeMismatch("CASE types text and numeric cannot be matched")
    nullable = None in values
    tiny = min((_exponent(float(v)) for v in present if isinstance(v, float)), default=0)
    return KeyExpr(result, pg_type, finite_domain(node, present, nullable), nullable, tiny=tiny)


def _case_literal(node: exp.Expression) -> Scalar | None:
    value = literal_value(node)
    if value is exp.Expression:
        raise FeatureNotSupported(
            "CASE results in GROUP BY must be constants", hint="Write CASE WHEN <condition> THEN '<label>' ... END."
        )
    return value  # type: ignore[return-value]


def coalesce(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``COALESCE(a, b, …)``: the union of the arguments' domains up to the first that is never NULL."""
    parts: list[KeyExpr] = []
    for argument in [node.this, *node.expressions]:
        constant = literal_value(argument)
        if constant is exp.Expression:
            parts.append(keys.derive(argument))
        elif constant is None:
            parts.append(KeyExpr(exp.Null(), "text", (None,), True))
        else:
            pg_type: PgType = "text" if isinstance(constant, str) else "boolean" if isinstance(constant, bool) else (
                literal_type(constant))  # type: ignore[arg-type]  # fmt: skip
            tiny = _exponent(constant) if isinstance(constant, float) else 0
            parts.append(KeyExpr(argument.copy(), pg_type, (constant,), False, tiny=tiny))  # type: ignore[arg-type]
    pg_types = {p.type for p in parts if p.values != (None,)}
    numeric = pg_types <= {"bigint", "integer", "smallint", "double precision", "numeric"}
    if len(pg_types) > 1 and not numeric:
        raise DatatypeMismatch(f"COALESCE types {' and '.join(sorted(pg_types))} cannot be matched")
    pg_type = functools.reduce(promote, sorted(pg_types)) if len(pg_types) > 1 else (
        next(iter(pg_types)) if pg_types else "text")  # fmt: skip
    values: list[Scalar] = []
    finite = True
    nullable = True
    for part in parts:
        if part.values is None:
            finite = False
        else:
            values.extend(float(v) if pg_type == "double precision" else v for v in part.values if v is not None)  # type: ignore[arg-type]
        if not part.nullable:
            nullable = False
            break
    sql = exp.Coalesce(this=parts[0].sql, expressions=[p.sql for p in parts[1:]])
    tiny = min(p.tiny for p in parts)
    if not finite:
        return KeyExpr(sql, pg_type, None, nullable, tiny=tiny)
    return KeyExpr(sql, pg_type, finite_domain(node, values, nullable), nullable, tiny=tiny)


def predicate(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """A comparison, AND/OR or NOT as a boolean key: false, true, and NULL when a column can be NULL
    (``IS`` never gives NULL)."""
    checked = keys.check_predicate(node)
    columns = [keys.resolve(c)[1] for c in node.find_all(exp.Column)]
    nullable = any(p.nullable for p in columns) and not isinstance(node, exp.Is)
    return KeyExpr(checked, "boolean", (False, True, None) if nullable else (False, True), nullable)
