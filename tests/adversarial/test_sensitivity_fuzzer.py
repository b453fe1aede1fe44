"""The sensitivity fuzzer: random policies × random accepted queries × worst-case neighbours, both backends.

For every drawn (policy, query) the engine's own un-noised measurement SQL (the analysis, the backend's
physical choices with a fixed salt, every rewrite pass; histograms of selected measures aside) runs on
the base database D and on D plus one adversarial person (:data:`fuzz_grammar.ADVERSARIES`), on DuckDB
and PostgreSQL. The property checked is the one the noise is calibrated to:

- every measure moves by at most its stated (L1, L2) sensitivity summed over all groups
  (``plan.sensitivities``), and by at most its per-group contribution in any one group (1 for a
  distinct-unit count, the partition-selection count included; ``max_rows`` rows' worth otherwise);
- at most ``plan.max_groups`` groups move at all;
- a public key's domain narrowed by WHERE (NOT IN, LIKE/ILIKE, OR-ed equalities, …) still holds every
  key a row that WHERE keeps can have, on D and on every neighbour: a group in the column's declared
  domain (within its bounds, or NULL when nullable) that the measurement reaches but the narrowed domain
  lacks would be silently dropped from the release (not a privacy loss, a wrong answer).

A failing case prints the policy YAML, the SQL, the adversary and the salt: a reproducible case.
Queries the analyzer refuses are skipped (refusals have their own tests); the share answered is
asserted so the grammar cannot silently drift into refusals. The default tier draws a rotating
sample (hypothesis' random seed, printed on failure) of :data:`EXAMPLES` per backend; ``-m heavy``
draws :data:`HEAVY_EXAMPLES`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from sqlglot import exp

from dpsql.aggregates import Selection
from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.errors import Error
from dpsql.noise.exponential import QuantileGrid, extreme_aims, interval_reach, interval_utilities, rank_utilities
from dpsql.plan import GroupKey, Measure, Plan
from dpsql.policy import Policy, parse_policy
from dpsql.release.apply import centre_rows
from dpsql.release.bias import BiasEstimate, split_folded
from dpsql.release.bias import estimate as bias_estimate
from dpsql.rewrite import histogram_queries, rewrite, to_sql
from dpsql.rewrite.physical import choose_physical
from tests.adversarial.fuzz_grammar import (
    ADVERSARIES,
    INVALID,
    NULLABLE_ALWAYS,
    FuzzPolicy,
    database_script,
    policies,
    queries,
)

EXAMPLES = 120
HEAVY_EXAMPLES = 1500
NAMES = [None, *ADVERSARIES]


@pytest.fixture(scope="module")
def duck_worlds() -> Iterator[dict[str | None, Backend]]:
    worlds = {}
    for name in NAMES:
        backend = open_backend("duckdb://")
        backend.execute_script(database_script(name))
        worlds[name] = backend
    yield worlds
    for backend in worlds.values():
        backend.close()


@pytest.fixture(scope="module")
def pg_worlds(pg_new_database: Callable[[], str]) -> Iterator[dict[str | None, Backend]]:
    worlds = {}
    for name in NAMES:
        backend = open_backend(pg_new_database())
        backend.execute_script(database_script(name))
        worlds[name] = backend
    yield worlds
    for backend in worlds.values():
        backend.close()


#: The physical choices each backend can make (hash order × top-rows strategy); one is drawn per case.
PHYSICAL_CHOICES = {
    "duckdb": [("md5", None), ("duckdb", None), ("duckdb", "min_by"), ("duckdb", "row_number"), ("md5", "min_by")],
    "postgres": [("md5", None), ("postgres", None), ("postgres", "row_number"), ("md5", "row_number")],
}


def _policy(max_rows: int, max_groups: int, kind_domain: str = "table") -> FuzzPolicy:
    return FuzzPolicy(
        "pid", max_rows, max_groups, kind_domain, True, frozenset(NULLABLE_ALWAYS), (0.0, 50.0), (0, 10), (-5.0, 5.0)
    )


#: Cases every run checks first (hypothesis' explicit examples): the two findings of issue #26 the
#: fixed-shape tests missed, and one case per bounding strategy, so coverage never rests on luck.
#: (policy, SQL, salt, physical choice: index into PHYSICAL_CHOICES[dialect]).
REGRESSIONS: list[tuple[FuzzPolicy, str, str, int]] = [
    # #26.2: a distinct-person count summed over a person's cells of one expression group
    (
        _policy(5, 3),
        "SELECT DATE_TRUNC('month', e.day) AS k0, COUNT(DISTINCT e.pid) AS v0 FROM events e GROUP BY k0",
        "s1",
        0,
    ),
    (_policy(5, 3, "none"), "SELECT DISTINCT FLOOR(e.amount * 10) FROM events e", "s1", 1),
    # #26.3: the crossing cell's centring count truncated while its sum was scaled exactly
    (
        _policy(1, 3),
        "SELECT e.kind AS k0, AVG(e.amount) AS v0, VAR_POP(e.amount) AS v1 FROM events e GROUP BY k0",
        "s1",
        0,
    ),
    (_policy(2, 2), "SELECT e.kind AS k0, corr(e.amount, e.qty) AS v0 FROM events e GROUP BY k0", "x", 1),
    # one per strategy: per-unit partials, rows (a distinct count of a column, a quantile), top rows
    (_policy(3, 2), "SELECT COUNT(*) AS v0, SUM(e.amount) AS v1, AVG(e.qty) AS v2 FROM events e", "s1", 0),
    (
        _policy(3, 2),
        "SELECT e.flag AS k0, COUNT(DISTINCT e.kind) AS v0, MIN(e.amount) AS v1 FROM events e GROUP BY k0",
        "s1",
        0,
    ),
    (_policy(2, 4, "list"), "SELECT e.kind AS k0, e.flag AS k1, COUNT(*) AS v0 FROM events e GROUP BY k0, k1", "s1", 2),
    # WHERE narrowing of public domains (#29 item 6): LIKE with an escaped _, non-ASCII ILIKE (kept: the
    # backends fold it differently), NOT IN, OR-ed equalities and INs, a date IN with timestamps
    (
        _policy(3, 2),
        "SELECT e.tag AS k0, COUNT(*) AS v0, SUM(e.amount) AS v1 FROM events e "
        "WHERE (e.tag LIKE 'al\\_ha' OR e.tag = 'Ωmega') AND (e.tag NOT IN ('zeta')) GROUP BY k0",
        "s1",
        0,
    ),
    (
        _policy(2, 3),
        "SELECT e.tag AS k0, COUNT(DISTINCT e.pid) AS v0 FROM events e WHERE e.tag ILIKE 'é' GROUP BY k0",
        "x",
        1,
    ),
    (
        _policy(4, 2, "list"),
        "SELECT e.kind AS k0, e.flag AS k1, AVG(e.qty) AS v0 FROM events e "
        "WHERE (e.kind NOT IN ('a', 'b')) AND (e.flag = TRUE OR e.flag = FALSE) GROUP BY k0, k1",
        "s1",
        2,
    ),
    (
        _policy(3, 3),
        "SELECT e.day AS k0, e.qty AS k1, COUNT(*) AS v0 FROM events e WHERE (e.day IN (TIMESTAMP "
        "'2024-02-10 00:00:00', TIMESTAMP '2024-02-11 12:00:00')) AND (e.qty IN (2, 2.5) OR e.qty = 9) GROUP BY k0, k1",
        "s1",
        0,
    ),
    # #35: a table two hops from the unit (lines → events → people; three with households), a foreign-key
    # join that multiplies no cap, and per-person subqueries (one clamped row per person)
    (_policy(3, 2), "SELECT COUNT(*) AS v0, SUM(l.price) AS v1 FROM lines l", "s1", 0),
    (
        _policy(2, 2),
        "SELECT l.color AS k0, COUNT(*) AS v0 FROM lines l JOIN events e ON l.eid = e.eid GROUP BY k0",
        "s1",
        1,
    ),
    (
        _policy(4, 3),
        "SELECT e.kind AS k0, SUM(l.price) AS v0 FROM events e LEFT JOIN lines l ON e.eid = l.eid GROUP BY k0",
        "x",
        2,
    ),
    (
        _policy(3, 2),
        "SELECT FLOOR(q.x0 / 2) AS k0, COUNT(*) AS v0, AVG(q.x1) AS v1 FROM (SELECT e.pid, COUNT(*) AS x0, "
        "SUM(e.amount) AS x1 FROM events e GROUP BY e.pid HAVING COUNT(*) > 2) q GROUP BY k0",
        "s1",
        0,
    ),
    (
        _policy(2, 2),
        "SELECT COUNT(*) AS v0, SUM(q.x0) AS v1 FROM (SELECT e.pid, COUNT(*) AS x0 FROM lines l "
        "JOIN events e ON l.eid = e.eid GROUP BY e.pid) q",
        "s1",
        0,
    ),
    # row arithmetic in WHERE and division / casts / % inside aggregates (#36): NULLIF'd divisors, clamps
    # before the arithmetic (the odd neighbour stores ±infinity, NaN and 2e9), integer division truncating
    (
        _policy(3, 2),
        "SELECT SUM(e.amount / e.qty) AS v0, AVG(e.qty / (e.qty - 2)) AS v1, SUM(e.qty % 4) AS v2 FROM events e "
        "WHERE (e.amount * (1 - 0.05) > 10) AND (e.qty / (e.qty - 1) >= 1)",
        "s1",
        0,
    ),
    (
        _policy(2, 3),
        "SELECT e.kind AS k0, AVG(CAST(e.amount AS INTEGER)) AS v0, SUM(CAST(e.flag AS INTEGER)) AS v1, "
        "SUM(e.amount / 1000.0) AS v2 FROM events e WHERE e.amount / e.qty > 3 GROUP BY k0",
        "x",
        1,
    ),
    # a row-level table (no unit column; each row its own person): clamps alone bound a row, the neighbour
    # is one more row (1e9, NaN with a secret ward, all NULL, ±infinity); the bias estimate's clamp excess too
    (
        _policy(3, 2),
        "SELECT v.ward AS k0, COUNT(*) AS v0, SUM(v.cost) AS v1, AVG(v.los) AS v2 FROM visits v GROUP BY k0",
        "s1",
        0,
    ),
    (_policy(2, 2), "SELECT COUNT(v.cost) AS v0, VAR_POP(v.cost) AS v1 FROM visits v WHERE v.cost + 1 > 20", "x", 1),
]


#: Which bounding strategy a measurement query took, from the CTE names each one writes.
STRATEGIES = {"__units": "per-unit partials", "__kept": "cells", "__top": "top rows", "__bounded": "rows"}


class Stats:
    """What a run covered: cases answered and refused, bounding strategies, aggregate and key forms."""

    def __init__(self) -> None:
        self.answered = 0
        self.refused = 0
        self.shapes: Counter[str] = Counter()

    def note(self, plan: Plan, sql: str) -> None:
        self.answered += 1
        self.shapes.update(f"strategy: {name}" for cte, name in STRATEGIES.items() if cte in sql)
        self.shapes.update(f"aggregate: {m.kind}" for m in plan.measures)
        self.shapes.update("key: expression" if k.expr is not None else "key: column" for k in plan.keys)
        self.shapes.update(
            "source: two or more hops from the unit" for s in plan.sources.private if s.path and s.path.hops
        )
        self.shapes.update("source: per-person subquery" for s in plan.sources.sources if s.derived is not None)
        self.shapes["join looked up by foreign key"] += len(plan.sources.looked_up)
        if plan.unit is None and plan.sources.private:
            self.shapes["source: row-level table (each row a person)"] += 1
        if plan.where is not None and plan.where.find(exp.Exists):
            self.shapes["semi-join inside the person"] += 1
        self.shapes.update(
            "key: domain narrowed by WHERE"
            for k in plan.keys
            if k.expr is None and k.domain is not None and k.domain != k.policy.release_domain()
        )
        if plan.selection_measure is not None:
            self.shapes["partition selection"] += 1
        if plan.where is not None and plan.where.find(exp.Div, exp.Mod, exp.Add, exp.Sub, exp.Mul):
            self.shapes["WHERE: row arithmetic"] += 1
        if any(m.expr is not None and m.expr.find(exp.Div, exp.Mod, exp.Cast) for m in plan.measures):
            self.shapes["aggregate: division, cast or %"] += 1

    def report(self, dialect: str) -> str:
        lines = [f"{dialect}: {self.answered} cases answered x {len(ADVERSARIES)} neighbours, {self.refused} refused"]
        lines += [f"  {name}: {n}" for name, n in sorted(self.shapes.items())]
        return "\n".join(lines)


def _bound(plan: Plan, backend: Backend, salt: str, choice: tuple[str, str | None]) -> Plan:
    """``plan`` with the physical choices the engine would make on ``backend`` (its clamp proofs
    included), the fixed ``salt``, and the drawn hash order and top-rows strategy."""
    physical = replace(choose_physical(plan, backend, salt), hash=choice[0], top_rows=choice[1])  # type: ignore[arg-type]
    return replace(plan, physical=physical)


def _folded(bound: Plan, backend: Backend) -> BiasEstimate | None:
    """On DuckDB, the bias estimate folded into the measurement's statement as the engine runs it
    (:func:`dpsql.release.bias.folded_query`; caps counted as cutting), when the measurement folds."""
    if backend.dialect != "duckdb":
        return None
    render = partial(backend.render, copy=False)
    estimate = bias_estimate(bound, True, 1.0, (bound.max_rows,), render, rewrite(bound))
    return estimate if estimate is not None and estimate.folded is not None else None


def _measured(bound: Plan, backend: Backend) -> dict[tuple, list[float]]:
    """The un-noised measurement query's rows, by group key (centred as before noise): from the statement
    the engine runs (the folded one where the bias estimate folds into it)."""
    n = len(bound.keys)
    folded = _folded(bound, backend)
    if folded is not None and folded.folded is not None:
        rows = split_folded(backend.execute(folded.folded[0])[1], folded.folded[1], n)[0]
    else:
        _, rows = backend.execute(to_sql(bound, backend.dialect))
    return {
        tuple(_key(v) for v in row[:n]): [0.0 if v is None else float(v) for v in row[n:]]
        for row in centre_rows(bound, rows)
    }


def _histograms(bound: Plan, backend: Backend) -> dict[int, dict[tuple, float]]:
    """Each selected measure's bounded histogram: (group key, bin) → count."""
    out = {}
    for i, sql in histogram_queries(bound, backend.render):
        _, rows = backend.execute(sql)
        out[i] = {tuple(_key(v) for v in row[:-1]): float(row[-1]) for row in rows}
    return out


