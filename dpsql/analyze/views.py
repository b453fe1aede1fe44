"""Inline CTEs and FROM-subqueries that only filter and rename rows of one table.

``WITH adults AS (SELECT age, sex AS s FROM patients WHERE age >= 18) SELECT s, COUNT(*)
FROM adults GROUP BY s`` is the same DP query as its inlined form, so the rest of the
analyzer sees only the inlined form and every check, bound and sensitivity applies
unchanged. A computed column of a view (ibis's ``.mutate(big=t.cost > 1000)``) is a row-level
expression of the view's table: every reference to it is replaced by the expression itself, so
the outer query is checked as if the analyst had written it there, and views nest to any depth
(ibis wraps selects in selects). A view that aggregates, deduplicates, limits, orders, uses a
window or a subquery could release an exact value or change how often a person appears, and is
refused with a precise error rather than analysed.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.sources import grouped_by_unit
from dpsql.errors import FeatureNotSupported, StatementTooComplex, SyntaxError_, UndefinedColumn
from dpsql.plan.sources import ident_name
from dpsql.policy import Policy

_VIEW_REFUSED = {
    "group": "GROUP BY",
    "having": "HAVING",
    "distinct": "DISTINCT",
    "limit": "LIMIT",
    "offset": "OFFSET",
    "order": "ORDER BY",
    "joins": "JOIN",
    "windows": "WINDOW",
    "with_": "nested WITH",
}


#: Inside a computed column of a view: an aggregate or window reads other rows and a subquery other tables,
#: and a volatile function would be evaluated once per reference once inlined, so none is a row-level value.
_NOT_ROW_LEVEL = (exp.AggFunc, exp.Window, exp.Query, exp.Subquery, exp.Rand)

#: Nodes one inlined computed column may have: a column referencing a computed column twice, nested n levels,
#: would otherwise grow as 2^n from a short statement (analyzer memory and time an analyst controls).
_MAX_INLINED_NODES = 2000


class _View:
    """One inlinable view: its single source table and how its output names map to expressions of that table
    (a column, or a row-level computed expression)."""

    def __init__(self, select: exp.Select, name: str) -> None:
        _refuse_grouping(select, name)
        for arg, clause in _VIEW_REFUSED.items():
            if select.args.get(arg):
                raise FeatureNotSupported(
                    f'{clause} inside the subquery or CTE "{name}" is not supported',
                    hint="Views may only filter (WHERE) and select or rename columns of one table; "
                    "aggregate in the outer query.",
                )
        source = select.args["from_"].this if select.args.get("from_") else None
        if not isinstance(source, exp.Table):
            raise FeatureNotSupported(f'the subquery or CTE "{name}" must read one table')
        self.table = source
        self.inner_aliases = {ident_name(source.args["alias"].this) if source.alias else ident_name(source.this)}
        self.where = select.args["where"].this if select.args.get("where") else None
        self.star = False
        self.columns: dict[str, exp.Expression] = {}  # output name -> column or row-level expression of the table
        for projection in select.expressions:
            node = projection.unalias()
            if isinstance(node, exp.Star) or (isinstance(node, exp.Column) and isinstance(node.this, exp.Star)):
                self.star = True
                continue
            if not isinstance(node, exp.Column) and node.find(*_NOT_ROW_LEVEL):
                raise FeatureNotSupported(
                    f'the subquery or CTE "{name}" may only select columns and row-level expressions',
                    hint="Aggregates, window functions, subqueries and random() inside views are not supported; "
                    "aggregate in the outer query.",
                )
            output = ident_name(projection.args["alias"].this) if isinstance(projection, exp.Alias) else None
            if isinstance(node, exp.Column):
                self.columns[output or ident_name(node.this)] = node
            elif output:  # an unnamed computed column cannot be referenced from outside
                self.columns[output] = node

    def target(self, name: str, view_name: str) -> exp.Expression:
        if name in self.columns:
            return self.columns[name]
        if self.star:
            return exp.column(name)
        raise UndefinedColumn(f"column {view_name}.{name} does not exist")


def _requalify(node: exp.Expression, inner_aliases: set[str], alias: str) -> exp.Expression:
    """Columns of the view's table, re-pointed at the alias the outer query uses (a bare column as the
    whole condition too: ``WHERE t0.urgent``)."""

    def repoint(column: exp.Expression) -> exp.Expression:
        if isinstance(column, exp.Column) and not isinstance(column.this, exp.Star):
            qualifier = ident_name(column.args.get("table"))
            if not qualifier or qualifier in inner_aliases:
                return exp.column(column.this.copy(), table=alias)
        return column

    return node.transform(repoint)


def inline_views(tree: exp.Expression, policy: Policy | None = None) -> exp.Expression:
    """Replace simple CTEs and FROM-subqueries by their table, merging their WHERE into the query's."""
    if not isinstance(tree, exp.Select):
        return tree
    with_ = tree.args.get("with_")
    if not with_ and not any(isinstance(s, exp.Subquery) for s in _sources(tree)):
        return tree
    tree = tree.copy()
    ctes: dict[str, exp.Select] = {}
    cte_columns: dict[str, list[exp.Identifier]] = {}
    if with_:
        if with_.args.get("recursive"):
            raise FeatureNotSupported("WITH RECURSIVE is not supported")
        for cte in with_.expressions:
            body = cte.this
            if not isinstance(body, exp.Select):
                raise FeatureNotSupported(f'the CTE "{cte.alias}" must be a plain SELECT')
            ctes[ident_name(cte.args["alias"].this)] = inline_views(_with_ctes(body, ctes), policy)  # type: ignore[assignment]
            cte_columns[ident_name(cte.args["alias"].this)] = list(cte.args["alias"].args.get("columns") or [])
        tree.set("with_", None)
    views: dict[str, _View] = {}
    conditions: list[exp.Expression] = []
    columns = {  # a CTE's column names (WITH revenue0 (supplier_no, total_revenue) AS …), by the alias read
        (ident_name(n.args["alias"].this) if n.alias else ident_name(n.this)): cte_columns[ident_name(n.this)]
        for n in _sources(tree)
        if isinstance(n, exp.Table) and ident_name(n.this) in cte_columns
    }
    for node in _sources(tree):
        if isinstance(node, exp.Subquery):
            alias = ident_name(node.args["alias"].this) if node.alias else ""
            if not alias:
                raise SyntaxError_("a subquery in FROM must have an alias")
            body = inline_views(node.this, policy) if isinstance(node.this, exp.Select) else node.this
            if not isinstance(body, exp.Select):
                raise FeatureNotSupported(f'the subquery "{alias}" must be a plain SELECT')
        elif isinstance(node, exp.Table) and not node.args.get("db") and ident_name(node.this) in ctes:
            alias = ident_name(node.args["alias"].this) if node.alias else ident_name(node.this)
            body = ctes[ident_name(node.this)]
        else:
            continue
        if body.args.get("group") and policy is not None and grouped_by_unit(body, policy):  # one row per person
            named = exp.TableAlias(this=exp.to_identifier(alias), columns=[c.copy() for c in columns.get(alias, [])])
            if isinstance(node, exp.Subquery) and node.args.get("alias") is not None:
                named = node.args["alias"].copy()
            node.replace(exp.Subquery(this=body, alias=named))
            continue
        if body.args.get("joins") and tree.args.get("from_") and node is tree.args["from_"].this:
            where = _flatten_joins(tree, body, alias)
            if where is not None:
                conditions.append(where)
            continue
        view = _View(body, alias)
        views[alias] = view
        table = view.table.copy()
        table.set("alias", exp.TableAlias(this=exp.to_identifier(alias)))
        node.replace(table)
        if view.where is not None:
            conditions.append(_requalify(view.where, view.inner_aliases, alias))
    if views:
        _map_columns(tree, views)  # before merging the views' own conditions: those name table columns
    for condition in conditions:
        outer = tree.args.get("where")
        tree.set("where", exp.Where(this=exp.and_(outer.this, condition) if outer else condition))
    return tree


