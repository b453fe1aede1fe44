"""Bias sized under DP (``SET dpsql.bias = on``, the default): intervals that cover what bounding cuts.

The privacy argument and design notes: docs/internals.md, section dpsql/release/bias.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from sqlglot import exp

from dpsql.accountant import fmt, remainder
from dpsql.aggregates import OUTPUTS
from dpsql.aggregates.base import BiasRates
from dpsql.analyze.expressions import clamp_sql
from dpsql.errors import InvalidParameterValue
from dpsql.noise.mechanisms import NoiseSpec, check_samplable, half_width, laplace_spec, release_many
from dpsql.plan import Plan
from dpsql.release.apply import Released
from dpsql.release.calibrate import published_cut
from dpsql.rewrite._sql import key_column, literal_number, measure_input
from dpsql.rewrite.bounding import count_unit_rows, over_sources
from dpsql.rewrite.filter import filter_rows
from dpsql.rewrite.measures import select_measures
from dpsql.session import Result, Session, ci_label

#: Share of a query's ε spent estimating its bias (stated in the note and in EXPLAIN).
SHARE = 0.2
#: Rows cut per unit counted at most, in caps: a unit with more than (1 + CEILING)·τ rows counts as CEILING·τ.
CEILING = 2
#: How far beyond its bounds one value counts at most, in bounds' widths.
REACH = 4
#: Weight of the rare totals (rows cut, excess beyond bounds) against the large one they are divided by.
RARE = 3.0


@dataclass(frozen=True, slots=True)
class Total:
    """One total of the auxiliary query: its name, how much one unit moves its vector over the groups (L1)."""

    name: str
    sensitivity: float
    #: Its part of the estimate's ε, relative to the others': the rare figures (rows cut, excess) get
    #: more than the large total they are divided by (rows kept).
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class BiasEstimate:
    """How one query's bias is estimated when it runs (prepared once with the query)."""

    #: ε spent on the estimate: a pure-ε share of the query's.
    epsilon: float
    #: SQL of the totals (a row per group: keys, then totals), per candidate cap (one unless chosen at run time);
    #: none when :attr:`folded`.
    sql: tuple[tuple[int, str], ...]
    totals: tuple[Total, ...]
    #: Whether the caps can cut a row (else only clamps are estimated).
    cuts: bool
    #: Per clamped measure, (its index, the index of the first measure clamping the same value alike, whose
    #: ``excess`` total it shares).
    clamped: tuple[tuple[int, int], ...]
    #: How the note names the privacy unit.
    unit: str
    nkeys: int
    #: The share of rows the caps leave out as the curator published it (``tables.T.published_rows_cut``):
    #: used instead of a DP estimate of the rows cut (None: estimated, when ``cuts``).
    published: float | None = None
    #: The measurement and the totals in one statement (:func:`folded_query`) at the plan's cap, and the
    #: measurement's width: run instead of the two (one scan of the rows, not two). None: run apart.
    folded: tuple[str, int] | None = None

    def at(self, epsilon: float) -> BiasEstimate:
        """This estimate for a query of ``epsilon``, at ``SHARE`` of it (a published figure alone spends none);
        refused before any charge when no exact sampler can noise a total at that share."""
        if not self.totals:
            return self
        made = replace(self, epsilon=epsilon * SHARE)
        try:
            for total in self.totals:
                check_samplable(made.spec(total, 1))
        except ValueError as exc:
            raise InvalidParameterValue(  # (the calibration's own message: the query's ε is what is too small)
                f"cannot calibrate noise for ε={epsilon:g}: the bias estimate's share (ε={epsilon * SHARE:g}): {exc}",
                hint="Use a larger dpsql.epsilon, or SET dpsql.bias = off for the noise-only ±.",
            ) from None
        return made

    def sql_at(self, tau: int) -> str | None:
        """The totals' SQL at the cap used (None: nothing to estimate under DP, a published figure only)."""
        if not self.totals:
            return None
        assert self.sql, "a folded estimate runs with its measurement"
        return next((sql for cap, sql in self.sql if cap == tau), self.sql[-1][1])

    def spec(self, total: Total, cells: int) -> NoiseSpec:
        """The noise of one total over ``cells`` groups: discrete Laplace at its weighted part of the ε."""
        share = total.weight / _weights(self.totals)  # (the same arithmetic as ever: the same ε, to the bit)
        return _total_spec(total.sensitivity, self.epsilon * share, max(cells, 1))

    def release(self, rows: Sequence[Sequence[Any]], keys: Sequence[tuple[Any, ...]], level: float) -> BiasFigures:
        """The totals of the released groups ``keys`` (one empty key without GROUP BY) noised: together
        ε-DP at ``self.epsilon``; only ever after the reservation."""
        found = {tuple(row[: self.nkeys]): row[self.nkeys :] for row in rows}
        zeros = [0.0] * len(self.totals)
        cells = [tuple(key) for key in keys]
        noisy: dict[tuple[Any, ...], dict[str, float]] = {key: {} for key in cells}
        if not cells:
            return BiasFigures(self, noisy, level)
        rows_of = [found.get(key, zeros) for key in cells]
        exact = [[float(row[t] or 0.0) for row in rows_of] for t in range(len(self.totals))]
        # every total's noise in one draw (independent draws, as one release per total would give)
        specs = [self.spec(total, len(cells)) for total in self.totals]
        released = release_many(list(zip(exact, specs, strict=True)))
        for total, values in zip(self.totals, released, strict=True):
            for key, value in zip(cells, values.tolist(), strict=True):
                noisy[key][total.name] = float(value)
        return BiasFigures(self, noisy, level)

    def explain_text(self, epsilon: float) -> str:
        """EXPLAIN's ``Intervals`` line: what the ± covers and what the estimate costs."""
        if not self.totals:
            return f"noise and the cap bias the curator published ({_percent(self.published or 0.0)} of rows cut)"
        share = f"ε={fmt(self.epsilon)} of this query's ε={fmt(epsilon)}"
        text = f"noise and the {_what(self)} bias estimated under DP ({share})"
        if self.published is not None:
            text += f", and the cap bias the curator published ({_percent(self.published)} of rows cut)"
        return text


