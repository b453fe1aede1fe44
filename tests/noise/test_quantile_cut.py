"""Quantile value intervals that cover the rows the caps cut (#40 item 2, ``published_rows_cut``).

With a share f of all rows left out by the caps (wherever they lie), the ends aim at the kept rows'
levels (q − f)/(1 − f) and q/(1 − f) (:func:`~dpsql.noise.exponential.cut_levels`): they hold the exact
quantile of all rows, the utilities still move by at most the rows a unit changes, and an end whose
level leaves (0, 1) is the bound itself.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsql.noise.exponential import QuantileGrid, cut_levels, interval_end, interval_utilities, quantile_grid
from tests.dp_check import assert_counts_epsilon_dp


def _cells(values: np.ndarray, grid: QuantileGrid) -> dict[int, int]:
    cells = np.floor((np.clip(values, grid.lower, grid.upper) - grid.lower) * grid.cells / (grid.upper - grid.lower))
    return dict(Counter(np.minimum(cells.astype(int), grid.cells - 1).tolist()))


def test_levels() -> None:
    assert cut_levels(0.9, 0.0) == (0.9, 0.9)
    low, high = cut_levels(0.9, 0.08)
    assert low == pytest.approx(0.82 / 0.92) and high == pytest.approx(0.9 / 0.92)
    assert cut_levels(0.5, 0.6)[0] < 0 < 1 < cut_levels(0.5, 0.6)[1]


def test_out_of_range_levels_give_the_bounds() -> None:
    grid = quantile_grid(0.0, 100.0, False)
    counts = {100: 50, 30000: 50}
    assert interval_end(counts, 0.05, 1.0, 1.0, grid, 0.95, upper=False, cut=0.08) == 0.0
    assert interval_end(counts, 0.95, 1.0, 1.0, grid, 0.95, upper=True, cut=0.08) == 100.0


_RNG = np.random.default_rng(4040)
#: All rows (gamma, mass near the bound), and which 8 % the caps cut: the top, the bottom, or at random.
ALL = np.clip(_RNG.gamma(2.0, 10.0, 5000), 0.0, 100.0)
ORDER = np.argsort(ALL, kind="stable")
CUT = int(0.08 * len(ALL))
KEPT = {
    "top": ALL[ORDER[: len(ALL) - CUT]],
    "bottom": ALL[ORDER[CUT:]],
    "random": ALL[_RNG.permutation(len(ALL))[CUT:]],
}


@pytest.mark.parametrize("where", sorted(KEPT))
def test_ends_hold_the_quantile_of_all_rows(where: str) -> None:
    """200 intervals per (cut placement, q), ε = 2 a end, Δ = 1: each holds the exact percentile_cont of
    *all* rows in ≥ 90 % of draws (≥ 95 % over all); without the cut the top and bottom placements miss."""
    grid = quantile_grid(0.0, 100.0, False)
    counts = _cells(KEPT[where], grid)
    held = total = 0
    for q in (0.1, 0.5, 0.9):
        exact = float(np.quantile(ALL, q))
        covered = 0
        for _ in range(200):
            low = interval_end(counts, q, 2.0, 1.0, grid, 0.95, upper=False, cut=0.08)
            high = interval_end(counts, q, 2.0, 1.0, grid, 0.95, upper=True, cut=0.08)
            covered += min(low, high) <= exact <= max(low, high)
        assert covered >= 180, (where, q, covered)
        held, total = held + covered, total + 200
    assert held >= 0.95 * total
    if where != "random":  # the negative control: noise-only ends miss the quantile of all rows
        q = 0.9 if where == "top" else 0.1
        exact = float(np.quantile(ALL, q))
        misses = sum(
            not (
                interval_end(counts, q, 2.0, 1.0, grid, 0.95, upper=False)
                <= exact
                <= interval_end(counts, q, 2.0, 1.0, grid, 0.95, upper=True)
            )
            for _ in range(50)
        )
        assert misses >= 45, (where, misses)


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.integers(0, 40), min_size=1, max_size=24),
    added=st.lists(st.integers(0, 23), min_size=0, max_size=5),
    q=st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]),
    cut=st.floats(0.0, 0.5),
    reach=st.floats(0.0, 200.0),
    upper=st.booleans(),
    remove=st.booleans(),
)
def test_utilities_at_the_cut_levels_move_at_most_the_rows_a_unit_changes(
    runs: list[int], added: list[int], q: float, cut: float, reach: float, upper: bool, remove: bool
) -> None:
    """At a level c in (0, 1) the target c·n moves by at most c per row: every utility, the sentinel's
    included, moves by at most the number of rows one unit adds or removes (Δ)."""
    aim = cut_levels(q, cut)[1 if upper else 0]
    if not 0.0 < aim < 1.0:
        return  # the bound itself, without reading the counts
    neighbour = list(runs)
    changed = 0
    for slot in added:
        index = slot % len(runs)
        if remove and neighbour[index] == 0:
            continue
        neighbour[index] += -1 if remove else 1
        changed += 1
    before = interval_utilities(runs, aim, reach, upper)
    after = interval_utilities(neighbour, aim, reach, upper)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) <= changed + 1e-9


def test_each_cut_end_is_epsilon_dp_on_neighbours() -> None:
    """Neighbouring histograms (one value added) on 64 integer cells at f = 0.2: every possible end,
    P₁ ≤ e^ε·P₂ both ways (Clopper–Pearson, Bonferroni over outcomes and directions)."""
    grid = QuantileGrid(0.0, 63.0, 64, True)
    d1 = {10: 3, 20: 4, 30: 2, 31: 1, 40: 2, 55: 1}
    d2 = {**d1, 30: 3}
    n, epsilon = 6000, 1.0
    for upper in (False, True):
        samples = [
            Counter(interval_end(d, 0.6, epsilon, 1.0, grid, 0.6, upper=upper, cut=0.2) for _ in range(n))
            for d in (d1, d2)
        ]
        outcomes = assert_counts_epsilon_dp(samples[0], samples[1], n, epsilon, upper)
        assert len(outcomes) > 3
