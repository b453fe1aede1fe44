"""The series limit: a DP query filtered by the keys another DP query releases (adaptive composition).

The privacy argument and design notes: docs/internals.md, section dpsql/outer/series.py.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.accountant import Cost
from dpsql.analyze import analyze_tree
from dpsql.analyze.parse import Params, parse_statement
from dpsql.errors import FeatureNotSupported, InternalError, SyntaxError_
from dpsql.ledger import Charge
from dpsql.outer.explain import CompositeExplanation, SubPlan
from dpsql.outer.host import Host
from dpsql.outer.shapes import own_aggregates, pg_name
from dpsql.plan import Plan
from dpsql.plan.sources import ident_name
from dpsql.prepared import Prepared
from dpsql.release.accuracy import confidence as confidence_level
from dpsql.session import OutputColumn, Result, Session
from dpsql.step import Notice, Part, Step

__all__ = ["Series", "answer_series", "describe_series", "explain_series", "split_series"]

#: A value of each released key type standing in for the real list while the outer is priced.
_STAND_IN: dict[str, object] = {
    "bigint": 0,
    "integer": 0,
    "smallint": 0,
    "double precision": 0.0,
    "numeric": decimal.Decimal(0),
    "date": dt.date(2000, 1, 1),
    "timestamp": dt.datetime(2000, 1, 1),
    "timestamp with time zone": dt.datetime(2000, 1, 1),
    "boolean": True,
}


@dataclass(frozen=True, slots=True)
class Series:
    """A series-limited statement: the inner DP query and the outer one, before its keys are known."""

    #: The sub-query releasing the series keys (PostgreSQL syntax).
    inner: str
    #: The outer query's key expressions, each matched to the inner output column at ``positions``.
    keys: tuple[exp.Expr, ...]
    positions: tuple[int, ...]
    #: The outer query without the sub-query (the key filter is added by :meth:`outer_sql`).
    template: exp.Select
    #: The sub-query's name in the statement (for messages).
    name: str

    def outer_sql(self, values: Sequence[tuple[Any, ...]]) -> str:
        """The outer query restricted to the key tuples ``values`` (non-empty, no NULL: a NULL key
        never satisfies the join's equality)."""
        select = self.template.copy()
        conditions: list[exp.Expr] = []
        for i, key in enumerate(self.keys):
            column = list(dict.fromkeys(v[i] for v in values))
            conditions.append(exp.In(this=key.copy(), expressions=[_literal(v) for v in column]))
        if len(self.keys) > 1:  # the pairs themselves; each IN above narrows one key's domain
            pairs = [
                exp.and_(*(exp.EQ(this=k.copy(), expression=_literal(v)) for k, v in zip(self.keys, t, strict=True)))
                for t in values
            ]
            conditions.append(exp.paren(_balanced_or(pairs), copy=False))
        return select.where(*conditions, copy=False).sql(dialect="postgres")


def _balanced_or(items: Sequence[exp.Expr]) -> exp.Expr:
    """OR of ``items`` as a balanced tree (a chain of hundreds of ORs would be too deep to analyse)."""
    if len(items) == 1:
        return items[0]
    middle = len(items) // 2
    return exp.or_(_balanced_or(items[:middle]), _balanced_or(items[middle:]))


def _literal(value: object) -> exp.Expr:
    """A released key as a SQL constant of its type."""
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int | decimal.Decimal) or (isinstance(value, float) and math.isfinite(value)):
        text = str(value)
        return exp.Neg(this=exp.Literal.number(text[1:])) if text.startswith("-") else exp.Literal.number(text)
    if isinstance(value, float):
        return exp.cast(exp.Literal.string(str(value)), "DOUBLE PRECISION")
    if isinstance(value, dt.datetime):
        return exp.cast(exp.Literal.string(value.isoformat(sep=" ")), "TIMESTAMP")
    if isinstance(value, dt.date):
        return exp.cast(exp.Literal.string(value.isoformat()), "DATE")
    return exp.Literal.string(str(value))


def _conjuncts(node: exp.Expr | None) -> list[exp.Expr]:
    if node is None:
        return []
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    if isinstance(node, exp.Paren) and isinstance(node.this, exp.And):
        return _conjuncts(node.this)
    return [node]


def _ranking(node: exp.Expr) -> bool:
    """A sub-query that aggregates (the ranking of the series)."""
    return isinstance(node, exp.Subquery) and isinstance(node.this, exp.Select) and own_aggregates(node.this)


