"""Comma joins are joins: ``FROM a, b WHERE a.k = b.k`` is planned as ``FROM a JOIN b ON a.k = b.k``.

TPC-H and most hand-written SQL list tables with commas and join them in WHERE. The pass takes each
SELECT whose FROM lists tables with commas and, in the order they are listed (a table is taken as soon
as an equality in WHERE ties it to a table already taken), moves every top-level WHERE equality between
its columns and the columns of the tables before it into its ``ON``. Conjuncts every branch of an OR
repeats (TPC-H Q19 writes ``p_partkey = l_partkey`` in each of three branches) are factored out first.
What is left of WHERE stays in WHERE; a table no equality ties to the others is a cross product and
stays a comma join, which the join checks refuse with a hint naming ``JOIN … ON``. From the SQL and the
policy's column names only: the plan is then checked exactly as if the analyst had written the joins.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlglot import exp

from dpsql.plan.sources import ident_name
from dpsql.policy import Policy


def comma_joins(tree: exp.Expression, policy: Policy) -> exp.Expression:
    """``tree`` with every comma join whose tables WHERE ties together made a join with ``ON``."""
    selects = [s for s in tree.find_all(exp.Select) if any(_comma(j) for j in s.args.get("joins") or [])]
    if not selects:
        return tree
    tree = tree.copy()
    for select in [s for s in tree.find_all(exp.Select) if any(_comma(j) for j in s.args.get("joins") or [])]:
        _convert(select, policy)
    return tree


def _comma(join: exp.Join) -> bool:
    return not any(join.args.get(k) for k in ("on", "using", "kind", "side", "method"))


def _alias(node: exp.Expression) -> str:
    if node.alias:
        return ident_name(node.args["alias"].this)
    return ident_name(node.this) if isinstance(node, exp.Table) else ""


def _columns_of(node: exp.Expression, policy: Policy) -> set[str]:
    """The column names a FROM entry offers: a policy table's, or a derived table's outputs."""
    if isinstance(node, exp.Table):
        table = policy.table(ident_name(node.this))
        return set(table.columns) if table is not None else set()
    alias = node.args.get("alias")
    if alias is not None and alias.args.get("columns"):
        return {ident_name(c) for c in alias.args["columns"]}
    body = node.this if isinstance(node, exp.Subquery) else None
    if isinstance(body, exp.Select):
        return {
            ident_name(p.args["alias"].this) if isinstance(p, exp.Alias) else p.alias_or_name for p in body.expressions
        }
    return set()


def conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if node is None:
        return []
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]


def _disjuncts(node: exp.Expression) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Or):
        return _disjuncts(node.this) + _disjuncts(node.expression)
    return [node]


def and_all(parts: Iterable[exp.Expression]) -> exp.Expression | None:
    """``parts`` joined by AND; an OR part keeps its parentheses (:func:`conjuncts` took them off, and
    ``A OR B AND C`` is ``A OR (B AND C)``: without them a WHERE would keep rows it filters out)."""
    result: exp.Expression | None = None
    for part in parts:
        if isinstance(part, exp.Or):
            part = exp.paren(part, copy=False)
        result = part if result is None else exp.And(this=result, expression=part)
    return result


def factor_or(node: exp.Expression) -> list[exp.Expression]:
    """``(A AND X) OR (A AND Y)`` → ``[A, X OR Y]``: conjuncts every branch repeats, pulled out."""
    branches = [conjuncts(b) for b in _disjuncts(node)]
    if len(branches) < 2:
        return [node]
    shared = [c for c in branches[0] if all(any(c == d for d in b) for b in branches[1:])]
    if not shared:
        return [node]
    rest = []
    for branch in branches:
        remaining = [c for c in branch if not any(c == s for s in shared)]
        if not remaining:
            return shared  # one branch is the shared part alone: the OR is always true given it
        rest.append(and_all(remaining))
    ored: exp.Expression | None = None
    for part in rest:
        assert part is not None
        wrapped = exp.paren(part, copy=False)
        ored = wrapped if ored is None else exp.Or(this=ored, expression=wrapped)
    assert ored is not None
    return [*shared, exp.paren(ored, copy=False)]


def _convert(select: exp.Select, policy: Policy) -> None:
    entries = [select.args["from_"].this, *(j.this for j in select.args.get("joins") or [])]
    aliases = [_alias(e) for e in entries]
    offered = {a: _columns_of(e, policy) for a, e in zip(aliases, entries, strict=True)}

    def owner(column: exp.Column) -> str | None:
        qualifier = ident_name(column.args.get("table"))
        if qualifier:
            return qualifier if qualifier in offered else None
        name = ident_name(column.this)
        found = [a for a, names in offered.items() if name in names]
        return found[0] if len(found) == 1 else None

    where = select.args.get("where")
    parts: list[exp.Expression] = []
    for conjunct in conjuncts(where.this if where is not None else None):
        parts += factor_or(conjunct) if isinstance(conjunct, exp.Or | exp.Paren) else [conjunct]
    ties: list[tuple[exp.Expression, str, str]] = []
    rest: list[exp.Expression] = []
    for part in parts:
        if isinstance(part, exp.EQ) and isinstance(part.this, exp.Column) and isinstance(part.expression, exp.Column):
            left, right = owner(part.this), owner(part.expression)
            if left is not None and right is not None and left != right:
                ties.append((part, left, right))
                continue
        rest.append(part)
    joins = list(select.args.get("joins") or [])
    taken = [aliases[0]]
    ordered: list[exp.Join] = []
    pending = list(zip(aliases[1:], joins, strict=True))
    while pending:
        for index, (alias, join) in enumerate(pending):
            if not _comma(join):  # an explicit join keeps its own ON
                taken.append(alias)
                ordered.append(join)
                pending.pop(index)
                break
            on = [t for t, a, b in ties if (a == alias and b in taken) or (b == alias and a in taken)]
            if on:
                ties = [x for x in ties if x[0] not in on]
                ordered.append(exp.Join(this=join.this, on=and_all(on)))
                taken.append(alias)
                pending.pop(index)
                break
        else:  # no listed table is tied to those taken: leave the rest (the join checks refuse it)
            ordered += [join for _, join in pending]
            break
    select.set("joins", ordered)
    rest += [t for t, _, _ in ties]
    select.set("where", exp.Where(this=and_all(rest)) if rest else None)
