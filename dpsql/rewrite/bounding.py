"""Pass 8, ``bound_contributions``: at most ``max_groups`` groups and ``max_rows`` rows per privacy unit.

Four strategies: per-unit partial aggregates (ungrouped), (unit, group) cells kept whole in a salted
order (grouped counts and sums), each unit's first rows in cell order by ``MIN_BY`` or ``ROW_NUMBER``
(counts over many groups, where the backend offers it), and row numbering in a salted row order
(everything else).
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.analyze.expressions import clamp_sql
from dpsql.plan import Plan
from dpsql.policy import ColumnPolicy
from dpsql.rewrite._sql import key_column, literal_number


def _as_text(value: exp.Expression) -> exp.Expression:
    return exp.Coalesce(this=exp.cast(value, exp.DataType.Type.TEXT), expressions=[exp.Literal.string("~")])


def _float_policy(plan: Plan, column: exp.Expression) -> ColumnPolicy | None:
    """The policy of a float column of a source (None otherwise, e.g. a hidden unit-join column or an
    expression key)."""
    if not isinstance(column, exp.Column):
        return None
    source = next((s for s in plan.sources.sources if s.alias == column.table), None)
    policy = source.table.columns.get(column.name) if source is not None else None
    return policy if policy is not None and policy.type == "float" else None


def _is_float(plan: Plan, column: exp.Expression) -> bool:
    return _float_policy(plan, column) is not None


def _hash_input(plan: Plan, column: exp.Expression) -> exp.Expression:
    """What a column contributes to the row hash, as text every backend renders alike.

    Doubles print differently (DuckDB ``4999.0``, PostgreSQL ``4999``, Spark ``1.0E15``), so a
    bounded float column is hashed as the BIGINT ``floor((clamp(x) − lower)·2^40 / (upper − lower))``:
    IEEE arithmetic gives the same integer everywhere, and it cannot overflow.
    """
    policy = _float_policy(plan, column)
    if policy is None or not isinstance(policy.lower, int | float) or not isinstance(policy.upper, int | float):
        return column.copy()
    lower, upper = float(policy.lower), float(policy.upper)
    if upper <= lower:
        return column.copy()
    clamped = clamp_sql(exp.cast(column.copy(), exp.DataType.Type.DOUBLE), literal_number(lower), literal_number(upper))
    offset = exp.paren(exp.Sub(this=clamped, expression=literal_number(lower)), copy=False)
    scaled = exp.Div(
        this=exp.paren(exp.Mul(this=offset, expression=exp.Literal.number(2**40)), copy=False),
        expression=literal_number(upper - lower),
    )
    return exp.cast(exp.Floor(this=scaled), exp.DataType.Type.BIGINT)


def _hash(plan: Plan, values: list[exp.Expression]) -> exp.Expression:
    """A salted order of rows or cells that is not the database's RANDOM() (whose seed an analyst could
    set) and does not depend on the analyst's query.

    ``md5`` (default): md5 of the salt and the values as text, the same on every backend, so every
    backend keeps the same rows. ``duckdb``: DuckDB's own HASH of the salt and the values, an order of
    magnitude cheaper per row. ``postgres``: PostgreSQL's 64-bit ``hashtextextended`` of md5's text, a
    bigint that sorts far faster than md5's 32 characters. Each is a different order, kept within the
    same bounds: the privacy argument needs only that a unit's order depends on its own rows and the
    salt, never on the query or on other units.
    """
    salt = exp.Literal.string(plan.physical.salt)
    if plan.physical.hash == "duckdb":
        return exp.Anonymous(this="HASH", expressions=[salt, *values])
    text: exp.Expression = salt
    for value in values:
        text = exp.DPipe(
            this=text, expression=exp.DPipe(this=exp.Literal.string("|"), expression=_as_text(_hash_input(plan, value)))
        )
    if plan.physical.hash == "postgres":
        return exp.Anonymous(this="hashtextextended", expressions=[text, exp.Literal.number(0)])
    return exp.MD5(this=text)


def over_sources(select: exp.Select, *projections: exp.Expr) -> exp.Select:
    """``projections`` over ``select``'s FROM, joins and WHERE: the rows a bounding step reads."""
    query = exp.select(*projections).from_(select.args["from_"].copy(), copy=False)
    for join in select.args.get("joins") or []:
        query.append("joins", join.copy())
    if select.args.get("where"):
        query.set("where", select.args["where"].copy())
    return query


