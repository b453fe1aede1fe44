"""Statements that read public tables only: answered exactly and free, in the post-processing sandbox.

A table the policy declares ``public: true`` holds no personal data (a lookup list, TPC-H's part,
supplier and nation with the customer as the unit). A statement whose every table is such a table —
``SELECT COUNT(*) FROM part WHERE p_size = 15``, a row listing, joins, sub-queries, TPC-H Q2, Q11 and
Q16 as written — is answered exactly: no noise, no charge, a NOTICE saying why, on every front door
(they all call the engine), and EXPLAIN says so. A statement naming any other table is left to the DP
path, unchanged.

Privacy: nothing private is read. Only the declared, non-identifier columns of the public tables the
statement names (those it refers to, at least one) are copied into a fresh sandbox
(:mod:`dpsql.outer.sandbox`: no file system, no extension, no other table), and the statement runs
there; whatever else it names does not exist there (42P01/42703). Free is not free: the sandbox is
admitted like post-processing (:func:`dpsql.outer.admission.post_process`: memory, one per analyst at
once, its CPU time charged to the analyst), bounded by the statement's deadline (57014) and its result
caps (54000); a public table brings at most :data:`MAX_PUBLIC_ROWS` rows (54000), and functions that
make rows or sized values are refused before anything runs (0A000), as over released rows.
Constants are folded first (:mod:`dpsql.analyze.fold`): PostgreSQL's arithmetic, not DuckDB's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlglot import exp

from dpsql.analyze import infer_parameter_types
from dpsql.analyze.fold import fold_constants
from dpsql.analyze.parse import Params, bind_parameters, placeholder_value
from dpsql.explain import sql_lines
from dpsql.outer import deadline, public_key, read_public
from dpsql.outer.admission import PublicTable, Table, post_process
from dpsql.outer.explain import CompositeExplanation
from dpsql.outer.host import Host
from dpsql.outer.sandbox import Sandbox, outer_sql, pg_type
from dpsql.outer.shapes import refuse_recursion, refuse_sized
from dpsql.pgtypes import PgType
from dpsql.plan.sources import ident_name
from dpsql.policy import PG_TYPE_NAMES, Policy
from dpsql.prepared import Description
from dpsql.session import OutputColumn, Result, Session
from dpsql.step import Notice, NoticeKind

__all__ = ["describe", "explain", "public_tables", "route"]


def notice(names: Iterable[str]) -> Notice:
    return Notice(
        f"dpsql: reads public tables only ({', '.join(names)}): answered exactly, without noise; no budget charged",
        NoticeKind.FREE,
    )


def public_tables(tree: exp.Expression, policy: Policy) -> list[str] | None:
    """The public tables a statement reads, when it reads no other table (its own CTEs aside); None
    otherwise, and for a statement that names no table (left to the usual path)."""
    if not isinstance(tree, exp.Select | exp.SetOperation):
        return None
    ctes = {ident_name(c.args["alias"].this) for c in tree.find_all(exp.CTE) if c.args.get("alias")}
    names: list[str] = []
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):  # a table function: not a public table
            return None
        name = ident_name(table.this)
        if not table.args.get("db") and name in ctes:
            continue
        found = policy.table(name)
        if found is None or not found.public or ident_name(table.args.get("db")) not in ("", "public"):
            return None
        if name not in names:
            names.append(name)
    return names or None


def _columns(engine: Host, name: str, tree: exp.Expression) -> list[tuple[str, PgType]]:
    """The declared, non-identifier columns of public table ``name`` that the statement can refer to:
    those it names (every one for ``*`` or a NATURAL join), and at least one, so rows still count."""
    table = engine.policy.table(name)
    assert table is not None
    declared = [(c, PG_TYPE_NAMES[col.type]) for c, col in table.columns.items() if not col.identifier]
    every = tree.find(exp.Star) is not None or any(j.args.get("method") for j in tree.find_all(exp.Join))
    named = {ident_name(c.this).lower() for c in tree.find_all(exp.Column) if isinstance(c.this, exp.Identifier)}
    used = declared if every else [(c, t) for c, t in declared if c.lower() in named]
    return used or declared[:1]


def _statement(tree: exp.Expression, params: Params) -> exp.Expression:
    """The statement as the sandbox runs it: parameters bound, constants folded (PostgreSQL's values and
    errors), recursion and row-making functions refused (0A000) — from the SQL alone, before any read."""
    bound = fold_constants(bind_parameters(tree.copy(), params))
    refuse_recursion(bound)
    refuse_sized(bound)
    return bound


def _kept(engine: Host, name: str, columns: Sequence[tuple[str, PgType]]) -> PublicTable:
    """The public table as the kept post-processing databases hold it: read from the backend straight into
    a kept database once per data stamp (the key, :func:`dpsql.outer.public_key`), not per statement, and
    not copied anywhere else (:meth:`dpsql.outer.sandbox.Database.public_table`)."""
    table = engine.policy.table(name)
    assert table is not None
    source = table.source or name
    key = public_key(engine, source, list(columns))
    return PublicTable(name, columns, key, lambda: read_public(engine, name, source, list(columns)))


def _shape(engine: Host, tables: list[Table], sql: str, ends: float | None) -> list[OutputColumn]:
    """The statement's columns, bound against empty public tables: known before anything is read."""
    with Sandbox(ends) as box:
        for name, columns, _ in tables:
            box.load(name, columns, [])
        described = box.describe(sql)
    return [OutputColumn(name, pg_type(duck) or "text", noisy=False) for name, duck in described]


