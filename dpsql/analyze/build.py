"""Resolve a checked SELECT against the policy and build the typed :class:`~dpsql.plan.Plan`.

Every column is resolved against the policy (unknown → 42703, identifier → 42501);
WHERE may only contain predicates that cannot fail on data (so no error can act as an
oracle; :mod:`dpsql.analyze.where`); every output is an aggregate, a GROUP BY key, or
post-processing of those.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.aggregates import AGGREGATE_NODES, OUTPUTS, recogniser, supported_functions
from dpsql.analyze.domains import derive, narrow_policies
from dpsql.analyze.scope import PublicValues, Scope
from dpsql.analyze.sources import resolve_sources
from dpsql.analyze.subqueries import Tools
from dpsql.analyze.subqueries import resolve as resolve_subqueries
from dpsql.analyze.where import canonical_cast, check_where, literal_type
from dpsql.errors import (
    DatatypeMismatch,
    Error,
    FeatureNotSupported,
    GroupingError,
    InvalidColumnReference,
    UndefinedFunction,
)
from dpsql.plan import GroupKey, OutputItem, Plan, selection_count
from dpsql.plan.sources import ident_name, qualified, resolve_ref
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, ColumnType, Policy
from dpsql.session import OutputColumn, PgType

_NOT_YET = {
    exp.ArrayAgg: "array_agg",
    exp.GroupConcat: "string_agg",
}
#: Post-processing functions allowed on noisy outputs (pure, total on numbers).
_OUTPUT_FUNCTIONS = (exp.Round, exp.Abs, exp.Coalesce, exp.Greatest, exp.Least, exp.Floor, exp.Ceil)


def _output_functions() -> str:
    """The functions allowed over aggregates, named from :data:`_OUTPUT_FUNCTIONS` (for hints)."""
    names = [f.sql_names()[0].lower() for f in _OUTPUT_FUNCTIONS]
    return f"{', '.join(names[:-1])} and {names[-1]}"


# --- GROUP BY ------------------------------------------------------------------------


def _projection_alias(projection: exp.Expr) -> str | None:
    return ident_name(projection.args["alias"].this) if isinstance(projection, exp.Alias) else None


def resolve_group_keys(tree: exp.Select, scope: Scope, where: exp.Expression | None = None) -> None:
    """GROUP BY columns, expressions, ordinals or output aliases; each becomes a :class:`GroupKey`.

    An expression key gets its SQL over clamped columns and, when finite, a domain derived from the
    policy (:mod:`dpsql.analyze.domains`); every key's domain is narrowed by WHERE's constant
    constraints (``where``: the checked predicate). Neither reads data.
    """
    group = tree.args.get("group")
    if not group:
        return
    grouping_sets = (exp.Rollup, exp.Cube, exp.GroupingSets)
    if any(group.args.get(k) for k in ("rollup", "cube", "grouping_sets")) or any(
        isinstance(e, grouping_sets) for e in group.expressions
    ):
        raise FeatureNotSupported("ROLLUP, CUBE and GROUPING SETS are not supported")
    projections = tree.expressions
    targets = []
    for item in group.expressions:
        target = item
        if isinstance(item, exp.Literal) and not item.is_string:
            index = int(item.name)
            if not 1 <= index <= len(projections):
                raise InvalidColumnReference(f"GROUP BY position {index} is not in select list")
            target = projections[index - 1].unalias()
        elif isinstance(item, exp.Column) and not item.args.get("table"):
            name = ident_name(item.this)
            if not any(name in s.table.columns for s in scope.sources.sources):
                matches = [p.unalias() for p in projections if _projection_alias(p) == name]
                if matches:
                    target = matches[0]
        if target.find(*AGGREGATE_NODES):
            raise GroupingError("aggregate functions are not allowed in GROUP BY")
        targets.append(target)
    add_group_keys(targets, scope, where)


def _distinct_keys(tree: exp.Select) -> bool:
    """``SELECT DISTINCT a, b`` without aggregates or GROUP BY means ``GROUP BY a, b``.

    What is released is exactly what ``GROUP BY`` would release with no aggregate shown: the whole
    (declared, derived, WHERE-narrowed) domain of public keys — a function of the policy and the SQL,
    so free of any person's data —, or, for other keys, the values whose noisy count passes DP
    partition selection (charged like a count).
    """
    return (
        bool(tree.args.get("distinct"))
        and not tree.args.get("group")
        and not any(p.find(*AGGREGATE_NODES) for p in tree.expressions)
    )


def add_group_keys(targets: list[exp.Expression], scope: Scope, where: exp.Expression | None) -> None:
    """Append a :class:`GroupKey` per distinct target (GROUP BY items, or SELECT DISTINCT's columns)."""
    narrowed = narrow_policies(where, lambda table, name: _source_policy(scope, table, name))

    def resolve(column: exp.Column) -> tuple[exp.Column, ColumnPolicy]:
        source, name, policy = resolve_ref(column, scope.sources)
        return qualified(source, name), narrowed.get((source.alias, name), policy)

    for target in targets:
        while isinstance(target, exp.Paren):
            target = target.this
        if isinstance(target, exp.Column):
            source, name, policy = resolve_ref(target, scope.sources)
            policy = _source_policy(scope, source.alias, name) or policy
            if any(k.column == name and k.table == source.alias for k in scope.keys):
                continue
            domain = narrowed.get((source.alias, name), policy).release_domain()
            scope.keys.append(GroupKey(column=name, table=source.alias, policy=policy, domain=domain))
            continue
        text = _canonical(target, scope)
        if any(k.expr is not None and k.column == text for k in scope.keys):
            continue
        key = derive(target, resolve, scope.check_predicate)
        virtual = ColumnPolicy(type=_POLICY_TYPES[key.type], nullable=key.nullable)
        scope.keys.append(
            GroupKey(column=text, table="", policy=virtual, domain=key.values, expr=key.sql, type=key.type)
        )


#: The policy type family standing for each released type of an expression key.
_POLICY_TYPES: dict[str, ColumnType] = {
    "bigint": "int",
    "integer": "int",
    "smallint": "int",
    "double precision": "float",
    "numeric": "float",
    "text": "text",
    "boolean": "boolean",
    "date": "date",
    "timestamp": "timestamp",
    "timestamp with time zone": "timestamp",
}


def _source_policy(scope: Scope, table: str, name: str) -> ColumnPolicy | None:
    """A column's policy; a public table's column without a declared domain gets its stored values
    (public data) as one, when the engine can read them and there are few enough."""
    source = next((s for s in scope.sources.sources if s.alias == table), None)
    policy = source.table.columns.get(name) if source is not None else None
    if policy is None or source is None or policy.domain is not None or scope.public_values is None:
        return policy
    reference = policy.stored_domain
    if reference is not None:  # domain: {table, column} of a public column that lists none
        target = scope.policy.tables[reference.table]
        values = scope.public_values(target.source or reference.table, reference.column)
    elif source.table.public and not policy.identifier:
        values = scope.public_values(source.table.source or source.name, name)
    else:
        return policy
    return policy if values is None else policy.model_copy(update={"domain": values})


def _canonical(node: exp.Expression, scope: Scope) -> str:
    """An expression's text with every column qualified: equal for ``date_trunc('month', d)`` in
    GROUP BY and ``DATE_TRUNC('month', visits.d)`` in the select list."""
    node = node.copy()
    for column in list(node.find_all(exp.Column)):
        source, name, _ = resolve_ref(column, scope.sources)
        column.replace(qualified(source, name))
    while isinstance(node, exp.Paren):
        node = node.this
    return node.sql(dialect="postgres")


def _expression_key(node: exp.Expression, scope: Scope) -> int | None:
    """Index of the expression key ``node`` spells, if any (select items, HAVING, ORDER BY)."""
    if isinstance(node, exp.Column | exp.Literal) or not any(k.expr is not None for k in scope.keys):
        return None
    try:
        text = _canonical(node, scope)
    except Error:
        return None
    return next((i for i, k in enumerate(scope.keys) if k.expr is not None and k.column == text), None)


# --- outputs: aggregates and post-processing -----------------------------------------


def _key_index(column: exp.Column, scope: Scope) -> int:
    source, name, _ = resolve_ref(column, scope.sources)
    for i, key in enumerate(scope.keys):
        if key.column == name and key.table == source.alias:
            return i
    raise GroupingError(
        f'column "{source.alias}.{name}" must appear in the GROUP BY clause or be used in an aggregate function',
        hint="dpsql releases aggregates only; raw column values never leave.",
    )


def _require_numeric_operands(node: exp.Expression) -> None:
    """Arithmetic on released numbers takes numbers: refuse text constants and failing casts up front."""
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div | exp.Mod | exp.Neg):
        for operand in (node.this, node.args.get("expression")):
            if isinstance(operand, exp.Literal) and operand.is_string:
                raise DatatypeMismatch(f'invalid input syntax for type double precision: "{operand.name}"')
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal) and node.this.is_string:
        family = literal_type(node)
        if family in ("number", "date", "timestamp"):
            canonical_cast(node, family)


