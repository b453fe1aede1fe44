"""The exponential mechanism for quantiles (MIN, MAX, median, percentiles) and report-noisy-max
for the mode: pure math over public grids and histogram counts (no plan, no SQL).

The privacy argument and design notes: docs/internals.md, section dpsql/noise/exponential.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _opendp() -> Any:
    """OpenDP's prelude, contrib features on: imported by the first noisy max (~0.3-0.6 s of every server
    worker's and command's start otherwise; issue #37)."""
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp


#: Candidates of one exponential mechanism (a stage): at most 512, which keeps one selection at
#: ~2 ms (OpenDP's exact sampler costs ~3 µs a candidate) and its rank error at (2Δ/ε)·ln(512/β).
QUANTILE_BINS = 512
#: Cells of the finest grid: 512 runs of 128 cells, resolution (U − L)/65536.
FINE_CELLS = QUANTILE_BINS * 128


@dataclass(frozen=True)
class QuantileGrid:
    """The public cells a quantile is released from, a function of the bounds and column type only."""

    lower: float
    upper: float
    #: Number of cells (histogram bins 0 … cells − 1).
    cells: int
    #: Cell j is the integer lower + j (an int column with few enough values); else equal widths.
    integer: bool

    @property
    def stride(self) -> int:
        """Cells per stage-1 run: 1 means a single exponential mechanism over the cells."""
        return -(-self.cells // QUANTILE_BINS)

    @property
    def runs(self) -> int:
        return -(-self.cells // self.stride)

    @property
    def width(self) -> float:
        """Width of one cell (1 for exact integers)."""
        return 1.0 if self.integer else (self.upper - self.lower) / self.cells

    def value(self, cell: int) -> float:
        """The released value of a cell: the integer itself, or the cell's midpoint (rounded to two
        significant digits of the width: no 17-digit grid arithmetic, still inside the cell)."""
        if self.integer:
            return self.lower + cell
        return min(self.upper, nice(self.lower + (cell + 0.5) * self.width, self.width))

    def run_value(self, run: int) -> float:
        """The released value of a stage-1 run: its middle (rounded like :meth:`value`)."""
        first, last = run * self.stride, min((run + 1) * self.stride, self.cells) - 1
        low, high = self.span(first, last)
        if self.integer:
            return (low + high) / 2
        return min(self.upper, nice((low + high) / 2, high - low))

    def span(self, first: int, last: int) -> tuple[float, float]:
        """The values cells ``first`` … ``last`` cover: [first integer, last integer], or the cells' edges."""
        if self.integer:
            return self.lower + first, self.lower + last
        return self.lower + first * self.width, min(self.upper, self.lower + (last + 1) * self.width)

    def candidate(self, value: float, runs: bool) -> tuple[int, float, float]:
        """The candidate (a run when ``runs``, else a cell) a released ``value`` stands for, and the
        values it covers: post-processing of the released value and the public grid only."""
        size = self.stride if runs else 1
        count = self.runs if runs else self.cells
        step = size * self.width
        index = math.floor((value - self.lower) / step + (0.0 if size > 1 or not self.integer else 0.5))
        index = min(max(index, 0), count - 1)
        low, high = self.span(index * size, min((index + 1) * size, self.cells) - 1)
        return index, low, high


def nice(x: float, width: float) -> float:
    """``x`` rounded to two significant digits of ``width`` (≤ width/20 away): deterministic
    post-processing of a released value, which keeps it inside a cell of that width around it."""
    if not (width > 0 and math.isfinite(width) and math.isfinite(x)):
        return x
    digits = 1 - math.floor(math.log10(width))
    return round(x, digits)


def quantile_grid(lower: float, upper: float, integer: bool) -> QuantileGrid:
    """The grid of a quantile over [lower, upper]: exact integers when the int column has at most
    :data:`FINE_CELLS` values (MIN/MAX/percentile_disc of an int column land on a possible value,
    and nothing is lost to rounding), else :data:`FINE_CELLS` equal cells."""
    if integer and float(lower).is_integer() and float(upper).is_integer() and upper - lower < FINE_CELLS:
        return QuantileGrid(lower, upper, int(upper - lower) + 1, True)
    return QuantileGrid(lower, upper, FINE_CELLS, False)


@lru_cache(maxsize=256)
def _noisy_max(scale: float) -> Any:
    dp = _opendp()
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=float), dp.max_divergence(), scale=scale)


