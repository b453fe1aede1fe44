"""Analyze: SQL text + policy → a typed :class:`~dpsql.plan.Plan`, or one precise refusal.

The order of passes is written down here and nowhere else: parse, comma joins made joins
(``joins.comma_joins``), fold constant date/time expressions (``fold.fold_constants``), inline simple
views (``views.inline_views``),
statement-shape checks (``checks.STATEMENT_CHECKS``), bind parameters (then fold again: a bound
parameter can complete a constant), then resolution and plan building.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.build import build_plan
from dpsql.analyze.checks import STATEMENT_CHECKS, require_known_tables
from dpsql.analyze.fold import fold_constants
from dpsql.analyze.joins import comma_joins
from dpsql.analyze.parse import Params, bind_parameters, parse_statement, too_complex
from dpsql.analyze.scope import PublicValues
from dpsql.analyze.views import inline_views
from dpsql.errors import UndefinedParameter
from dpsql.plan import Plan
from dpsql.policy import PG_TYPE_NAMES, Policy

__all__ = ["analyze", "analyze_tree", "infer_parameter_types", "parse_statement"]


def analyze_tree(
    tree: exp.Expression, policy: Policy, params: Params = None, public_values: PublicValues | None = None
) -> Plan:
    """Check and plan an already parsed statement (``public_values``: :attr:`Scope.public_values`)."""
    try:
        require_known_tables(tree, policy)
        tree = inline_views(fold_constants(comma_joins(tree, policy)), policy)
        for check in STATEMENT_CHECKS:
            check(tree)
        bound = fold_constants(bind_parameters(tree, params))
        assert isinstance(bound, exp.Select)
        return build_plan(bound, policy, public_values)
    except RecursionError:
        raise too_complex() from None


def analyze(sql: str, policy: Policy, params: Params = None) -> Plan:
    """Parse, check and plan ``sql`` against ``policy``."""
    return analyze_tree(parse_statement(sql), policy, params)


#: Bind carries at most 65535 parameter values (an Int16 count), as in PostgreSQL.
MAX_PARAMETERS = 65535


def infer_parameter_types(tree: exp.Expression, policy: Policy) -> list[str]:
    """PostgreSQL type names for ``$1..$n``: the type of the column each one is compared with."""
    found: dict[int, str] = {}
    columns = {name: col for table in policy.tables.values() for name, col in table.columns.items()}
    for param in tree.find_all(exp.Parameter):
        if not isinstance(param.this, exp.Literal):
            continue
        index = int(param.this.name)
        if not 1 <= index <= MAX_PARAMETERS:  # a list sized by $99999999 would be gigabytes
            raise UndefinedParameter(
                f"there is no parameter ${index}",
                hint=f"Parameters are numbered $1 to ${MAX_PARAMETERS} (the protocol's limit).",
            )
        context = param.parent
        while isinstance(context, exp.Paren | exp.Neg | exp.Cast):
            context = context.parent
        column = None
        if context is not None:
            column = next((c for c in context.find_all(exp.Column)), None)
        if isinstance(context, exp.Limit | exp.Offset):
            found[index] = "bigint"
        elif column is not None and column.name.lower() in columns:
            found[index] = PG_TYPE_NAMES[columns[column.name.lower()].type]
        else:
            found.setdefault(index, "text")
    count = max(found, default=0)
    return [found.get(i, "text") for i in range(1, count + 1)]
