"""Resolve a checked SELECT against the policy and build the typed :class:`~dpsql.plan.Plan`.

Every column is resolved against the policy (unknown → 42703, identifier → 42501);
WHERE may only contain predicates that cannot fail on data (so no error can act as an
oracle); every output is an aggregate, a GROUP BY key, or post-processing of those.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.aggregates import OUTPUTS
from dpsql.analyze.expressions import bound
from dpsql.analyze.sources import Sources, ident_name, qualified, resolve_ref, resolve_sources
from dpsql.errors import (
    DatatypeMismatch,
    FeatureNotSupported,
    GroupingError,
    InvalidColumnReference,
    InvalidEscapeSequence,
    InvalidParameterValue,
    NumericValueOutOfRange,
    SyntaxError_,
    UndefinedFunction,
)
from dpsql.plan import GroupKey, Measure, OutputItem, Plan
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, Policy
from dpsql.session import OutputColumn, PgType

#: Variance family → (PostgreSQL's output name, sample variance?, square root?)
_VARIANCES: dict[type[exp.Expr], tuple[str, bool, bool]] = {
    exp.Variance: ("variance", True, False),
    exp.VariancePop: ("var_pop", False, False),
    exp.Stddev: ("stddev", True, True),
    exp.StddevSamp: ("stddev_samp", True, True),
    exp.StddevPop: ("stddev_pop", False, True),
}
_AGGREGATES: tuple[type[exp.Expr], ...] = (exp.Count, exp.Sum, exp.Avg, *_VARIANCES)
_QUANTILES = (exp.Min, exp.Max, exp.Median, exp.WithinGroup)
_NOT_YET = {
    exp.ArrayAgg: "array_agg",
    exp.GroupConcat: "string_agg",
}
_PREDICATES = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
#: Post-processing functions allowed on noisy outputs (pure, total on numbers).
_OUTPUT_FUNCTIONS = (exp.Round, exp.Abs, exp.Coalesce, exp.Greatest, exp.Least, exp.Floor, exp.Ceil)


@dataclass
class _Scope:
    """Name resolution state for one SELECT."""

    policy: Policy
    sources: Sources
    keys: list[GroupKey] = field(default_factory=list)
    measures: list[Measure] = field(default_factory=list)
    #: measure → its index in ``measures`` (a list scan per aggregate made analysis quadratic).
    _index: dict[Measure, int] = field(default_factory=dict)

    def measure(self, measure: Measure) -> int:
        """Index of ``measure``, adding it once: shared counts are computed and noised once."""
        index = self._index.get(measure)
        if index is None:
            index = self._index[measure] = len(self.measures)
            self.measures.append(measure)
        return index


_ident_name = ident_name


def resolve_column(column: exp.Column, scope: _Scope) -> tuple[str, ColumnPolicy]:
    """A column reference → (name, policy); identifiers are never readable."""
    _, name, policy = resolve_ref(column, scope.sources)
    return name, policy


# --- WHERE ----------------------------------------------------------------------------


def _literal_type(node: exp.Expression) -> str | None:
    """The policy type family of a constant, or None if it is not a constant."""
    if isinstance(node, exp.Neg):
        return _literal_type(node.this)
    if isinstance(node, exp.Paren):
        return _literal_type(node.this)
    if isinstance(node, exp.Null):
        return "null"
    if isinstance(node, exp.Boolean):
        return "boolean"
    if isinstance(node, exp.Literal):
        return "text" if node.is_string else "number"
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        to = node.to.this
        if to in exp.DataType.TEMPORAL_TYPES:
            return "timestamp" if to != exp.DataType.Type.DATE else "date"
        if to in exp.DataType.NUMERIC_TYPES:
            return "number"
        if to in exp.DataType.TEXT_TYPES:
            return "text"
    return None


def _require_finite(literal: exp.Expression) -> None:
    """Numbers too large for a double would overflow differently on each backend: refuse them."""
    node = literal.this if isinstance(literal, exp.Neg) else literal
    if isinstance(node, exp.Literal) and not math.isfinite(float(node.name)):
        raise NumericValueOutOfRange(f'value out of range: "{node.name}"')


def _canonical_cast(cast: exp.Cast, kind: str) -> exp.Expression:
    """Validate ``CAST('<text>' AS <type>)`` here, so the backend never evaluates a cast that could fail.

    A failing cast is only evaluated when some row reaches it, so its error would tell whether
    anyone matches the rest of the predicate: an exact, un-noised oracle.
    """
    text = cast.this.name
    try:
        if kind == "number":
            number = float(text)
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError(text)
            return exp.Literal.number(text.strip())
        if kind == "date":
            return exp.cast(exp.Literal.string(dt.date.fromisoformat(text.strip()).isoformat()), exp.DataType.Type.DATE)
        if kind == "timestamp":
            value = dt.datetime.fromisoformat(text.strip()).isoformat(sep=" ")
            return exp.cast(exp.Literal.string(value), exp.DataType.Type.TIMESTAMP)
    except ValueError:
        shown = {"number": "numeric"}.get(kind, kind)
        raise DatatypeMismatch(f'invalid input syntax for type {shown}: "{text}"') from None
    return cast.this.copy() if kind == "text" else cast


def _check_literal_for(column: str, policy: ColumnPolicy, literal: exp.Expression) -> exp.Expression:
    """Type-check a constant against a column, so no comparison can fail on a data value."""
    kind = _literal_type(literal)
    if kind is None:
        raise FeatureNotSupported(
            "only comparisons between a column and constants are supported in WHERE",
            hint=f'Compare "{column}" with a literal value.',
        )
    if kind == "null":
        return literal
    if isinstance(literal, exp.Cast):
        literal = _canonical_cast(literal, kind)
    if policy.type in ("int", "float"):
        if kind == "number":
            _require_finite(literal)
            return literal
        if kind == "text":
            try:
                if not math.isfinite(float(literal.name)):
                    raise ValueError(literal.name)
            except ValueError:
                raise DatatypeMismatch(
                    f'invalid input syntax for type {PG_TYPE_NAMES[policy.type]}: "{literal.name}"',
                    hint=f'"{column}" is numeric; compare it with a number.',
                ) from None
            return exp.Literal.number(literal.name)
    elif policy.type in ("date", "timestamp"):
        if kind in ("date", "timestamp"):
            return literal
        if kind == "text":
            try:
                value = dt.datetime.fromisoformat(literal.name)
            except ValueError:
                raise DatatypeMismatch(
                    f'invalid input syntax for type {policy.type}: "{literal.name}"',
                    hint="Write dates as 'YYYY-MM-DD'.",
                ) from None
            text = value.date().isoformat() if policy.type == "date" else value.isoformat(sep=" ")
            return exp.cast(exp.Literal.string(text), policy.type)
    elif policy.type == "text":
        if kind == "text":
            return literal
    elif policy.type == "boolean":
        if kind == "boolean":
            return literal
        if kind == "text" and literal.name.lower() in ("true", "false", "t", "f"):
            return exp.Boolean(this=literal.name.lower() in ("true", "t"))
    raise DatatypeMismatch(
        f"operator does not exist: {PG_TYPE_NAMES[policy.type]} compared with {kind}",
        hint=f'"{column}" is of type {PG_TYPE_NAMES[policy.type]}; compare it with a value of that type.',
    )


#: The escape character of every LIKE dpsql sends, spelled out: DuckDB has no default escape,
#: PostgreSQL's is backslash, so an implicit one would match differently on each backend.
LIKE_ESCAPE = "\\"


def canonical_like_pattern(pattern: str) -> str:
    """A LIKE pattern, read with PostgreSQL's default escape (backslash), rewritten so that no backend
    can fail on it when sent with ``ESCAPE '\\'``.

    A pattern is evaluated only when some row reaches the predicate, so a pattern the backend rejects
    (PostgreSQL: a trailing escape character, 22025) would tell whether anyone matches the rest of the
    WHERE clause: an exact oracle. It is refused here instead, before anything runs, whatever the data.
    In the canonical form only ``%``, ``_`` and the backslash itself are ever escaped.
    """
    out: list[str] = []
    chars = iter(pattern)
    for char in chars:
        if char == LIKE_ESCAPE:
            literal = next(chars, None)
            if literal is None:
                raise InvalidEscapeSequence("LIKE pattern must not end with escape character")
            out.append(LIKE_ESCAPE + literal if literal in "%_" + LIKE_ESCAPE else literal)
        else:
            out.append(char)
    return "".join(out)


def _operand(node: exp.Expression, scope: _Scope) -> tuple[str, ColumnPolicy] | None:
    """The column an operand refers to (unwrapping parentheses), or None for constants."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return resolve_column(node, scope)
    if isinstance(node, exp.Lower | exp.Upper) and isinstance(node.this, exp.Column):
        name, policy = resolve_column(node.this, scope)
        if policy.type != "text":
            raise UndefinedFunction(f"function {node.key}({PG_TYPE_NAMES[policy.type]}) does not exist")
        return name, policy
    return None


