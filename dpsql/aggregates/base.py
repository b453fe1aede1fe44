"""What every aggregate provides, with the defaults most of them share.

An aggregate owns, per stage, what differs between aggregates: the label, per-row sensitivity and
raw SQL of its measures; how a released value becomes a Python value; how its output is coerced
after noise, its confidence interval and its EXPLAIN line. Registered by kind in
:data:`dpsql.aggregates.MEASURES` (measure kinds) and :data:`dpsql.aggregates.OUTPUTS` (output kinds).

The aggregates sit below the analyzer and the release stage: what they read of the analyzer's
scope and of the release's budgeting is the :class:`Scope` and :class:`Spending` protocols here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from sqlglot import exp

from dpsql.aggregates.notes import Counts, Interval
from dpsql.noise.exponential import QuantileGrid
from dpsql.noise.mechanisms import NoiseSpec, half_width
from dpsql.pgtypes import PgType
from dpsql.plan import GroupKey, Measure, OutputItem, Plan
from dpsql.plan.sources import Sources
from dpsql.policy import PG_TYPE_NAMES, ColumnPolicy

Rows = list[tuple[Any, ...]]


@dataclass(frozen=True)
class Operand:
    """What an aggregate reads: a declared column, or a bounded expression over columns."""

    table: str | None
    name: str
    policy: ColumnPolicy
    expr: exp.Expression | None = None


class Scope(Protocol):
    """What a recogniser reads and adds to: the analyzer's name resolution for one SELECT
    (:class:`dpsql.analyze.scope.Scope`)."""

    @property
    def sources(self) -> Sources: ...
    @property
    def keys(self) -> list[GroupKey]: ...
    @property
    def measures(self) -> list[Measure]: ...
    def measure(self, measure: Measure) -> int: ...
    def operand(self, argument: exp.Expression | None) -> Operand: ...
    def bounded_sum(self, operand: Operand, function: str, *, centred: bool) -> Measure: ...
    def count_of(self, operand: Operand) -> Measure: ...


class Spending(Protocol):
    """What an EXPLAIN line reads of a query's budgeting (:class:`dpsql.release.calibrate.Budgeting`)."""

    @property
    def epsilon(self) -> float: ...
    @property
    def specs(self) -> Sequence[NoiseSpec | None]: ...
    @property
    def shares(self) -> Sequence[float]: ...
    @property
    def interval_level(self) -> float | None: ...
    @property
    def measured(self) -> float | None: ...
    @property
    def interval_cut(self) -> float | None: ...


class BiasRates(NamedTuple):
    """A query's released bias estimate as rates, each (estimate ≥ 0, half-width at the query's level)."""

    #: Rows cut by the cap per row kept.
    cut: tuple[float, float]
    #: Per clamped measure: how far its values lie beyond the bounds, per unit of its |clamped total| …
    per_total: Mapping[int, tuple[float, float]]
    #: … and per row kept.
    per_row: Mapping[int, tuple[float, float]]


class Recognised(NamedTuple):
    """An aggregate call, replaced: an output expression over measure variables ``m<i>``."""

    expr: exp.Expression
    #: The output kind (a key of :data:`dpsql.aggregates.OUTPUTS`).
    kind: str
    #: The measures the expression reads, in order.
    measures: tuple[int, ...]


def measure_var(index: int) -> exp.Var:
    """The variable an output expression reads measure ``index`` through."""
    return exp.var(f"m{index}")


