"""Post-processing over DP sub-queries, and schema probes: the engine's one entry for composite statements.

``SELECT * FROM (SELECT problem, COUNT(*) AS c FROM patients GROUP BY problem) t ORDER BY c DESC
LIMIT 5``, CTEs over aggregates, ``UNION ALL`` of DP queries and windows over aggregates are split
(:mod:`.shapes`) into inner DP queries and an outer statement. The privacy argument, in order:

1. every inner query is validated and priced by the ordinary engine, and the outer statement is
   bound against empty tables of the inner queries' declared columns, before anything is charged —
   so every refusal depends on the SQL and the policy only, and costs nothing;
2. the inner costs, composed by the accountant (sequential composition), are reserved once, durably,
   before any inner query runs (one reservation, so no inner answer can be charged without the others);
3. each inner query is run and released with noise exactly as if it had been sent alone;
4. the outer statement runs in a fresh sandbox (:mod:`.sandbox`) holding only the released rows and
   public tables, once admitted (:mod:`.admission`: memory, per-analyst share, CPU time charged), on a
   low-priority thread: post-processing, which cannot lose privacy. Its errors (a division by a noisy zero)
   depend on noise, never on un-noised values. It is bounded like a database statement: the statement
   timeout runs from the start of the composite statement and interrupts the sandbox (57014); its
   result is capped in rows and bytes (54000); ``WITH RECURSIVE`` and functions making rows or sized
   values are refused in step 1 (0A000, free).

Schema probes (``LIMIT 0``, ``WHERE false``/``WHERE 1 = 0``) of an answerable query return its columns
and no rows, charging nothing: that no row is returned is decided from the SQL alone.
"""

from __future__ import annotations

import re
import secrets
import time
import weakref
from dataclasses import replace
from typing import Any

from sqlglot import exp
from sqlglot.optimizer.simplify import simplify

from dpsql.analyze import analyze_tree, infer_parameter_types
from dpsql.analyze.parse import Params, bind_parameters, parse_statement, placeholder_value
from dpsql.backends import Backend
from dpsql.cache import data_stamp, database_identity
from dpsql.errors import ProgramLimitExceeded
from dpsql.lru import LRU
from dpsql.outer.admission import PublicTable, Table, post_process
from dpsql.outer.explain import CompositeExplanation, SubPlan
from dpsql.outer.host import Host
from dpsql.outer.sandbox import MAX_PUBLIC_ROWS, Sandbox, outer_sql, pg_type, shape_database
from dpsql.outer.scalar import answer_scalar, explain_scalar, split_scalar
from dpsql.outer.series import answer_series, describe_series, explain_series, split_series
from dpsql.outer.shapes import Composite, decompose, needs_outer, own_aggregates, refuse_recursion
from dpsql.pgtypes import PgType
from dpsql.policy import PG_TYPE_NAMES, Policy
from dpsql.prepared import Description
from dpsql.release.accuracy import confidence as confidence_level
from dpsql.session import OutputColumn, Result, Session
from dpsql.step import Notice, NoticeKind, Part, Step

__all__ = ["describe", "explain", "route"]

#: Cheap text test before parsing: only statements with one of these can be composite or a probe.
_MAYBE = re.compile(
    r"\b(with|union|intersect|except|over|limit|false)\b|\(\s*select\b|\bwhere[(\s]+(?:[\d'.+-]|true\b|not\b)",
    re.IGNORECASE,
)

POSTPROCESSED_NOTICE = Notice("dpsql: confidence intervals are not computed for post-processed columns")
PROBE_NOTICE = Notice(
    "dpsql: the query cannot return rows (LIMIT 0 or a false WHERE); nothing charged", NoticeKind.FREE
)


def _constant_false(where: exp.Expression) -> bool:
    """A WHERE that is false whatever the data: no column, no sub-query, simplifies to FALSE."""
    if where.find(exp.Column, exp.Select, exp.Subquery, exp.Func):
        return False
    try:
        simplified = simplify(where.copy())
    except Exception:  # sqlglot cannot fold it: not a probe
        return False
    return isinstance(simplified, exp.Boolean) and not simplified.this


def _limit_zero(tree: exp.Expression) -> bool:
    limit = tree.args.get("limit")
    value = limit.expression if isinstance(limit, exp.Limit) else None
    return isinstance(value, exp.Literal) and value.is_int and int(value.name) == 0


