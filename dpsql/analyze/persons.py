"""Per-person questions: a FROM-subquery that groups by the privacy unit is one row per person.

``SELECT COUNT(*) FROM (SELECT customer_id FROM accounts GROUP BY customer_id HAVING COUNT(*) > 1) t``
("customers with more than one account"), ``SELECT AVG(n) FROM (SELECT a.customer_id, COUNT(*) AS n
FROM transactions t JOIN accounts a ON … GROUP BY a.customer_id) p`` ("transactions per customer"),
a histogram of per-customer spend: the inner query computes, for each person, values from that
person's rows only; the outer query is an ordinary DP query over a table whose unit is the person and
which holds one row per person (``max_rows_per_unit: 1``).

Privacy: a person's row is a function of their own rows (the inner sources are joined on the unit
only, as any query's are), so adding or removing a person adds or removes that one row and changes no
other; its values are clamped to public bounds from the policy — a count to [0, cap], a sum of clamped
values to cap × the bounds (widened to 0), an average, minimum or maximum to the column's bounds, where
cap is the rows one person may add to the inner query (:attr:`Sources.max_rows`) — so every outer
aggregate's sensitivity follows from those bounds, exactly as for a declared column. HAVING keeps or
drops the person's row on the same clamped values (comparisons with constants only, which cannot fail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlglot import exp

from dpsql.analyze.expressions import bound_literal, clamp_sql
from dpsql.analyze.scope import Scope
from dpsql.analyze.where import check_where
from dpsql.errors import Error, FeatureNotSupported, GroupingError, SyntaxError_
from dpsql.plan.sources import Source, Sources, from_node, ident_name, qualified, resolve_ref
from dpsql.policy import ColumnPolicy, Policy, TablePolicy
from dpsql.units import UnitPath

_COMPARISONS = (exp.EQ, exp.NEQ, exp.LT, exp.LTE, exp.GT, exp.GTE)
#: A per-person count with a cap up to this has its values 0 … cap as a public domain (GROUP BY it).
MAX_COUNT_DOMAIN = 1000


@dataclass(frozen=True, slots=True)
class _Output:
    name: str
    sql: exp.Expression
    policy: ColumnPolicy


#: :func:`dpsql.analyze.sources.resolve_sources`, passed in (that module imports this one).
ResolveSources = Callable[[exp.Select, Policy], Sources]


def grouped_by_unit(select: exp.Select, policy: Policy, resolve_sources: ResolveSources) -> bool:
    """Whether ``select`` groups by the privacy unit of its sources and nothing else (a per-person
    relation). From the SQL and the policy only; False when it cannot be resolved (its own analysis
    then refuses it precisely)."""
    group = select.args.get("group")
    if group is None or len(group.expressions) != 1 or select.args.get("from_") is None:
        return False
    try:
        sources = resolve_sources(select, policy)
        column = _group_column(select)
        found = resolve_ref(column, sources, identifiers=True) if column is not None else None
    except Error:  # unresolvable here: the query's own analysis refuses it with the exact error
        return False
    return found is not None and found[0].private and found[1] == found[0].unit_column


def _group_column(select: exp.Select) -> exp.Column | None:
    """The single GROUP BY expression as a column (a position or an output alias resolved)."""
    key = select.args["group"].expressions[0]
    if isinstance(key, exp.Literal) and key.is_int:
        index = int(key.name) - 1
        key = select.expressions[index].unalias() if 0 <= index < len(select.expressions) else key
    elif isinstance(key, exp.Column) and not key.table:
        named = next((p.this for p in select.expressions if isinstance(p, exp.Alias) and p.alias == key.name), None)
        key = named if named is not None else key
    return key if isinstance(key, exp.Column) else None


def person_source(node: exp.Subquery, policy: Policy, resolve_sources: ResolveSources) -> Source:
    """The per-person relation a FROM-subquery grouped by the unit defines (module docstring), or a
    precise refusal of what it cannot be."""
    alias = ident_name(node.args["alias"].this) if node.alias else ""
    if not alias:
        raise SyntaxError_("a subquery in FROM must have an alias")
    select = node.this
    if not isinstance(select, exp.Select) or not grouped_by_unit(select, policy, resolve_sources):
        raise FeatureNotSupported(
            f'GROUP BY inside the subquery or CTE "{alias}" is only supported on the privacy unit',
            hint="A subquery may aggregate per person (GROUP BY the privacy unit: one row per person, "
            "then aggregate in the outer query); aggregate anything else in the outer query.",
        )
    for clause in ("distinct", "limit", "offset", "order", "windows", "with_"):
        if select.args.get(clause):
            raise FeatureNotSupported(
                f'{clause.upper().rstrip("_")} is not supported inside the per-person subquery "{alias}"',
                hint="A per-person subquery keeps every person (one row each); filter with WHERE or HAVING.",
            )
    sources = resolve_sources(select, policy)
    scope = Scope(policy=policy, sources=sources, check_predicate=lambda p: check_where(p, scope))
    where = select.args.get("where")
    checked = check_where(where.this, scope) if where else None
    column = _group_column(select)
    assert column is not None
    owner, unit_name, unit_policy = resolve_ref(column, sources, identifiers=True)
    unit_sql = qualified(owner, unit_name)
    cap = sources.max_rows
    outputs: list[_Output] = []
    aggregates: dict[str, exp.Expression] = {}  # an aggregate call's SQL → its clamped value
    unit_out = unit_name
    for projection in select.expressions:
        node_ = projection.unalias()
        name = ident_name(projection.args["alias"].this) if isinstance(projection, exp.Alias) else None
        if isinstance(node_, exp.Column):
            found = resolve_ref(node_, sources, identifiers=True)
            if (found[0].alias, found[1]) != (owner.alias, unit_name):
                raise GroupingError(
                    f'column "{found[1]}" must appear in the GROUP BY clause or be used in an aggregate function',
                    hint="A per-person subquery selects the privacy unit and aggregates of each person's rows.",
                )
            unit_out = name or unit_name
            continue
        value, policy_ = _aggregate(node_, scope, cap, alias)
        aggregates[node_.sql(dialect="postgres")] = value
        outputs.append(_Output(name or _default_name(node_), value, policy_))
    renamed = [ident_name(c) for c in (node.args["alias"].args.get("columns") or [])]  # AS t (id, n)
    if renamed:
        if len(renamed) != len(select.expressions):
            raise SyntaxError_(f'the subquery "{alias}" has {len(select.expressions)} columns, {len(renamed)} named')
        order = [p.unalias() for p in select.expressions]
        unit_at = next((i for i, p in enumerate(order) if isinstance(p, exp.Column)), None)
        if unit_at is not None:
            unit_out = renamed[unit_at]
        others = [name for i, name in enumerate(renamed) if i != unit_at]
        outputs = [_Output(name, o.sql, o.policy) for name, o in zip(others, outputs, strict=True)]
    names = [unit_out, *(o.name for o in outputs)]
    if len(set(names)) != len(names):
        raise FeatureNotSupported(f'the per-person subquery "{alias}" names two columns alike: alias them')
    inner = exp.select(
        exp.alias_(unit_sql.copy(), unit_out, quoted=True),
        *(exp.alias_(o.sql, o.name, quoted=True) for o in outputs),
    )
    inner = inner.from_(from_node(sources.sources[0], policy), copy=False)
    for join in sources.joins:
        inner.append("joins", join.copy())
    if checked is not None:
        inner = inner.where(checked, copy=False)
    inner = inner.group_by(unit_sql.copy(), copy=False)
    having = select.args.get("having")
    if having is not None:
        inner = inner.having(having_predicate(having.this, scope, cap, alias, aggregates), copy=False)
    columns = {unit_out: unit_policy.model_copy(update={"identifier": True})}
    columns.update({o.name: o.policy for o in outputs})
    table = TablePolicy(privacy_unit=unit_out, max_rows_per_unit=1, columns=columns)
    person = sources.unit_description.split(" (", 1)[0]
    path = UnitPath(alias, (), unit_out, person, (f"{alias} (one row per {person})",))
    derived = exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True)))
    return Source(alias=alias, name=f"({alias})", table=table, path=path, derived=derived, inner=tuple(sources.sources))


def _default_name(node: exp.Expression) -> str:
    """PostgreSQL's name for an unaliased aggregate column: the function's name."""
    return node.key if isinstance(node, exp.AggFunc) else "?column?"


def _aggregate(node: exp.Expr, scope: Scope, cap: int, alias: str) -> tuple[exp.Expression, ColumnPolicy]:
    """One person's clamped value of an aggregate call and the column policy it is read with."""
    if isinstance(node, exp.Count):
        argument = node.this
        if isinstance(argument, exp.Distinct):
            for value in argument.expressions:
                resolve_ref(value, scope.sources) if isinstance(value, exp.Column) else None
        elif isinstance(argument, exp.Column):
            resolve_ref(argument, scope.sources, identifiers=True)  # an identifier may be counted, never read
        elif not isinstance(argument, exp.Star) and argument is not None:
            scope.operand(argument)  # refuses identifiers and unbounded arithmetic
        top = exp.Literal.number(cap)
        counted = exp.Case().when(exp.GT(this=node.copy(), expression=top), top.copy()).else_(node.copy())
        # every count from 0 to the cap is possible: a public domain (GROUP BY the count, TPC-H Q13)
        domain = tuple(range(cap + 1)) if cap <= MAX_COUNT_DOMAIN else None
        return counted, ColumnPolicy(type="int", lower=0, upper=cap, nullable=False, domain=domain)
    if not isinstance(node, exp.Sum | exp.Avg | exp.Min | exp.Max):
        raise FeatureNotSupported(
            f'the per-person subquery "{alias}" may compute COUNT, SUM, AVG, MIN and MAX only',
            hint="Compute other statistics in the outer query, over the per-person values.",
        )
    operand = scope.operand(node.this)
    policy = operand.policy
    if isinstance(node, exp.Sum | exp.Avg) and not policy.numeric:
        raise FeatureNotSupported(f'{node.key.upper()} of "{operand.name}" needs a number')
    if not policy.bounded:
        raise FeatureNotSupported(
            f'column "{operand.name}" has no declared bounds',
            hint="Declare lower/upper for it in the policy: each person's value must be bounded.",
        )
    value = operand.expr
    if value is None:
        column = qualified(next(s for s in scope.sources.sources if s.alias == operand.table), operand.name)
        value = clamp_sql(column, bound_literal(policy.lower, policy), bound_literal(policy.upper, policy))
    inner = type(node)(this=value)
    if isinstance(node, exp.Sum):
        low, high = cap * min(float(policy.lower), 0.0), cap * max(float(policy.upper), 0.0)  # type: ignore[arg-type]
        integer = policy.type == "int"
        lower_, upper_ = (int(low), int(high)) if integer else (low, high)
        summed = ColumnPolicy(type=policy.type, lower=lower_, upper=upper_, nullable=policy.nullable)
        return clamp_sql(inner, bound_literal(lower_, summed), bound_literal(upper_, summed)), summed
    if isinstance(node, exp.Avg):
        low, high = float(policy.lower), float(policy.upper)  # type: ignore[arg-type]
        return inner, ColumnPolicy(type="float", lower=low, upper=high, nullable=policy.nullable)
    return inner, ColumnPolicy(type=policy.type, lower=policy.lower, upper=policy.upper, nullable=policy.nullable)