def _normalise_column(node: exp.Expression, scope: _Scope) -> exp.Expression:
    """Rewrite column references to the bare, quoted policy name (the rewrite has one table)."""
    if isinstance(node, exp.Column):
        source, name, _ = resolve_ref(node, scope.sources)
        return qualified(source, name)
    node = node.copy()
    for column in list(node.find_all(exp.Column)):
        source, name, _ = resolve_ref(column, scope.sources)
        column.replace(qualified(source, name))
    return node


def check_where(node: exp.Expression, scope: _Scope) -> exp.Expression:
    """Validate a predicate tree; return it with columns normalised and literals typed."""
    if isinstance(node, exp.Paren):
        return exp.Paren(this=check_where(node.this, scope))
    if isinstance(node, exp.And | exp.Or):
        return node.__class__(this=check_where(node.this, scope), expression=check_where(node.expression, scope))
    if isinstance(node, exp.Not):
        return exp.Not(this=check_where(node.this, scope))
    if isinstance(node, exp.Boolean):
        return node.copy()
    if isinstance(node, _AGGREGATES) or node.find(*_AGGREGATES):
        raise GroupingError("aggregate functions are not allowed in WHERE", hint="Use HAVING to filter groups.")
    if isinstance(node, exp.Column):
        _, policy = resolve_column(node, scope)
        if policy.type != "boolean":
            raise DatatypeMismatch(f"argument of WHERE must be type boolean, not type {PG_TYPE_NAMES[policy.type]}")
        return _normalise_column(node, scope)
    if isinstance(node, _PREDICATES):
        return _check_comparison(node, scope)
    if isinstance(node, exp.Is):
        if _operand(node.this, scope) is None or not isinstance(node.expression, exp.Null | exp.Boolean):
            raise FeatureNotSupported("IS must test a column for NULL, TRUE or FALSE")
        return _normalise_column(node, scope)
    if isinstance(node, exp.In):
        return _check_in(node, scope)
    if isinstance(node, exp.Between):
        target = _required_operand(node.this, scope)
        low = _check_literal_for(*target, node.args["low"])
        high = _check_literal_for(*target, node.args["high"])
        return exp.Between(this=_normalise_column(node.this, scope), low=low, high=high)
    if isinstance(node, exp.Like | exp.ILike):
        name, policy = _required_operand(node.this, scope)
        if policy.type != "text":
            raise UndefinedFunction(
                f"operator does not exist: {PG_TYPE_NAMES[policy.type]} ~~ unknown",
                hint=f'LIKE needs a text column; "{name}" is {PG_TYPE_NAMES[policy.type]}.',
            )
        pattern = node.expression
        if isinstance(pattern, exp.Cast) and _literal_type(pattern) == "text":
            pattern = pattern.this
        if not (isinstance(pattern, exp.Literal) and pattern.is_string):
            raise FeatureNotSupported("LIKE patterns must be string constants")
        if node.args.get("escape") is not None:
            raise FeatureNotSupported("LIKE ... ESCAPE is not supported")
        checked = exp.Escape(
            this=node.__class__(
                this=_normalise_column(node.this, scope),
                expression=exp.Literal.string(canonical_like_pattern(pattern.name)),
            ),
            expression=exp.Literal.string(LIKE_ESCAPE),
        )
        return exp.Not(this=checked) if node.args.get("negate") else checked
    if isinstance(node, exp.Escape):
        raise FeatureNotSupported("LIKE ... ESCAPE is not supported")
    raise FeatureNotSupported(
        f"{node.key.upper()} expressions are not supported in WHERE",
        hint="WHERE may use comparisons with constants, AND/OR/NOT, IN, BETWEEN, LIKE and IS NULL.",
    )


