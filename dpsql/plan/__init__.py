"""The typed, frozen plan the analyzer hands to rewrite, release and post-processing.

A plan says what is measured in SQL (``Measure``: counts and clamped sums, each with
its sensitivity), how group keys may be released (``GroupKey``), and how released
output columns are computed from noisy measures (``OutputItem``: an expression over
measure and key references, evaluated after noise — pure post-processing).

The plan sits below the aggregates: a measure finds the aggregate of its kind (its label,
sensitivity and SQL) in :data:`MEASURE_AGGREGATES`, which :mod:`dpsql.aggregates` fills when it is
imported (every plan is built by the analyzer, which imports it), never by importing it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlglot import exp

from dpsql.pgtypes import PgType
from dpsql.plan.sources import Sources
from dpsql.policy import ColumnPolicy, Scalar
from dpsql.session import OutputColumn

if TYPE_CHECKING:
    from dpsql.aggregates import Aggregate
    from dpsql.backends import RowHash, TopRows

#: A key of :data:`dpsql.aggregates.MEASURES` (measures) or :data:`dpsql.aggregates.OUTPUTS` (outputs).
AggregateKind = str

#: Measure kind → its aggregate: :data:`dpsql.aggregates.MEASURES`, registered by that package at import.
MEASURE_AGGREGATES: dict[AggregateKind, Aggregate] = {}


@dataclass(frozen=True, slots=True)
class Measure:
    """One aggregate computed by the backend and released with noise.

    ``sum`` measures add ``clamp(column, lower, upper) - centre``; the centre is the
    bounds' midpoint for AVG (halving sensitivity) and 0 for SUM.
    """

    kind: AggregateKind
    column: str | None = None
    #: Alias of the table ``column`` belongs to, as the query names it.
    table: str | None = None
    lower: float | None = None
    upper: float | None = None
    centre: float = 0.0
    integer: bool = True
    #: For ``quantile`` measures: which quantile (0 = MIN, 0.5 = median, 1 = MAX).
    q: float | None = None
    #: For ``sum`` measures: add the squares of the centred values (variance).
    square: bool = False
    #: For ``mode`` measures: the public candidates, in policy order.
    domain: tuple[Scalar, ...] | None = None
    #: A bounded expression aggregated instead of ``column`` (columns qualified; see analyze.expressions).
    expr: exp.Expression | None = None

    @property
    def aggregate(self) -> Aggregate:
        """The registered aggregate that labels, bounds, computes and converts this measure."""
        return MEASURE_AGGREGATES[self.kind]

    @property
    def selected(self) -> bool:
        """Chosen from a histogram by the exponential mechanism (quantile, mode), not noised additively."""
        return self.aggregate.selected

    @property
    def clamped_sum(self) -> bool:
        """A SUM of a value clamped to declared bounds (the clamp/centre/square/coalesce passes apply)."""
        return self.aggregate.clamped_sum

    @property
    def star(self) -> bool:
        """COUNT(*): reads no column."""
        return self.aggregate.counts_rows

    @property
    def counts(self) -> bool:
        """COUNT(*) or COUNT(column): a count of rows or of a column's non-NULL values."""
        return self.aggregate.counts_values

    @property
    def sensitivity(self) -> float:
        """Largest change of one cell when one row is added or removed (a unit adds ``max_rows`` rows)."""
        return self.aggregate.row_sensitivity(self)

    @property
    def label(self) -> str:
        return self.aggregate.label(self)


def integer_valued(measure: Measure) -> bool:
    """Whether the measure's released values are integers (integer noise; an int column's sum)."""
    return measure.integer and float(measure.centre).is_integer()


def selection_count(sources: Sources) -> Measure:
    """The count partition selection thresholds (:mod:`dpsql.release.selection`): distinct privacy
    units per group.

    With a unit (rows bounded per unit) it is ``COUNT(DISTINCT unit)`` over the bounded rows: each unit
    adds 1 to each of at most ``max_groups`` groups. Without one every row is a person, and with
    ``max_rows`` = 1 a unit keeps one row: ``COUNT(*)`` then already counts units, and is shared with
    the query's own ``COUNT(*)`` (one measure, no budget split).
    """
    unit = sources.unit
    if unit is None or sources.max_rows == 1:  # one row per unit: COUNT(*) counts units
        return Measure(kind="count_star")
    return Measure(kind="count_units", column=unit.name, table=unit.table)


@dataclass(frozen=True, slots=True)
class GroupKey:
    """A GROUP BY key and, when it is public, its domain (declared, or derived from the policy and WHERE).

    A plain column has ``expr`` None. An expression key (``DATE_TRUNC('month', d)``) has ``expr``, the SQL
    computing it from clamped columns (see :mod:`dpsql.analyze.domains`), ``column`` its canonical text
    (columns qualified; how select items are matched to it), ``table`` empty, a virtual ``policy`` and
    its released ``type``.
    """

    column: str
    table: str
    policy: ColumnPolicy
    domain: tuple[Scalar, ...] | None
    expr: exp.Expression | None = None
    type: PgType | None = None