def _probe(tree: exp.Expression) -> exp.Expression | None:
    """The query a schema probe asks about (its false WHERE dropped), or None when it is no probe.

    A probe of named rows (``SELECT department, cost FROM visits WHERE cost > 50 LIMIT 0``: Superset's
    column probe of a SQL dataset, with an engine spec sending LIMIT 0) is analysed as its ``SELECT
    DISTINCT``: the same columns and types, identifiers and bad predicates refused alike, and no row
    leaves either way, so its answer depends on the SQL and the policy only. ``SELECT *`` stays refused."""
    if not isinstance(tree, exp.Select):
        return None
    where = tree.args.get("where")
    if where is not None and _constant_false(where.this):
        probe = tree.copy()
        probe.set("where", None)
    elif _limit_zero(tree):
        probe = tree
    else:
        return None
    if not own_aggregates(probe) and not probe.args.get("distinct") and not probe.find(exp.Star):
        probe = probe.copy()
        probe.set("distinct", exp.Distinct())
    return probe


def _plain(sql: str, tree: exp.Expression, policy: Policy) -> bool:
    """Whether the statement is a plain single query whatever its parameters' values, read on its unbound
    (shared, uncopied) tree: no sub-query, set operation or window over aggregates (binding cannot add
    one), no LIMIT a parameter could make 0, and a WHERE that reads a column, so no value makes it a
    constant FALSE (a schema probe)."""
    if not _MAYBE.search(sql) or not isinstance(tree, exp.Select | exp.SetOperation):
        return True
    if needs_outer(tree, policy):
        return False
    limit = tree.args.get("limit")
    if isinstance(limit, exp.Limit) and not isinstance(limit.expression, exp.Literal):
        return False
    where = tree.args.get("where")
    if where is not None and not where.this.find(exp.Column, exp.Select, exp.Subquery, exp.Func):
        return False
    return _probe(tree) is None


def _parse(sql: str, params: Params, tree: exp.Expression | None = None) -> exp.Expression | None:
    if not _MAYBE.search(sql):
        return None
    tree = parse_statement(sql) if tree is None else tree.copy()
    if not isinstance(tree, exp.Select | exp.SetOperation):
        return None
    return bind_parameters(tree, params)


def route(
    engine: Host, sql: str, session: Session, params: Params = None, parsed: exp.Expression | None = None
) -> Result | None:
    """Answer ``sql`` (``parsed``: its tree, if already parsed) when it is a schema probe or a composite
    statement; None: the engine's usual path.

    A text without parameters found to be neither is remembered (:meth:`Statements.mark_plain`), so a
    repeated plain query costs a dict lookup here, not a copy of its tree. With parameters, a probe
    can depend on their values (``LIMIT $1``), so nothing is remembered."""
    statements = engine.statements
    if statements.plain(sql):
        return None
    known = None if params else _COMPOSITES.get(sql)
    if known is not None and known[0] is engine.policy:
        return answer(engine, known[1], session, sql)
    if parsed is not None and _plain(sql, parsed, engine.policy):
        statements.mark_plain(sql)
        return None
    tree = _parse(sql, params, parsed)
    if tree is None:
        return None
    wraps = needs_outer(tree, engine.policy)
    probe = None if wraps else _probe(tree)
    if probe is not None:
        prepared = engine.prepare(probe.sql(dialect="postgres"), session)  # refused exactly as the query would be
        confidence_level(engine.policy, session)
        return _empty([o.column for o in prepared.plan.outputs])
    if wraps:
        refuse_recursion(tree)
    scalar = split_scalar(tree, engine.policy) if wraps else None
    if scalar is not None:
        return answer_scalar(engine, scalar, session, sql)
    series = split_series(tree) if wraps else None
    if series is not None:
        return answer_series(engine, series, session, sql)
    composite = decompose(tree, engine.policy) if wraps else None
    if composite is None:
        if not params:
            statements.mark_plain(sql)
        return None
    if not params:
        _COMPOSITES.put(sql, (engine.policy, composite), weight=_TREE_BYTES_PER_CHAR * len(sql))
    return answer(engine, composite, session, sql)


#: Composite statements already split, by their text (without parameters) and the policy that split
#: them: a repeat (a dashboard's refresh) skips the parse, the copies and the split. The split depends on
#: the SQL and the policy only, and :func:`answer` reads the tree without changing it.
_COMPOSITES: LRU[str, tuple[Policy, Composite]] = LRU(256, max_bytes=32 * 1024 * 1024)
#: A rough weight of a split statement's trees per character of its text (``dpsql.lru``: ~1 kB per node).
_TREE_BYTES_PER_CHAR = 64