def _required_operand(node: exp.Expression, scope: _Scope) -> tuple[str, ColumnPolicy]:
    operand = _operand(node, scope)
    if operand is None:
        raise FeatureNotSupported(
            "the left side of this predicate must be a column",
            hint="Write predicates as <column> <operator> <constant>.",
        )
    return operand


def _check_comparison(node: exp.Expression, scope: _Scope) -> exp.Expression:
    left, right = _operand(node.this, scope), _operand(node.expression, scope)
    if left and right:
        if (left[1].type in ("int", "float")) != (right[1].type in ("int", "float")) or (
            left[1].type not in ("int", "float") and left[1].type != right[1].type
        ):
            raise DatatypeMismatch(
                f"operator does not exist: {PG_TYPE_NAMES[left[1].type]} {node.key} {PG_TYPE_NAMES[right[1].type]}",
                hint="Compare columns of the same type.",
            )
        return node.__class__(
            this=_normalise_column(node.this, scope), expression=_normalise_column(node.expression, scope)
        )
    if left:
        return node.__class__(
            this=_normalise_column(node.this, scope), expression=_check_literal_for(*left, node.expression)
        )
    if right:
        return node.__class__(
            this=_check_literal_for(*right, node.this), expression=_normalise_column(node.expression, scope)
        )
    raise FeatureNotSupported(
        "comparisons in WHERE must involve a column",
        hint="Write predicates as <column> <operator> <constant>.",
    )