@dataclass(frozen=True, slots=True)
class OutputItem:
    """A released column: ``expr`` refers to measures as ``exp.Var('m<i>')`` and keys as ``exp.Var('k<i>')``."""

    column: OutputColumn
    expr: exp.Expression
    noisy: bool
    #: Bounds an output is clamped to after noise (AVG stays inside the column bounds).
    clamp: tuple[float, float] | None = None
    #: Which measures feed this output; used for confidence intervals.
    measures: tuple[int, ...] = ()
    kind: AggregateKind = "expr"


@dataclass(frozen=True, slots=True)
class Physical:
    """Backend-dependent choices made after analysis: they change the SQL, never what is released.

    ``salt`` is the secret mixed into the per-row hash that picks which rows of a heavy unit are kept
    (per engine, never shown). ``proven`` lists sum measures whose inputs the database's own
    statistics prove inside the bounds: clamping them is the identity, so the rewrite leaves the
    CASE out. ``hash`` names the salted order (``md5``, the same on every backend, or the backend's
    cheaper own hash: DuckDB's HASH, PostgreSQL's ``hashtextextended``); ``top_rows``: counts over many
    public groups keep each unit's first rows in one step (DuckDB's ``MIN_BY`` aggregation, or
    ``ROW_NUMBER``), None: never. Either way a unit keeps at most ``max_rows`` rows.
    """

    salt: str = ""
    proven: frozenset[int] = frozenset()
    hash: RowHash = "md5"
    top_rows: TopRows = None


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything needed to run, noise and post-process one DP query: the analysis, frozen."""

    sources: Sources
    where: exp.Expression | None
    keys: list[GroupKey]
    measures: list[Measure]
    outputs: list[OutputItem]
    having: exp.Expression | None = None
    order: list[tuple[exp.Expression, bool, bool | None]] = field(default_factory=list)  # (expr, desc, nulls_first)
    limit: int | None = None
    offset: int = 0
    distinct: bool = False
    #: Index of the distinct-unit count partition selection thresholds (None when keys are public).
    selection_measure: int | None = None
    #: How this plan runs on one backend (salt, clamp proofs, cell bounding): set by the engine with
    #: ``dataclasses.replace``, never by mutation, so the analysed plan stays as the analyzer built it.
    physical: Physical = Physical()
    #: The rows one unit keeps after the joins when not the policy's caps (``SET dpsql.max_rows_per_unit``,
    #: or chosen under DP: :mod:`dpsql.release.cap`); set by the engine with ``replace``. Any cap is
    #: private: bounding keeps at most this many rows per unit and every sensitivity follows it.
    tau: int | None = None
    #: How :attr:`tau` was set, for EXPLAIN and the notices: "" (the policy's caps), "set" (by the analyst),
    #: "auto" (to be chosen under DP when the query runs; :attr:`tau` the largest candidate) or "chosen".
    tau_origin: str = ""

    def post_centred(self) -> list[int]:
        """Centred sums computed as Σx − centre·COUNT(x) after the query (cheaper in SQL than Σ(x − centre))."""
        return [i for i, m in enumerate(self.measures) if m.clamped_sum and m.centre and not m.square]

    @property
    def public_keys(self) -> bool:
        return all(k.domain is not None for k in self.keys)

    @property
    def unit(self) -> exp.Column | None:
        """Privacy-unit expression when rows must be bounded per unit (None: one row per person)."""
        return self.sources.unit

    @property
    def max_rows(self) -> int:
        if self.unit is None:
            return 1
        return self.tau if self.tau is not None else self.sources.max_rows

    @property
    def cap_origin(self) -> str:
        """Where :attr:`max_rows` comes from, as a parenthesis for EXPLAIN and the notes ("" for the policy)."""
        return {
            "set": " (SET dpsql.max_rows_per_unit)",
            "auto": " (the largest cap; the one used is chosen under DP when the query runs)",
            "chosen": " (chosen under DP)",
        }.get(self.tau_origin, "")

    @property
    def max_groups(self) -> int:
        """Groups one unit may touch: bounded in SQL to ``max_groups_per_unit`` and by ``max_rows``."""
        return min(self.sources.max_groups_declared or self.max_rows, self.max_rows) if self.keys else 1

    def sensitivities(self, measure: Measure) -> tuple[float, float]:
        """(L1, L2) sensitivity of ``measure`` over all released groups, for one whole unit."""
        return measure.aggregate.sensitivities(measure, self)