def convert_output(node: exp.Expression, scope: Scope) -> tuple[exp.Expression, str, tuple[int, ...]]:
    """Turn a select/HAVING/ORDER BY expression into post-processing over measures and keys."""
    if isinstance(node, exp.Filter):
        return convert_output(_filtered(node), scope)
    key = _expression_key(node, scope)
    if key is not None:
        return exp.var(f"k{key}"), "key", ()
    aggregate = recogniser(node)
    if aggregate is not None:
        if isinstance(node.this, exp.Distinct) and not isinstance(node, exp.Count):
            raise FeatureNotSupported(f"{node.key.upper()}(DISTINCT ...) is not supported")
        return aggregate.recognise(node, scope)
    if isinstance(node, exp.WithinGroup):
        inner = node.this
        name = inner.name.lower() if isinstance(inner, exp.Anonymous) else inner.sql_name().lower()
        raise FeatureNotSupported(f"aggregate function {name} is not supported yet")
    for cls, name in _NOT_YET.items():
        if isinstance(node, cls):
            raise FeatureNotSupported(
                f"aggregate function {name} is not supported yet",
                hint=f"Supported aggregates: {', '.join(supported_functions())}.",
            )
    if isinstance(node, exp.Column):
        return exp.var(f"k{_key_index(node, scope)}"), "key", ()
    if isinstance(node, exp.Literal | exp.Null | exp.Boolean):
        return node.copy(), "expr", ()
    allowed = (exp.Binary, exp.Neg, exp.Paren, exp.Not, exp.Cast, *_OUTPUT_FUNCTIONS)
    if isinstance(node, exp.Binary) and not isinstance(
        node, exp.Add | exp.Sub | exp.Mul | exp.Div | exp.Mod | exp.Predicate | exp.Connector | exp.DPipe
    ):
        raise FeatureNotSupported(f"operator {node.key} is not supported on aggregates")
    if isinstance(node, exp.Anonymous) or (isinstance(node, exp.Func) and not isinstance(node, allowed)):
        raise UndefinedFunction(
            f"function {node.name.lower() if isinstance(node, exp.Anonymous) else node.sql_name().lower()}() "
            "does not exist",
            hint=f"Allowed here: the aggregates {', '.join(supported_functions())}; "
            f"the functions {_output_functions()}.",
        )
    if not isinstance(node, allowed):
        raise FeatureNotSupported(f"{node.key.upper()} expressions are not supported in the select list")
    _require_numeric_operands(node)
    measures: list[int] = []
    args: dict[str, object] = {}
    for arg_name, value in node.args.items():  # build a new node: copying subtrees per level is quadratic
        children = value if isinstance(value, list) else [value]
        converted = []
        for child in children:
            if isinstance(child, exp.Expression) and not isinstance(child, exp.DataType):
                new, _, used = convert_output(child, scope)
                measures.extend(used)
                converted.append(new)
            else:
                converted.append(child.copy() if isinstance(child, exp.Expression) else child)
        args[arg_name] = converted if isinstance(value, list) else converted[0]
    node = node.__class__(**args)
    return node, "expr", tuple(dict.fromkeys(measures))