def _check_in(node: exp.In, scope: _Scope) -> exp.Expression:
    target = _required_operand(node.this, scope)
    if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
        raise FeatureNotSupported("IN (subquery) is not supported", hint="List constant values inside IN (...).")
    if not node.expressions:
        raise SyntaxError_('syntax error at or near ")"', hint="IN needs at least one value.")
    values = [_check_literal_for(*target, v) for v in node.expressions]
    return exp.In(this=_normalise_column(node.this, scope), expressions=values)


# --- GROUP BY ------------------------------------------------------------------------


def _projection_alias(projection: exp.Expr) -> str | None:
    return _ident_name(projection.args["alias"].this) if isinstance(projection, exp.Alias) else None


def resolve_group_keys(tree: exp.Select, scope: _Scope) -> None:
    """GROUP BY columns, ordinals or output aliases; each becomes a :class:`GroupKey`."""
    group = tree.args.get("group")
    if not group:
        return
    grouping_sets = (exp.Rollup, exp.Cube, exp.GroupingSets)
    if any(group.args.get(k) for k in ("rollup", "cube", "grouping_sets")) or any(
        isinstance(e, grouping_sets) for e in group.expressions
    ):
        raise FeatureNotSupported("ROLLUP, CUBE and GROUPING SETS are not supported")
    projections = tree.expressions
    for item in group.expressions:
        target = item
        if isinstance(item, exp.Literal) and not item.is_string:
            index = int(item.name)
            if not 1 <= index <= len(projections):
                raise InvalidColumnReference(f"GROUP BY position {index} is not in select list")
            target = projections[index - 1].unalias()
        elif isinstance(item, exp.Column) and not item.args.get("table"):
            name = _ident_name(item.this)
            if not any(name in s.table.columns for s in scope.sources.sources):
                matches = [p.unalias() for p in projections if _projection_alias(p) == name]
                if matches:
                    target = matches[0]
        if not isinstance(target, exp.Column):
            if target.find(*_AGGREGATES):
                raise GroupingError("aggregate functions are not allowed in GROUP BY")
            raise FeatureNotSupported("GROUP BY expressions are not supported yet", hint="Group by declared columns.")
        source, name, policy = resolve_ref(target, scope.sources)
        if any(k.column == name and k.table == source.alias for k in scope.keys):
            continue
        scope.keys.append(GroupKey(column=name, table=source.alias, policy=policy, domain=policy.release_domain()))