def bound_contributions(select: exp.Select, plan: Plan) -> exp.Select:
    """Keep at most ``max_groups`` groups and ``max_rows`` rows of each privacy unit.

    Ungrouped queries cap per-unit partial aggregates (:func:`_bound_per_unit`). Grouped ones whose
    aggregates are counts and sums (everything but a distinct count of a non-unit column) aggregate
    (unit, group) cells once and keep whole cells in a salted order, scaling the one cell per unit that
    crosses the bound (:func:`_bound_by_cells`); on backends that keep the top rows of each unit in one
    step, counts over many public groups take those rows instead (:func:`_bound_by_top_rows`).
    Everything else goes rows (unit, used columns, row hash) → rank groups per unit → number rows per
    unit in hash order → aggregate the rows within both bounds. Bounding happens after the joins, so no
    join can multiply a unit's rows past the bound the noise assumes.
    """
    if plan.unit is None:
        return select
    if not plan.keys and not select.args.get("group") and all(m.aggregate.decomposable for m in plan.measures):
        return _bound_per_unit(select, plan)
    columns: dict[str, exp.Column] = {}
    for node in [
        *select.expressions,
        *(select.args["group"].expressions if select.args.get("group") else []),
    ]:
        for column in node.find_all(exp.Column):
            columns.setdefault(column.sql(), column)
    names = {sql: f"c{i}" for i, sql in enumerate(columns)}
    outer = select.copy()
    for key in ("from_", "joins", "where"):  # the outer query reads a bounding CTE, set below
        outer.set(key, None)
    for column in list(outer.find_all(exp.Column)):
        column.replace(exp.column(names[column.sql()], quoted=True))
    if select.args.get("group") and _scalable(outer, plan, names):
        if _top_rows_apply(select, outer, plan, names):
            return _bound_by_top_rows(select, plan, outer, columns, names)
        return _bound_by_cells(select, plan, outer, columns, names)
    used = [exp.alias_(column.copy(), names[sql]) for sql, column in columns.items()]
    rank_groups = bool(plan.keys) and plan.max_groups < plan.max_rows
    keys = [key_column(plan, i) for i in range(len(plan.keys))]
    key_hash = [exp.alias_(_hash(plan, keys), "__kh")] if rank_groups else []
    rows = over_sources(
        select,
        exp.alias_(plan.unit.copy(), "__unit"),
        *used,
        exp.alias_(_hash(plan, [plan.unit.copy(), *(c.copy() for c in _besides_unit(plan, columns))]), "__h"),
        *key_hash,
    )
    unit = exp.column("__unit", quoted=True)
    floats = [exp.column(names[sql], quoted=True) for sql, c in columns.items() if _is_float(plan, c)]
    groups, filter_rows_ = _rank_groups(plan, "__rows", rank_groups)
    number = exp.Window(this=exp.RowNumber(), partition_by=[unit.copy()], order=_hash_order("__h", floats))
    bounded = exp.select(exp.Star(), exp.alias_(number, "__rn")).from_("__groups")
    if filter_rows_ is not None:
        bounded = bounded.where(filter_rows_)
    outer = outer.from_("__bounded", copy=False).where(
        exp.LTE(this=exp.column("__rn"), expression=exp.Literal.number(plan.max_rows)), copy=False
    )
    # copy=False throughout: ``outer`` and the CTEs are this pass's own trees (a copy per call was
    # quadratic-looking for large keys: a 1000-branch CASE key took seconds to rewrite)
    for name, cte in (("__rows", rows), ("__groups", groups), ("__bounded", bounded)):
        outer = outer.with_(name, as_=cte, copy=False)
    return outer


def _besides_unit(plan: Plan, columns: dict[str, exp.Column]) -> list[exp.Column]:
    """The used columns other than the unit (read by a distinct-unit count): the unit is already
    hashed and grouped on first, so rows are picked as if it were not read twice."""
    assert plan.unit is not None
    unit = plan.unit.sql()
    return [c for sql, c in columns.items() if sql != unit]


def _hash_order(hash_column: str, floats: list[exp.Column]) -> exp.Order:
    """Order by a salted hash; exact float values break its (rare) ties the same way on every backend."""
    ties = [exp.Ordered(this=f, nulls_first=False) for f in floats]
    return exp.Order(expressions=[exp.Ordered(this=exp.column(hash_column)), *ties])