def split_series(tree: exp.Expr) -> Series | None:
    """The series-limit parts of ``tree`` (parameters bound), None when it has no such shape (the engine
    then answers or refuses it as before). Decided from the SQL alone."""
    if not isinstance(tree, exp.Select) or not own_aggregates(tree):
        return None
    joins = [j for j in tree.args.get("joins") or [] if _ranking(j.this)]
    where = tree.args.get("where")
    conjuncts = _conjuncts(where.this if where is not None else None)
    tests = [c for c in conjuncts if isinstance(c, exp.In) and _ranking(c.args.get("query") or exp.Null())]
    if len(joins) + len(tests) != 1:
        return None
    if tests:
        (test,) = tests
        inner = test.args["query"].this
        if len(inner.expressions) != 1:
            return None  # PostgreSQL refuses it too: "subquery has too many columns"
        template = tree.copy()
        rest = [c.copy() for c in conjuncts if c is not test]
        template.set("where", exp.Where(this=exp.and_(*rest)) if rest else None)
        return Series(inner.sql(dialect="postgres"), (test.this.copy(),), (0,), template, "IN (SELECT …)")
    (join,) = joins
    sub = join.this
    name = sub.alias_or_name
    if join.side or join.kind not in ("", "INNER") or join.args.get("using"):
        return None
    inner = sub.this
    names = [pg_name(p).lower() for p in inner.expressions]

    def position(column: exp.Expr) -> int | None:
        if not isinstance(column, exp.Column):
            return None
        if column.table and column.table != name:
            return None
        found = ident_name(column.this).lower()
        if found not in names:
            if column.table:
                return -1
            return None
        return names.index(found)

    refused = FeatureNotSupported(
        f'the series-limit sub-query "{name}" can only be joined by equality of its columns (ON key = {name}.column)',
        hint="Each condition of the ON clause must compare a key of the outer query with a column of the sub-query.",
    )
    keys: list[exp.Expr] = []
    positions: list[int] = []
    for condition in _conjuncts(join.args.get("on")):
        if not isinstance(condition, exp.EQ):
            raise refused
        left, right = position(condition.this), position(condition.expression)
        if (left is None) == (right is None) or -1 in (left, right):
            raise refused
        key, at = (condition.expression, left) if left is not None else (condition.this, right)
        assert at is not None
        if any(position(c) is not None for c in key.find_all(exp.Column)):
            raise refused
        keys.append(key.copy())
        positions.append(at)
    if not keys:
        raise refused
    template = tree.copy()
    template.set("joins", [j.copy() for j in tree.args["joins"] if j is not join] or None)
    for column in template.find_all(exp.Column):
        if column.table == name:
            raise FeatureNotSupported(
                f'columns of the series-limit sub-query "{name}" can only be used in its ON condition',
                hint="The sub-query chooses which series are shown; select the outer query's own columns.",
            )
    return Series(inner.sql(dialect="postgres"), tuple(keys), tuple(positions), template, name)


def _stand_in(inner: Plan, series: Series) -> list[tuple[Any, ...]]:
    """One key tuple of the inner's key types (a sub-query with fewer columns: 42601, as PostgreSQL)."""
    if max(series.positions) >= len(inner.outputs):
        raise SyntaxError_("subquery has too few columns")
    types = [inner.outputs[i].column.type for i in series.positions]
    return [tuple(_STAND_IN.get(t, "") for t in types)]


def describe_series(engine: Host, series: Series) -> list[OutputColumn]:
    """The outer query's columns, from the SQL and the policy alone (nothing run or charged)."""
    inner = analyze_tree(parse_statement(series.inner), engine.policy)
    outer = analyze_tree(parse_statement(series.outer_sql(_stand_in(inner, series))), engine.policy)
    return [o.column for o in outer.outputs]


def _keys(rows: list[tuple[Any, ...]], series: Series) -> list[tuple[Any, ...]]:
    """The distinct released key tuples, in release order, without NULLs (they never join)."""
    found = (tuple(r[i] for i in series.positions) for r in rows)
    return list(dict.fromkeys(t for t in found if all(v is not None for v in t)))