# --- outputs: aggregates and post-processing -----------------------------------------


def _key_index(column: exp.Column, scope: _Scope) -> int:
    source, name, _ = resolve_ref(column, scope.sources)
    for i, key in enumerate(scope.keys):
        if key.column == name and key.table == source.alias:
            return i
    raise GroupingError(
        f'column "{source.alias}.{name}" must appear in the GROUP BY clause or be used in an aggregate function',
        hint="dpsql releases aggregates only; raw column values never leave.",
    )


@dataclass(frozen=True)
class _Operand:
    """What an aggregate reads: a declared column, or a bounded expression over columns."""

    table: str | None
    name: str
    policy: ColumnPolicy
    expr: exp.Expression | None = None


def _aggregate_column(agg: exp.Expression, scope: _Scope) -> _Operand:
    argument = agg.this
    while isinstance(argument, exp.Paren):
        argument = argument.this
    if isinstance(argument, exp.Column):
        source, name, policy = resolve_ref(argument, scope.sources)
        return _Operand(source.alias, name, policy)
    if argument is None or argument.find(*_AGGREGATES):
        raise GroupingError("aggregate function calls cannot be nested")

    def resolve(column: exp.Column) -> tuple[exp.Column, ColumnPolicy]:
        source, name, policy = resolve_ref(column, scope.sources)
        return qualified(source, name), policy

    bounded = bound(argument, resolve, lambda predicate: check_where(predicate, scope))
    return _Operand(None, argument.sql(dialect="postgres"), bounded.policy(), bounded.sql)


def _distinct_units(agg: exp.Count, scope: _Scope) -> Measure:
    """COUNT(DISTINCT <privacy unit>): each unit adds at most 1 per group."""
    argument = agg.this.expressions[0] if len(agg.this.expressions) == 1 else None
    unit = scope.sources.unit
    if isinstance(argument, exp.Column) and unit is not None:
        source, name, _ = resolve_ref(argument, scope.sources, identifiers=True)
        if name == source.unit_column:
            return Measure(kind="count_units", column=name, table=source.alias)
    raise FeatureNotSupported(
        "COUNT(DISTINCT ...) is supported only on the privacy unit",
        hint="Distinct counts of other columns can change by more than one per person."
        + (f" Count DISTINCT {unit.sql()} to count persons." if unit is not None else ""),
    )


