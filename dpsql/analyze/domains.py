"""GROUP BY expressions: their SQL over clamped columns and, when it is finite, their derived domain.

A key such as ``DATE_TRUNC('month', visit_date)`` has a finite set of possible values that follows
from the policy alone (the column's declared bounds): 60 months for 2020-01-01..2024-12-31. Such a
key is released exactly like a declared ``domain``: every value of the derived domain gets a row
(a noisy zero when nobody is in it), values outside it never appear, and no partition selection
(no δ) is needed. The domain is computed here, in Python, from the policy and the SQL text only,
never from data, so which rows are released cannot depend on any person.

The key is computed by the backend on columns **clamped to their bounds first** (as inside
aggregates, :mod:`dpsql.analyze.expressions`): a stored value outside the bounds (±infinity, NaN,
a huge number) lands in an edge bucket of the domain instead of creating a new group or failing.

Constant constraints of WHERE narrow the domain (:func:`narrow_policies`,
:mod:`dpsql.analyze.keys.narrow`). Keys whose domain is infinite or unknown (a float expression,
an unbounded column) are computed the same way and go through DP partition selection like
undeclared columns. A derived domain larger than :data:`MAX_DERIVED_GROUPS` is refused (54000).

Each key function is a handler in :mod:`dpsql.analyze.keys` registered in :data:`KEY_FUNCTIONS`,
the one table from sqlglot expression class to handler; any other class is refused (0A000), so a
key function is supported only once it has a handler that derives its domain from the policy.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.fold import truncate
from dpsql.analyze.keys import bins, casts, choices, columns, dates, numbers
from dpsql.analyze.keys.base import (
    MAX_DERIVED_GROUPS,
    CheckPredicate,
    Handler,
    KeyContext,
    KeyExpr,
    Resolve,
    literal_value,
)
from dpsql.analyze.keys.bins import date_bin
from dpsql.analyze.keys.narrow import narrow_policies
from dpsql.analyze.keys.numbers import width_bucket
from dpsql.errors import FeatureNotSupported

__all__ = [
    "KEY_FUNCTIONS",
    "MAX_DERIVED_GROUPS",
    "KeyExpr",
    "date_bin",
    "derive",
    "handler_for",
    "narrow_policies",
    "truncate",
    "width_bucket",
]

#: Every GROUP BY key function: sqlglot expression class → its handler. A node is handled by the entry
#: of the most specific class in its MRO (``exp.Predicate`` takes every comparison, ``exp.Cast`` TRY_CAST).
KEY_FUNCTIONS: dict[type[exp.Expr], Handler] = {
    exp.Paren: columns.paren,
    exp.Column: columns.column,
    exp.TimestampTrunc: dates.date_trunc,
    exp.DateTrunc: dates.date_trunc,
    exp.Extract: dates.extract,
    exp.DateBin: bins.date_bin_key,
    exp.Floor: numbers.rounded,
    exp.Ceil: numbers.rounded,
    exp.WidthBucket: numbers.width_bucket_key,
    exp.Neg: numbers.negate,
    exp.Add: numbers.arithmetic,
    exp.Sub: numbers.arithmetic,
    exp.Mul: numbers.arithmetic,
    exp.Div: numbers.arithmetic,
    exp.Cast: casts.cast,
    exp.Case: choices.case,
    exp.Coalesce: choices.coalesce,
    exp.Predicate: choices.predicate,
    exp.Connector: choices.predicate,
    exp.Not: choices.predicate,
}

_SUPPORTED = (
    "GROUP BY may use columns, DATE_TRUNC, EXTRACT, CASE with constant results, width_bucket, "
    "FLOOR/CEIL, arithmetic over bounded columns, COALESCE and predicates."
)


def handler_for(node: exp.Expr) -> Handler | None:
    """The handler registered for the most specific class of ``node`` (``None``: not a key function)."""
    for cls in type(node).__mro__:
        handler = KEY_FUNCTIONS.get(cls)
        if handler is not None:
            return handler
    return None


def derive(node: exp.Expression, resolve: Resolve, check_predicate: CheckPredicate) -> KeyExpr:
    """The SQL and derived domain of a GROUP BY expression, or a refusal naming what is not supported.

    ``resolve`` qualifies a column and gives its (WHERE-narrowed) policy; ``check_predicate`` checks a
    condition (CASE WHEN, boolean keys) as WHERE would.
    """
    return _dispatch(node, KeyContext(resolve, check_predicate, _dispatch))


def _dispatch(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    # before any handler: a constant, parenthesized or not (literal_value looks through parentheses), groups nothing
    if literal_value(node) is not exp.Expression:
        raise FeatureNotSupported("GROUP BY a constant is not supported", hint="Remove the constant from GROUP BY.")
    handler = handler_for(node)
    if handler is None:
        raise FeatureNotSupported(f"{node.key.upper()} is not supported in GROUP BY", hint=_SUPPORTED)
    return handler(node, keys)
