"""Subqueries in WHERE, classified by what they read (issue #36).

- **Over public tables only** (``l_partkey IN (SELECT p_partkey FROM part WHERE p_name LIKE 'forest%')``,
  ``p_size = (SELECT MIN(p_size) FROM part)``): public data, the same on every neighbouring database;
  kept in the measurement query as a semi-join or a constant, checked like any query over its tables.
- **Over the same person's rows** (``EXISTS (SELECT * FROM lineitem WHERE l_orderkey = o_orderkey AND
  l_commitdate < l_receiptdate)``, ``NOT EXISTS``, ``o_orderkey IN (SELECT l_orderkey FROM lineitem GROUP
  BY l_orderkey HAVING SUM(l_quantity) > 300)``): a semi- or anti-join inside each person's rows. The
  subquery is tied to the outer row along a foreign key or the unit, and also by the unit itself, so
  whether a row is kept depends on its own person's rows only: removing another person changes nothing,
  and a row is kept or not, never multiplied (the join bound is the outer query's). Its predicates are
  checked like WHERE and a HAVING compares clamped aggregates with numbers, so nothing can fail on a row.
- **Anything else** is refused with what would work: an aggregate of other people's rows per outer row
  (TPC-H Q17's average per part) cannot decide which rows count.

The subquery is rewritten here with the sources of the measurement (chained tables as their derived
tables, backend names, qualified columns), so the rewrite renders it as it stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlglot import exp

from dpsql.analyze.persons import ResolveSources, having_predicate
from dpsql.analyze.scope import CHECKED, Scope
from dpsql.errors import Error, FeatureNotSupported
from dpsql.plan.sources import Source, Sources, from_node, qualified, resolve_ref
from dpsql.policy import ColumnPolicy

#: :func:`dpsql.analyze.where.check_where`, passed in.
CheckWhere = Callable[[exp.Expression, Scope], exp.Expression]

_COMPARISONS = (exp.EQ, exp.NEQ, exp.LT, exp.LTE, exp.GT, exp.GTE)
_FLIPPED: dict[type[exp.Expression], type[exp.Expression]] = {
    exp.LT: exp.GT,
    exp.GT: exp.LT,
    exp.LTE: exp.GTE,
    exp.GTE: exp.LTE,
}


@dataclass(frozen=True, slots=True)
class Tools:
    """The analyzer's resolution and WHERE checks, passed in (those modules import this one)."""

    resolve_sources: ResolveSources
    check_where: CheckWhere


def reads_public_only(select: exp.Expression, scope: Scope) -> bool:
    """Whether every table the subquery names is a public table of the policy."""
    tables = [scope.policy.table(t.name) for t in select.find_all(exp.Table)]
    return bool(tables) and all(t is not None and t.public for t in tables)


def resolve(node: exp.Expression, scope: Scope, tools: Tools) -> exp.Expression:
    """``node`` (a WHERE tree) with every subquery predicate checked and rendered (marked :data:`CHECKED`)."""
    if isinstance(node, exp.Paren):
        return exp.Paren(this=resolve(node.this, scope, tools))
    if isinstance(node, exp.And | exp.Or):
        left = resolve(node.this, scope, tools)
        return type(node)(this=left, expression=resolve(node.expression, scope, tools))
    if isinstance(node, exp.Not):
        return exp.Not(this=resolve(node.this, scope, tools))
    if isinstance(node, exp.Exists):
        checked: exp.Expression = exp.Exists(this=_semi(node.this, scope, tools))
    elif isinstance(node, exp.In) and node.args.get("query") is not None:
        checked = _in(node, scope, tools)
    elif isinstance(node, _COMPARISONS) and isinstance(node.expression, exp.Subquery | exp.Select):
        checked = _scalar(node, scope, tools)
    elif isinstance(node, _COMPARISONS) and isinstance(node.this, exp.Subquery | exp.Select):
        flipped: type[exp.Expression] = _FLIPPED.get(type(node), type(node))
        checked = _scalar(flipped(this=node.expression, expression=node.this), scope, tools)
    else:
        return node
    checked.meta[CHECKED] = True
    return checked