def _bias_totals(plan: Plan, backend: Backend) -> tuple[BiasEstimate, dict[tuple, list[float]]] | None:
    """The bias estimate's un-noised totals by group key (None: the plan has none), caps counted as cutting:
    from the folded statement where the engine would run that (``plan`` bound), else their own."""
    folded = _folded(plan, backend)
    if folded is not None and folded.folded is not None:
        rows = split_folded(backend.execute(folded.folded[0])[1], folded.folded[1], folded.nkeys)[1]
        n = folded.nkeys
        return folded, {tuple(_key(v) for v in r[:n]): [0.0 if v is None else float(v) for v in r[n:]] for r in rows}
    estimate = bias_estimate(plan, True, 1.0, (plan.max_rows,), partial(backend.render, copy=False))
    sql = None if estimate is None else estimate.sql_at(plan.max_rows)
    if estimate is None or sql is None:
        return None
    _, rows = backend.execute(sql)
    n = estimate.nkeys
    return estimate, {tuple(_key(v) for v in r[:n]): [0.0 if v is None else float(v) for v in r[n:]] for r in rows}


def _bias_violations(
    estimate: BiasEstimate, before: dict[tuple, list[float]], after: dict[tuple, list[float]]
) -> list[str]:
    """Each bias total's vector over the groups moves by at most its stated L1 sensitivity."""
    problems = []
    zeros = [0.0] * len(estimate.totals)
    for t, total in enumerate(estimate.totals):
        moved = sum(abs(after.get(k, zeros)[t] - before.get(k, zeros)[t]) for k in set(before) | set(after))
        if not moved <= total.sensitivity * (1 + 1e-9) + 1e-6:
            problems.append(f"bias total {total.name} moved by {moved:g}, its sensitivity is {total.sensitivity:g}")
    return problems


