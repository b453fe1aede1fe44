"""FROM and JOIN: which tables a query reads, and what protects a person across them.

Private tables protect a *privacy unit* (a person, or a household): directly through a
column, or through a foreign key to the unit's table. A query may join private tables
only on their unit (so one person's rows meet only that person's rows) and may join any
private table with public lookup tables. Every other join shape — self-joins, cross or
non-equi joins between private tables, joins of tables without a unit — could let one
person's rows multiply or mix with others' beyond the declared bounds, and is refused.

The result, :class:`~dpsql.plan.sources.Sources`, and name resolution over it belong to the plan
(:mod:`dpsql.plan.sources`): the rewrite and the aggregates read them without the analyzer.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze import persons
from dpsql.analyze.persons import person_source
from dpsql.analyze.scope import Scope
from dpsql.analyze.where import check_where
from dpsql.errors import (
    DuplicateAlias,
    FeatureNotSupported,
    ProgramLimitExceeded,
    UndefinedTable,
)
from dpsql.plan.sources import Source, Sources, from_node, ident_name, qualified, resolve_ref
from dpsql.policy import ColumnPolicy, Policy


def _source(node: exp.Expression, policy: Policy) -> Source:
    if isinstance(node, exp.Subquery):  # GROUP BY the unit inside: one row per person
        return person_source(node, policy, resolve_sources)
    if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier):
        raise FeatureNotSupported("FROM must name a table", hint="Subqueries and table functions are refused.")
    schema = ident_name(node.args.get("db"))
    name = ident_name(node.this)
    table = policy.tables.get(name)
    if table is None or schema not in ("", "public") or node.args.get("catalog"):
        shown = f"{schema}.{name}" if schema else name
        raise UndefinedTable(
            f'relation "{shown}" does not exist',
            hint=f'Tables in dataset "{policy.dataset}": {", ".join(sorted(policy.tables))}.',
        )
    alias = ident_name(node.args["alias"].this) if node.alias else name
    return Source(alias=alias, name=name, table=table, path=policy.unit_path(name))


def _conjuncts(node: exp.Expression) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    return [node]


def _check_join_kind(join: exp.Join) -> None:
    join_type, side = (join.args.get("kind") or "").upper(), (join.args.get("side") or "").upper()
    if join_type == "CROSS" or (not join.args.get("on") and not join.args.get("using")):
        raise FeatureNotSupported(
            "cross joins are not supported",
            hint="A cross join pairs every row with every other: write JOIN t ON a.k = t.k (or an equality "
            "between the tables in WHERE) along a foreign key, the privacy unit or a public table's key.",
        )
    if join.args.get("using"):
        raise FeatureNotSupported("JOIN ... USING is not supported", hint="Write the condition with ON.")
    if join_type not in ("", "INNER", "OUTER") or side not in ("", "LEFT"):
        raise FeatureNotSupported(
            f"{(side + ' ' + join_type).strip() or join_type} JOIN is not supported", hint="Use JOIN or LEFT JOIN."
        )
    if join.args.get("method"):  # NATURAL, ASOF, ...
        raise FeatureNotSupported(f"{join.args['method'].upper()} JOIN is not supported")


def _follows_reference(a: tuple[Source, str, ColumnPolicy], b: tuple[Source, str, ColumnPolicy]) -> bool:
    """``a.column = b.to`` for a declared ``references`` of a's table: rows keep their unit."""
    ref = a[0].table.references
    return ref is not None and ref.column == a[1] and ref.table == b[0].name and ref.to == b[1]


def _same_unit(referencing: Source, target: Source) -> exp.Expression | None:
    """``referencing.unit IS NOT DISTINCT FROM target.unit`` for a foreign-key join whose condition does
    not itself equate the two units (one of them is reached through hops): the key may repeat in the
    data, and a row must only ever meet rows of its own person. None when the condition equates them."""
    ref = referencing.table.references
    assert ref is not None
    if referencing.unit is None or target.unit is None:
        return None  # the target's rows are each one person, named by the key the condition matches
    if (referencing.unit_column, target.unit_column) == (ref.column, ref.to):
        return None
    return exp.NullSafeEQ(this=referencing.unit, expression=target.unit)