def rank_utilities(
    counts: Sequence[int], q: float, total: int, before: int, target: float | Sequence[float]
) -> list[float]:
    """Utilities of consecutive candidates with ``counts`` values each, ``before`` values lying
    before the first one (below it; above the last one when q = 1, the candidates then read from
    the top). ``target`` is the rank aimed at, counted from the same end: one for all candidates,
    or one per candidate in that order (MIN/MAX, :func:`extreme_aims`; data-independent constants).

    For MIN and MAX (q = 0 or 1) a candidate starting exactly at the target rank is half a rank
    worse than one covering it, so the extreme is approached from the inside.
    """
    extreme = q in (0.0, 1.0)
    ordered = list(reversed(counts)) if q == 1.0 else list(counts)
    targets = [float(target)] * len(ordered) if isinstance(target, int | float) else list(target)
    utilities = []
    below = float(before)
    for count, aim in zip(ordered, targets, strict=True):
        above = below + count
        start = below + 0.5 if extreme else below
        utilities.append(-max(0.0, start - aim, aim - above))
        below = above
    return utilities[::-1] if q == 1.0 else utilities


#: β of MIN/MAX's aims: the empty candidates beyond the data win with probability ≤ β in all.
EXTREME_BETA = 0.05


@lru_cache(maxsize=256)
def extreme_aims(epsilon: float, sensitivity: float, candidates: int) -> tuple[float, ...]:
    """The rank each MIN/MAX candidate aims at, counted from the extreme end (index 0: the outermost).

    k_j = max(1, (2Δ/ε)·ln(j·H_B/β)) for the j-th candidate from the end: the candidates beyond the
    data, whichever they are, then win with probability ≤ β together (module docstring), and data
    that reach the bound are met about half as deep as by one constant aim (2Δ/ε)·ln(B/β). A
    function of ε, Δ and B only (public), never of the data.
    """
    harmonic = sum(1.0 / j for j in range(1, candidates + 1))
    scale = 2.0 * sensitivity / epsilon
    return tuple(max(1.0, scale * math.log(j * harmonic / EXTREME_BETA)) for j in range(1, candidates + 1))


def quantile_utilities(
    counts: Mapping[int, int], q: float, bins: int = QUANTILE_BINS, *, extreme_rank: float = 1.0
) -> list[float]:
    """Utility of each bin for the q-quantile of the histogram ``counts`` (bin index → count).

    A bin covering ranks (C_j, C_{j+1}] scores minus its distance to the target rank. For
    MIN and MAX (q = 0 or 1) the target is the ``extreme_rank``-th value from the bottom or
    the top, a constant: below the true minimum every empty bin is one rank away from rank
    1, so no DP mechanism can find the exact minimum; aiming ``extreme_rank`` values in
    makes the answer land between the true extreme and that rank with high probability.
    Either way each utility changes by at most 1 per added or removed value.
    """
    total = sum(counts.values())
    target = extreme_rank if q in (0.0, 1.0) else q * total
    return rank_utilities([counts.get(j, 0) for j in range(bins)], q, total, 0, target)


def _choose(counts: Sequence[int], q: float, total: int, before: int, epsilon: float, sensitivity: float) -> int:
    """One ε-DP exponential mechanism over consecutive candidates (see :func:`rank_utilities`)."""
    target = extreme_aims(epsilon, sensitivity, len(counts)) if q in (0.0, 1.0) else q * total
    utilities = rank_utilities(counts, q, total, before, target)
    return int(_noisy_max(2.0 * sensitivity / epsilon)(utilities))


def select_quantile(
    counts: Mapping[int, int], q: float, epsilon: float, sensitivity: float, grid: QuantileGrid
) -> float:
    """An ε-DP q-quantile of the histogram ``counts`` (cell → count) on ``grid``: report-noisy-max over
    at most :data:`QUANTILE_BINS` cells, MIN/MAX over the runs, else the exponential mechanism over
    every cell (:func:`_every_cell`; module docstring)."""
    total = sum(counts.values())
    stride = grid.stride
    if stride == 1:
        return grid.value(_choose([counts.get(j, 0) for j in range(grid.cells)], q, total, 0, epsilon, sensitivity))
    if q in (0.0, 1.0):
        # MIN/MAX aim (2Δ/ε)·ln(B/β) ranks inside the data: one mechanism over the runs at full ε,
        # released at the run's middle.
        runs = [0] * grid.runs
        for cell, count in counts.items():
            runs[cell // stride] += count
        return grid.run_value(_choose(runs, q, total, 0, epsilon, sensitivity))
    return grid.value(_every_cell(counts, q * total, epsilon, sensitivity, grid.cells))


@lru_cache(maxsize=256)
def _gumbel_max(scale: float) -> Any:
    dp = _opendp()
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=float), dp.zero_concentrated_divergence(), scale=scale)