def _key(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def _violations(plan: Plan, before: dict[tuple, list[float]], after: dict[tuple, list[float]]) -> list[str]:
    """Every way ``after`` differs from ``before`` by more than the plan's stated sensitivities."""
    problems: list[str] = []
    groups = set(before) | set(after)
    zeros = [0.0] * len(plan.measures)
    moved_groups = 0
    for key in groups:
        b, a = before.get(key, zeros), after.get(key, zeros)
        if any(not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-6) for x, y in zip(b, a, strict=True)):
            moved_groups += 1
    if moved_groups > plan.max_groups:
        problems.append(f"{moved_groups} groups moved, max_groups is {plan.max_groups}")
    for i, measure in enumerate(plan.measures):
        if measure.selected:
            continue  # quantiles and modes: their histograms are checked by _histogram_violations
        l1, l2 = plan.sensitivities(measure)
        per_group = 1.0 if measure.aggregate.once_per_unit else measure.sensitivity * plan.max_rows
        deltas = {k: after.get(k, zeros)[i] - before.get(k, zeros)[i] for k in groups}
        tol = 1e-6 * max(1.0, l1)
        total = sum(abs(d) for d in deltas.values())
        square = math.sqrt(sum(d * d for d in deltas.values()))
        worst = max(deltas.items(), key=lambda kv: abs(kv[1]), default=((), 0.0))
        label = f"measure {i} ({measure.label}, {measure.kind})"
        if total > l1 + tol:
            problems.append(f"{label}: L1 moved {total:g} > sensitivity {l1:g}")
        if square > l2 + tol:
            problems.append(f"{label}: L2 moved {square:g} > sensitivity {l2:g}")
        if abs(worst[1]) > per_group + tol:
            problems.append(f"{label}: group {worst[0]!r} moved {worst[1]:g} > per-group bound {per_group:g}")
    return problems