def _filtered(node: exp.Filter) -> exp.Expression:
    """``agg(x) FILTER (WHERE p)`` → ``agg(CASE WHEN p THEN x END)`` (COUNT(*): ``CASE WHEN p THEN 1 END``).

    Exactly PostgreSQL's meaning: rows failing ``p`` are NULL inputs, which every aggregate skips.
    The predicate goes through the WHERE checks when the CASE operand is bounded, and the measure
    keeps the per-row sensitivity of the aggregate: filtering only removes rows.
    """
    aggregate: exp.Expression = node.this
    where = node.expression
    registered = recogniser(aggregate)
    if registered is None or not registered.filterable or isinstance(aggregate, exp.WithinGroup | exp.Filter):
        raise FeatureNotSupported("FILTER is supported on COUNT, SUM, AVG and variance aggregates")
    if isinstance(aggregate.this, exp.Distinct):
        raise FeatureNotSupported("FILTER on COUNT(DISTINCT ...) is not supported", hint="Move the filter to WHERE.")
    condition = where.this if isinstance(where, exp.Where) else where
    aggregate = aggregate.copy()
    if aggregate.expression is not None:  # two-argument aggregates: both arguments filtered
        aggregate.set("expression", exp.Case(ifs=[exp.If(this=condition.copy(), true=aggregate.expression)]))
    argument = aggregate.this
    if isinstance(argument, exp.Star) or argument is None:
        argument = exp.Literal.number(1)
    aggregate.set("this", exp.Case(ifs=[exp.If(this=condition.copy(), true=argument)]))
    return aggregate