def _rank_groups(plan: Plan, source: str, rank_groups: bool) -> tuple[exp.Select, exp.Expression | None]:
    """``source`` with each row's group ranked per unit by the salted key hash ``__kh``, and the
    condition keeping a unit's first ``max_groups`` groups (``source`` as is when not ranking)."""
    if not rank_groups:
        return exp.select(exp.Star()).from_(source), None
    rank = exp.Window(
        this=exp.Anonymous(this="DENSE_RANK"),
        partition_by=[exp.column("__unit", quoted=True)],
        order=exp.Order(expressions=[exp.Ordered(this=exp.column("__kh"))]),
    )
    groups = exp.select(exp.Star(), exp.alias_(rank, "__g")).from_(source)
    return groups, exp.LTE(this=exp.column("__g"), expression=exp.Literal.number(plan.max_groups))


def _aggregates(outer: exp.Select) -> list[exp.AggFunc]:
    """The outermost aggregate calls of ``outer``'s projections."""
    found: list[exp.AggFunc] = []
    for projection in outer.expressions:
        found += [a for a in projection.find_all(exp.AggFunc) if a.find_ancestor(exp.AggFunc) is None]
    return found


def _unit_name(plan: Plan, names: dict[str, str]) -> str | None:
    assert plan.unit is not None
    return names.get(plan.unit.sql())


def _distinct_unit(node: exp.Expr, unit: str | None) -> bool:
    """``COUNT(DISTINCT unit)``: 1 in each kept cell of the unit, whatever rows are kept."""
    inner = node.this.expressions if isinstance(node, exp.Count) and isinstance(node.this, exp.Distinct) else []
    return len(inner) == 1 and isinstance(inner[0], exp.Column) and inner[0].name == unit


def _scalable(outer: exp.Select, plan: Plan, names: dict[str, str]) -> bool:
    """Whether every aggregate is a count or a sum: additive over a cell's rows, so a cell's partial
    aggregate stands for its rows (a distinct count of the unit counts 1 per kept cell)."""
    unit = _unit_name(plan, names)
    for node in _aggregates(outer):
        if isinstance(node, exp.Count):
            if isinstance(node.this, exp.Distinct) and not _distinct_unit(node, unit):
                return False
        elif not isinstance(node, exp.Sum):
            return False
    return True


def _group_inputs(select: exp.Select, plan: Plan, columns: dict[str, exp.Column]) -> list[str]:
    """SQL of the columns the GROUP BY reads, other than the unit: with the unit, they name a cell."""
    assert plan.unit is not None
    read = {c.sql() for g in select.args["group"].expressions for c in g.find_all(exp.Column)}
    return [sql for sql in columns if sql in read and sql != plan.unit.sql()]