def _semi(node: exp.Expression, scope: Scope, tools: Tools) -> exp.Subquery:
    if reads_public_only(node, scope):
        return public_subquery(node, scope, tools, exists=True)
    return same_person(node, scope, tools)


def _in(node: exp.In, scope: Scope, tools: Tools) -> exp.Expression:
    query = node.args["query"]
    negated = False
    target = node.this
    if not isinstance(target, exp.Column):
        raise FeatureNotSupported("the left side of IN (subquery) must be a column")
    if reads_public_only(query, scope):
        source, name, _ = resolve_ref(target, scope.sources)
        return exp.In(this=qualified(source, name), query=public_subquery(query, scope, tools))
    body = _body(query)
    if len(body.expressions) != 1 or not isinstance(body.expressions[0].unalias(), exp.Column):
        raise FeatureNotSupported("IN (subquery) over protected rows must select one column")
    inner_column = body.expressions[0].unalias()
    assert isinstance(inner_column, exp.Column)
    semi = same_person(query, scope, tools, tie=(target, inner_column))
    exists: exp.Expression = exp.Exists(this=semi)
    return exp.Not(this=exists) if negated else exists


def _scalar(node: exp.Expression, scope: Scope, tools: Tools) -> exp.Expression:
    """``column <op> (SELECT …)``: a public subquery's one value (a constant of public data)."""
    sub = node.expression
    if not reads_public_only(sub, scope):
        raise FeatureNotSupported(
            "a subquery in WHERE that aggregates protected rows is not supported",
            hint="An aggregate of protected rows is a DP release of its own: run it first and compare with "
            "its released value as a constant, or compare with a per-person value (a subquery in FROM grouped "
            "by the privacy unit).",
        )
    if not isinstance(node.this, exp.Column):
        raise FeatureNotSupported("the left side of a comparison with a subquery must be a column")
    source, name, policy = resolve_ref(node.this, scope.sources)
    if not policy.numeric and policy.type not in ("date", "timestamp"):
        raise FeatureNotSupported("a comparison with a subquery needs a number or a date")
    return type(node)(this=qualified(source, name), expression=public_subquery(sub, scope, tools))


def _body(node: exp.Expression) -> exp.Select:
    body = node.this if isinstance(node, exp.Subquery) else node
    if not isinstance(body, exp.Select):
        raise FeatureNotSupported("a subquery must be a plain SELECT")
    for clause in ("with_", "limit", "offset", "order", "windows", "distinct"):
        if body.args.get(clause) and clause != "distinct":
            raise FeatureNotSupported(f"{clause.upper().rstrip('_')} inside a subquery in WHERE is not supported")
    return body


def _inner_scope(body: exp.Select, scope: Scope, tools: Tools) -> Scope:
    sources = tools.resolve_sources(body, scope.policy)
    inner = Scope(policy=scope.policy, sources=sources, check_predicate=lambda p: tools.check_where(p, inner))
    return inner


def _from(sources: Sources, select: exp.Select) -> exp.Select:
    select = select.from_(from_node(sources.sources[0], sources.policy), copy=False)
    for join in sources.joins:
        select.append("joins", join.copy())
    return select


def _side(column: exp.Column, inner: Scope, outer: Scope) -> tuple[str, Source, str, ColumnPolicy]:
    """Which query a column of the subquery belongs to: its own tables first, then the outer query's."""
    try:
        source, name, policy = resolve_ref(column, inner.sources, identifiers=True)
        return "inner", source, name, policy
    except Error:
        source, name, policy = resolve_ref(column, outer.sources, identifiers=True)
        return "outer", source, name, policy


def _sides(node: exp.Expression, inner: Scope, outer: Scope) -> set[str]:
    return {_side(c, inner, outer)[0] for c in node.find_all(exp.Column)}