@lru_cache(maxsize=4096)
def _total_spec(sensitivity: float, epsilon: float, cells: int) -> NoiseSpec:
    """A total's discrete-Laplace spec (pure and public: cached, as the intervals ask for it per cell)."""
    return laplace_spec(sensitivity, epsilon, integer=False, cells=cells)


@lru_cache(maxsize=1024)
def _weights(totals: tuple[Total, ...]) -> float:
    """The totals' weights summed (the denominator of each one's part of the estimate's ε)."""
    return sum(t.weight for t in totals)


def _what(estimate: BiasEstimate) -> str:
    return "/".join((["cap"] if estimate.cuts else []) + (["clamp"] if estimate.clamped else []))


#: The suffix of the result-cache key a release's bias estimate is kept under, beside its measurements.
BIAS_SUFFIX = "#bias"


@dataclass(frozen=True, slots=True)
class BiasFigures:
    """The released totals per released group and the confidence level their bounds are read at;
    everything below is post-processing of them (and of public noise scales)."""

    estimate: BiasEstimate
    noisy: dict[tuple[Any, ...], dict[str, float]]
    level: float
    #: What the methods below computed (the ± of every cell asks for the same few figures): post-processing
    #: of the figures above, never compared nor stored.
    memo: dict[tuple[str, str], Any] = field(default_factory=dict, compare=False, repr=False)

    def _width(self, name: str) -> float:
        """One group's half-width for total ``name``."""
        key = ("width", name)
        if key not in self.memo:
            total = next(t for t in self.estimate.totals if t.name == name)
            self.memo[key] = half_width(self.estimate.spec(total, len(self.noisy)), self.level)
        width: float = self.memo[key]
        return width

    def total(self, name: str) -> tuple[float, float]:
        """The total over the released groups and its half-width (√G·h: G independent noises)."""
        key = ("total", name)
        if key not in self.memo:
            root = math.sqrt(max(len(self.noisy), 1))
            self.memo[key] = (sum(v[name] for v in self.noisy.values()), root * self._width(name))
        total: tuple[float, float] = self.memo[key]
        return total

    def detected(self, name: str) -> bool:
        """Whether the total over the released groups is above 0 at the level, one-sided (its two-sided
        half-width at 2·level − 1): what a query that cuts nothing passes with probability ≤ 1 − level."""
        key = ("detected", name)
        if key not in self.memo:
            total = next(t for t in self.estimate.totals if t.name == name)
            width = half_width(self.estimate.spec(total, len(self.noisy)), max(2 * self.level - 1, 0.5))
            self.memo[key] = self.total(name)[0] > math.sqrt(max(len(self.noisy), 1)) * width
        detected: bool = self.memo[key]
        return detected

    def _kept(self, key: tuple[Any, ...] | None) -> float:
        return max(1.0, self.total("kept")[0] if key is None else self.noisy[key]["kept"])

    def rates(self, key: tuple[Any, ...] | None, size: Mapping[int, float]) -> BiasRates:
        """Group ``key``'s figures (None: the query's totals) as rates, each (estimate ≥ 0, half-width): rows
        cut and excess per row kept, and excess per unit of ``size`` (per clamped SUM measure, |its released
        value| in the group, or Σ over the groups). Undetected totals count 0. The rows kept divide: a large
        released figure whose own noise is neglected (a relative error of ~τ/(ε·rows))."""

        def figure(name: str) -> tuple[float, float]:
            if not self.detected(name):
                return 0.0, 0.0
            if key is None:
                return max(0.0, self.total(name)[0]), self.total(name)[1]
            return max(0.0, self.noisy[key][name]), self._width(name)

        if not self.estimate.totals:  # a published figure only
            return BiasRates((_per_kept(self.estimate.published), 0.0), {}, {})
        kept = self._kept(key)
        cut = figure("cut") if self.estimate.cuts else (0.0, 0.0)
        per_total, per_row = {}, {}
        for i, j in self.estimate.clamped:
            excess, width = figure(f"excess{j}")
            per_row[i] = (excess / kept, width / kept)
            if size.get(i, 0.0) > 0:
                per_total[i] = (excess / size[i], width / size[i])
        if self.estimate.published is not None:
            return BiasRates((_per_kept(self.estimate.published), 0.0), per_total, per_row)
        return BiasRates((cut[0] / kept, cut[1] / kept), per_total, per_row)

    def stored(self) -> tuple[int, list[tuple[Any, ...]], list[list[float]]]:
        """The released figures as measurements are kept (:func:`dpsql.cache.measurement_result`): the number
        of keys, each released group's key and each total's column, to keep beside the measurements."""
        keys = list(self.noisy)
        return self.estimate.nkeys, keys, [[self.noisy[k][t.name] for k in keys] for t in self.estimate.totals]

    @classmethod
    def from_rows(cls, estimate: BiasEstimate, rows: Sequence[Sequence[Any]], level: float) -> BiasFigures:
        n = estimate.nkeys
        noisy = {
            tuple(row[:n]): {t.name: float(x) for t, x in zip(estimate.totals, row[n:], strict=True)} for row in rows
        }
        return cls(estimate, noisy, level)

    def note(self, plan: Plan, level: float, widened: bool) -> str:
        """``dpsql: ±95% covers noise and the estimated cap/clamp bias (~4 % of rows cut …)``: released
        figures only (the totals over the released groups), public bounds and caps."""
        parts = []
        kept = self._kept(None) if self.estimate.totals else 1.0
        if self.estimate.published is not None:
            share = _percent(self.estimate.published)
            parts.append(
                f"{share} of rows cut beyond {plan.max_rows} per {self.estimate.unit}, as the curator published"
            )
        if self.estimate.cuts:
            value, width = self.total("cut")
            beyond = f"beyond {plan.max_rows} per {self.estimate.unit}"
            parts.append(
                f"~{_percent(value / (value + kept))} of rows cut {beyond}"
                if self.detected("cut")
                else f"no rows cut {beyond} detected (fewer than ~{_percent(width / kept)})"
            )
        for i, j in self.estimate.clamped:
            if i != j:
                continue
            m = plan.measures[i]
            value, width = self.total(f"excess{j}")
            what = m.column if m.expr is None and m.column else "a summed expression"
            beyond = f"{what} beyond [{m.lower:g}, {m.upper:g}]"
            parts.append(
                f"{beyond} by ~{value / kept:.3g} a row"
                if self.detected(f"excess{j}")
                else f"no {beyond} detected (less than ~{width / kept:.3g} a row)"
            )
        pct = ci_label(level)
        if not self.estimate.totals:
            return f"dpsql: ±{pct}% covers noise and the cap bias ({parts[0]} for the whole table)"
        lead = (
            f"±{pct}% covers noise and the estimated {_what(self.estimate)} bias"
            if widened
            else f"±{pct}% covers the noise only; the estimated {_what(self.estimate)} bias"
        )
        limits = ([f"one person has more than {plan.max_rows * CEILING} rows cut"] if self.estimate.cuts else []) + (
            [f"a value lies more than {REACH} times its bounds' width beyond them"] if self.estimate.clamped else []
        )
        return (
            f"dpsql: {lead} ({'; '.join(parts)}; estimated under DP with ε={fmt(self.estimate.epsilon)} of this "
            f"query's ε; a lower bound where {' or '.join(limits)})"
        )