def _bound_by_cells(
    select: exp.Select, plan: Plan, outer: exp.Select, columns: dict[str, exp.Column], names: dict[str, str]
) -> exp.Select:
    """Grouped counts and sums: aggregate each (unit, group) cell once, keep whole cells, scale one.

    A cell is one unit's rows in one group. Its partial aggregates (count, sums of clamped values) are
    computed in one aggregation over (unit, group columns); a unit's cells are ordered by a salted hash
    and kept whole while the unit's running row count stays within ``max_rows``; the one cell that
    crosses the bound (at most one per unit) contributes ``room / n`` of each partial (its rows, ``room``
    of ``n`` of them, weighted equally; integer partials truncated toward zero). So each unit adds at
    most ``max_rows`` rows' worth to the counts and at most ``max_rows`` clamped values to each sum
    (|partial · room / n| ≤ room · max |bound|), over at most ``max_groups`` groups, all computed from
    its own rows: the sensitivity the noise assumes. No row is hashed, sorted or joined back: the
    per-row work is the cell aggregation itself.
    """
    assert plan.unit is not None
    inputs = _group_inputs(select, plan, columns)
    source = {names[sql]: columns[sql] for sql in columns}
    unit = _unit_name(plan, names)
    room, size = exp.column("__room", quoted=True), exp.column("__n", quoted=True)
    partials: list[exp.Expr] = []
    seen: dict[str, exp.Column] = {"COUNT(*)": size}  # one partial per distinct aggregate; COUNT(*) is __n
    for node in _aggregates(outer):
        if _distinct_unit(node, unit):
            # 1 per group the unit keeps any cell in: a group can hold several of its cells (an
            # expression key such as FLOOR(x) maps many raw values to one group), so never a sum of cells
            node.replace(exp.Count(this=exp.Distinct(expressions=[exp.column("__unit", quoted=True)]), big_int=True))
            continue
        partial = node.copy().transform(
            lambda n: source[n.name].copy() if isinstance(n, exp.Column) and n.name in source else n, copy=False
        )
        if partial.sql() not in seen:
            seen[partial.sql()] = exp.column(f"__p{len(partials)}", quoted=True)
            partials.append(exp.alias_(partial, f"__p{len(partials)}", quoted=True))
        value = seen[partial.sql()].copy()
        scaled = _scaled(node, value, room, size, _integer_sum(node, plan), exact=_centring_count(node))
        whole = exp.GTE(this=room.copy(), expression=size.copy())
        node.replace(exp.Sum(this=exp.Case().when(whole, value.copy()).else_(scaled)))
    rank_groups = bool(plan.keys) and plan.max_groups < plan.max_rows
    key_columns = [key_column(plan, i) for i in range(len(plan.keys))]
    cells = over_sources(
        select,
        exp.alias_(plan.unit.copy(), "__unit"),
        *(exp.alias_(columns[sql].copy(), names[sql]) for sql in inputs),
        exp.alias_(exp.Count(this=exp.Star(), big_int=True), "__n"),
        *partials,
        exp.alias_(_hash(plan, [plan.unit.copy(), *(columns[sql].copy() for sql in inputs)]), "__ch"),
        *([exp.alias_(_hash(plan, key_columns), "__kh")] if rank_groups else []),
    ).group_by(plan.unit.copy(), *(columns[sql].copy() for sql in inputs), copy=False)
    groups, within_groups = _rank_groups(plan, "__cells", rank_groups)
    floats = [exp.column(names[sql], quoted=True) for sql in inputs if _is_float(plan, columns[sql])]
    running = exp.Window(
        this=exp.Sum(this=size.copy()),
        partition_by=[exp.column("__unit", quoted=True)],
        order=_hash_order("__ch", floats),
        spec=exp.WindowSpec(kind="ROWS", start="UNBOUNDED", start_side="PRECEDING", end="CURRENT ROW"),
    )
    counted = exp.select(exp.Star(), exp.alias_(exp.cast(running, exp.DataType.Type.BIGINT), "__upto")).from_(
        "__groups"
    )
    if within_groups is not None:
        counted = counted.where(within_groups)
    k = exp.Literal.number(plan.max_rows)
    before = exp.paren(exp.Sub(this=exp.column("__upto"), expression=size.copy()), copy=False)
    kept = (
        exp.select(exp.Star(), exp.alias_(exp.Sub(this=k.copy(), expression=before), "__room"))
        .from_("__counted")
        .where(exp.LT(this=before.copy(), expression=k.copy()))
    )
    outer = outer.from_("__kept", copy=False)
    for name, cte in (("__cells", cells), ("__groups", groups), ("__counted", counted), ("__kept", kept)):
        outer = outer.with_(name, as_=cte, copy=False)
    return outer


def count_unit_rows(ctes: dict[str, exp.CTE]) -> bool:
    """Give ``__counted`` of :func:`_bound_by_cells` each cell's unit's rows over all its cells, ``__bn``
    (for the bias totals folded into the statement): a window with the running count's partition and
    order and the whole partition as its frame, so the backend sorts the cells once for both (no second
    aggregation of the cells per unit, no join back). NULL units share one partition, as they share one
    group. False, with nothing added, unless ``__counted`` reads every cell (not when groups are ranked:
    then it keeps a unit's first ``max_groups`` groups only)."""
    counted, groups = ctes.get("__counted"), ctes.get("__groups")
    if counted is None or groups is None or not isinstance(counted.this, exp.Select):
        return False
    if groups.this.sql() != "SELECT * FROM __cells" or counted.this.args.get("where") is not None:
        return False
    upto = next((e for e in counted.this.expressions if e.alias == "__upto"), None)
    running = upto.find(exp.Window) if upto is not None else None
    if running is None:
        return False
    whole = running.copy()
    whole.set(
        "spec",
        exp.WindowSpec(kind="ROWS", start="UNBOUNDED", start_side="PRECEDING", end="UNBOUNDED", end_side="FOLLOWING"),
    )
    counted.this.append("expressions", exp.alias_(exp.cast(whole, exp.DataType.Type.BIGINT), "__bn"))
    return True