def _possible(key: GroupKey, value: Any) -> bool:
    """Whether a plain column key's stored ``value`` is one its un-narrowed policy releases: in the declared
    domain, else within the bounds (NULL when nullable). Values outside are dropped by design."""
    policy = key.policy
    declared = policy.release_domain()
    if declared is not None:
        return value in declared
    if value is None:
        return policy.nullable
    if isinstance(value, float) and math.isnan(value):
        return False
    if policy.lower is not None and policy.upper is not None:
        lower, upper = bounds = policy.lower, policy.upper
        if isinstance(value, dt.datetime):  # a timestamp column's bounds may be declared as dates
            lower, upper = (v if isinstance(v, dt.datetime) else dt.datetime.combine(v, dt.time()) for v in bounds)  # type: ignore[arg-type]
        return bool(lower <= value <= upper)
    return True


def _lost_groups(plan: Plan, measured: dict[tuple, list[float]]) -> list[str]:
    """Groups some row reaches, possible under the policy, yet missing from a WHERE-narrowed domain."""
    problems = []
    for i, key in enumerate(plan.keys):
        if key.expr is not None or key.domain is None:
            continue
        for group in measured:
            value = group[i]
            if value not in key.domain and _possible(key, value):
                problems.append(f"narrowed domain of {key.table}.{key.column} lacks {value!r}, which a row reaches")
    return problems


