"""A declared column as (part of) a key, and a parenthesized key.

A text or boolean column keeps its declared domain; a number is clamped to its bounds (its
integers enumerated when few enough); a bare date or timestamp must go through DATE_TRUNC or
EXTRACT, and an unbounded number without a domain is refused, since its groups would be unbounded.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.expressions import bound
from dpsql.analyze.keys.base import MAX_DERIVED_GROUPS, KeyContext, KeyExpr, finite_domain
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType
from dpsql.policy import PG_TYPE_NAMES


def column(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """A column inside a key expression (a bare GROUP BY column is planned as a plain key instead)."""
    assert isinstance(node, exp.Column)
    qualified, policy = keys.resolve(node)
    domain = policy.release_domain()
    if policy.type in ("text", "boolean"):
        pg_type: PgType = PG_TYPE_NAMES[policy.type]
        return KeyExpr(
            qualified,
            pg_type,
            None if domain is None else finite_domain(node, domain, policy.nullable),
            policy.nullable,
        )
    if policy.type in ("date", "timestamp"):
        raise FeatureNotSupported(
            f"a bare {policy.type} column cannot be used inside a GROUP BY expression",
            hint="Wrap it in DATE_TRUNC or EXTRACT.",
        )
    if not policy.bounded and domain is None:
        raise FeatureNotSupported(
            f'column "{node.name}" has no declared bounds',
            hint=f'Declare lower/upper for "{node.name}" so expressions over it have a finite range.',
        )
    clamped = bound(node, keys.resolve, lambda p: p)
    pg_type = "bigint" if policy.type == "int" else "double precision"
    if domain is not None:
        values = [v for v in domain if v is not None]
        return KeyExpr(
            clamped.sql, pg_type, finite_domain(node, values, policy.nullable), policy.nullable, tiny=clamped.tiny
        )
    if policy.type == "int" and clamped.upper - clamped.lower + 1 <= MAX_DERIVED_GROUPS:
        every = range(int(clamped.lower), int(clamped.upper) + 1)
        return KeyExpr(clamped.sql, pg_type, finite_domain(node, every, policy.nullable), policy.nullable)
    return KeyExpr(clamped.sql, pg_type, None, policy.nullable, clamped.lower, clamped.upper, clamped.tiny)


def paren(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``(key)``: the inner key, parenthesized in SQL."""
    inner = keys.derive(node.this)
    return KeyExpr(exp.paren(inner.sql), inner.type, inner.values, inner.nullable, inner.lower, inner.upper,
                   inner.tiny)  # fmt: skip