def _output_name(projection: exp.Expr) -> str:
    """The column name PostgreSQL would give this select item."""
    alias = _projection_alias(projection)
    if alias is not None:
        return alias
    node = projection
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return ident_name(node.this)
    if isinstance(node, exp.Cast):
        return _output_name(node.this) if isinstance(node.this, exp.Column | exp.Func) else node.to.sql().lower()
    if isinstance(node, exp.WithinGroup | exp.Filter):
        return _output_name(node.this)
    if isinstance(node, exp.Func):
        aggregate = recogniser(node)
        name = aggregate.output_name(node) if aggregate is not None else None
        if name is not None:
            return name
        if isinstance(node, exp.TimestampTrunc | exp.DateTrunc):
            return "date_trunc"
        return node.sql_name().lower() if not isinstance(node, exp.Anonymous) else node.name.lower()
    return "?column?"


_TEMPORAL_TYPES: dict[exp.DType, PgType] = {
    exp.DataType.Type.DATE: "date",
    exp.DataType.Type.TIMESTAMP: "timestamp",
}


def _output_type(kind: str, expr: exp.Expression, scope: Scope, measures: tuple[int, ...]) -> PgType:
    typed = OUTPUTS[kind].output_type(scope, measures, expr)
    if typed is not None:
        return typed
    if isinstance(expr, exp.Predicate | exp.Connector | exp.Not | exp.Boolean):
        return "boolean"
    if isinstance(expr, exp.Cast):
        target = expr.to.this
        if target in exp.DataType.INTEGER_TYPES:
            return "bigint"
        if target in exp.DataType.TEXT_TYPES:
            return "text"
        if target == exp.DataType.Type.DECIMAL:
            return "numeric"  # CAST(x AS numeric): what BI tools asked for, as PostgreSQL would type it
        if target in _TEMPORAL_TYPES and isinstance(expr.this, exp.Var) and expr.this.name.startswith("k"):
            return _TEMPORAL_TYPES[target]
        return "double precision"
    if isinstance(expr, exp.Var) and expr.name.startswith("k"):
        key = scope.keys[int(expr.name[1:])]
        return key.type or PG_TYPE_NAMES[key.policy.type]
    integral = all(scope.measures[m].integer and scope.measures[m].centre == 0 for m in measures) and not expr.find(
        exp.Anonymous
    )
    literals_integral = all(not lit.is_string and "." not in lit.name for lit in expr.find_all(exp.Literal))
    if integral and literals_integral and not expr.find(exp.Round):
        return "bigint"
    return "double precision"