def _every_cell(counts: Mapping[int, int], target: float, epsilon: float, sensitivity: float, cells: int) -> int:
    """The exponential mechanism over cells 0 … cells − 1 with utility −distance(target, the cell's
    ranks): the non-empty cells one by one, each run of empty cells between them as one block weighted
    by its length (Gumbel-max, exact), then a cell uniformly inside the chosen block (OS CSPRNG)."""
    scale = 2.0 * sensitivity / epsilon
    starts: list[int] = []
    lengths: list[int] = []
    utilities: list[float] = []

    def block(start: int, length: int, below: float, above: float) -> None:
        starts.append(start)
        lengths.append(length)
        utilities.append(-max(0.0, below - target, target - above) + scale * math.log(length))

    below, following = 0, 0
    for cell in sorted(c for c, n in counts.items() if n):
        if cell > following:
            block(following, cell - following, below, below)
        above = below + counts[cell]
        block(cell, 1, below, above)
        below, following = above, cell + 1
    if following < cells:
        block(following, cells - following, below, below)
    chosen = int(_gumbel_max(scale)(utilities))
    return starts[chosen] + (secrets.randbelow(lengths[chosen]) if lengths[chosen] > 1 else 0)


def interval_reach(epsilon: float, sensitivity: float, grid: QuantileGrid, level: float) -> float:
    """E: how many ranks beyond the quantile's each end of its interval aims (:func:`interval_end`).

    Report-noisy-max with exponential noise of scale s = 2Δ/ε picks a candidate scoring g below the
    best with probability ≤ e^{−g/s}; the best scores 0, the wrong-side candidates (at most one per
    run) below −E, so with E = s·ln(runs/(β/2)) an end lands on the wrong side with probability
    ≤ β/2. A function of ε, Δ, the grid and the level only (public)."""
    candidates = grid.runs if grid.stride > 1 else grid.cells
    return 2.0 * sensitivity / epsilon * math.log(candidates / ((1.0 - level) / 2.0))


def cut_levels(q: float, cut: float) -> tuple[float, float]:
    """The kept rows' quantile levels between which the q-quantile of all rows lies when a share ``cut``
    of them (at most) was left out by the caps: (q − f)/(1 − f) and q/(1 − f).

    With N rows in all, m ≤ fN of them cut and n = N − m kept, the exact quantile x has rank k in
    (qN − 1, qN + 2) among all rows. At most k − 1 < qN + 1 ≤ c·n + 1 kept values lie below x, for
    c = q/(1 − f) since n ≥ (1 − f)N; at least k − m > qN − 1 − m ≥ c'·n − 1 kept values lie at or
    below it, for c' = (q − f)/(1 − f) (c'·(N − m) ≤ qN − m ⟺ m·(1 − c') ≤ N·(q − c'), true for
    m ≤ fN). So :func:`interval_end`'s argument (ranks qn + 1 and qn − 1) holds with c·n and c'·n.
    Public: q and the curator's published share only. The coverage rests on the curator's figure holding
    for the rows the query reads (it is published for the whole table, as the ± of counts use it); the
    privacy argument does not depend on it."""
    if cut <= 0.0:
        return q, q
    return (q - cut) / (1.0 - cut), q / (1.0 - cut)