def _sum_measure(operand: _Operand, function: str, *, centred: bool) -> Measure:
    name, policy = operand.name, operand.policy
    if not policy.numeric:
        raise UndefinedFunction(
            f"function {function}({PG_TYPE_NAMES[policy.type]}) does not exist",
            hint=f"{function.upper()} needs a numeric column.",
        )
    if not policy.bounded:
        raise FeatureNotSupported(
            f'column "{name}" has no declared bounds',
            hint=f'Declare lower/upper for "{name}" in the policy so {function.upper()} has a finite sensitivity.',
        )
    lower, upper = float(policy.lower), float(policy.upper)  # type: ignore[arg-type]
    integer = policy.type == "int"
    centre = 0.0
    if centred:
        centre = float((int(lower) + int(upper)) // 2) if integer else (lower + upper) / 2
    return Measure(
        kind="sum",
        column=name,
        table=operand.table,
        lower=lower,
        upper=upper,
        centre=centre,
        integer=integer,
        expr=operand.expr,
    )


def _count_measure(operand: _Operand, scope: _Scope) -> Measure:
    """COUNT(col) of a non-nullable column is COUNT(*): share one measurement (and its budget).

    Not across joins: a LEFT JOIN can make a non-nullable column NULL.
    """
    if operand.policy.nullable or scope.sources.joins:
        return Measure(kind="count", column=operand.name, table=operand.table, expr=operand.expr)
    return Measure(kind="count_star")


def _measure_expression(agg: exp.Expression, scope: _Scope) -> tuple[exp.Expression, str, tuple[int, ...]]:
    """Replace one aggregate call by an expression over measure variables.

    Returns the expression, its output kind and the measures it reads.
    """
    if agg.args.get("filter") or isinstance(agg.parent, exp.Filter):
        raise FeatureNotSupported("aggregate FILTER clauses are not supported yet", hint="Move the filter to WHERE.")
    if isinstance(agg.this, exp.Distinct):
        if not isinstance(agg, exp.Count):
            raise FeatureNotSupported(f"{agg.key.upper()}(DISTINCT ...) is not supported")
        index = scope.measure(_distinct_units(agg, scope))
        return exp.var(f"m{index}"), "count", (index,)
    if isinstance(agg, exp.Count):
        if isinstance(agg.this, exp.Star) or agg.this is None:
            index = scope.measure(Measure(kind="count_star"))
        else:
            index = scope.measure(_count_measure(_aggregate_column(agg, scope), scope))
        return exp.var(f"m{index}"), "count", (index,)
    operand = _aggregate_column(agg, scope)
    if isinstance(agg, exp.Sum):
        index = scope.measure(_sum_measure(operand, "sum", centred=False))
        return exp.var(f"m{index}"), "sum", (index,)
    if type(agg) in _VARIANCES:
        function, sample, root = _VARIANCES[type(agg)]
        centred = _sum_measure(operand, function, centred=True)
        square = dataclasses.replace(centred, square=True)
        if square.sensitivity >= 2.0**62:  # squares beyond BIGINT: sum them as doubles
            square = dataclasses.replace(square, integer=False)
        squares = scope.measure(square)
        total = scope.measure(centred)
        count = scope.measure(_count_measure(operand, scope))
        call = exp.Anonymous(
            this="dp_variance",
            expressions=[
                exp.var(f"m{squares}"),
                exp.var(f"m{total}"),
                exp.var(f"m{count}"),
                exp.Boolean(this=sample),
                exp.Boolean(this=root),
            ],
        )
        return call, "variance", (squares, total, count)
    total = scope.measure(_sum_measure(operand, "avg", centred=True))
    count = scope.measure(_count_measure(operand, scope))
    measure = scope.measures[total]
    call = exp.Anonymous(
        this="dp_avg",
        expressions=[exp.var(f"m{total}"), exp.var(f"m{count}"), exp.Literal.number(measure.centre)],
    )
    return call, "avg", (total, count)


def _mode_measure(node: exp.WithinGroup, scope: _Scope) -> Measure:
    """mode() WITHIN GROUP (ORDER BY col): report-noisy-max over the column's public domain."""
    order = node.expression
    ordered = order.expressions[0] if isinstance(order, exp.Order) and len(order.expressions) == 1 else None
    if ordered is None or not isinstance(ordered.this, exp.Column):
        raise FeatureNotSupported("mode() needs exactly one ORDER BY column")
    source, name, policy = resolve_ref(ordered.this, scope.sources)
    domain = policy.release_domain()
    if domain is None:
        raise FeatureNotSupported(
            f'mode() needs a public domain for column "{name}"',
            hint=f'Declare the possible values of "{name}" (domain) in the policy: the winner is chosen among them.',
        )
    return Measure(kind="mode", column=name, table=source.alias, domain=domain, integer=False)


def _quantile_measure(node: exp.Expression, scope: _Scope) -> tuple[Measure, bool]:
    """MIN/MAX/median/percentile_cont/percentile_disc → a quantile measure; also whether it is discrete."""
    if isinstance(node, exp.WithinGroup):
        inner, order = node.this, node.expression
        if not isinstance(inner, exp.PercentileCont | exp.PercentileDisc):
            name = inner.name.lower() if isinstance(inner, exp.Anonymous) else inner.sql_name().lower()
            raise FeatureNotSupported(f"aggregate function {name} is not supported yet")
        fraction = inner.this
        if not (isinstance(fraction, exp.Literal) and not fraction.is_string and 0 <= float(fraction.name) <= 1):
            raise InvalidParameterValue(
                "percentile value must be a constant between 0 and 1", hint="Write e.g. percentile_cont(0.9)."
            )
        ordered = order.expressions[0] if isinstance(order, exp.Order) and len(order.expressions) == 1 else None
        if ordered is None:
            raise FeatureNotSupported("WITHIN GROUP needs exactly one ORDER BY column")
        q = float(fraction.name)
        if ordered.args.get("desc"):
            q = 1.0 - q
        argument, discrete = ordered.this, isinstance(inner, exp.PercentileDisc)
    else:
        q = {exp.Min: 0.0, exp.Max: 1.0, exp.Median: 0.5}[type(node)]  # type: ignore[index]  # a quantile node
        argument, discrete = node.this, not isinstance(node, exp.Median)
    function_node: exp.Func = node.this if isinstance(node, exp.WithinGroup) else node  # type: ignore[assignment]
    function = function_node.sql_name().lower()
    while isinstance(argument, exp.Paren):
        argument = argument.this
    if not isinstance(argument, exp.Column):
        raise FeatureNotSupported(f"{function} over an expression is not supported yet")
    source, name, policy = resolve_ref(argument, scope.sources)
    bounds = _sum_measure(_Operand(source.alias, name, policy), function, centred=False)
    measure = Measure(
        kind="quantile",
        column=name,
        table=source.alias,
        lower=bounds.lower,
        upper=bounds.upper,
        integer=bounds.integer,
        q=q,
    )
    return measure, discrete


def _require_numeric_operands(node: exp.Expression) -> None:
    """Arithmetic on released numbers takes numbers: refuse text constants and failing casts up front."""
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div | exp.Mod | exp.Neg):
        for operand in (node.this, node.args.get("expression")):
            if isinstance(operand, exp.Literal) and operand.is_string:
                raise DatatypeMismatch(f'invalid input syntax for type double precision: "{operand.name}"')
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal) and node.this.is_string:
        kind = _literal_type(node)
        if kind in ("number", "date", "timestamp"):
            _canonical_cast(node, kind)