def _per_kept(share: float | None) -> float:
    """Rows cut per row kept, from the share of rows cut."""
    return 0.0 if share is None else share / (1.0 - share)


def _percent(share: float) -> str:
    pct = 100 * share
    return f"{pct:.0f} %" if pct >= 10 else f"{pct:.1g} %" if pct >= 0.1 or pct == 0 else "<0.1 %"


def clamped_measures(plan: Plan) -> tuple[tuple[int, int], ...]:
    """The additive measures summing a value clamped to declared bounds (not squares: variances), each with
    the first such measure of the same value and bounds (an AVG and a SUM of one column share a total).

    Not a summed expression: its bounds are derived from its clamped columns' (interval arithmetic,
    rounded outward), so it never lies beyond them; estimating its excess spent ε and a pass of per-row
    work on a total that is 0 (TPC-H Q1's two price expressions)."""
    out: list[tuple[int, int]] = []
    first: dict[tuple[str, float, float], int] = {}
    for i, m in enumerate(plan.measures):
        if m.clamped_sum and not m.square and m.expr is None and m.lower is not None and m.upper is not None:
            key = (measure_input(m).sql(), float(m.lower), float(m.upper))
            out.append((i, first.setdefault(key, i)))
    return tuple(out)


def estimate(
    plan: Plan,
    cuts: bool,
    epsilon: float,
    candidates: Sequence[int],
    render: Callable[[exp.Expression], str],
    measurement: exp.Select | None = None,
) -> BiasEstimate | None:
    """The estimate of a query that can cut something (``cuts``: its caps can leave a row out; or a measure is
    clamped), at ``SHARE`` of its ``epsilon``; None (no estimate, no cost) when nothing can be cut. Public
    facts only (the plan and the policy), so whether an estimate is made never depends on the data.

    ``measurement`` (the rewritten query, when its backend takes a folded statement): at the plan's cap
    alone, the totals are folded into it (:func:`folded_query`) when it is shaped for that."""
    shaped = shape(plan, cuts, candidates, render, measurement)
    return None if shaped is None else shaped.at(epsilon)