def _integer_sum(node: exp.Expr, plan: Plan) -> bool:
    """Whether a SUM adds integers (its measure is released as an integer, not centred or squared)."""
    if not isinstance(node, exp.Sum):
        return True  # counts
    alias = node.find_ancestor(exp.Alias)
    name = alias.alias if alias is not None else ""
    if not (name.startswith("m") and name[1:].isdigit()):
        return False
    measure = plan.measures[int(name[1:])]
    return measure.integer and measure.centre == 0 and not measure.square


def _centring_count(node: exp.Expr) -> bool:
    """Whether ``node`` is the exact count ``z<i>`` a centred sum ``m<i>`` is folded with (``m − c·z``)."""
    alias = node.find_ancestor(exp.Alias)
    name = alias.alias if alias is not None else ""
    return name.startswith("z") and name[1:].isdigit()


def _scaled(
    node: exp.Expr, value: exp.Column, room: exp.Column, size: exp.Column, integer: bool, *, exact: bool = False
) -> exp.Expression:
    """``room / n`` of a crossing cell's partial: exact for COUNT(*), truncated toward zero for other
    integers (so never beyond ``room`` rows' worth), in double precision for float sums. The integer
    form ``(p DIV n)·room + ((p MOD n)·room) DIV n`` equals ``trunc(p·room / n)`` without forming p·room.

    ``exact``: a centring count ``z`` is scaled in double precision like the sum it centres, so the
    centred sum ``(m − c·z)·room / n`` is the crossing cell's centred values weighted equally, each
    within half the bounds' range. Truncating ``z`` alone would move the centred sum by up to ``|c|``
    per unit beyond the sensitivity the noise assumes (when NULLs or FILTER make ``z`` < ``n``)."""
    if isinstance(node, exp.Count) and isinstance(node.this, exp.Star):
        return room.copy()
    if isinstance(node, exp.Count) and not exact:  # COUNT(x) ≤ n: the product is at most n · max_rows
        return exp.IntDiv(this=exp.Mul(this=value.copy(), expression=room.copy()), expression=size.copy())
    if integer and not exact:
        whole = exp.Mul(this=exp.IntDiv(this=value.copy(), expression=size.copy()), expression=room.copy())
        rest = exp.Mul(
            this=exp.paren(exp.Mod(this=value.copy(), expression=size.copy()), copy=False), expression=room.copy()
        )
        return exp.Add(this=whole, expression=exp.IntDiv(this=rest, expression=size.copy()))
    share = exp.Mul(this=exp.cast(value.copy(), exp.DataType.Type.DOUBLE), expression=room.copy())
    return exp.Div(this=share, expression=size.copy())


def _top_rows_apply(select: exp.Select, outer: exp.Select, plan: Plan, names: dict[str, str]) -> bool:
    """Counts over public, non-NULL key columns whose domains hold more groups than ``max_rows``, on
    a backend that keeps a unit's top rows in one step (``plan.physical.top_rows``): there most cells
    hold one row, so ordering cells costs what ordering rows does, and picking rows directly beats
    it. Decided from the plan and the policy only (never the data)."""
    if plan.physical.top_rows is None or plan.max_groups < plan.max_rows or not plan.keys:
        return False
    unit = _unit_name(plan, names)
    counts = all(
        isinstance(n, exp.Count) and (isinstance(n.this, exp.Star) or _distinct_unit(n, unit))
        for n in _aggregates(outer)
    )
    plain = all(k.expr is None and k.domain is not None and not k.policy.nullable for k in plan.keys)
    if not counts or not plain or len(select.args["group"].expressions) != len(plan.keys):
        return False
    groups = 1
    for key in plan.keys:
        groups *= len(key.domain or ())
    return groups > plan.max_rows