def having_predicate(
    node: exp.Expression, scope: Scope, cap: int, alias: str, aggregates: dict[str, exp.Expression] | None = None
) -> exp.Expression:
    """HAVING of a per-person subquery (or of a group inside one person's rows): AND/OR/NOT of comparisons
    between a (clamped) aggregate of the rows and a number: no arithmetic, so nothing can fail on any row."""
    aggregates = {} if aggregates is None else aggregates
    if isinstance(node, exp.Paren):
        return exp.paren(having_predicate(node.this, scope, cap, alias, aggregates), copy=False)
    if isinstance(node, exp.And | exp.Or):
        left = having_predicate(node.this, scope, cap, alias, aggregates)
        right = having_predicate(node.expression, scope, cap, alias, aggregates)
        return type(node)(this=left, expression=right)
    if isinstance(node, exp.Not):
        return exp.Not(this=having_predicate(node.this, scope, cap, alias, aggregates))
    if isinstance(node, _COMPARISONS):
        sides: list[exp.Expression] = []
        for side in (node.this, node.expression):
            if (isinstance(side, exp.Literal) and not side.is_string) or isinstance(side, exp.Neg):
                sides.append(side.copy())
            elif isinstance(side, exp.AggFunc):
                key = side.sql(dialect="postgres")
                sides.append(aggregates.get(key) or _aggregate(side, scope, cap, alias)[0])
            else:
                break
        else:
            return type(node)(this=sides[0], expression=sides[1])
    raise FeatureNotSupported(
        f'HAVING of the per-person subquery "{alias}" may only compare its aggregates with numbers',
        hint="For example HAVING COUNT(*) > 1 or HAVING SUM(amount) >= 1000.",
    )