def shape(
    plan: Plan,
    cuts: bool,
    candidates: Sequence[int],
    render: Callable[[exp.Expression], str],
    measurement: exp.Select | None = None,
) -> BiasEstimate | None:
    """:func:`estimate` before its ε is known (0 until :meth:`BiasEstimate.at`): what it measures and its SQL,
    which no privacy setting changes, built once per prepared statement shape (the engine keeps it)."""
    clamped = clamped_measures(plan)
    cuts = cuts and plan.unit is not None  # (each row is one person: no cap cuts a row, values are still clamped)
    if (not cuts and not clamped) or not any(not m.selected for m in plan.measures):
        return None
    published = published_cut(plan) if cuts else None
    cuts = cuts and published is None  # (a published figure: nothing to estimate)
    unit = plan.sources.unit_description
    if not cuts and not clamped:
        return BiasEstimate(0.0, (), (), False, (), unit, len(plan.keys), published)
    tau = max(candidates)
    totals = [Total("kept", float(tau))]
    if cuts:
        totals.append(Total("cut", float(tau * CEILING), RARE))
    for i, j in clamped:
        m = plan.measures[i]
        assert m.lower is not None and m.upper is not None
        if i == j:
            totals.append(Total(f"excess{i}", tau * _ceiling(m.lower, m.upper), RARE))
    folded = None
    if measurement is not None and tuple(candidates) == (plan.max_rows,):
        query = folded_query(plan, measurement, plan.max_rows, clamped, cuts)
        folded = None if query is None else (render(query), len(measurement.expressions))
    sql = () if folded else tuple((c, render(totals_query(plan, c, clamped, cuts))) for c in candidates)
    return BiasEstimate(0.0, sql, tuple(totals), cuts, clamped, unit, len(plan.keys), published, folded)