def convert_output(node: exp.Expression, scope: _Scope) -> tuple[exp.Expression, str, tuple[int, ...]]:
    """Turn a select/HAVING/ORDER BY expression into post-processing over measures and keys."""
    if isinstance(node, exp.WithinGroup) and isinstance(node.this, exp.Mode):
        index = scope.measure(_mode_measure(node, scope))
        return exp.var(f"m{index}"), "mode", (index,)
    if isinstance(node, _QUANTILES):
        measure, discrete = _quantile_measure(node, scope)
        index = scope.measure(measure)
        return exp.var(f"m{index}"), "quantile_disc" if discrete else "quantile", (index,)
    for cls, name in _NOT_YET.items():
        if isinstance(node, cls):
            raise FeatureNotSupported(
                f"aggregate function {name} is not supported yet",
                hint="Supported aggregates: COUNT(*), COUNT(column), SUM(column), AVG(column).",
            )
    if isinstance(node, exp.Filter):
        raise FeatureNotSupported("aggregate FILTER clauses are not supported yet", hint="Move the filter to WHERE.")
    if isinstance(node, _AGGREGATES):
        return _measure_expression(node, scope)
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
            hint="Allowed here: COUNT, SUM, AVG and round, abs, coalesce, greatest, least, floor, ceil.",
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


