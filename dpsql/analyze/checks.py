"""Statement-shape checks: each takes the parsed tree and passes, or raises one precise error.

They run in the order of ``STATEMENT_CHECKS`` before any column is resolved, so the
analyst hears about the outermost problem first (a DELETE is refused as a write, not
for its unknown table).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.aggregates import supported_functions
from dpsql.errors import (
    FeatureNotSupported,
    GroupingError,
    ProgramLimitExceeded,
    ReadOnlyViolation,
    SyntaxError_,
    UndefinedTable,
)
from dpsql.plan.sources import ident_name
from dpsql.policy import Policy

_WRITE_TAGS: dict[type[exp.Expression], str] = {
    exp.Insert: "INSERT",
    exp.Update: "UPDATE",
    exp.Delete: "DELETE",
    exp.Merge: "MERGE",
    exp.Create: "CREATE",
    exp.Drop: "DROP",
    exp.Alter: "ALTER",
    exp.TruncateTable: "TRUNCATE",
}


def require_read_only(tree: exp.Expression) -> None:
    """DDL and DML are refused as PostgreSQL refuses them in a read-only transaction."""
    for kind, tag in _WRITE_TAGS.items():
        if isinstance(tree, kind):
            raise ReadOnlyViolation(
                f"cannot execute {tag} in a read-only transaction",
                hint="dpsql is a read-only gateway: only aggregate SELECT queries are answered.",
            )
    if isinstance(tree, exp.Command) and str(tree.this).upper() in {"GRANT", "REVOKE", "VACUUM", "ANALYZE"}:
        raise ReadOnlyViolation(f"cannot execute {str(tree.this).upper()} in a read-only transaction")


def require_select(tree: exp.Expression) -> None:
    """Only plain SELECT; set operations and utility commands are not aggregates dpsql can bound."""
    if isinstance(tree, exp.SetOperation):
        op = {exp.Union: "UNION", exp.Intersect: "INTERSECT", exp.Except: "EXCEPT"}.get(type(tree), "set")
        raise FeatureNotSupported(
            f"{op} is not supported",
            hint="Set operations can count one person twice; run each SELECT as its own query.",
        )
    if isinstance(tree, exp.Copy):
        raise FeatureNotSupported("COPY is not supported", hint="dpsql never exports rows.")
    if not isinstance(tree, exp.Select | exp.Command | exp.DDL | exp.DML | exp.Set | exp.Show):
        raise SyntaxError_(f'syntax error at or near "{tree.sql().split()[0] if tree.sql() else ""}"')
    if not isinstance(tree, exp.Select):
        name = str(tree.this).upper() if isinstance(tree, exp.Command) else tree.key.upper()
        raise FeatureNotSupported(
            f"{name} statements are not supported",
            hint=f"dpsql answers aggregate SELECT queries ({', '.join(supported_functions())}) only.",
        )


def reject_unsupported_clauses(tree: exp.Expression) -> None:
    """Clauses that would release rows, lock rows, or hide extra queries."""
    if tree.args.get("with_"):
        raise FeatureNotSupported("WITH queries are not supported yet", hint="Inline the CTE's filter in WHERE.")
    if tree.args.get("into"):
        raise ReadOnlyViolation("cannot execute SELECT INTO in a read-only transaction")
    if tree.args.get("locks"):
        raise FeatureNotSupported("SELECT ... FOR UPDATE/SHARE is not supported")
    if tree.args.get("windows") or tree.find(exp.Window):
        raise FeatureNotSupported(
            "window functions are not supported",
            hint="A window function releases a value per row; use GROUP BY instead.",
        )
    if tree.args.get("distinct") and tree.args["distinct"].args.get("on"):
        raise FeatureNotSupported("SELECT DISTINCT ON is not supported")
    if tree.args.get("laterals"):
        raise FeatureNotSupported("LATERAL is not supported")
    if tree.find(exp.TableSample):
        raise FeatureNotSupported(
            "TABLESAMPLE is not supported", hint="Sampling is not accounted for; filter with WHERE instead."
        )
    root: object = tree  # sqlglot's Query and Expression types do not overlap for mypy; identity is all we ask
    for sub in tree.find_all(exp.Subquery, exp.Select):
        if sub is not root and not _per_person(sub):
            raise FeatureNotSupported(
                "subqueries are not supported",
                hint="A subquery can compute an exact aggregate; write one aggregate query instead.",
            )


def _per_person(start: exp.Expr) -> bool:
    """A FROM or JOIN subquery that groups (or a node inside one): a per-person relation, analysed and
    refused precisely by :mod:`dpsql.analyze.persons` when it does not group by the privacy unit; or a
    subquery in the statement's WHERE, classified by :mod:`dpsql.analyze.subqueries`."""
    node: exp.Expr | None = start
    while node is not None:
        if isinstance(node, exp.Subquery) and isinstance(node.parent, exp.From | exp.Join):
            return isinstance(node.this, exp.Select) and node.this.args.get("group") is not None
        if isinstance(node, exp.Where) and isinstance(node.parent, exp.Select) and node.parent.parent is None:
            return True
        node = node.parent
    return False