def _ceiling(lower: float, upper: float) -> float:
    """How far beyond its bounds one value counts at most: REACH bounds' widths (their reach if they are equal)."""
    return REACH * (upper - lower if upper > lower else max(abs(lower), abs(upper), 1.0))


def rest(session: Session, epsilon: float, spent: float) -> Session:
    """The settings the measurement is calibrated with: ``epsilon`` less what the estimate spends."""
    return Session(
        session.analyst,
        epsilon=remainder(epsilon, spent),
        delta=session.delta,
        mechanism=session.mechanism,
        confidence=session.confidence,
    )


def totals_query(plan: Plan, tau: int, clamped: Sequence[tuple[int, int]], cuts: bool) -> exp.Select:
    """``SELECT k…, SUM(kept), SUM(cut), SUM(excess) … GROUP BY k…`` over the rows per (unit, group).

    Per (unit, group): its rows ``n_g`` (after the measurement's joins and WHERE) and per clamped value the
    sum over them of ``clamp(x − U, 0, W)`` above U, ``clamp(L − x, 0, W)`` below L, in DOUBLE (no integer
    overflow: an error must not depend on the data); the unit's rows ``n`` in all by a window. NaN lies
    above every bound on every backend (:func:`clamp_sql`; one branch per row, so at most W); NULLs are
    skipped. One unit's rows move each total's vector over the groups by at most its :class:`Total`
    sensitivity (the module's argument)."""
    keys = [key_column(plan, k) for k in range(len(plan.keys))]
    # each row is one person (no unit): every row is its own cell, n = n_g = G = 1
    unit = plan.unit.copy() if plan.unit is not None else exp.Literal.number(0)
    per_cell: list[exp.Expr] = [exp.alias_(unit, "__u")]
    per_cell += [exp.alias_(k.copy(), f"k{i}") for i, k in enumerate(keys)]
    one = exp.Count(this=exp.Star(), big_int=True) if plan.unit is not None else exp.Literal.number(1)
    per_cell.append(exp.alias_(one, "__m"))
    per_cell += _excess_sums(plan, clamped, summed=plan.unit is not None)
    cells = over_sources(_rows(plan), *per_cell)
    windows: list[exp.Expr] = [exp.alias_(exp.Literal.number(1), "__n"), exp.alias_(exp.Literal.number(1), "__g")]
    if plan.unit is not None:
        cells = cells.group_by(plan.unit.copy(), *(k.copy() for k in keys), copy=False)
        u = exp.column("__u", quoted=True)
        windows = [
            exp.alias_(exp.Window(this=exp.Sum(this=exp.column("__m", quoted=True)), partition_by=[u.copy()]), "__n"),
            exp.alias_(exp.Window(this=exp.Count(this=exp.Star()), partition_by=[u.copy()]), "__g"),
        ]
    units = exp.select(exp.Star(), *windows).from_("__bias_cells")
    key_names = [exp.column(f"k{i}", quoted=True) for i in range(len(keys))]
    query = _totals(plan, tau, clamped, cuts, key_names, ("__m", "__n", "__g"))
    return query.with_("__bias_cells", as_=cells, copy=False).with_("__bias_units", as_=units, copy=False)


def groups_cap(plan: Plan, tau: int) -> int | None:
    """The groups a unit keeps when that cap can cut more than the row cap τ does (a declared
    ``max_groups_per_unit`` below τ, in a grouped query); None otherwise (k ≥ τ: a unit with G > k groups has
    n ≥ G > τ rows and keeps τ either way)."""
    declared = plan.sources.max_groups_declared
    return declared if plan.keys and declared is not None and declared < tau else None


def _rows(plan: Plan) -> exp.Select:
    """The rows the measurement reads (its sources, joins and WHERE), as a SELECT to project over."""
    return filter_rows(select_measures(exp.select(), plan), plan)