def public_subquery(
    node: exp.Expression,
    scope: Scope,
    tools: Tools,
    *,
    exists: bool = False,
) -> exp.Subquery:
    """A subquery over public tables only, checked and rendered over their backend names (one column;
    any, for EXISTS)."""
    body = _body(node)
    inner = _inner_scope(body, scope, tools)
    if exists:
        body = body.select(exp.Literal.number(1), append=False)
    if len(body.expressions) != 1:
        raise FeatureNotSupported("a subquery in WHERE must select one column")
    where = body.args.get("where")
    try:
        checked = tools.check_where(where.this, inner) if where else None
        projection = _public_projection(body.expressions[0].unalias(), inner)
    except Error as exc:
        if any(_side(c, inner, scope)[0] == "outer" for c in body.find_all(exp.Column) if _resolvable(c, scope)):
            raise FeatureNotSupported(
                "a subquery over public tables may not refer to the outer query's columns",
                hint="Join the public table in the outer query instead (JOIN part ON p_partkey = l_partkey).",
            ) from exc
        raise
    select = _from(inner.sources, exp.select(projection))
    if checked is not None:
        select = select.where(checked, copy=False)
    if body.args.get("distinct"):
        select.set("distinct", exp.Distinct())
    if body.args.get("group") or body.args.get("having"):
        raise FeatureNotSupported("GROUP BY inside a subquery over public tables in WHERE is not supported")
    return exp.Subquery(this=select)


def _resolvable(column: exp.Column, scope: Scope) -> bool:
    try:
        resolve_ref(column, scope.sources, identifiers=True)
    except Error:
        return False
    return True


_PUBLIC_AGGREGATES = (exp.Min, exp.Max, exp.Avg, exp.Sum, exp.Count)


def _public_projection(node: exp.Expression, inner: Scope) -> exp.Expression:
    """The one value a public subquery selects: a column, or MIN/MAX/AVG/SUM/COUNT of one (its rows are
    public: no bound needed), possibly times a number."""
    if isinstance(node, exp.Mul | exp.Div) and isinstance(node.this, exp.Literal):
        return type(node)(this=node.this.copy(), expression=_public_projection(node.expression, inner))
    if isinstance(node, exp.Column):
        source, name, _ = resolve_ref(node, inner.sources)
        return qualified(source, name)
    if isinstance(node, _PUBLIC_AGGREGATES) and isinstance(node.this, exp.Column | exp.Star):
        argument = node.this if isinstance(node.this, exp.Star) else _public_projection(node.this, inner)
        return type(node)(this=argument)
    raise FeatureNotSupported(
        "a subquery over public tables may select a column or MIN, MAX, AVG, SUM or COUNT of one",
        hint="For example p_size = (SELECT MIN(p_size) FROM part).",
    )


