"""Quantiles on an adapted grid (exact integers) and in two exponential-mechanism stages.

Accuracy figures on the health demo at ε = 1 (200 releases, mean absolute error; before → after):
median(age) 0.0996 → 0, p90(age) 0.0215 → 0, MIN(age) 1.0 → 0, MAX(age) 1.03 → 0.98,
median(bmi) p95 error 0.0031 → 0.0002 (MAE 0.0031 → 0.0003–0.003: a heavy tail of runs one run
off) (``bench/quantiles.py``; PipelineDP's quantile tree: 0.0006 on age).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from scipy.stats import beta

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine, Prepared
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.noise.exponential import (
    FINE_CELLS,
    QUANTILE_BINS,
    QuantileGrid,
    quantile_grid,
    quantile_rank_error,
    select_quantile,
)
from dpsql.policy import load_policy, parse_policy
from dpsql.session import Session

POLICY = """
dataset: clipped
budget: {dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}
analysts: [{name: alice}]
tables:
  t:
    columns:
      x: {type: int, lower: 0, upper: 100, nullable: false}
      y: {type: float, lower: 0.0, upper: 100.0, nullable: false}
      w: {type: int, lower: 0, upper: 1000000, nullable: false}
"""


def _releases(engine: Engine, sql: str, epsilon: float, runs: int) -> list[float]:
    """``runs`` released values of ``sql`` over one measurement (the mechanism's distribution)."""
    prepared: Prepared = engine.prepare(sql, Session("alice", epsilon=epsilon))
    rows = engine.step.query(prepared.sql)
    histograms = {i: engine.step.query(q) for i, q in prepared.histograms}
    return [engine.step.release_rows(prepared, rows, 0.95, histograms).rows[0][0] for _ in range(runs)]


# ------------------------------------------------------------------------------ the grid


def test_grid_follows_the_bounds_resolution() -> None:
    age = quantile_grid(0.0, 110.0, True)
    assert (age.cells, age.integer, age.stride) == (111, True, 1)
    assert [age.value(0), age.value(58), age.value(110)] == [0.0, 58.0, 110.0]
    wide = quantile_grid(0.0, 2000.0, True)  # 2001 integers: runs of 4, still exact integers
    assert (wide.cells, wide.integer, wide.stride, wide.runs) == (2001, True, 4, 501)
    huge = quantile_grid(0.0, 1e6, True)
    assert (huge.cells, huge.integer, huge.stride, huge.runs) == (FINE_CELLS, False, 128, QUANTILE_BINS)
    bmi = quantile_grid(12.0, 60.0, False)
    assert (bmi.cells, bmi.integer) == (FINE_CELLS, False)
    assert bmi.value(0) == pytest.approx(12.0 + 48 / FINE_CELLS / 2) and bmi.value(FINE_CELLS - 1) < 60.0


def test_rank_error_bound_is_one_mechanism_over_the_cells() -> None:
    grid = quantile_grid(0.0, 1.0, False)
    one_stage = quantile_rank_error(1.0, 1.0, quantile_grid(0.0, 100.0, True))
    assert one_stage == pytest.approx(2.0 * math.log(101 / 0.05))
    every_cell = quantile_rank_error(1.0, 1.0, grid)  # was 78.3 in two stages (512 runs, then 384 cells)
    assert every_cell == pytest.approx(2.0 * math.log(FINE_CELLS / 0.05))
    assert quantile_rank_error(1.0, 1.0, grid, extreme=True) == pytest.approx(2.0 * math.log(512 / 0.05))


# ------------------------------------------------------------------------------ accuracy


@pytest.fixture(scope="module")
def health() -> Iterator[tuple[Engine, Backend]]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    yield Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:")), backend
    backend.close()


@pytest.mark.parametrize(
    ("sql", "exact"),
    [
        ("SELECT median(age) FROM patients", "SELECT quantile_cont(age, 0.5) FROM patients"),
        (
            "SELECT percentile_disc(0.9) WITHIN GROUP (ORDER BY age) FROM patients",
            "SELECT quantile_disc(age, 0.9) FROM patients",
        ),
        ("SELECT MIN(age) FROM patients", "SELECT min(age) FROM patients"),
    ],
)
def test_int_column_quantiles_are_exact_integers(health: tuple[Engine, Backend], sql: str, exact: str) -> None:
    """On 111 integer cells the value is the integer itself: exact in (nearly) every release at ε = 1
    (before: a 1/512 bin's centre, wrong by 0.0996 for the median every time)."""
    engine, backend = health
    truth = backend.execute(exact)[1][0][0]
    values = _releases(engine, sql, 1.0, 100)
    assert all(float(v).is_integer() for v in values)
    assert sum(v == truth for v in values) >= 95


def test_float_median_is_refined_inside_the_bin(health: tuple[Engine, Backend]) -> None:
    """bmi on [12, 60]: 0.0031 off every time with the bin's centre; refined, ~95% within 0.0002 at a value
    share of ε = 1 (the query's ε = 3: a third each for the value and the two ends of its interval). bmi
    has one decimal: at a share of 1/3 about half the releases land between 26.3 and 26.4 (the empty
    cells there outweigh the one cell holding 26.3), yet 7× closer than the two stages were at 1/3."""
    engine, backend = health
    truth = backend.execute("SELECT quantile_cont(bmi, 0.5) FROM patients")[1][0][0]
    values = _releases(engine, "SELECT median(bmi) FROM patients", 3.0, 200)
    assert sum(abs(v - truth) < 0.001 for v in values) >= 0.8 * len(values)


@pytest.mark.parametrize("runs", [30, pytest.param(100, marks=pytest.mark.heavy)])
def test_dense_median_within_a_tenth_of_a_percent_of_the_range(runs: int) -> None:
    """100,000 values uniform on [100, 700], bounds [0, 1000]: MAE was 0.78 (half a 512-bin), now ~0.02–0.04.
    Each release costs ~0.23 s of CPU: the default tier averages 30 (``-m heavy``: the former 100). Measured
    over 100 releases: MAE 0.037, errors' sd 0.042, so the mean of 30 has sd ~0.008 and the bound 0.1 sits 8 sd
    above it; the regression it guards against (MAE 0.78) fails either size with certainty."""
    backend = open_backend("duckdb://")
    backend.execute_script(
        "CREATE TABLE t AS SELECT 0 AS x, (hash(i) % 1000000) / 1000.0 * 0.6 + 100 AS y, 0 AS w FROM range(100000) r(i)"
    )
    policy = parse_policy(POLICY.replace("upper: 100.0", "upper: 1000.0"))
    engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
    truth = backend.execute("SELECT quantile_cont(y, 0.5) FROM t")[1][0][0]
    values = _releases(engine, "SELECT median(y) FROM t", 1.0, runs)
    assert statistics.fmean(abs(v - truth) for v in values) < 0.1
    backend.close()


@pytest.mark.parametrize(
    ("dataset", "sql", "exact"),
    [
        # person-level (20 visits per patient): the exact p90 of the rows the policy keeps, cost clamped to
        # [0, 2000] (the three heavy patients' visits are all 4,999: any 20 of them are the same values)
        (
            "clinic",
            "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY cost) FROM visits",
            "SELECT quantile_cont(LEAST(GREATEST(cost, 0), 2000), 0.9) FROM (SELECT cost, row_number() OVER "
            "(PARTITION BY patient_id ORDER BY id) AS k FROM visits) WHERE k <= 20",
        ),
        ("health", "SELECT percentile_disc(0.25) WITHIN GROUP (ORDER BY bmi) FROM patients",
         "SELECT quantile_disc(bmi, 0.25) FROM patients"),
    ],
)  # fmt: skip
def test_value_interval_covers_the_exact_quantile(dataset: str, sql: str, exact: str) -> None:
    """#40 item 2: 100 releases at ε = 1; the printed 95% interval holds the exact quantile in ≥ 95%
    (≥ 90 of 100 allows the binomial spread; the bound is conservative: all 100 in practice)."""
    backend = open_backend("duckdb://")
    load_demo(backend, [dataset])
    engine = Engine(load_policy(demo_policy_path(dataset)), backend, Ledger.open("sqlite:///:memory:"))
    truth = float(backend.execute(exact)[1][0][0])
    prepared = engine.prepare(sql, Session("alice", epsilon=1.0))
    rows = engine.step.query(prepared.sql)
    histograms = {i: engine.step.query(q) for i, q in prepared.histograms}
    held = 0
    for _ in range(100):
        result = engine.step.release_rows(prepared, rows, 0.95, histograms)
        low, high = result.intervals[0][0] or (math.inf, -math.inf)
        held += low <= truth <= high
        note = next(n for n in result.notices if n.startswith("dpsql: percentile_"))
        assert note.startswith(f"dpsql: percentile_{'cont' if 'cont' in sql else 'disc'}: between "), note
    backend.close()
    assert held >= 90, held


def test_max_of_data_ending_at_60_stays_in_the_data() -> None:
    """Data on [0, 60], bounds [0, 100], ε/3: MAX lands above the data in at most a few % of runs."""
    backend = open_backend("duckdb://")
    backend.execute_script(
        "CREATE TABLE t AS SELECT i % 61 AS x, (i * 6 % 6001) / 100.0 AS y, i AS w FROM range(1000) r(i)"
    )
    engine = Engine(parse_policy(POLICY), backend, Ledger.open("sqlite:///:memory:"))
    for column in ("x", "y"):
        values = _releases(engine, f"SELECT MAX({column}) FROM t", 1.0 / 3, 200)
        assert sum(v > 61 for v in values) <= 10, column
        assert statistics.fmean(values) > 55, column
    backend.close()


def test_explain_names_the_grid(health: tuple[Engine, Backend]) -> None:
    engine, _ = health
    lines = engine.explain("SELECT median(age), median(bmi), MAX(bmi) FROM patients", Session("alice")).columns
    assert "over 111 integers" in lines[0]["measure"]
    assert "over 65536 cells; its 95% value interval: one more for each end, over 512 runs" in lines[1]["measure"]
    assert "over 111 integers; its 95% value interval: one more for each end, over 111 integers" in lines[0]["measure"]
    assert "grouped in 512 runs" in lines[2]["measure"]
    assert all(line["rank_error95"] > 0 for line in lines)


# ------------------------------------------------------------------------------ privacy


def _probability_ratios_hold(sample: Callable[[dict[int, int]], float], n: int, epsilon: float) -> None:
    """Neighbouring histograms (one value added near the median): for each cell of a coarse partition
    of the outputs, P₁ ≤ e^ε·P₂ both ways (Clopper–Pearson, Bonferroni over outcomes and directions)."""
    grid = quantile_grid(0.0, 1.0, False)
    d1 = {30000: 3, 32768: 2, 32800: 1, 33000: 2, 40000: 1, 50000: 2}
    d2 = {**d1, 32790: 1}  # one more value, between the two middle ones
    edges = [0.45, 0.49, 0.4995, 0.5003, 0.501, 0.51, 0.6]  # coarse partition, finer where the mass is

    def part(value: float) -> int:
        return sum(value > e for e in edges)

    samples = [Counter(part(sample(d)) for _ in range(n)) for d in (d1, d2)]
    outcomes = len(edges) + 1
    alpha = 0.001 / (2 * outcomes)
    for outcome in range(outcomes):
        for a, b in ((samples[0], samples[1]), (samples[1], samples[0])):
            k_a, k_b = a[outcome], b[outcome]
            if k_a == 0:
                continue
            low_a = beta.ppf(alpha, k_a, n - k_a + 1)
            high_b = beta.ppf(1 - alpha, k_b + 1, n - k_b) if k_b < n else 1.0
            assert low_a <= math.exp(epsilon) * high_b, (outcome, k_a, k_b)
    assert grid.stride > 1  # the every-cell path (blocks of empty cells) was the one sampled


def test_every_cell_mechanism_is_epsilon_dp_on_neighbours() -> None:
    grid = quantile_grid(0.0, 1.0, False)
    _probability_ratios_hold(lambda d: select_quantile(d, 0.5, 1.0, 1.0, grid), 1500, 1.0)


@pytest.mark.heavy
def test_every_cell_mechanism_is_epsilon_dp_on_neighbours_heavy() -> None:
    grid = quantile_grid(0.0, 1.0, False)
    _probability_ratios_hold(lambda d: select_quantile(d, 0.5, 1.0, 1.0, grid), 20000, 1.0)


def test_integer_cells_are_epsilon_dp_on_neighbours() -> None:
    """The one-stage path over exact integers: same check, partition = the integers themselves."""
    grid = QuantileGrid(0.0, 7.0, 8, True)
    d1, d2 = {0: 3, 2: 4, 3: 2, 6: 1}, {0: 3, 2: 4, 3: 3, 6: 1}
    n, epsilon = 8000, 1.0
    samples = [Counter(select_quantile(d, 0.5, epsilon, 1.0, grid) for _ in range(n)) for d in (d1, d2)]
    alpha = 0.001 / 16
    for outcome in range(8):
        for a, b in ((samples[0], samples[1]), (samples[1], samples[0])):
            k_a, k_b = a[float(outcome)], b[float(outcome)]
            if k_a:
                high_b = beta.ppf(1 - alpha, k_b + 1, n - k_b) if k_b < n else 1.0
                assert beta.ppf(alpha, k_a, n - k_a + 1) <= math.exp(epsilon) * high_b
    assert samples[0].most_common(1)[0][0] == 2.0


def test_refusals_unchanged() -> None:
    engine = Engine(parse_policy(POLICY), open_backend("duckdb://"), Ledger.open("sqlite:///:memory:"))
    with pytest.raises(Error) as info:
        engine.prepare("SELECT percentile_disc(2) WITHIN GROUP (ORDER BY x) FROM t", Session("alice"))
    assert (info.value.sqlstate, info.value.message) == ("22023", "percentile value must be a constant between 0 and 1")