def _excess_sums(plan: Plan, clamped: Sequence[tuple[int, int]], summed: bool = True) -> list[exp.Expr]:
    """Per clamped value (the first measure of each), ``SUM(excess) AS __e{i}`` over a cell's rows (a row's
    own excess when not ``summed``: each row is its own cell)."""
    double = exp.DataType.Type.DOUBLE
    out: list[exp.Expr] = []
    for i in [i for i, j in clamped if i == j]:
        m = plan.measures[i]
        assert m.lower is not None and m.upper is not None
        x = exp.cast(measure_input(m), double, copy=False)
        lo, hi, width = literal_number(m.lower), literal_number(m.upper), literal_number(_ceiling(m.lower, m.upper))
        above = clamp_sql(exp.Sub(this=x.copy(), expression=hi.copy()), exp.Literal.number(0), width)
        below = clamp_sql(exp.Sub(this=lo.copy(), expression=x.copy()), exp.Literal.number(0), width.copy())
        # one branch per row, at most W: NaN lies above U (and would lie below L too)
        excess = (
            exp.Case()
            .when(exp.GT(this=x.copy(), expression=hi), above, copy=False)
            .when(exp.LT(this=x, expression=lo), below, copy=False)
            .else_(exp.Literal.number(0), copy=False)
        )
        out.append(exp.alias_(exp.Sum(this=excess) if summed else excess, f"__e{i}"))
    return out


def _totals(
    plan: Plan,
    tau: int,
    clamped: Sequence[tuple[int, int]],
    cuts: bool,
    keys: Sequence[exp.Expression],
    counts: tuple[str, ...],
) -> exp.Select:
    """The totals over ``__bias_units`` (a row per cell: its rows, ``counts[0]``, its unit's rows in all,
    ``counts[1]``, and, where :func:`groups_cap` binds, its unit's groups, ``counts[2]``; its ``__e{i}`` sums),
    grouped by the ``keys`` (named ``k{i}``). Each total is linear in a cell's rows and sums at a given
    unit's ``n``: cells finer than (unit, group) give the same totals.

    A unit keeps ``kept_u = min(n, τ)`` rows, or with a groups cap k binding ``min(n · min(1, k/G), τ)``
    (whole groups in a salted order: k/G of its rows expected; its cut rows spread over its groups as if
    groups were kept at random). A cell adds ``n_g/n · kept_u`` to kept (Σ ≤ τ), ``n_g/n · clamp(n − kept_u,
    0, C)`` to cut (Σ ≤ C) and its excess times ``kept_u/n`` (Σ ≤ τ·W): the sensitivities :func:`estimate`
    states."""
    double = exp.DataType.Type.DOUBLE
    m_, n = exp.column(counts[0], quoted=True), exp.column(counts[1], quoted=True)
    cap = exp.Literal.number(tau)
    share = exp.Div(this=exp.cast(m_.copy(), double), expression=exp.cast(n.copy(), double))  # n_g / n
    k = groups_cap(plan, tau)
    reach: exp.Expression = n.copy()
    if k is not None and len(counts) > 2:  # n · min(1, k/G)
        g, n_double = exp.column(counts[2], quoted=True), exp.cast(n.copy(), double)
        fewer = exp.Div(this=exp.Mul(this=n_double, expression=exp.Literal.number(k)), expression=exp.cast(g, double))
        reach = exp.Case().when(exp.GT(this=g.copy(), expression=exp.Literal.number(k)), fewer).else_(n.copy())
    kept = exp.Case().when(exp.GT(this=reach.copy(), expression=cap.copy()), cap.copy()).else_(reach.copy())
    outer: list[exp.Expr] = [exp.alias_(key.copy(), f"k{i}", quoted=True) for i, key in enumerate(keys)]
    outer.append(_total(exp.Mul(this=share.copy(), expression=exp.paren(kept.copy(), copy=False)), "kept"))
    if cuts:
        left = exp.paren(kept.copy(), copy=False) if k is not None else cap.copy()  # (n − min(n, τ) = n − τ)
        beyond = clamp_sql(
            exp.Sub(this=n.copy(), expression=left), exp.Literal.number(0), exp.Literal.number(tau * CEILING)
        )
        outer.append(_total(exp.Mul(this=share.copy(), expression=exp.paren(beyond, copy=False)), "cut"))
    # a unit is counted at the rows the measurement keeps: kept_u/n of its excess (τ/n when n > τ)
    scale: exp.Expression = (
        exp.Case()
        .when(
            exp.GT(this=n.copy(), expression=cap.copy()),
            exp.Div(this=exp.cast(cap.copy(), double), expression=exp.cast(n.copy(), double)),
        )
        .else_(exp.Literal.number(1))
    )
    if k is not None:
        scale = exp.Div(this=exp.cast(exp.paren(kept.copy(), copy=False), double), expression=exp.cast(n, double))
    for i in [i for i, j in clamped if i == j]:
        column = exp.Coalesce(this=exp.column(f"__e{i}", quoted=True), expressions=[exp.Literal.number(0)])
        outer.append(_total(exp.Mul(this=column, expression=exp.paren(scale.copy(), copy=False)), f"excess{i}"))
    query = exp.select(*outer).from_("__bias_units")
    if keys:
        query = query.group_by(*(key.copy() for key in keys), copy=False)
    return query