class Aggregate:
    """Defaults: a count-like measure of sensitivity 1 and an output that copies one measure."""

    #: The measure and/or output kind this aggregate is registered under.
    kind: ClassVar[str]
    #: Chosen over a histogram (exponential mechanism / report-noisy-max), not noised additively.
    selected: ClassVar[bool] = False
    #: Its output is one measure column, released column-wise on the fast path (no interpreter).
    direct: ClassVar[bool] = False
    #: EXPLAIN shows a CI for its output (one additive measure).
    explain_ci: ClassVar[bool] = False
    #: Its measure is a SUM of a value clamped to declared bounds: the clamp, centre, square and
    #: coalesce rewrite passes act on it.
    clamped_sum: ClassVar[bool] = False
    #: Per-unit partial results add up to the whole (COUNT, SUM): ungrouped queries may cap per-unit
    #: partials instead of ranking rows. False for distinct counts.
    decomposable: ClassVar[bool] = True
    #: A unit adds at most 1 to each group's value, however many rows it holds (distinct-unit counts).
    once_per_unit: ClassVar[bool] = False
    #: ``FILTER (WHERE p)`` is applied as ``CASE WHEN p THEN arg END`` on its argument.
    filterable: ClassVar[bool] = True
    #: Post-processing functions its output expression calls to combine noisy measures, by name.
    functions: ClassVar[dict[str, Callable[..., Any]]] = {}
    #: The sqlglot call types it recognises (for ``f(...) WITHIN GROUP``: the type of ``f``).
    recognises: ClassVar[tuple[type[exp.Expr], ...]] = ()
    #: Its output has no ± by nature and its own note says so (quantiles, modes): never the generic
    #: "no interval" note.
    own_note: ClassVar[bool] = False
    #: Released as NULL when its noisy count is ≤ 0 (AVG, variance): a note says why.
    null_when_empty: ClassVar[bool] = False
    #: Its measures are ends of a value interval, chosen at the policy's confidence level.
    interval_end: ClassVar[bool] = False
    #: Its measure is COUNT(*): it reads no column, and its noisy value is a group's released size.
    counts_rows: ClassVar[bool] = False
    #: Its measure counts rows or a column's non-NULL values (COUNT(*), COUNT(column)): a non-negative
    #: integer read as a group's (or a column's) size.
    counts_values: ClassVar[bool] = False

    # -- analysis -------------------------------------------------------------------------------

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        """Turn one call of this aggregate into measures added to ``scope`` (refusing what is unsafe)."""
        raise NotImplementedError(self.kind)

    def output_name(self, node: exp.Expr) -> str | None:
        """The column name PostgreSQL gives the call, when it is not the function's SQL name."""
        return None

    # -- measures -------------------------------------------------------------------------------

    def label(self, measure: Measure) -> str:
        raise NotImplementedError(self.kind)

    def row_sensitivity(self, measure: Measure) -> float:
        """Largest change of one cell when one row is added or removed."""
        return 1.0

    def sensitivities(self, measure: Measure, plan: Plan) -> tuple[float, float]:
        """(L1, L2) over all released groups for one whole unit (``max_rows`` rows)."""
        total = measure.sensitivity * plan.max_rows
        return total, total

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        """The aggregate the measurement query computes (``value()``: the measure's input)."""
        return exp.Count(this=exp.Star(), big_int=True)

    def converter(self, measure: Measure) -> Callable[[Any], Any]:
        """How a released value of this measure becomes a Python value."""
        return int if measure.integer and float(measure.centre).is_integer() else float

    # -- outputs --------------------------------------------------------------------------------

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        """The output column's PostgreSQL type (None: typed from its expression by the analyzer).
        ``scope`` is the analyzer's (keys, measures, sources); ``expr`` the output's expression."""
        return None

    def output_clamp(self, scope: Any, measures: tuple[int, ...]) -> tuple[float, float] | None:
        """Bounds the released output is clamped to after noise (post-processing), if any."""
        return None

    def coerce(self, out: OutputItem, value: Any) -> Any:
        """The output's value after noise, in its column's type (post-processing)."""
        return value

    def value_range(self, out: OutputItem, plan: Plan) -> tuple[float, float] | None:
        """What the exact answer can be (public: from the policy): confidence intervals are clipped
        to it for display. Default: the output's clamp (AVG inside the declared bounds), if any."""
        return out.clamp

    def direct_values(self, values: list[Any], convert: Callable[[Any], Any]) -> list[Any]:
        return [convert(v) for v in values]

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        """Half-width of the cell's confidence interval (None when none is known)."""
        if isinstance(out.expr, exp.Var) and out.expr.name.startswith("m"):
            return widths[int(out.expr.name[1:])]
        return None

    def bias(self, out: OutputItem, plan: Plan, value: float, rates: BiasRates) -> tuple[float, float]:
        """How far contribution bounding may have moved the cell ``value``, as (estimate ≥ 0, its half-width)
        from the query's released bias ``rates`` (:mod:`dpsql.release.bias`): post-processing. Default: none
        known (quantiles, modes, distinct counts, variances)."""
        return 0.0, 0.0

    def interval(self, out: OutputItem, plan: Plan, env: Mapping[str, Any]) -> Interval | None:
        """The cell's released value interval (quantiles: its own measures), when it has one that is
        not a symmetric ± (post-processing of the row's released measures ``env``)."""
        return None

    def notes(
        self,
        out: OutputItem,
        plan: Plan,
        budgeting: Spending,
        level: float,
        values: list[Any],
        counts: Mapping[str | None, Counts],
        intervals: Sequence[tuple[str, Interval | None]] | None = None,
    ) -> list[str] | None:
        """NOTICE texts on a bare output of this aggregate (``out.expr`` one measure variable) that a ±
        cannot give, from public figures and the released ``values`` only (``counts``: each column's
        released noisy group counts; ``intervals``: each row's label and released value interval);
        None: the release stage's generic notes (clipped intervals)."""
        return None

    def explain(self, out: OutputItem, plan: Plan, budgeting: Spending, confidence: float) -> dict[str, Any]:
        """The EXPLAIN entry of an output of this aggregate."""
        if not out.noisy:
            return {"measure": "constant"}
        specs = [s for s in (budgeting.specs[i] for i in out.measures) if s is not None]
        return {
            "measure": " + ".join(plan.measures[i].label for i in out.measures),
            "sensitivity": max(plan.sensitivities(plan.measures[i])[0] for i in out.measures),
            "scale": max(s.scale * s.grid for s in specs),
            # the measurement's ε (less a cap choice's or bias estimate's share), split over the measures
            "epsilon": (budgeting.measured or budgeting.epsilon) * len(out.measures) / len(plan.measures),
            "ci": half_width(specs[0], confidence) if self.explain_ci else math.nan,
        }