def _names_public(sql: str, policy: Policy) -> bool:
    """Whether the text names some public table: a statement reading public tables only must (a cheap test
    on the text before its tree is walked, as every statement passes here)."""
    text = sql.lower()
    return any(name.lower() in text for name, table in policy.tables.items() if table.public)


def _parts(engine: Host, tree: exp.Expression, params: Params) -> tuple[list[str], exp.Expression] | None:
    names = public_tables(tree, engine.policy)
    if names is None:
        return None
    return names, _statement(tree, params)


def route(engine: Host, sql: str, session: Session, params: Params, parsed: exp.Expression) -> Result | None:
    """The exact answer of a statement over public tables only; None: not one (the usual path)."""
    if not _names_public(sql, engine.policy):
        return None
    parts = _parts(engine, parsed, params)
    if parts is None:
        return None
    names, statement = parts
    ends = deadline(engine)
    query = outer_sql(statement)
    empty: list[Table] = [(n, _columns(engine, n, statement), []) for n in names]
    columns = _shape(engine, empty, query, ends)
    public = [_kept(engine, name, cols) for name, cols, _ in empty]
    rows = post_process(session.analyst, ends, [], query, [c.type for c in columns], public=public)
    result = Result(columns, rows, [tuple(None for _ in columns)] * len(rows), 0.0, 0.0)
    result.notices.append(notice(names))
    return result


class PublicExplanation(CompositeExplanation):
    """EXPLAIN of a statement over public tables only: exact, free, and the SQL the sandbox runs."""

    def lines(self) -> list[str]:
        lines = [f"{self.node}  (epsilon=0 delta=0; exact, no noise, no budget charged)"]
        lines.append("  SQL (over the public tables' declared columns, in a sandbox):")
        lines.extend(sql_lines(self.outer_sql, indent=6))
        return lines


def explain(
    engine: Host, sql: str, session: Session, params: Params, parsed: exp.Expression
) -> PublicExplanation | None:
    """EXPLAIN of a statement over public tables only (bound, so it refuses what execution would); None:
    not one. Reads nothing, charges nothing."""
    if not _names_public(sql, engine.policy):
        return None
    parts = _parts(engine, parsed, params)
    if parts is None:
        return None
    names, statement = parts
    query = outer_sql(statement)
    _shape(engine, [(n, _columns(engine, n, statement), []) for n in names], query, None)
    node = f"Public tables only: {', '.join(names)}"
    return PublicExplanation(node, 0.0, 0.0, [], query, mechanism="exact")


def describe(engine: Host, sql: str, session: Session, parsed: exp.Expression) -> Description | None:
    """Columns and parameter types of a statement over public tables only (None: not one)."""
    if not _names_public(sql, engine.policy) or public_tables(parsed, engine.policy) is None:
        return None
    param_types = infer_parameter_types(parsed, engine.policy)
    parts = _parts(engine, parsed, [placeholder_value(t) for t in param_types] or None)
    assert parts is not None
    names, statement = parts
    query = outer_sql(statement)
    columns = _shape(engine, [(n, _columns(engine, n, statement), []) for n in names], query, None)
    return Description(columns, param_types)