def explain(
    engine: Host, sql: str, session: Session, params: Params = None, parsed: exp.Expression | None = None
) -> CompositeExplanation | None:
    """EXPLAIN of a composite statement: every DP query priced and explained, the outer statement bound
    (so EXPLAIN refuses what execution would), nothing run or charged. None: not a composite."""
    if engine.statements.plain(sql):
        return None
    tree = _parse(sql, params, parsed)
    if tree is None or not needs_outer(tree, engine.policy):
        return None
    refuse_recursion(tree)
    scalar = split_scalar(tree, engine.policy)
    if scalar is not None:
        return explain_scalar(engine, scalar, session)
    series = split_series(tree)
    if series is not None:
        return explain_series(engine, series, session, params)
    composite = decompose(tree, engine.policy)
    if composite is None:
        return None
    prepared = [engine.prepare(inner.sql, session) for inner in composite.inners]
    _shape(engine, composite, [_inner_columns([o.column for o in p.plan.outputs]) for p in prepared])
    cost = Step.total([Part(p) for p in prepared])
    subplans = [
        SubPlan(f"DP sub-query, released as {inner.table}", engine.explain(inner.sql, session, actual=False))
        for inner in composite.inners
    ]
    node = "Post-processing"
    return CompositeExplanation(
        node, cost.epsilon if cost else 0.0, cost.delta if cost else 0.0, subplans, outer_text(composite)
    )


def describe(engine: Host, sql: str, session: Session, parsed: exp.Expression | None = None) -> Description | None:
    """Columns and parameter types of a probe or composite statement, spending nothing (None: not one)."""
    if not _MAYBE.search(sql):
        return None
    tree = parse_statement(sql) if parsed is None else parsed.copy()
    if not isinstance(tree, exp.Select | exp.SetOperation):
        return None
    param_types = infer_parameter_types(tree, engine.policy)
    bound = bind_parameters(tree, [placeholder_value(t) for t in param_types] or None)
    probe = None if needs_outer(bound, engine.policy) else _probe(bound)
    if probe is not None:
        plan = analyze_tree(probe, engine.policy)
        return Description([o.column for o in plan.outputs], param_types)
    if not needs_outer(bound, engine.policy):
        return None
    refuse_recursion(bound)
    scalar = split_scalar(bound, engine.policy)
    if scalar is not None:
        plan = analyze_tree(parse_statement(scalar.outer_sql(0)), engine.policy)
        return Description([o.column for o in plan.outputs], param_types)
    series = split_series(bound)
    if series is not None:
        return Description(describe_series(engine, series), param_types)
    composite = decompose(bound, engine.policy)
    if composite is None:
        return None
    inputs = [
        _inner_columns([o.column for o in analyze_tree(parse_statement(i.sql), engine.policy).outputs])
        for i in composite.inners
    ]
    return Description(_shape(engine, composite, inputs), param_types)


def outer_text(composite: Composite) -> str:
    """The outer statement in the sandbox's dialect, generated once per (cached) composite."""
    if not composite.text:
        composite.text = outer_sql(composite.outer)
    return composite.text


def deadline(engine: Host) -> float | None:
    """When a statement starting now must end (:func:`time.monotonic`): the engine's statement timeout,
    the one its backend applies to every database statement (None: no timeout)."""
    timeout_ms = getattr(engine.backend, "statement_timeout_ms", None)
    return time.monotonic() + timeout_ms / 1000 if timeout_ms else None


def _empty(columns: list[OutputColumn]) -> Result:
    return Result(columns, [], [], 0.0, 0.0, notices=[PROBE_NOTICE])


def _inner_columns(columns: list[OutputColumn]) -> list[OutputColumn]:
    """The inner query's columns with unique names (a sandbox table cannot have two ``count`` columns)."""
    seen: dict[str, int] = {}
    out = []
    for c in columns:
        n = seen.get(c.name, 0)
        seen[c.name] = n + 1
        out.append(c if n == 0 else replace(c, name=f"{c.name}_{n}"))
    return out


def _public_columns(engine: Host, name: str) -> list[tuple[str, PgType]]:
    table = engine.policy.table(name)
    assert table is not None
    return [(c, PG_TYPE_NAMES[col.type]) for c, col in table.columns.items() if not col.identifier]


#: Output columns (name, DuckDB type) of outer statements that bound, by their SQL and input tables.
_SHAPES: LRU[str, list[tuple[str, str]]] = LRU(512, max_bytes=8 * 1024 * 1024)