def _refuse_grouping(select: exp.Select, name: str) -> None:
    """GROUP BY in a view that is not one row per person (:mod:`dpsql.analyze.persons`): refused."""
    if select.args.get("group"):
        raise FeatureNotSupported(
            f'GROUP BY inside the subquery or CTE "{name}" is only supported on the privacy unit',
            hint="A subquery may aggregate per person (GROUP BY the privacy unit: one row per person, then "
            "aggregate in the outer query); aggregate anything else in the outer query.",
        )


def _flatten_joins(tree: exp.Select, body: exp.Select, alias: str) -> exp.Expression | None:
    """A FROM-subquery that joins tables and names their columns (ibis, Looker derived tables) becomes
    those joins in the outer query: ``SELECT t4.building, COUNT(*) FROM (SELECT t2.cost, t3.building
    FROM visits t2 JOIN departments t3 ON …) t4 GROUP BY 1`` is the same query as the flat join, so
    every join check (public tables, unit joins, join limits) applies unchanged. Returns the view's WHERE.
    """
    _refuse_grouping(body, alias)
    for arg, clause in _VIEW_REFUSED.items():
        if arg != "joins" and body.args.get(arg):
            raise FeatureNotSupported(
                f'{clause} inside the subquery or CTE "{alias}" is not supported',
                hint="Views may only filter (WHERE), join and select or rename columns; aggregate in the outer query.",
            )
    inner = _sources(body)
    if not all(isinstance(t, exp.Table) for t in inner):
        raise FeatureNotSupported(f'the subquery or CTE "{alias}" may only join tables')
    inner_aliases = {ident_name(t.args["alias"].this) if t.alias else ident_name(t.this) for t in inner}
    outer_aliases = {
        ident_name(t.args["alias"].this) if t.alias else ident_name(t.this)
        for t in _sources(tree)[1:]
        if isinstance(t, exp.Table)
    }
    if inner_aliases & outer_aliases:
        raise FeatureNotSupported(f'the subquery "{alias}" reuses a table alias of the outer query')
    columns: dict[str, exp.Expression] = {}
    for projection in body.expressions:
        node = projection.unalias()
        output = ident_name(projection.args["alias"].this) if isinstance(projection, exp.Alias) else None
        if isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
            columns[output or ident_name(node.this)] = node
        elif output and not node.find(*_NOT_ROW_LEVEL) and not isinstance(node, exp.Star):
            columns[output] = node  # a computed column (TPC-H's volume, l_year): inlined where it is read
        else:
            raise FeatureNotSupported(
                f'the subquery or CTE "{alias}" with a JOIN may only select columns and named row-level expressions',
                hint="List what the outer query reads (t.col AS name, or an expression AS name); aggregate, "
                "window and subquery expressions belong in the outer query.",
            )
    output_aliases = {ident_name(p.args["alias"].this) for p in tree.expressions if isinstance(p, exp.Alias)}
    for column in list(tree.find_all(exp.Column)):
        if isinstance(column.this, exp.Star):
            continue
        name, qualifier = ident_name(column.this), ident_name(column.args.get("table"))
        if qualifier == alias and name not in columns:
            raise UndefinedColumn(f"column {alias}.{name} does not exist")
        if qualifier == alias or (not qualifier and name in columns and name not in output_aliases):
            column.replace(_inlined(tree, column, columns[name], name))
    tree.set("from_", body.args["from_"].copy())
    tree.set("joins", [j.copy() for j in body.args["joins"]] + list(tree.args.get("joins") or []))
    return body.args["where"].this.copy() if body.args.get("where") else None