def _histogram_violations(plan: Plan, before: dict[tuple, float], after: dict[tuple, float]) -> list[str]:
    """A quantile's or mode's histogram: one unit's kept rows move the (group, bin) counts by at most
    ``max_rows`` in total, in at most ``max_groups`` groups (what the exponential mechanism's utility
    sensitivity assumes)."""
    deltas = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    total = sum(abs(d) for d in deltas.values())
    groups = {k[:-1] for k, d in deltas.items() if d}
    problems = []
    if total > plan.max_rows:
        problems.append(f"histogram counts moved {total:g} > max_rows {plan.max_rows}")
    if len(groups) > plan.max_groups:
        problems.append(f"histogram: {len(groups)} groups moved > max_groups {plan.max_groups}")
    return problems


def _utility_violations(plan: Plan, i: int, before: dict[tuple, float], after: dict[tuple, float]) -> list[str]:
    """A quantile measure's utilities (the value's, MIN/MAX's aims, an interval end's) on the two
    histograms: summed over the groups, the largest move of any candidate's utility is at most the
    measure's stated sensitivity (what the composition of the groups' mechanisms assumes)."""
    measure = plan.measures[i]
    if measure.q is None:
        return []  # a mode: its utilities are the counts, checked by _histogram_violations
    selection = measure.aggregate
    assert isinstance(selection, Selection)
    grid = selection.grid(measure)
    assert grid is not None
    sensitivity = plan.sensitivities(measure)[0]
    groups = {k[:-1] for k in (*before, *after)}
    moved = 0.0
    for group in groups:
        hists = [_cells_of(h, group, grid.cells) for h in (before, after)]
        # the cells where some utility can change: the non-empty ones of either side, each next one, cell 0
        places = sorted({0, *(c for h in hists for cell in h for c in (cell, cell + 1) if c < grid.cells)})
        utilities = [_utilities(measure, grid, h, sensitivity, places) for h in hists]
        moved += max(abs(a - b) for a, b in zip(*utilities, strict=True))
    if moved > sensitivity + 1e-6:
        return [f"utilities of {measure.label} moved {moved:g} in all > sensitivity {sensitivity:g}"]
    return []