def interval_end(
    counts: Mapping[int, int],
    q: float,
    epsilon: float,
    sensitivity: float,
    grid: QuantileGrid,
    level: float,
    upper: bool,
    cut: float = 0.0,
) -> float:
    """One end of the q-quantile's ``level`` value interval: the outer edge of a run (a cell when the
    grid has at most :data:`QUANTILE_BINS`) chosen ε-DP to lie E ranks beyond the quantile's, or the
    bound. With ``cut`` (the share of rows the caps leave out, as the curator published it) the end
    aims around the kept rows' quantile at :func:`cut_levels` instead, which covers the q-quantile of
    all rows; a level outside (0, 1) gives the bound without reading the counts.

    The exact quantile (percentile_cont's or percentile_disc's) is a value of rank k in (qn − 1, qn + 2).
    The lower end aims at t = qn − 1 − E: a run whose lower edge is above the k-th value has at least
    k > qn − 1 values below it, so it scores below −E. The sentinel (the bound L, "everything below")
    scores −max(0, t): 0 when t < 0; otherwise the run holding rank t scores 0. The upper end mirrors
    it (t = qn + 1 + E, sentinel U scoring −max(0, n − t)). Every utility moves by at most Δ per unit
    (n, the counts below a run and t move by at most Δ, in the same direction).
    """
    aim = cut_levels(q, cut)[1 if upper else 0]
    if upper and aim >= 1.0:
        return grid.upper  # (the cut rows may all lie above: nothing bounds the quantile below U)
    if not upper and aim <= 0.0:
        return grid.lower
    stride = grid.stride
    runs = [0] * grid.runs
    for cell, count in counts.items():
        runs[cell // stride] += count
    reach = 1.0 + interval_reach(epsilon, sensitivity, grid, level)
    chosen = int(_noisy_max(2.0 * sensitivity / epsilon)(interval_utilities(runs, aim, reach, upper)))
    if upper:
        if chosen == grid.runs:
            return grid.upper
        return grid.span(chosen * stride, min((chosen + 1) * stride, grid.cells) - 1)[1]
    if chosen == 0:
        return grid.lower
    return grid.span((chosen - 1) * stride, chosen * stride - 1)[0]


def interval_utilities(runs: Sequence[int], q: float, reach: float, upper: bool) -> list[float]:
    """The candidates' utilities for one end (:func:`interval_end`): the runs in order, with the sentinel
    bound first (lower end) or last (upper end); the target rank is q·n ∓ ``reach``."""
    total = sum(runs)
    target = q * total + reach if upper else q * total - reach
    utilities, below = [], 0
    for count in runs:
        above = below + count
        utilities.append(-max(0.0, below - target, target - above))
        below = above
    if upper:
        return [*utilities, -max(0.0, total - target)]
    return [-max(0.0, target), *utilities]


def rank_error_bound(epsilon: float, sensitivity: float, confidence: float = 0.95, bins: int = QUANTILE_BINS) -> float:
    """With probability ≥ ``confidence`` the chosen bin's utility is within this many ranks of the best.

    The exponential mechanism's standard bound: OPT − (2Δ/ε)·ln(B/β) with β = 1 − confidence.
    It bounds the *rank* error; the value error depends on the data's spread and is not
    reported per cell (it would depend on private data).
    """
    return 2.0 * sensitivity / epsilon * math.log(bins / (1.0 - confidence))


def quantile_rank_error(
    epsilon: float, sensitivity: float, grid: QuantileGrid, confidence: float = 0.95, *, extreme: bool = False
) -> float:
    """The rank error bound of :func:`select_quantile` at ``confidence``: over the cells (or, for
    MIN/MAX on a grid of runs, over the runs)."""
    if extreme and grid.stride > 1:
        return rank_error_bound(epsilon, sensitivity, confidence, grid.runs)
    return rank_error_bound(epsilon, sensitivity, confidence, grid.cells)


@lru_cache(maxsize=256)
def _noisy_max_monotonic(scale: float) -> Any:
    dp = _opendp()
    domain = dp.vector_domain(dp.atom_domain(T=int))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=int, monotonic=True), dp.max_divergence(), scale=scale)


def select_mode(counts: list[int], epsilon: float, sensitivity: float) -> int:
    """Report-noisy-max over candidate counts: an ε-DP arg-max.

    Privacy argument. Candidates are the column's public domain, so which candidates exist
    reveals nothing. One unit changes the counts by at most ``sensitivity`` each, all in the
    same direction (adding rows only raises counts): the utility is monotonic, and OpenDP's
    noisy max with exponential noise of scale Δ/ε is then ε-DP ([MS20], exact CSPRNG sampling).
    The released value is the winning candidate only, never its count.
    """
    return int(_noisy_max_monotonic(sensitivity / epsilon)(counts))


@lru_cache(maxsize=256)
def _noisy_max_monotonic_float(scale: float) -> Any:
    dp = _opendp()
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=float, monotonic=True), dp.max_divergence(), scale=scale)


def select_cap(scores: Sequence[float], epsilon: float) -> int:
    """Report-noisy-max over candidate scores that one unit moves by at most 1, all in one direction
    (:mod:`dpsql.release.cap`: minus the units a cap cuts, minus public terms): ε-DP with exponential
    noise of scale 1/ε ([MS20], OpenDP's exact CSPRNG sampling). Returns the winning index only."""
    return int(_noisy_max_monotonic_float(1.0 / epsilon)(list(scores)))
