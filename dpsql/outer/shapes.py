"""Recognising composite statements: DP aggregates wrapped in sub-queries, CTEs, set operations or windows.

BI tools wrap aggregates (Superset's series limit, ibis' ``t0.*``, ``UNION ALL`` of describe()).
:func:`decompose` finds the maximal sub-SELECTs that read protected tables and aggregate at their own
level; each becomes an *inner* query answered by the ordinary engine, and is replaced in the
statement by a scan of a sandbox table holding its released rows. What is left (the *outer*
statement) reads only released rows and public tables, so whatever it computes is post-processing.
Windows directly over aggregates (``SUM(COUNT(*)) OVER ()``) are split: the grouped aggregates go
inside, the window outside. Decided from the SQL text alone, never from data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.analyze.sources import grouped_by_unit
from dpsql.errors import FeatureNotSupported, UndefinedTable
from dpsql.plan.sources import ident_name
from dpsql.policy import Policy

#: Functions refused in the outer statement (0A000, before anything is charged): they make rows
#: (``generate_series``, ``unnest``, ``range``), a value whose size an argument sets (``repeat``, ``lpad``,
#: ``format`` widths, ``list_resize``) or one value of every row (``string_agg``, ``array_agg``: a cross
#: join of released tables multiplies its size). Over a handful of released rows each could make
#: gigabytes in the sandbox's process; none is needed to post-process aggregates.
_SIZED_NODES: tuple[type[exp.Expr], ...] = (
    exp.Unnest,
    exp.GenerateSeries,  # and ExplodingGenerateSeries
    exp.Explode,  # and Posexplode
    exp.ExplodeOuter,
    exp.Inline,
    exp.GenerateDateArray,
    exp.GenerateTimestampArray,
    exp.Repeat,
    exp.Pad,
    exp.Space,
    exp.Format,
    exp.GroupConcat,
    exp.ArrayAgg,
    exp.ArrayConcatAgg,
    exp.ArrayUniqueAgg,
    exp.List,
    exp.JSONArrayAgg,
    exp.JSONObjectAgg,
    exp.ObjectAgg,
)
#: The same, for names sqlglot keeps as anonymous functions (PostgreSQL's and DuckDB's spellings).
_SIZED_NAMES = frozenset(
    {
        "range",
        "generate_series",
        "generate_subscripts",
        "unnest",
        "regexp_split_to_table",
        "string_to_table",
        "json_array_elements",
        "json_array_elements_text",
        "jsonb_array_elements",
        "jsonb_array_elements_text",
        "json_each",
        "jsonb_each",
        "json_each_text",
        "jsonb_each_text",
        "sequence",
        "repeat",
        "array_repeat",
        "list_repeat",
        "lpad",
        "rpad",
        "printf",
        "sprintf",
        "format",
        "bar",
        "list_resize",
        "array_resize",
        "array_fill",
        "string_agg",
        "listagg",
        "group_concat",
        "array_agg",
        "list",
        "histogram",
        "xmlagg",
        "json_agg",
        "jsonb_agg",
        "json_object_agg",
        "jsonb_object_agg",
        "json_group_array",
        "json_group_object",
    }
)

#: Prefix of the sandbox tables holding released rows (a name no analyst's query can reach:
#: tables named in the statement are checked against the policy before anything is replaced).
RELEASED_PREFIX = "__dpsql_released_"


@dataclass(frozen=True, slots=True)
class Inner:
    """One DP sub-query: the sandbox table its released rows go to, and its SQL (parameters bound)."""

    table: str
    sql: str


@dataclass(slots=True)
class Composite:
    """A statement split into DP inner queries and the post-processing statement over their rows."""

    inners: list[Inner]
    #: The outer statement (PostgreSQL syntax) reading the released tables, CTEs and public tables.
    outer: exp.Expr
    #: Public policy tables the outer statement reads (loaded into the sandbox from the backend).
    public: list[str] = field(default_factory=list)
    #: Output columns that are plain references to exact (non-noisy) columns, by name.
    exact_outputs: set[int] = field(default_factory=set)
    #: The outer statement in the sandbox's dialect, once generated (``dpsql.outer.outer_text``).
    text: str = ""

    @property
    def limit_zero(self) -> bool:
        """``… LIMIT 0`` on the outer statement: a schema probe, answered without running anything."""
        limit = self.outer.args.get("limit")
        value = limit.expression if isinstance(limit, exp.Limit) else None
        return isinstance(value, exp.Literal) and value.is_int and int(value.name) == 0


def _is_star(node: exp.Expr) -> bool:
    return isinstance(node, exp.Star) or (isinstance(node, exp.Column) and isinstance(node.this, exp.Star))


def _nested(node: exp.Expr, root: exp.Expr) -> bool:
    return node is not root and isinstance(node, exp.Select | exp.Subquery | exp.SetOperation)


def own_nodes(select: exp.Expr) -> list[exp.Expr]:
    """Nodes of ``select`` at its own level: nested SELECTs, sub-queries and CTE bodies left out."""
    return list(select.walk(prune=lambda n: _nested(n, select)))


def _window_func(node: exp.Expr) -> bool:
    return isinstance(node.parent, exp.Window) and node.arg_key == "this"


def own_aggregates(select: exp.Select) -> bool:
    """Whether ``select`` aggregates at its own level (an aggregate call that is not a window's function)."""
    if select.args.get("group"):
        return True
    return any(isinstance(n, exp.AggFunc) and not _window_func(n) for n in own_nodes(select))


def _own_windows(select: exp.Select) -> bool:
    return any(isinstance(n, exp.Window) for n in own_nodes(select))


def _sources(select: exp.Select) -> list[exp.Expr]:
    """The FROM item and the JOINed items of ``select``."""
    items: list[exp.Expr] = []
    if select.args.get("from_"):
        items.append(select.args["from_"].this)
    items.extend(j.this for j in select.args.get("joins") or [])
    return items


class _Lifter:
    """Walks the statement, replacing each DP inner query by a scan of its sandbox table."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.inners: list[Inner] = []
        #: CTE name -> whether its body is a filter view over a protected table (inlined by the engine).
        self.views: dict[str, exp.CTE] = {}
        self.ctes: set[str] = set()
        #: Whether some inner query was taken whole (no window split).
        self.took_plain = False

    def protected(self, table: exp.Table) -> bool:
        found = self.policy.table(ident_name(table.this))
        return found is not None and not found.public

    def reads_directly(self, select: exp.Select) -> bool:
        """Reads a protected table in its FROM/JOIN, itself or through a filter view (a CTE the engine inlines)."""
        for item in _sources(select):
            if not isinstance(item, exp.Table):
                continue
            name = ident_name(item.this)
            if not item.db and name in self.views:
                return True
            if not item.db and name in self.ctes:
                continue
            if self.protected(item):
                return True
        return False

    def take(self, select: exp.Select) -> exp.Expr:
        """``select`` as an inner query; returns what replaces it in the statement."""
        self.took_plain = self.took_plain or not _own_windows(select)
        table = f"{RELEASED_PREFIX}{len(self.inners) + 1}"
        if _own_windows(select):
            inner, outer = split_windows(select, table)
        else:
            inner, outer = hoist_constants(select, table)
        used = {ident_name(t.this) for t in inner.find_all(exp.Table) if not t.db}
        views = [cte.copy() for name, cte in self.views.items() if name in used]
        if views:  # filter views of an enclosing WITH that the inner query reads go with it
            own = inner.args.get("with_")
            inner.set("with_", exp.With(expressions=views + (own.expressions if own else [])))
        self.inners.append(Inner(table, inner.sql(dialect="postgres")))
        return outer

    def lift(self, node: exp.Expr) -> exp.Expr:
        """Lift inner queries out of ``node``; returns ``node`` or what replaced it."""
        if isinstance(node, exp.Subquery):
            node.set("this", self.lift(node.this))
            return node
        if isinstance(node, exp.SetOperation):
            self._lift_with(node)
            node.set("this", self.lift(node.this))
            node.set("expression", self.lift(node.expression))
            return node
        if not isinstance(node, exp.Select):
            return node
        self._lift_with(node)
        if own_aggregates(node) and self.reads_directly(node):
            return self.take(node)
        for item in _sources(node):
            if isinstance(item, exp.Subquery):
                self.lift(item)
        return node

    def _lift_with(self, node: exp.Expr) -> None:
        with_ = node.args.get("with_")
        for cte in with_.expressions if with_ else []:
            name = ident_name(cte.args["alias"].this) if cte.args.get("alias") else cte.alias_or_name
            body = cte.this
            if isinstance(body, exp.Select) and not own_aggregates(body) and self.reads_directly(body):
                self.views[name] = cte  # a filter view: the engine inlines it into the inner query reading it
            else:
                cte.set("this", self.lift(body))
            self.ctes.add(name)


def _constant(node: exp.Expr) -> bool:
    return not isinstance(node, exp.Column) and node.find(exp.Column, exp.AggFunc, exp.Star, exp.Select) is None


def hoist_constants(select: exp.Select, table: str) -> tuple[exp.Select, exp.Select]:
    """The inner query without its constant items (``'count' AS stat``), which the outer query adds back:
    they are typed by the sandbox like any literal, not by the engine. Items of the inner query get
    unique names (a table cannot have two ``count`` columns); the outer query restores PostgreSQL's."""
    inner = select.copy()
    if any(_is_star(p) for p in inner.expressions) or all(_constant(p.unalias()) for p in inner.expressions):
        return inner, exp.select("*").from_(exp.to_table(table))
    kept: list[exp.Expr] = []
    items: list[exp.Expr] = []
    names: set[str] = set()
    for p in inner.expressions:
        shown = pg_name(p)
        if _constant(p.unalias()):
            items.append(exp.alias_(p.unalias().copy(), shown, quoted=True))
            continue
        name = shown if shown not in names and not shown.startswith("__") else f"__c{len(kept)}"
        names.add(name)
        if name == shown and isinstance(p, exp.Alias | exp.Column):  # named already: the text kept, so the
            kept.append(p.copy())  # inner query shares its result-cache entry with the same query sent alone
        else:
            kept.append(exp.alias_(p.unalias().copy(), name, quoted=True))
        items.append(exp.alias_(exp.column(name, quoted=True), shown, quoted=True))
    inner.set("expressions", kept)
    return inner, exp.select(*items).from_(exp.to_table(table))


def split_windows(select: exp.Select, table: str) -> tuple[exp.Select, exp.Select]:
    """``SELECT k, COUNT(*), RANK() OVER (ORDER BY COUNT(*)) … GROUP BY k`` as an inner grouped query
    (keys and aggregates) and an outer query computing the windows over its released rows."""
    projections = select.expressions
    keys: list[exp.Expr] = []
    for g in select.args["group"].expressions if select.args.get("group") else []:
        if isinstance(g, exp.Literal) and g.is_int and 1 <= int(g.name) <= len(projections):
            g = projections[int(g.name) - 1].unalias()
        keys.append(g)
    key_sql = {k.sql(dialect="postgres"): f"__k{i}" for i, k in enumerate(keys)}
    key_names = {k.name.lower(): f"__k{i}" for i, k in enumerate(keys) if isinstance(k, exp.Column)}
    aggregates: dict[str, tuple[str, exp.Expr]] = {}

    def replace(node: exp.Expr) -> exp.Expr:
        if isinstance(node, exp.Identifier):  # an alias named like a key (`department AS department`) stays
            return node
        if isinstance(node, exp.AggFunc) and not _window_func(node):
            text = node.sql(dialect="postgres")
            alias = aggregates.setdefault(text, (f"__a{len(aggregates)}", node.copy()))[0]
            return exp.column(alias)
        text = node.sql(dialect="postgres")
        if text in key_sql:
            return exp.column(key_sql[text])
        if isinstance(node, exp.Column) and node.name.lower() in key_names:
            return exp.column(key_names[node.name.lower()])
        return node

    named = [
        p.copy() if isinstance(p, exp.Alias) else exp.alias_(p.copy(), pg_name(p), quoted=True) for p in projections
    ]
    outer = exp.select(*(p.transform(replace) for p in named)).from_(exp.to_table(table))
    if select.args.get("distinct"):
        outer.set("distinct", select.args["distinct"].copy())
    if select.args.get("order"):
        outer.set("order", select.args["order"].transform(replace))
    for arg in ("limit", "offset"):
        if select.args.get(arg):
            outer.set(arg, select.args[arg].copy())
    inner = select.copy()
    for arg in ("order", "limit", "offset", "distinct", "windows"):
        inner.set(arg, None)
    items = [exp.alias_(k.copy(), name) for k, name in zip(keys, key_sql.values(), strict=True)]
    items += [exp.alias_(node, name) for name, node in aggregates.values()]
    inner.set("expressions", items)
    return inner, outer


def pg_name(projection: exp.Expr) -> str:
    """The column name PostgreSQL gives a select item (alias, column, function name, else ``?column?``)."""
    if isinstance(projection, exp.Alias):
        return ident_name(projection.args["alias"])
    node = projection
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return ident_name(node.this)
    if isinstance(node, exp.Window):
        return pg_name(node.this)
    if isinstance(node, exp.Cast):
        return pg_name(node.this) if isinstance(node.this, exp.Column | exp.Func) else node.to.sql().lower()
    if isinstance(node, exp.Anonymous):
        return str(node.name).lower()
    if isinstance(node, exp.Count):
        return "count"
    if isinstance(node, exp.Func):
        return node.sql_name().lower()
    return "?column?"


def _named(projection: exp.Expr) -> exp.Expr:
    """``projection`` aliased with its PostgreSQL name (the sandbox would name it after its text)."""
    if _is_star(projection) or isinstance(projection, exp.Alias | exp.Column):  # a column keeps its name
        return projection.copy()
    return exp.alias_(projection.copy(), pg_name(projection), quoted=True)


def _first_select(node: exp.Expr) -> exp.Select | None:
    while isinstance(node, exp.SetOperation | exp.Subquery):
        node = node.this
    return node if isinstance(node, exp.Select) else None


def needs_outer(tree: exp.Expr, policy: Policy) -> bool:
    """Whether the statement wraps DP aggregates: a set operation, a window over aggregates, or a
    sub-query or CTE that aggregates a protected table (filter-only views are inlined by the engine)."""
    if isinstance(tree, exp.SetOperation):
        return True
    if not isinstance(tree, exp.Select):
        return False
    if _own_windows(tree) and own_aggregates(tree):
        return True
    # a sub-query grouped by the privacy unit is one row per person, read by the engine as a table; a
    # semi-join inside each person's rows (EXISTS, IN over an identifier) is the engine's too
    return any(
        node is not tree and own_aggregates(node) and not grouped_by_unit(node, policy) and not _semi_join(node, policy)
        for node in tree.find_all(exp.Select)
    )


def _semi_join(select: exp.Select, policy: Policy) -> bool:
    """A subquery of WHERE that :mod:`dpsql.analyze.subqueries` answers as a semi-join: under EXISTS, or
    selecting an identifier for IN (a DP sub-query, Superset's series limit, selects a released key)."""
    parent = select.parent.parent if isinstance(select.parent, exp.Subquery) else select.parent
    if isinstance(parent, exp.Exists):
        return True
    if isinstance(parent, exp.In) and len(select.expressions) == 1:
        column = select.expressions[0].unalias()
        if isinstance(column, exp.Column):
            name = ident_name(column.this)
            return any(name in t.columns and t.columns[name].identifier for t in policy.tables.values())
    return False


def refuse_recursion(tree: exp.Expr) -> None:
    """0A000 for ``WITH RECURSIVE`` anywhere in the statement: a recursive CTE over released rows need
    never end (the ordinary engine refuses it too). Decided from the SQL alone, before any charge."""
    if any(w.args.get("recursive") for w in tree.find_all(exp.With)):
        raise FeatureNotSupported("WITH RECURSIVE is not supported")


def refuse_sized(outer: exp.Expr) -> None:
    """0A000 for a function of the outer statement that makes rows or sized values (:data:`_SIZED_NODES`):
    bounds the sandbox's work by the released rows and the statement's text. From the SQL alone."""
    for node in outer.find_all(exp.Func, exp.Unnest):
        name = node.name.lower() if isinstance(node, exp.Anonymous) else ""
        if isinstance(node, _SIZED_NODES) or name in _SIZED_NAMES:
            shown = node.sql(dialect="postgres").split("(", 1)[0].strip() or type(node).__name__
            raise FeatureNotSupported(
                f"{shown.upper()} is not supported in a query over DP results",
                hint="Functions that make rows or long values (generate_series, unnest, repeat, lpad, "
                "string_agg, array_agg, …) are refused over released rows.",
            )


def decompose(tree: exp.Expr, policy: Policy) -> Composite | None:
    """Split a composite statement (parameters already bound), or None when it is not one or when its
    outer part would still read a protected table (the engine then refuses it as it always has).
    ``WITH RECURSIVE`` and row- or size-making functions of the outer part are refused (0A000)."""
    if not needs_outer(tree, policy):
        return None
    refuse_recursion(tree)
    ctes = {ident_name(c.args["alias"].this) for c in tree.find_all(exp.CTE) if c.args.get("alias")}
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):  # read_csv(…), range(…), generate_series(…)
            raise FeatureNotSupported("FROM must name a table", hint="Subqueries and table functions are refused.")
        name = ident_name(table.this)
        if not table.db and name in ctes:
            continue
        if policy.table(name) is None or ident_name(table.args.get("db")) not in ("", "public"):
            schema = ident_name(table.args.get("db"))
            raise UndefinedTable(
                f'relation "{f"{schema}.{name}" if schema else name}" does not exist',
                hint=f'Tables in dataset "{policy.dataset}": {", ".join(sorted(policy.tables))}.',
            )
    tree = tree.copy()
    lifter = _Lifter(policy)
    root = tree
    outer = lifter.lift(tree)
    if not lifter.inners or (outer is not root and lifter.took_plain):
        return None  # nothing to lift, or the whole statement is one query: the engine answers or refuses it
    # filter views that only inner queries read are dropped from the outer WITH
    for table in outer.find_all(exp.Table):
        if not table.db and ident_name(table.this) in lifter.views:
            return None  # the outer part reads a view of a protected table: not post-processing
    for cte in list(outer.find_all(exp.CTE)):
        if cte.alias_or_name in lifter.views:
            cte.pop()
    for w in list(outer.find_all(exp.With)):
        if not w.expressions:
            w.pop()
    public: list[str] = []
    for table in outer.find_all(exp.Table):
        if table.db and ident_name(table.args.get("db")) == "public":
            table.set("db", None)  # the sandbox holds the policy's tables by name alone
        name = ident_name(table.this)
        if name.startswith(RELEASED_PREFIX) or (not table.db and name in lifter.ctes):
            continue
        found = policy.table(name)
        if found is None or not found.public:
            return None  # the outer part reads a protected table: not post-processing
        if name not in public:
            public.append(name)
    refuse_sized(outer)
    first = _first_select(outer)
    exact: set[int] = set()
    if first is not None:
        first.set("expressions", [_named(p) for p in first.expressions])
    return Composite(lifter.inners, outer, public, exact)