#: The folded statement's first column: 0 on the measurement's rows, 1 on the totals' rows.
PART = "__part"


def folded_query(
    plan: Plan, measurement: exp.Select, tau: int, clamped: Sequence[tuple[int, int]], cuts: bool
) -> exp.Union | None:
    """The measurement and its bias totals in one statement over one aggregation of (unit, group) cells, or
    None when the measurement is not shaped for it (its cells must read the rows :func:`totals_query`
    reads, grouped by the unit and by every key as a column of their own).

    The measurement's ``__cells`` gains the ``__e{i}`` sums (it already counts each cell's rows, ``__n``); the
    totals are :func:`_totals` over its cells with their unit's rows ``__bn``: computed by the measurement's
    own sort of each unit's cells where it reads them all (:func:`dpsql.rewrite.bounding.count_unit_rows`;
    ``__counted`` computed once, MATERIALIZED), else ``__cells`` MATERIALIZED with the unit's rows joined
    back (:func:`_unit_rows`). The measurement's rows are untouched: the cells are the same rows and the later
    steps select their own columns. Rows come tagged by :data:`PART`: ``(0, measurement columns…, NULL…)`` and
    ``(1, keys…, NULL…, totals…)`` (:func:`split_folded`). The totals equal :func:`totals_query`'s: each is
    linear in a cell's rows at its unit's ``n`` (:func:`_totals`), so the privacy argument is unchanged."""
    ctes = {cte.alias: cte for cte in (measurement.args.get("with_") or exp.With()).expressions}
    cells_cte = ctes.get("__cells")
    if cells_cte is None or not isinstance(cells_cte.this, exp.Select) or plan.unit is None:
        return None
    if groups_cap(plan, tau) is not None:  # (its cells may be finer than (unit, group): G is not their count)
        return None
    cells = cells_cte.this
    rows = over_sources(_rows(plan), exp.Star())
    if any(_sql(cells, part) != _sql(rows, part) for part in ("from_", "joins", "where")):
        return None
    named = {e.this.sql(): e.alias for e in cells.expressions if isinstance(e, exp.Alias)}
    grouped = {g.sql() for g in (cells.args.get("group") or exp.Group()).expressions}
    keys = [key_column(plan, i).sql() for i in range(len(plan.keys))]
    if named.get(plan.unit.sql()) != "__unit" or any(k not in named or k not in grouped for k in keys):
        return None
    main = measurement.copy()  # the measurement's own SELECT, its CTEs taken out (copied once)
    with_ = main.args["with_"]
    main.set("with_", None)
    ctes = {cte.alias: cte for cte in with_.expressions}
    for sums in _excess_sums(plan, clamped):
        ctes["__cells"].this.append("expressions", sums)
    units = exp.select(exp.Star()).from_("__counted")  # every cell, with its unit's rows by the measurement's sort
    if count_unit_rows(ctes):
        ctes["__counted"].set("materialized", True)
    else:
        ctes["__cells"].set("materialized", True)
        units = _unit_rows()
    key_names = [exp.column(named[k], quoted=True) for k in keys]
    totals = _totals(plan, tau, clamped, cuts, key_names, ("__n", "__bn"))
    width, extra = len(main.expressions), len(totals.expressions) - len(keys)
    first = exp.select(exp.alias_(exp.Literal.number(0), PART), exp.Star(), *_nulls(extra)).from_("__measured")
    second = exp.select(
        exp.Literal.number(1), *[exp.column(f"k{i}", quoted=True) for i in range(len(keys))], *_nulls(width - len(keys))
    ).from_("__totals")
    second.select(*[exp.column(e.alias, quoted=True) for e in totals.expressions[len(keys) :]], copy=False)
    both = exp.union(first, second, distinct=False)
    for cte in with_.expressions:
        both = both.with_(cte.alias, as_=cte.this, materialized=cte.args.get("materialized"), copy=False)
    return (
        both.with_("__bias_units", as_=units, copy=False)
        .with_("__measured", as_=main, copy=False)
        .with_("__totals", as_=totals, copy=False)
    )