def _shape(
    engine: Host, composite: Composite, inputs: list[list[OutputColumn]], ends: float | None = None
) -> list[OutputColumn]:
    """Bind the outer statement to empty tables of the inner and public columns: its output columns,
    or its error, known from the SQL and the policy alone (nothing has been read or charged). A shape
    that bound is remembered (:data:`_SHAPES`: the same SQL over the same columns binds the same)."""
    sql = outer_text(composite)
    tables = [
        (inner.table, [(c.name, c.type) for c in columns])
        for inner, columns in zip(composite.inners, inputs, strict=True)
    ]
    tables += [(name, _public_columns(engine, name)) for name in composite.public]
    key = repr((sql, tables))
    described = _SHAPES.get(key)
    if described is None:
        with Sandbox(ends if ends is not None else deadline(engine), database=shape_database()) as box:
            for name, columns in tables:
                box.load(name, columns, [])
            described = _SHAPES.put(key, box.describe(sql), weight=len(key))
    exact = {c.name for columns in inputs for c in columns if c.noisy is False}
    for name in composite.public:
        exact.update(c for c, _ in _public_columns(engine, name))
    for alias in composite.outer.find_all(exp.Alias):  # renamings of exact columns stay exact
        if isinstance(alias.this, exp.Column) and alias.this.name in exact:
            exact.add(alias.alias)
    first = composite.outer
    while isinstance(first, exp.SetOperation | exp.Subquery):
        first = first.this
    computed = {
        p.alias_or_name
        for p in (first.expressions if isinstance(first, exp.Select) else [])
        if not isinstance(p.unalias(), exp.Column)
    }
    out = []
    for name, duck in described:
        noisy = name not in exact or name in computed
        out.append(OutputColumn(name, pg_type(duck) or "text", noisy=noisy))
    return out


def answer(engine: Host, composite: Composite, session: Session, sql: str) -> Result:
    """Validate and price every inner query and the outer statement, reserve the total of the inner
    queries not already released (the DP step of :mod:`dpsql.step`: the result cache first) once,
    release them, then post-process the released rows in the sandbox, interrupted at the statement's
    deadline (57014, charged: the budget was reserved, as for a database statement that times out)."""
    ends = deadline(engine)
    prepared = [engine.prepare(inner.sql, session) for inner in composite.inners]
    confidence = confidence_level(engine.policy, session)
    inputs = [_inner_columns([o.column for o in p.plan.outputs]) for p in prepared]
    columns = _shape(engine, composite, inputs, ends)
    if composite.limit_zero:
        return _empty(columns)
    step = engine.step
    parts = [step.lookup(p, confidence) for p in prepared]
    cost = step.total(parts)
    with step.reserved(cost, session, engine.fingerprint(sql)) as charge:
        released = [step.release(part, confidence) for part in parts]
        tables: list[Table] = [
            (inner.table, [(c.name, c.type) for c in cols], result.rows)
            for inner, cols, result in zip(composite.inners, inputs, released, strict=True)
        ]
        public = [_public_table(engine, name) for name in composite.public]
        kinds = [c.type for c in columns]
        values = post_process(session.analyst, ends, tables, outer_text(composite), kinds, public=public)
    exact = tuple(None for _ in columns)
    result = Result(columns, values, [exact] * len(values), 0.0, 0.0)
    step.notice(result, cost, charge, session, parts)
    result.notices.append(POSTPROCESSED_NOTICE)
    return result


#: A token per backend object (weakly held): kept public copies are never shared between two backend
#: objects, even two in-memory databases pinned to one name.
_BACKEND_TOKENS: weakref.WeakKeyDictionary[Backend, str] = weakref.WeakKeyDictionary()


def public_key(engine: Host, source: str, columns: list[tuple[str, PgType]]) -> str:
    """Equal keys, equal rows: the backend object and database, its data stamp (which moves with every
    write it can see; a fresh token when it cannot be read, so nothing is reused), the source, the columns."""
    backend = engine.backend
    token = _BACKEND_TOKENS.get(backend)
    if token is None:
        token = _BACKEND_TOKENS.setdefault(backend, secrets.token_hex(8))
    try:
        stamp = data_stamp(backend)
    except Exception:  # no version readable: never reused
        stamp = secrets.token_hex(16)
    return "\x1f".join([token, database_identity(backend), stamp, source, repr(columns)])


def _public_table(engine: Host, name: str) -> PublicTable:
    """A public table the outer statement reads, with the key of its current rows (read only when no kept
    copy has them, see :meth:`dpsql.outer.sandbox.Database.public_table`)."""
    table = engine.policy.table(name)
    assert table is not None
    columns = _public_columns(engine, name)
    source = table.source or name
    key = public_key(engine, source, columns)
    return PublicTable(name, columns, key, lambda: read_public(engine, name, source, columns))


def read_public(engine: Host, name: str, source: str, columns: list[tuple[str, PgType]]) -> list[tuple[Any, ...]]:
    """A public table's declared columns, read from the backend (public by policy: no noise needed)."""
    where = exp.to_table(source) if "." in source else exp.to_table(source, quoted=True)
    select = exp.select(*(exp.column(c, quoted=True) for c, _ in columns)).from_(where)
    rows = engine.step.query(engine.backend.render(select.limit(MAX_PUBLIC_ROWS + 1)))
    if len(rows) > MAX_PUBLIC_ROWS:
        raise ProgramLimitExceeded(f'public table "{name}" has more than {MAX_PUBLIC_ROWS} rows')
    return rows