class Selection(Aggregate):
    """Measures chosen per group from a histogram query rather than noised."""

    selected = True
    filterable = False
    own_note = True

    def sensitivities(self, measure: Measure, plan: Plan) -> tuple[float, float]:
        """Utility sensitivity Δ = max_rows, composed over the groups a unit touches: its rows move group
        g's utilities by at most d_g with Σ_g d_g ≤ max_rows (the fuzzer's histogram check), and each
        group's mechanism at scale 2Δ/ε (Δ/ε: monotone) is (2d_g/(2Δ/ε))-DP, so together ε-DP."""
        return float(plan.max_rows), float(plan.max_rows)

    def select(
        self,
        plan: Plan,
        index: int,
        rows: Rows,
        histogram: Rows,
        epsilon: float,
        *,
        level: float = 0.95,
        cut: float = 0.0,
    ) -> list[Any]:
        """One released value per row, chosen ε-DP from that group's histogram (``level``: the query's
        confidence, and ``cut``: the published share of rows cut it covers, for measures that release
        an interval's end)."""
        raise NotImplementedError(self.kind)

    def grid(self, measure: Measure) -> QuantileGrid | None:
        """The public grid the histogram query counts values in; None: the values themselves are
        the bins (public candidates)."""
        return None

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return None


class Key(Aggregate):
    """A group key output: released as is (keys are public or selected), no interval."""

    kind = "key"
    direct = True

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        """The key's own type: a derived key's (a time bucket is a timestamp), else its column's."""
        assert isinstance(expr, exp.Var)
        key = scope.keys[int(expr.name[1:])]
        return key.type or PG_TYPE_NAMES[key.policy.type]

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return None

    def explain(self, out: OutputItem, plan: Plan, budgeting: Spending, confidence: float) -> dict[str, Any]:
        return {"measure": "group key"}


class Expression(Aggregate):
    """An output expression over released measures and keys (post-processing)."""

    kind = "expr"

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        """An interval for an expression of at most one noisy measure: ``c·x``, ``x/c``, ``x ± c``, ``-x``
        and ``ROUND(x, d)`` (wider by half a unit of the last digit kept) carry x's half-width exactly;
        anything combining several noisy values (ratios, sums of measures) gets none (a sum of
        half-widths would not hold at the same confidence), and the notes say so."""
        names = {v.name for v in out.expr.find_all(exp.Var) if v.name.startswith("m")}
        if len(names) != 1:
            return None
        return _linear_width(out.expr, widths, out.column.type == "bigint")


def _linear_width(node: exp.Expression, widths: list[float | None], integer: bool) -> float | None:
    """Half-width of ``node`` when it is a constant-coefficient affine image (or ROUND) of one measure;
    an integer division (``integer``) truncates, which adds up to 1."""
    if isinstance(node, exp.Var):
        return widths[int(node.name[1:])] if node.name.startswith("m") else None
    if isinstance(node, exp.Literal) and not node.is_string:
        return 0.0
    if isinstance(node, exp.Paren | exp.Neg):
        return _linear_width(node.this, widths, integer)
    if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div):
        left, right = _linear_width(node.this, widths, integer), _linear_width(node.expression, widths, integer)
        if left is None or right is None:
            return None
        if isinstance(node, exp.Add | exp.Sub):
            return left + right
        constant = node.expression if left else node.this
        if not isinstance(constant, exp.Literal) or (left and right) or (isinstance(node, exp.Div) and not left):
            return None
        factor = abs(float(constant.name))
        if isinstance(node, exp.Mul):
            return (left or right) * factor
        return None if factor == 0 else left / factor + (1.0 if integer else 0.0)
    if isinstance(node, exp.Round):
        inner = _linear_width(node.this, widths, integer)
        digits = node.args.get("decimals")
        places = 0.0 if digits is None else _constant(digits)
        if inner is None or places is None:
            return None
        return inner + 0.5 * 10.0 ** -int(places)
    return None


def _constant(node: exp.Expression) -> float | None:
    """A numeric literal, possibly negated (``ROUND(x, -1)``); None for anything else."""
    if isinstance(node, exp.Neg):
        inner = _constant(node.this)
        return None if inner is None else -inner
    if isinstance(node, exp.Literal) and not node.is_string:
        return float(node.name)
    return None