def require_known_tables(tree: exp.Expression, policy: Policy) -> None:
    """A SELECT naming a table the policy does not declare is 42P01 first, as PostgreSQL would say
    (before ``SELECT *`` or any other shape is judged): the answer depends on the policy only."""
    if not isinstance(tree, exp.Select):
        return
    ctes = {ident_name(c.args["alias"].this) for c in tree.find_all(exp.CTE) if c.args.get("alias")}
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier) or isinstance(table.parent, exp.Into):
            continue
        schema, name = ident_name(table.args.get("db")), ident_name(table.this)
        if not schema and name in ctes:
            continue
        if policy.tables.get(name) is None or schema not in ("", "public") or table.args.get("catalog"):
            shown = f"{schema}.{name}" if schema else name
            raise UndefinedTable(
                f'relation "{shown}" does not exist',
                hint=f'Tables in dataset "{policy.dataset}": {", ".join(sorted(policy.tables))}.',
            )


def reject_star(tree: exp.Expression) -> None:
    """SELECT * and t.* would release raw rows."""
    for projection in tree.expressions:
        if isinstance(projection, exp.Star) or (
            isinstance(projection, exp.Column) and isinstance(projection.this, exp.Star)
        ):
            raise GroupingError(
                "SELECT * would release individual rows",
                hint="dpsql answers aggregates only: select COUNT(*), SUM(column) or AVG(column), "
                "optionally with GROUP BY keys.",
            )


def require_from(tree: exp.Expression) -> None:
    """A query with no table touches no private data and is not the engine's business."""
    if not tree.args.get("from_"):
        raise FeatureNotSupported(
            "a query without FROM is not answered by the privacy engine",
            hint="Name a table declared in the policy.",
        )


StatementCheck = Callable[[exp.Expression], None]

#: Applied in this order to every statement before resolution.
#: Aggregate calls in one statement. The query's ε is split across its measures, so past a few dozen
#: each is pure noise; and each costs analysis time before any charge.
MAX_AGGREGATES = 100


def limit_aggregates(tree: exp.Expression) -> None:
    """Refuse statements with more than ``MAX_AGGREGATES`` aggregate calls, before they are analysed."""
    count = sum(1 for _ in tree.find_all(exp.AggFunc))
    if count > MAX_AGGREGATES:
        raise ProgramLimitExceeded(
            f"a query may compute at most {MAX_AGGREGATES} aggregates (this one has {count})",
            hint="The query's ε is split across its aggregates; ask for fewer per query.",
        )


#: WHEN branches of one CASE expression. BI tools' bucketings and relabellings use a few dozen; past a
#: thousand a CASE is a lookup table (declare a domain, or GROUP BY the column). Each branch is checked
#: like a WHERE predicate before any charge, in linear time (~0.3 ms a branch): the cap keeps a CASE's
#: analysis well under a second, and a GROUP BY CASE key within MAX_DERIVED_GROUPS.
MAX_CASE_BRANCHES = 1000


def limit_case_branches(tree: exp.Expression) -> None:
    """Refuse a CASE with more than ``MAX_CASE_BRANCHES`` WHEN branches, before it is analysed (free)."""
    for case in tree.find_all(exp.Case):
        count = len(case.args.get("ifs") or [])
        if count > MAX_CASE_BRANCHES:
            raise ProgramLimitExceeded(
                f"a CASE expression may have at most {MAX_CASE_BRANCHES} WHEN branches (this one has {count})",
                hint="Declare the column's domain, GROUP BY a coarser expression, or split the CASE.",
            )


STATEMENT_CHECKS: tuple[StatementCheck, ...] = (
    require_read_only,
    require_select,
    reject_unsupported_clauses,
    reject_star,
    require_from,
    limit_aggregates,
    limit_case_branches,
)