def _join_condition(join: exp.Join, sources: Sources, unify: dict[str, str]) -> exp.Expression:
    """Validate ``ON`` (a conjunction of column equalities), record which units it equates and which
    tables it looks up by a foreign key (:attr:`Sources.looked_up`)."""
    normalised: list[exp.Expression] = []
    filters: list[exp.Expression] = []
    for conjunct in _conjuncts(join.args["on"]):
        if not isinstance(conjunct, exp.EQ) or not all(
            isinstance(side, exp.Column) for side in (conjunct.this, conjunct.expression)
        ):
            filters.append(conjunct)  # a predicate (LEFT JOIN … ON k = k AND o_comment NOT LIKE …): below
            continue
        left = resolve_ref(conjunct.this, sources, identifiers=True)
        right = resolve_ref(conjunct.expression, sources, identifiers=True)
        normalised.append(exp.EQ(this=qualified(left[0], left[1]), expression=qualified(right[0], right[1])))
        if not (left[0].private and right[0].private):
            continue
        on_units = left[1] == left[0].unit_column and right[1] == right[0].unit_column
        if on_units:
            _union(unify, left[0].alias, right[0].alias)
            continue
        for referencing, target in ((left, right), (right, left)):
            if _follows_reference(referencing, target):
                sources.looked_up.add(target[0].alias)
                same = _same_unit(referencing[0], target[0])
                if same is not None:
                    normalised.append(same)
                _union(unify, left[0].alias, right[0].alias)
                break
        else:
            raise FeatureNotSupported(
                f'private tables "{left[0].name}" and "{right[0].name}" must be joined on their privacy unit',
                hint="Join on the privacy-unit columns or along a foreign key declared in the policy "
                "(references); joining on other columns mixes different persons' rows.",
            )
    if not normalised:
        raise FeatureNotSupported(
            "JOIN conditions need an equality between columns",
            hint="Join along a foreign key, the privacy unit or a public table's key (JOIN t ON a.k = t.k); "
            "a join without one can pair one person's rows with many others'.",
        )
    # other conjuncts filter the pairs the equalities make (never more rows than those), checked as WHERE
    scope = Scope(policy=sources.policy, sources=sources, check_predicate=lambda p: check_where(p, scope))
    normalised += [check_where(f, scope) for f in filters]
    parts = [exp.paren(p, copy=False) if isinstance(p, exp.Or) else p for p in normalised]  # A OR B AND C ≠
    condition: exp.Expression = parts[0]
    for extra in parts[1:]:
        condition = exp.And(this=condition, expression=extra)
    return condition


#: Tables in one query's FROM and JOINs (each join can multiply the rows the database works through).
MAX_JOINED_TABLES = 8


def resolve_sources(tree: exp.Select, policy: Policy) -> Sources:
    """Resolve FROM and JOINs; refuse every join that could multiply or mix persons' rows."""
    sources = Sources(policy, [_source(tree.args["from_"].this, policy)])
    joins = tree.args.get("joins") or []
    if len(joins) + 1 > MAX_JOINED_TABLES:
        raise ProgramLimitExceeded(
            f"a query may join at most {MAX_JOINED_TABLES} tables",
            hint="Every join multiplies the work the database does; split the question into smaller queries.",
        )
    for join in joins:
        _check_join_kind(join)
        source = _source(join.this, policy)
        if any(s.alias == source.alias for s in sources.sources):
            raise DuplicateAlias(f'table name "{source.alias}" specified more than once')
        if source.private and any(s.name == source.name for s in sources.sources):
            raise FeatureNotSupported(
                f'self-joins of private table "{source.name}" are not supported',
                hint="A self-join can count one person's rows many times over.",
            )
        # a public table joined again under another alias (TPC-H's nation n1, nation n2) is joined on an
        # equality like every join (cross joins are refused), so it multiplies rows only as a key repeats
        sources.sources.append(source)
    if joins:
        for source in sources.private:
            if source.unit is None:
                raise FeatureNotSupported(
                    f'table "{source.name}" has no privacy unit and cannot be joined',
                    hint="Declare privacy_unit (or references) for it in the policy.",
                )
    unify: dict[str, str] = {}
    for join in joins:
        condition = _join_condition(join, sources, unify)
        sources.joins.append(
            exp.Join(this=from_node(_by_alias(sources, join), policy), on=condition, side=join.args.get("side"))
        )
    private = sources.private
    if len(private) > 1:
        roots = {_root(unify, s.alias) for s in private}
        if len(roots) > 1:
            raise FeatureNotSupported(
                "private tables must be joined on their privacy unit",
                hint="Add ON conditions equating the tables' privacy-unit columns "
                f"({', '.join(f'{s.alias}.{s.unit_column}' for s in private)}).",
            )
    return sources


def grouped_by_unit(select: exp.Select, policy: Policy) -> bool:
    """Whether ``select`` is a per-person relation (:func:`dpsql.analyze.persons.grouped_by_unit`)."""
    return persons.grouped_by_unit(select, policy, resolve_sources)


def _root(parent: dict[str, str], alias: str) -> str:
    """Union-find: the representative of the set of tables joined on one unit."""
    while parent.get(alias, alias) != alias:
        alias = parent[alias]
    return alias


def _union(parent: dict[str, str], a: str, b: str) -> None:
    parent[_root(parent, a)] = _root(parent, b)


def _by_alias(sources: Sources, join: exp.Join) -> Source:
    node = join.this
    alias = ident_name(node.args["alias"].this) if node.alias else ident_name(node.this)
    return next(s for s in sources.sources if s.alias == alias)