def _bound_by_top_rows(
    select: exp.Select, plan: Plan, outer: exp.Select, columns: dict[str, exp.Column], names: dict[str, str]
) -> exp.Select:
    """Each unit's first ``max_rows`` rows in the salted order of their cell.

    The order is the cell hash of :func:`_bound_by_cells`, so the rows kept are whole cells and part of
    the crossing cell: for counts (rows of one cell are alike) the same counts that path keeps. DuckDB's
    ``MIN_BY(x, order, n)`` keeps the n smallest in a bounded heap per unit, one aggregation; it skips
    NULL values, so only non-NULL key columns come here (:func:`_top_rows_apply`). Elsewhere
    ``ROW_NUMBER()`` over the unit in that order (one sort of the rows by unit and a bigint, where the
    cells path sorts as many cells); rows of a cell tie, and which of them is kept cannot change a count.
    """
    assert plan.unit is not None
    keys = [key_column(plan, i) for i in range(len(plan.keys))]
    order = _hash(plan, [plan.unit.copy(), *(k.copy() for k in keys)])
    unit = _unit_name(plan, names)
    unit_column = [exp.alias_(plan.unit.copy(), unit)] if unit is not None else []
    if plan.physical.top_rows == "row_number":
        in_order = exp.Order(expressions=[exp.Ordered(this=order)])
        number = exp.Window(this=exp.RowNumber(), partition_by=[plan.unit.copy()], order=in_order)
        top = over_sources(
            select, *unit_column, *(exp.alias_(k.copy(), names[k.sql()]) for k in keys), exp.alias_(number, "__rn")
        )
        within = exp.LTE(this=exp.column("__rn"), expression=exp.Literal.number(plan.max_rows))
        return outer.from_("__top", copy=False).where(within, copy=False).with_("__top", as_=top, copy=False)
    top = over_sources(
        select,
        *unit_column,
        *(
            exp.alias_(
                exp.Unnest(
                    expressions=[
                        exp.Anonymous(
                            this="MIN_BY", expressions=[k.copy(), order.copy(), exp.Literal.number(plan.max_rows)]
                        )
                    ]
                ),
                names[k.sql()],
            )
            for k in keys
        ),
    ).group_by(plan.unit.copy(), copy=False)
    return outer.from_("__top", copy=False).with_("__top", as_=top, copy=False)


def _bound_per_unit(select: exp.Select, plan: Plan) -> exp.Select:
    """Ungrouped queries: aggregate per unit, then cap each unit's partial aggregate.

    A unit's count is capped at ``max_rows`` and its sum of (already clamped) values at
    ``max_rows`` times the per-row bounds (widened to include 0), so one unit moves each measure by
    at most the sensitivity the noise assumes, as when keeping ``max_rows`` of its rows. One hash
    aggregation instead of hashing and sorting every row: an order of magnitude faster, and no row is
    dropped at random.
    """
    k = plan.max_rows
    partials: list[exp.Expr] = []
    totals = []
    seen: dict[str, exp.Column] = {}  # one partial per distinct aggregate (AVG's count and its centring count)

    def partial_of(aggregate: exp.Expression, name: str) -> exp.Column:
        if aggregate.sql() not in seen:
            seen[aggregate.sql()] = exp.column(f"__{name}", quoted=True)
            partials.append(exp.alias_(aggregate.copy(), f"__{name}", quoted=True))
        return seen[aggregate.sql()].copy()

    for projection in select.expressions:
        name, aggregate = projection.alias, projection.this
        if isinstance(aggregate, exp.Coalesce):  # COALESCE(SUM(value), 0)
            partial = partial_of(aggregate.this, name)
            low, high = _row_bounds(plan, name)
            capped = clamp_sql(partial, literal_number(k * min(low, 0)), literal_number(k * max(high, 0)))
        else:  # COUNT(*), COUNT(x), COUNT(DISTINCT unit)
            partial = partial_of(aggregate, name)
            cap = 1 if isinstance(aggregate.this, exp.Distinct) else k
            capped = (
                exp.Case()
                .when(exp.GT(this=partial, expression=literal_number(cap)), literal_number(cap))
                .else_(partial.copy())
            )
        total = exp.Coalesce(this=exp.Sum(this=capped), expressions=[exp.Literal.number(0)])
        totals.append(exp.alias_(total, name))
    assert plan.unit is not None
    units = over_sources(select, *partials).group_by(plan.unit.copy(), copy=False)
    return exp.select(*totals).from_("__units").with_("__units", as_=units)


def _row_bounds(plan: Plan, name: str) -> tuple[float, float]:
    """Bounds of one row's summed value for the sum measure aliased ``name`` (``m<i>``)."""
    measure = plan.measures[int(name[1:])]
    if measure.square:
        return 0.0, measure.sensitivity  # (x − centre)², at most the squared reach
    assert measure.lower is not None and measure.upper is not None
    return measure.lower, measure.upper