def build_outputs(tree: exp.Select, scope: Scope) -> list[OutputItem]:
    outputs = []
    for projection in tree.expressions:
        expr, kind, measures = convert_output(projection.unalias(), scope)
        clamp = OUTPUTS[kind].output_clamp(scope, measures)
        column = OutputColumn(
            name=_output_name(projection), type=_output_type(kind, expr, scope, measures), noisy=bool(measures)
        )
        outputs.append(
            OutputItem(
                column=column,
                expr=expr,
                noisy=bool(measures),
                clamp=clamp,
                measures=measures,
                kind=kind,
            )
        )
    return outputs


def _order_terms(
    tree: exp.Select, scope: Scope, outputs: list[OutputItem]
) -> list[tuple[exp.Expression, bool, bool | None]]:
    order = tree.args.get("order")
    if not order:
        return []
    names = {item.column.name: i for i, item in enumerate(outputs)}
    terms: list[tuple[exp.Expression, bool, bool | None]] = []
    for ordered in order.expressions:
        node = ordered.this
        if isinstance(node, exp.Literal) and not node.is_string:
            index = int(node.name)
            if not 1 <= index <= len(outputs):
                raise InvalidColumnReference(f"ORDER BY position {index} is not in select list")
            expr: exp.Expression = exp.var(f"o{index - 1}")
        elif isinstance(node, exp.Column) and not node.args.get("table") and ident_name(node.this) in names:
            expr = exp.var(f"o{names[ident_name(node.this)]}")
        else:
            expr, _, _ = convert_output(node, scope)
        terms.append((expr, bool(ordered.args.get("desc")), ordered.args.get("nulls_first")))
    return terms


def _constant_int(node: exp.Expression | None, clause: str) -> int | None:
    if node is None:
        return None
    value = node.expression if isinstance(node, exp.Limit | exp.Offset) else node
    if isinstance(value, exp.Literal) and not value.is_string and value.name.isdigit():
        return int(value.name)
    if isinstance(value, exp.Null):
        return None
    raise FeatureNotSupported(f"{clause} must be a non-negative integer constant")


def build_plan(tree: exp.Select, policy: Policy, public_values: PublicValues | None = None) -> Plan:
    """Resolve ``tree`` (already through the statement checks) into a :class:`Plan`; ``public_values``
    reads a public table column's stored values (key domains; :attr:`Scope.public_values`)."""
    scope = Scope(
        policy=policy,
        sources=resolve_sources(tree, policy),
        check_predicate=lambda p: check_where(p, scope),
        public_values=public_values,
    )
    where = tree.args.get("where")
    tools = Tools(resolve_sources, check_where)
    checked_where = check_where(resolve_subqueries(where.this, scope, tools), scope) if where else None
    resolve_group_keys(tree, scope, checked_where)
    if _distinct_keys(tree):
        add_group_keys([p.unalias() for p in tree.expressions], scope, checked_where)
    outputs = build_outputs(tree, scope)
    having = tree.args.get("having")
    having_expr = convert_output(having.this, scope)[0] if having else None
    order = _order_terms(tree, scope, outputs)
    selection = None
    if scope.keys and any(k.domain is None for k in scope.keys):
        selection = scope.measure(selection_count(scope.sources))
    if not scope.measures and not scope.keys:
        raise GroupingError(
            "a query must compute at least one aggregate",
            hint="Add COUNT(*), SUM(column) or AVG(column); dpsql never releases raw keys alone.",
        )
    return Plan(
        sources=scope.sources,
        where=checked_where,
        keys=scope.keys,
        measures=scope.measures,
        outputs=outputs,
        having=having_expr,
        order=order,
        limit=_constant_int(tree.args.get("limit"), "LIMIT"),
        offset=_constant_int(tree.args.get("offset"), "OFFSET") or 0,
        distinct=bool(tree.args.get("distinct")),
        selection_measure=selection,
    )