def _output_name(projection: exp.Expr) -> str:
    """The column name PostgreSQL would give this select item."""
    alias = _projection_alias(projection)
    if alias is not None:
        return alias
    node = projection
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return _ident_name(node.this)
    if isinstance(node, exp.Cast):
        return _output_name(node.this) if isinstance(node.this, exp.Column | exp.Func) else node.to.sql().lower()
    if isinstance(node, exp.WithinGroup):
        return _output_name(node.this)
    if type(node) in _VARIANCES:
        return _VARIANCES[type(node)][0]
    if isinstance(node, exp.Func):
        return node.sql_name().lower() if not isinstance(node, exp.Anonymous) else node.name.lower()
    return "?column?"


def _output_type(kind: str, expr: exp.Expression, scope: _Scope, measures: tuple[int, ...]) -> PgType:
    if kind == "key":
        return PG_TYPE_NAMES[scope.keys[int(expr.name[1:])].policy.type]
    typed = OUTPUTS[kind].output_type(scope, measures)
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
        return "double precision"
    if isinstance(expr, exp.Var) and expr.name.startswith("k"):
        return PG_TYPE_NAMES[scope.keys[int(expr.name[1:])].policy.type]
    integral = all(scope.measures[m].integer and scope.measures[m].centre == 0 for m in measures) and not expr.find(
        exp.Anonymous
    )
    literals_integral = all(not lit.is_string and "." not in lit.name for lit in expr.find_all(exp.Literal))
    if integral and literals_integral and not expr.find(exp.Round):
        return "bigint"
    return "double precision"


def build_outputs(tree: exp.Select, scope: _Scope) -> list[OutputItem]:
    outputs = []
    for projection in tree.expressions:
        expr, kind, measures = convert_output(projection.unalias(), scope)
        clamp = OUTPUTS[kind].output_clamp(scope, measures)
        column = OutputColumn(
            name=_output_name(projection), type=_output_type(kind, expr, scope, measures), noisy=bool(measures)
        )
        kind = "quantile" if kind == "quantile_disc" else kind  # released like any quantile
        outputs.append(
            OutputItem(
                column=column,
                expr=expr,
                noisy=bool(measures),
                clamp=clamp,
                measures=measures,
                kind=kind,  # type: ignore[arg-type]
            )
        )
    return outputs


def _order_terms(tree: exp.Select, scope: _Scope, outputs: list[OutputItem]) -> list:
    order = tree.args.get("order")
    if not order:
        return []
    names = {item.column.name: i for i, item in enumerate(outputs)}
    terms = []
    for ordered in order.expressions:
        node = ordered.this
        if isinstance(node, exp.Literal) and not node.is_string:
            index = int(node.name)
            if not 1 <= index <= len(outputs):
                raise InvalidColumnReference(f"ORDER BY position {index} is not in select list")
            expr: exp.Expression = exp.var(f"o{index - 1}")
        elif isinstance(node, exp.Column) and not node.args.get("table") and _ident_name(node.this) in names:
            expr = exp.var(f"o{names[_ident_name(node.this)]}")
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


def build_plan(tree: exp.Select, policy: Policy) -> Plan:
    """Resolve ``tree`` (already through the statement checks) into a :class:`Plan`."""
    scope = _Scope(policy=policy, sources=resolve_sources(tree, policy))
    where = tree.args.get("where")
    checked_where = check_where(where.this, scope) if where else None
    resolve_group_keys(tree, scope)
    outputs = build_outputs(tree, scope)
    having = tree.args.get("having")
    having_expr = convert_output(having.this, scope)[0] if having else None
    order = _order_terms(tree, scope, outputs)
    selection = None
    if scope.keys and any(k.domain is None for k in scope.keys):
        selection = scope.measure(Measure(kind="count_star"))
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
