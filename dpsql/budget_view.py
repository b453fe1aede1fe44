"""Analyst self-service: ``SHOW dpsql.budget`` and the ``dpsql_budget`` relation.

Both give the *connected* analyst one row about their own budget: ε and δ spent, remaining and
in total (the policy's budget plus the curator's grants), how many charged queries, and whether the
curator froze them. Privacy argument: every figure is a function of the analyst's own charges and
the curator's levers on them — never of the data, never of another analyst's spending and never of
the dataset's total (which would reveal what the others spent). It reads the ledger only and
charges nothing. Remaining ε is the accountant's own figure (:func:`dpsql.accountant.remaining_budget`),
the one the ledger checks against.

``SELECT … FROM dpsql_budget`` (what a BI tool sends; the relation also exists, empty, in the
shadow catalog so schema sync lists it) is evaluated over that one row by sqlglot's executor, so
projections, aliases and WHERE work as on a table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlglot
from sqlglot import exp

from dpsql.accountant import Spent, remaining_budget
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType
from dpsql.session import OutputColumn, Result

if TYPE_CHECKING:
    from dpsql.ledger import Ledger
    from dpsql.policy import Policy

#: The relation's name (in ``public``, as a BI tool sees it).
BUDGET_RELATION = "dpsql_budget"
#: The one row's columns, in order, with their PostgreSQL types.
BUDGET_COLUMNS: tuple[tuple[str, PgType], ...] = (
    ("analyst", "text"),
    ("epsilon_spent", "double precision"),
    ("epsilon_remaining", "double precision"),
    ("epsilon_total", "double precision"),
    ("delta_spent", "double precision"),
    ("delta_remaining", "double precision"),
    ("delta_total", "double precision"),
    ("queries", "bigint"),
    ("frozen", "boolean"),
)
_TYPES: dict[str, PgType] = dict(BUDGET_COLUMNS)


def own_budget(ledger: Ledger, policy: Policy, analyst: str) -> tuple[Any, ...]:
    """The analyst's own row (see :data:`BUDGET_COLUMNS`)."""
    dataset, accounting = policy.dataset, policy.budget.accounting
    levers = ledger.levers(dataset, analyst)
    limit = levers.limit(policy.analyst_budget(analyst))
    spent = next((row.spent for row in ledger.summary(dataset) if row.analyst == analyst), Spent())
    left = remaining_budget(spent, limit, accounting)
    epsilon_spent = spent.privacy_loss(accounting, limit.delta)[0]
    delta_spent = spent.delta if accounting == "pure" else spent.selection_delta
    return (
        analyst,
        epsilon_spent,
        left.epsilon,
        limit.epsilon,
        delta_spent,
        left.delta,
        limit.delta,
        spent.queries,
        levers.frozen,
    )


def is_budget_query(sql: str, policy: Policy) -> bool:
    """Whether ``sql`` is a SELECT reading only ``dpsql_budget`` (and the policy has no such table)."""
    if BUDGET_RELATION not in sql.lower() or policy.table(BUDGET_RELATION) is not None:
        return False
    tree = _parse(sql)
    if not isinstance(tree, exp.Select):
        return False
    tables = list(tree.find_all(exp.Table))
    return bool(tables) and all(
        t.name.lower() == BUDGET_RELATION and t.db.lower() in ("", "public") and not t.catalog for t in tables
    )


def answer(sql: str, row: tuple[Any, ...]) -> Result:
    """Evaluate a SELECT over ``dpsql_budget`` holding just ``row``; free (no charge, no noise)."""
    from sqlglot.executor import execute

    tree = _parse(sql)
    assert tree is not None
    for node in tree.find_all(exp.Table):
        node.set("db", None)
    names = [name for name, _ in BUDGET_COLUMNS]
    try:
        table = execute(tree, tables={BUDGET_RELATION: [dict(zip(names, row, strict=True))]})
    except Exception:
        raise FeatureNotSupported(
            f"this query over {BUDGET_RELATION} is not supported",
            hint=f"Use SELECT <columns> FROM {BUDGET_RELATION} [WHERE …], or SHOW dpsql.budget.",
        ) from None
    rows = [tuple(r) for r in table.rows]
    columns = [OutputColumn(name, _TYPES.get(name) or _type_of(rows, i)) for i, name in enumerate(table.columns)]
    return Result(
        columns=columns,
        rows=rows,
        accuracy=[tuple(None for _ in columns) for _ in rows],
        epsilon_spent=0.0,
        delta_spent=0.0,
    )


def _parse(sql: str) -> Any:
    try:
        return sqlglot.parse_one(sql, read="postgres")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return None


def _type_of(rows: list[tuple[Any, ...]], i: int) -> PgType:
    value = rows[0][i] if rows else None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "bigint"
    if isinstance(value, float):
        return "double precision"
    return "text"
