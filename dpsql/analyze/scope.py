"""Name resolution for one SELECT, and the operand helpers every aggregate's recogniser shares.

The analyzer (``analyze.build``) owns clauses; each aggregate (``dpsql.aggregates``) owns how its
call becomes measures. Both meet here: a :class:`Scope` resolves columns against the policy
(identifiers are never readable), turns an aggregate's argument into a bounded :class:`Operand`,
and adds each distinct measure once (shared counts are computed and noised once, so charged once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlglot import exp

from dpsql.aggregates import AGGREGATE_NODES, Operand
from dpsql.analyze.expressions import bound
from dpsql.errors import FeatureNotSupported, GroupingError, UndefinedFunction
from dpsql.plan import GroupKey, Measure
from dpsql.plan.sources import Sources, qualified, resolve_ref
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy, Policy

#: Reads a public table column's stored values (backend table, column), None when too many.
PublicValues = Callable[[str, str], "tuple[Any, ...] | None"]

#: Meta flag on a predicate checked and rendered before WHERE's own checks (a subquery predicate,
#: :mod:`dpsql.analyze.subqueries`): those pass it through as it is.
CHECKED = "dpsql_subquery_checked"


@dataclass
class Scope:
    """Name resolution state for one SELECT."""

    policy: Policy
    sources: Sources
    #: Validates a predicate used inside an aggregate's argument (CASE WHEN …) as WHERE would.
    check_predicate: Callable[[exp.Expression], exp.Expression]
    keys: list[GroupKey] = field(default_factory=list)
    measures: list[Measure] = field(default_factory=list)
    #: The stored values of a public table's column (table, column), or None when there are too many:
    #: a public table's data is public, so its values may be a key's domain (read by the engine).
    public_values: PublicValues | None = None
    #: measure → its index in ``measures`` (a list scan per aggregate made analysis quadratic).
    _index: dict[Measure, int] = field(default_factory=dict)

    def measure(self, measure: Measure) -> int:
        """Index of ``measure``, adding it once: shared counts are computed and noised once."""
        index = self._index.get(measure)
        if index is None:
            index = self._index[measure] = len(self.measures)
            self.measures.append(measure)
        return index

    def resolve(self, column: exp.Column) -> tuple[str, ColumnPolicy]:
        """A column reference → (name, policy); identifiers are never readable."""
        _, name, policy = resolve_ref(column, self.sources)
        return name, policy

    def operand(self, argument: exp.Expression | None) -> Operand:
        """An aggregate's argument: a column, or an expression bounded by interval arithmetic (an
        aggregate call inside it is refused)."""
        while isinstance(argument, exp.Paren):
            argument = argument.this
        if isinstance(argument, exp.Column):
            source, name, policy = resolve_ref(argument, self.sources)
            return Operand(source.alias, name, policy)
        if argument is None or argument.find(*AGGREGATE_NODES):
            raise GroupingError("aggregate function calls cannot be nested")

        def resolve(column: exp.Column) -> tuple[exp.Column, ColumnPolicy]:
            source, name, policy = resolve_ref(column, self.sources)
            return qualified(source, name), policy

        bounded = bound(argument, resolve, self.check_predicate)
        return Operand(None, argument.sql(dialect="postgres"), bounded.policy(), bounded.sql)

    def bounded_sum(self, operand: Operand, function: str, *, centred: bool) -> Measure:
        """A clamped SUM of ``operand`` (centred on the bounds' midpoint for AVG/variance).

        Refuses non-numeric and unbounded operands: without declared bounds one row's
        contribution, hence the sensitivity, is unbounded.
        """
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

    def count_of(self, operand: Operand) -> Measure:
        """COUNT(col) of a non-nullable column is COUNT(*): share one measurement (and its budget).

        Not across joins: a LEFT JOIN can make a non-nullable column NULL.
        """
        if operand.policy.nullable or self.sources.joins:
            return Measure(kind="count", column=operand.name, table=operand.table, expr=operand.expr)
        return Measure(kind="count_star")