def _cells_of(histogram: dict[tuple, float], group: tuple, cells: int) -> dict[int, int]:
    """One group's cell counts as the release reads them (NULL cells dropped, the bound in the last cell)."""
    out: dict[int, int] = {}
    for key, count in histogram.items():
        if key[:-1] == group and key[-1] is not None:
            cell = min(max(int(key[-1]), 0), cells - 1)
            out[cell] = out.get(cell, 0) + int(count)
    return out


def _utilities(
    measure: Measure, grid: QuantileGrid, counts: dict[int, int], sensitivity: float, places: list[int]
) -> list[float]:
    """The candidate utilities the measure's mechanism reads, at fixed positions (so two histograms' lists
    compare candidate by candidate): runs for MIN/MAX and interval ends, else the cells at ``places`` (every
    other cell scores as the last of them before it)."""
    q = measure.q
    assert q is not None
    runs = [0] * grid.runs
    for cell, count in counts.items():
        runs[cell // grid.stride] += count
    total = sum(runs)
    if measure.kind in ("quantile_low", "quantile_high"):
        reach = 1.0 + interval_reach(1.0, sensitivity, grid, 0.95)
        return interval_utilities(runs, q, reach, measure.kind == "quantile_high")
    if q in (0.0, 1.0):
        candidates = runs if grid.stride > 1 else [counts.get(j, 0) for j in range(grid.cells)]
        return rank_utilities(candidates, q, total, 0, extreme_aims(1.0, sensitivity, len(candidates)))
    out: list[float] = []
    cells = sorted(counts)
    for place in places:
        below = sum(counts[c] for c in cells if c < place)
        above = below + counts.get(place, 0)
        out.append(-max(0.0, below - q * total, q * total - above))
    return out


def _check_case(
    worlds: dict[str | None, Backend],
    dialect: str,
    fuzz_policy: FuzzPolicy,
    sql: str,
    salt: str,
    choice: int,
    stats: Stats,
    tau: int | None = None,
) -> None:
    policy: Policy = parse_policy(fuzz_policy.yaml(), "<fuzz policy>")
    try:
        plan = analyze(sql, policy)
    except Error:
        stats.refused += 1
        return
    if tau is not None and plan.unit is not None:  # SET dpsql.max_rows_per_unit: any cap, the noise follows
        plan = replace(plan, tau=tau, tau_origin="set")
        stats.shapes["cap set per query"] += 1
    physical = PHYSICAL_CHOICES[dialect][choice % len(PHYSICAL_CHOICES[dialect])]
    base_plan = _bound(plan, worlds[None], salt, physical)
    stats.note(plan, to_sql(base_plan, dialect))
    base, base_histograms = _measured(base_plan, worlds[None]), _histograms(base_plan, worlds[None])
    base_bias = _bias_totals(base_plan, worlds[None])
    if base_bias is not None and base_bias[0].folded is not None:
        stats.shapes["bias estimate folded into the measurement"] += 1
    lost = _lost_groups(plan, base)
    assert not lost, f"\n-- on {dialect}, base database\n-- {chr(10).join(lost)}\n{sql};\n-- {fuzz_policy.yaml()}"
    for name in ADVERSARIES:
        if name in INVALID:
            continue  # a declared key repeats there: the engine refuses (tests/adversarial/test_multihop_neighbours.py)
        bound = _bound(plan, worlds[name], salt, physical)  # clamp proofs are the neighbour's own
        after = _measured(bound, worlds[name])
        problems = _violations(plan, base, after) + _lost_groups(plan, after)
        if base_bias is not None:  # the bias estimate's totals (dpsql.release.bias), on the same rows
            problems += _bias_violations(base_bias[0], base_bias[1], _bias_totals(bound, worlds[name])[1])  # type: ignore[index]
        for i, histogram in _histograms(bound, worlds[name]).items():
            problems += [f"measure {i}: {p}" for p in _histogram_violations(plan, base_histograms[i], histogram)]
            problems += [f"measure {i}: {p}" for p in _utility_violations(plan, i, base_histograms[i], histogram)]
        assert not problems, (
            f"\n-- sensitivity violated on {dialect}, adversary {name!r} "
            f"(tests/adversarial/fuzz_grammar.py), salt {salt!r}, physical {physical}, cap {tau}\n"
            f"-- {chr(10).join(problems)}\n{sql};\n-- policy:\n{fuzz_policy.yaml()}"
        )


def _fuzz(worlds: dict[str | None, Backend], dialect: str, examples: int, *, shrink: bool) -> Stats:
    """Draw ``examples`` cases; ``shrink``: minimise a failing case (minutes; the printed case already
    reproduces it, so the default tier reports it as drawn)."""
    stats = Stats()
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(
        fuzz_policy=policies(),
        sql=queries(),
        salt=st.sampled_from(["s1", "salt-2", "x"]),
        choice=st.integers(0, 9),
        tau=st.one_of(st.none(), st.none(), st.integers(1, 7)),
    )
    def run(fuzz_policy: FuzzPolicy, sql: str, salt: str, choice: int, tau: int | None) -> None:
        _check_case(worlds, dialect, fuzz_policy, sql, salt, choice, stats, tau)

    for case in reversed(REGRESSIONS):
        run = example(*case, None)(run)
    run()
    print(stats.report(dialect))  # shown with -s or -rP: what the run covered
    return stats


@pytest.fixture(params=["duckdb", "postgres"])
def worlds(request: pytest.FixtureRequest) -> tuple[str, dict[str | None, Backend]]:
    name = str(request.param)
    return name, request.getfixturevalue("duck_worlds" if name == "duckdb" else "pg_worlds")


def test_every_measure_moves_within_its_sensitivity(worlds: tuple[str, dict[str | None, Backend]]) -> None:
    dialect, backends = worlds
    stats = _fuzz(backends, dialect, EXAMPLES, shrink=False)
    # the grammar must stay mostly inside what dpsql accepts, or the fuzzer proves little
    assert stats.answered >= 0.6 * (stats.answered + stats.refused), (stats.answered, stats.refused)
    for strategy in STRATEGIES.values():
        assert stats.shapes[f"strategy: {strategy}"] > 0, stats.report(dialect)
    assert stats.shapes["key: domain narrowed by WHERE"] > 0, stats.report(dialect)
    for shape in (
        "source: two or more hops from the unit",
        "source: per-person subquery",
        "source: row-level table (each row a person)",
        "cap set per query",
    ):
        assert stats.shapes[shape] > 0, stats.report(dialect)
    assert stats.shapes["join looked up by foreign key"] > 0, stats.report(dialect)
    assert stats.shapes["semi-join inside the person"] > 0, stats.report(dialect)
    assert stats.shapes["WHERE: row arithmetic"] > 0, stats.report(dialect)
    assert stats.shapes["aggregate: division, cast or %"] > 0, stats.report(dialect)
    if dialect == "duckdb":  # the measurement and bias totals as one statement (dpsql.release.bias.folded_query)
        assert stats.shapes["bias estimate folded into the measurement"] > 0, stats.report(dialect)


@pytest.mark.heavy
def test_every_measure_moves_within_its_sensitivity_heavy(worlds: tuple[str, dict[str | None, Backend]]) -> None:
    dialect, backends = worlds
    stats = _fuzz(backends, dialect, HEAVY_EXAMPLES, shrink=True)
    assert stats.answered >= 0.6 * (stats.answered + stats.refused), (stats.answered, stats.refused)