def _inlined(tree: exp.Select, column: exp.Column, target: exp.Expression, name: str) -> exp.Expression:
    """What replaces a reference to a flattened view's column: the column or expression it names, in
    parentheses when computed, and keeping its output name where the outer query selects it."""
    if sum(1 for _ in target.walk()) > _MAX_INLINED_NODES:
        raise StatementTooComplex(f'the computed column "{name}" is too complex to inline')
    replacement = target.copy()
    if isinstance(replacement, exp.Column):
        return replacement
    if not isinstance(replacement, exp.Literal | exp.Func | exp.Paren):
        replacement = exp.Paren(this=replacement)
    if column.parent is tree and column.arg_key == "expressions":
        return exp.Alias(this=replacement, alias=exp.to_identifier(name, quoted=column.this.quoted))
    return replacement


def _map_columns(tree: exp.Select, views: dict[str, _View]) -> None:
    output_aliases = {ident_name(p.args["alias"].this) for p in tree.expressions if isinstance(p, exp.Alias)}
    for column in list(tree.find_all(exp.Column)):
        if isinstance(column.this, exp.Star):
            continue
        name = ident_name(column.this)
        if (
            not column.args.get("table")
            and name in output_aliases
            and not any(name in v.columns for v in views.values())
        ):
            continue  # an output alias (ORDER BY n), not a view column
        qualifier = ident_name(column.args.get("table"))
        name = ident_name(column.this)
        if qualifier in views:
            _substitute(tree, column, views[qualifier], qualifier)
        elif not qualifier:
            owners = [alias for alias, view in views.items() if name in view.columns or view.star]
            if len(owners) == 1 and len(views) == len(list(_sources(tree))):
                _substitute(tree, column, views[owners[0]], owners[0])
            elif len(views) == len(list(_sources(tree))) and not owners:
                raise UndefinedColumn(f'column "{name}" does not exist')


