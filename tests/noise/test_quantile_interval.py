"""A quantile's value interval (#40 item 2): each end is an ε-DP report-noisy-max over the runs and a
sentinel bound, aiming E ranks beyond the quantile's rank; together they hold the exact
percentile_cont and percentile_disc with probability ≥ the level, on any data."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsql.noise.exponential import (
    QuantileGrid,
    interval_end,
    interval_reach,
    interval_utilities,
    quantile_grid,
)
from tests.dp_check import assert_counts_epsilon_dp


def _cells(values: np.ndarray, grid: QuantileGrid) -> dict[int, int]:
    """The histogram the SQL builds: values clamped to the bounds, binned, the upper bound in the last cell."""
    clamped = np.clip(values, grid.lower, grid.upper)
    if grid.integer:
        cells = (clamped - grid.lower).astype(int)
    else:
        cells = np.floor((clamped - grid.lower) * grid.cells / (grid.upper - grid.lower)).astype(int)
    return dict(Counter(np.minimum(cells, grid.cells - 1).tolist()))


_RNG = np.random.default_rng(40)
#: Data shaped unlike each other: dense, heavy-tailed with a mass at the bound, ties, tiny, one value.
DATASETS = {
    "normal": _RNG.normal(50, 10, 4000),
    "gamma-with-mass-at-bound": np.concatenate([_RNG.gamma(2.0, 8.0, 3000), np.full(240, 250.0)]),
    "one-decimal": np.round(_RNG.normal(26, 4, 2000), 1),
    "integers": _RNG.integers(0, 20, 1500).astype(float),
    "tiny": np.array([3.0, 9.0, 41.5, 77.0, 80.0]),
    "one-value": np.full(600, 42.0),
    "empty": np.array([], dtype=float),
}


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("integer", [False, True])
def test_interval_holds_the_exact_quantiles(name: str, integer: bool) -> None:
    """300 intervals per (data, q): each holds the exact percentile_cont and percentile_disc in ≥ 95%
    of draws (allowing the binomial spread of 300 draws: ≥ 90% per case, ≥ 95% over all cases)."""
    grid = quantile_grid(0.0, 100.0, True) if integer else quantile_grid(0.0, 100.0, False)
    values = np.clip(DATASETS[name], 0.0, 100.0)
    values = np.floor(values) if integer else values
    counts = _cells(values, grid)
    draws, held, total = 300, 0, 0
    for q in (0.1, 0.5, 0.9):
        exact = (
            [np.quantile(values, q, method="linear"), np.quantile(values, q, method="inverted_cdf")]
            if len(values)
            else []
        )
        covered = 0
        for _ in range(draws):
            low = interval_end(counts, q, 0.5, 2.0, grid, 0.95, upper=False)
            high = interval_end(counts, q, 0.5, 2.0, grid, 0.95, upper=True)
            assert grid.lower <= low <= grid.upper and grid.lower <= high <= grid.upper  # low > high: rare, both shown
            covered += all(low <= x <= high for x in exact)
        assert covered >= 0.9 * draws, (name, q, covered)
        held, total = held + covered, total + draws
    assert held >= 0.95 * total


def test_reach_is_public_and_shrinks_with_epsilon() -> None:
    grid = quantile_grid(0.0, 2000.0, False)
    assert interval_reach(1.0, 20.0, grid, 0.95) == pytest.approx(40.0 * math.log(512 / 0.025))
    assert interval_reach(2.0, 20.0, grid, 0.95) == pytest.approx(interval_reach(1.0, 20.0, grid, 0.95) / 2)
    small = quantile_grid(0.0, 100.0, True)  # 101 integers: one candidate per integer
    assert interval_reach(1.0, 1.0, small, 0.9) == pytest.approx(2.0 * math.log(101 / 0.05))


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.integers(0, 40), min_size=1, max_size=24),
    added=st.lists(st.integers(0, 23), min_size=0, max_size=5),
    q=st.sampled_from([0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]),
    reach=st.floats(0.0, 200.0),
    upper=st.booleans(),
    remove=st.booleans(),
)
def test_utilities_move_at_most_the_rows_a_unit_changes(
    runs: list[int], added: list[int], q: float, reach: float, upper: bool, remove: bool
) -> None:
    """One unit's rows (here up to 5, anywhere, added or removed) move every candidate's utility, the
    sentinel's included, by at most the number of rows: the sensitivity the noise is scaled to."""
    neighbour = list(runs)
    changed = 0
    for slot in added:
        index = slot % len(runs)
        if remove:
            if neighbour[index] == 0:
                continue
            neighbour[index] -= 1
        else:
            neighbour[index] += 1
        changed += 1
    before = interval_utilities(runs, q, reach, upper)
    after = interval_utilities(neighbour, q, reach, upper)
    assert len(before) == len(after) == len(runs) + 1
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) <= changed + 1e-9
    assert max(before) == pytest.approx(0.0)  # a candidate scoring 0 always exists (the bound if no run)


def test_each_end_is_epsilon_dp_on_neighbours() -> None:
    """Neighbouring histograms (one value added at the median) on 64 integer cells: every possible end,
    P₁ ≤ e^ε·P₂ both ways (Clopper–Pearson, Bonferroni over outcomes and directions)."""
    grid = QuantileGrid(0.0, 63.0, 64, True)
    d1 = {10: 3, 20: 4, 30: 2, 31: 1, 40: 2, 55: 1}
    d2 = {**d1, 30: 3}
    n, epsilon = 6000, 1.0
    for upper in (False, True):
        samples = [
            Counter(interval_end(d, 0.5, epsilon, 1.0, grid, 0.6, upper=upper) for _ in range(n)) for d in (d1, d2)
        ]
        outcomes = assert_counts_epsilon_dp(samples[0], samples[1], n, epsilon, upper)
        assert len(outcomes) > 3  # the ends do vary: the check is not vacuous