def same_person(
    node: exp.Expression,
    scope: Scope,
    tools: Tools,
    tie: tuple[exp.Expression, exp.Column] | None = None,
) -> exp.Subquery:
    """A subquery over private tables tied to the outer row's person (module docstring), rendered for an
    EXISTS. ``tie``: ``outer IN (SELECT inner …)`` as the pair (outer expression, inner column)."""
    body = _body(node)
    inner = _inner_scope(body, scope, tools)
    if scope.sources.unit is None or inner.sources.unit is None:
        raise FeatureNotSupported(
            "a subquery over protected rows may only filter rows of the same person",
            hint="EXISTS/IN over protected rows is answered when the outer query reads protected rows too and "
            "the subquery is tied to them along a foreign key or the privacy unit (TPC-H Q4's EXISTS over an "
            "order's lineitems); selecting public rows by other people's data is not a DP aggregate.",
        )
    where = body.args.get("where")
    conjuncts = _split(where.this) if where else []
    if tie is not None:
        conjuncts.append(exp.EQ(this=tie[0], expression=tie[1]))
    own: list[exp.Expression] = []
    linked: list[exp.Expression] = []
    tied = False
    for conjunct in conjuncts:
        sides = _sides(conjunct, inner, scope)
        if sides <= {"inner"}:
            own.append(tools.check_where(conjunct, inner))
            continue
        linked.append(_linked(conjunct, inner, scope))
        tied = tied or _ties(conjunct, inner, scope)
    if not tied:
        raise FeatureNotSupported(
            "a subquery over protected rows must be tied to the outer row along a foreign key or the privacy unit",
            hint="For example EXISTS (SELECT * FROM lineitem WHERE l_orderkey = o_orderkey AND …): a subquery "
            "that reads other people's rows for each row is not supported.",
        )
    if body.find(exp.AggFunc) is not None and not body.args.get("group"):
        raise FeatureNotSupported(
            "a subquery in WHERE that aggregates protected rows is not supported",
            hint="An aggregate of other people's rows cannot decide which rows count; compare with a constant, "
            "or with a per-person value (a subquery in FROM grouped by the privacy unit).",
        )
    same = exp.NullSafeEQ(this=inner.sources.unit, expression=scope.sources.unit)
    select = _from(inner.sources, exp.select(exp.Literal.number(1)))
    condition = _and([*own, *linked, same])
    select = select.where(condition, copy=False)
    group = body.args.get("group")
    if group is not None:
        keys = []
        for key in group.expressions:
            if not isinstance(key, exp.Column):
                raise FeatureNotSupported("GROUP BY inside a subquery in WHERE may name columns only")
            source, name, _ = resolve_ref(key, inner.sources, identifiers=True)
            keys.append(qualified(source, name))
        select = select.group_by(*keys, copy=False)
        having = body.args.get("having")
        if having is not None:
            select = select.having(having_predicate(having.this, inner, inner.sources.max_rows, "subquery"), copy=False)
    return exp.Subquery(this=select)


def _split(node: exp.Expression) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return _split(node.this) + _split(node.expression)
    return [node]


def _and(parts: list[exp.Expression]) -> exp.Expression:
    """``parts`` joined by AND, an OR part in parentheses (``_split`` took them off)."""
    parts = [exp.paren(p, copy=False) if isinstance(p, exp.Or) else p for p in parts]
    out = parts[0]
    for part in parts[1:]:
        out = exp.And(this=out, expression=part)
    return out


def _linked(node: exp.Expression, inner: Scope, outer: Scope) -> exp.Expression:
    """A conjunct reading both queries: a comparison of one column of each (``l2.l_suppkey <> l1.l_suppkey``)."""
    if isinstance(node, _COMPARISONS) and isinstance(node.this, exp.Column) and isinstance(node.expression, exp.Column):
        left, right = _side(node.this, inner, outer), _side(node.expression, inner, outer)
        if left[0] != right[0]:
            numeric = {left[3].numeric, right[3].numeric}
            if len(numeric) == 2 or (not left[3].numeric and left[3].type != right[3].type):
                raise FeatureNotSupported(f"cannot compare {left[3].type} with {right[3].type} in a subquery")
            return type(node)(this=qualified(left[1], left[2]), expression=qualified(right[1], right[2]))
    raise FeatureNotSupported(
        "a subquery's conditions on the outer query's columns must compare two columns",
        hint="For example l2.l_orderkey = l1.l_orderkey AND l2.l_suppkey <> l1.l_suppkey.",
    )


def _ties(node: exp.Expression, inner: Scope, outer: Scope) -> bool:
    """Whether an equality ties the subquery's rows to the outer row's person: the two units, or a
    foreign key from one to the other (``l_orderkey = o_orderkey``), or the same key of one table
    (``l2.l_orderkey = l1.l_orderkey``: the same order, so the same person)."""
    if not isinstance(node, exp.EQ):
        return False
    a, b = _side(node.this, inner, outer), _side(node.expression, inner, outer)
    if not (a[1].private and b[1].private):
        return False
    if a[2] == a[1].unit_column and b[2] == b[1].unit_column:
        return True
    for left, right in ((a, b), (b, a)):
        ref = left[1].table.references
        if ref is not None and ref.column == left[2] and ref.table == right[1].name and ref.to == right[2]:
            return True
        if left[1].name == right[1].name and left[2] == right[2] and ref is not None and ref.column == left[2]:
            return True
    return False