def _only_listed(result: Result, series: Series, keys: list[tuple[Any, ...]], outer: Prepared) -> None:
    """Drop the rows of key combinations not in the list (several keys: their domains' product is
    released, the pairs outside the list being noisy zeros). Post-processing of public values."""
    if len(series.keys) < 2:
        return
    shown = [o.column.name.lower() for o in outer.plan.outputs]
    template = series.template
    at: list[int] = []
    for key in series.keys:
        match = [
            i
            for i, p in enumerate(template.expressions)
            if i < len(shown) and p.unalias().sql(dialect="postgres") == key.sql(dialect="postgres")
        ]
        if not match:
            return  # a key not shown: the rows cannot be told apart, all are kept
        at.append(match[0])
    listed = set(keys)
    kept = [i for i, row in enumerate(result.rows) if tuple(row[j] for j in at) in listed]
    result.rows = [result.rows[i] for i in kept]
    result.accuracy = [result.accuracy[i] for i in kept]


def answer_series(engine: Host, series: Series, session: Session, sql: str) -> Result:
    """Price the inner and (with stand-in keys) the outer, reserve both at once, release the inner,
    then the outer restricted to its released keys (see the module's privacy argument)."""
    inner = engine.prepare(series.inner, session)  # refused exactly as the sub-query alone would be
    stand_in = engine.prepare(series.outer_sql(_stand_in(inner.plan, series)), session)
    confidence = confidence_level(engine.policy, session)
    step = engine.step
    first = step.lookup(inner, confidence)
    parts = [first]
    outer: Prepared | None = None
    keys: list[tuple[Any, ...]] | None = None
    if first.hit is not None:  # keys already public: the outer may be a cached release too
        keys = _keys(first.hit.rows, series)
        if keys:
            outer = engine.prepare(series.outer_sql(keys), session)
            parts.append(step.lookup(outer, confidence))
    else:
        parts.append(Part(stand_in))
    cost = step.total(parts)
    with step.reserved(cost, session, engine.fingerprint(sql)) as charge:
        return _released_series(engine, series, session, confidence, parts, first, keys, outer, stand_in, cost, charge)


def _released_series(
    engine: Host,
    series: Series,
    session: Session,
    confidence: float,
    parts: list[Part],
    first: Part,
    keys: list[tuple[Any, ...]] | None,
    outer: Prepared | None,
    stand_in: Prepared,
    cost: Cost | None,
    charge: Charge | None,
) -> Result:
    """Release the ranking and the outer query, after their one reservation."""
    step = engine.step
    released = step.release(first, confidence)
    if keys is None:
        keys = _keys(released.rows, series)
        if keys:
            outer = engine.prepare(series.outer_sql(keys), session)
            parts[1] = step.lookup(outer, confidence)  # reserved; a stored release of these keys is reused
    if outer is None:
        columns = [o.column for o in stand_in.plan.outputs]
        result = Result(columns, [], [], 0.0, 0.0)
    else:
        if outer.budgeting.cost != stand_in.budgeting.cost:  # priced before the charge: must not change
            raise InternalError("the series-limit query's cost changed with its released keys")
        released = step.release(parts[1], confidence)
        # the part's own charge (or cache) notice dropped: this statement's is added below
        notices = [n for n in map(Notice.of, released.notices) if not n.budget]
        result = Result(list(released.columns), list(released.rows), list(released.accuracy), 0.0, 0.0)
        result.notices.extend(notices)
        _only_listed(result, series, keys, outer)
    step.notice(result, cost, charge, session, parts)
    result.notices.append(
        Notice(f'dpsql: series limit: {len(keys)} series chosen by the DP sub-query "{series.name}", released first')
    )
    return result


def explain_series(engine: Host, series: Series, session: Session, params: Params = None) -> CompositeExplanation:
    """EXPLAIN of a series limit: the ranking and the outer query (with its stand-in keys), each priced
    as execution prices them, their sum reserved together; nothing run or charged."""
    inner = engine.prepare(series.inner, session)
    stand_in = series.outer_sql(_stand_in(inner.plan, series))
    outer = engine.prepare(stand_in, session)
    cost = Step.total([Part(inner), Part(outer)])
    keys = ", ".join(k.sql(dialect="postgres") for k in series.keys)
    subplans = [
        SubPlan(
            f'DP sub-query "{series.name}", released first (its keys choose the series)',
            engine.explain(series.inner, session, actual=False),
        ),
        SubPlan(
            f'DP query over the chosen series ({keys} IN the keys "{series.name}" releases)',
            engine.explain(stand_in, session, actual=False),
        ),
    ]
    return CompositeExplanation("Series limit", cost.epsilon if cost else 0.0, cost.delta if cost else 0.0, subplans)