def _substitute(tree: exp.Select, column: exp.Column, view: _View, alias: str) -> None:
    """Replace a reference to a view's output by what it names, over the table now aliased ``alias``; a
    selected reference keeps its output name (``SELECT t1.big`` still returns a column "big")."""
    name = ident_name(column.this)
    target = view.target(name, alias)
    if sum(1 for _ in target.walk()) > _MAX_INLINED_NODES:
        raise StatementTooComplex(
            f'the computed column "{name}" of the subquery or CTE "{alias}" is too complex to inline',
            hint="Compute it in the outer query, or nest fewer computed columns.",
        )
    replacement: exp.Expression = _requalify(target.copy(), view.inner_aliases, alias)
    if not isinstance(replacement, exp.Column | exp.Literal | exp.Func | exp.Paren):
        replacement = exp.Paren(this=replacement)  # keeps precedence: t1.c * 2 with c = cost + 1
    renamed = not isinstance(replacement, exp.Column) or ident_name(replacement.this) != name
    if renamed and column.parent is tree and column.arg_key == "expressions":
        replacement = exp.Alias(this=replacement, alias=exp.to_identifier(name, quoted=column.this.quoted))
    column.replace(replacement)


def _sources(tree: exp.Select) -> list[exp.Expression]:
    found = [tree.args["from_"].this] if tree.args.get("from_") else []
    return found + [join.this for join in tree.args.get("joins") or []]


def _with_ctes(body: exp.Select, ctes: dict[str, exp.Select]) -> exp.Select:
    """A CTE body whose FROM names an earlier CTE reads that CTE's definition."""
    if not ctes:
        return body
    body = body.copy()
    for node in _sources(body):
        if isinstance(node, exp.Table) and not node.args.get("db") and ident_name(node.this) in ctes:
            alias = ident_name(node.args["alias"].this) if node.alias else ident_name(node.this)
            node.replace(exp.Subquery(this=ctes[ident_name(node.this)].copy(),
                                      alias=exp.TableAlias(this=exp.to_identifier(alias))))  # fmt: skip
    return body