def _nulls(count: int) -> list[exp.Expr]:
    return [exp.Null() for _ in range(count)]


def _unit_rows() -> exp.Select:
    """Each cell with its unit's rows in all (``__bn``): a hash aggregation per unit joined back (NULL units
    alike, as one), cheaper on DuckDB than a window partitioning the cells again beside the measurement's."""
    unit = exp.column("__unit", table="__cells", quoted=True)
    per_unit = (
        exp.select(
            exp.alias_(exp.column("__unit", quoted=True), "__uu"),
            exp.alias_(exp.Sum(this=exp.column("__n", quoted=True)), "__bn"),
        )
        .from_("__cells")
        .group_by(exp.column("__unit", quoted=True))
    )
    same = exp.NullSafeEQ(this=unit, expression=exp.column("__uu", table="__u"))
    return (
        exp.select(exp.column(exp.Star(), table="__cells"), exp.column("__bn", table="__u"))
        .from_("__cells")
        .join(per_unit.subquery("__u"), on=same)
    )


def split_folded(
    rows: Sequence[Sequence[Any]], width: int, nkeys: int
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The folded statement's rows (:func:`folded_query`) as the measurement's rows (``width`` columns) and
    the totals' rows (keys, then totals), in the order each came."""
    measured = [tuple(row[1 : 1 + width]) for row in rows if row[0] == 0]
    totals = [tuple(row[1 : 1 + nkeys]) + tuple(row[1 + width :]) for row in rows if row[0] != 0]
    return measured, totals


def _sql(select: exp.Select, part: str) -> str:
    value = select.args.get(part)
    if isinstance(value, list):
        return ";".join(v.sql() for v in value)
    return value.sql() if isinstance(value, exp.Expression) else ""


def _total(value: exp.Expression, name: str) -> exp.Expr:
    return exp.alias_(exp.Coalesce(this=exp.Sum(this=value), expressions=[exp.Literal.number(0)]), name)


def widen(plan: Plan, result: Result, figures: BiasFigures, released: Released) -> set[int]:
    """Widen each cell's ± to cover its estimated bias (post-processing of released values and figures): the
    noise's half-width w and the estimate's h combine as √(w² + h²) (independent noises), and the estimated
    bias b is added: ± (√(w² + h²) + b). Each output's aggregate says how bounding biases it
    (:meth:`dpsql.aggregates.base.Aggregate.bias`). A row is matched to its group by its selected keys; a
    query whose keys are not all selected spreads the totals like the kept rows. Returns the columns widened."""
    nkeys = len(plan.keys)
    where: dict[int, int] = {}  # key index → output column
    for o, out in enumerate(plan.outputs):
        if isinstance(out.expr, exp.Var) and out.expr.name[:1] == "k" and out.expr.name[1:].isdigit():  # a key
            where.setdefault(int(out.expr.name[1:]), o)
    matched = nkeys == 0 or all(k in where for k in range(nkeys))
    index = {tuple(row[:nkeys]): j for j, row in enumerate(released.rows)}
    clamped = [i for i, _ in figures.estimate.clamped if plan.measures[i].centre == 0]
    totals = {i: float(sum(abs(float(v)) for v in released.columns[i] if v is not None)) for i in clamped}
    widened: set[int] = set()
    rows = []
    for row, widths in zip(result.rows, result.accuracy, strict=True):
        key = tuple(row[where[k]] for k in range(nkeys)) if matched else None
        j = index.get(key) if key is not None else None
        if j is None or key not in figures.noisy:
            key = None  # (not found: the totals, spread)
        sizes = totals if key is None or j is None else {i: abs(float(released.columns[i][j] or 0)) for i in clamped}
        rates = figures.rates(key, sizes)
        new = list(widths)
        for o, out in enumerate(plan.outputs):
            width, value = new[o] if o < len(new) else None, row[o]
            if not isinstance(width, int | float) or not math.isfinite(width) or not isinstance(value, int | float):
                continue
            shift, half = OUTPUTS[out.kind].bias(out, plan, float(value), rates)
            if shift > 0 or half > 0:
                new[o] = math.hypot(width, half) + shift
                widened.add(o)
        rows.append(tuple(new))
    result.accuracy = rows
    return widened
