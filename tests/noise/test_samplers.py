"""Statistical and hygiene tests of the CSPRNG integer samplers against their exact pmfs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import opendp.prelude as dp
import pytest
from scipy import stats

from dpsql.noise.samplers import BULK_THRESHOLD, discrete_gaussian, discrete_laplace, laplace_rational_scale

from ._stats import (
    P_MIN,
    dgauss_pmf,
    dlap_pmf,
    gauss_variance,
    gof_pvalue,
    laplace_variance,
)

dp.enable_features("contrib")

SCALES = [0.5, 1.0, 3.7, 50.0]
Sampler = Callable[[float, int], np.ndarray]
SAMPLERS: dict[str, Sampler] = {"laplace": discrete_laplace, "gaussian": discrete_gaussian}


def small_path(sampler: Sampler, scale: float, n: int) -> np.ndarray:
    """Draw ``n`` samples through the scalar (small-size) path only."""
    chunk = BULK_THRESHOLD
    parts = [sampler(scale, min(chunk, n - i)) for i in range(0, n, chunk)]
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------- pmf


@pytest.mark.parametrize("scale", SCALES)
def test_exact_pmfs_sum_to_one(scale: float) -> None:
    k = np.arange(-math.ceil(80 * scale) - 10, math.ceil(80 * scale) + 11)
    assert dlap_pmf(scale, k).sum() == pytest.approx(1.0, abs=1e-12)
    assert dgauss_pmf(scale, k).sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("scale", [*SCALES, 1e-3, 1e6, 2.0**50])
def test_rational_scale_rounds_up_by_a_hair(scale: float) -> None:
    t, s = laplace_rational_scale(scale)
    assert s & (s - 1) == 0  # power of two
    assert t / s >= scale
    assert (t / s - scale) / scale <= 2.0**-39


# ------------------------------------------------------------------------------------ goodness of fit


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", SCALES)
def test_bulk_path_fits_exact_pmf(mechanism: str, scale: float) -> None:
    samples = SAMPLERS[mechanism](scale, 200_000)
    assert samples.dtype == np.int64
    assert gof_pvalue(samples, mechanism, scale) > P_MIN


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", SCALES)
def test_small_path_fits_exact_pmf(mechanism: str, scale: float) -> None:
    samples = small_path(SAMPLERS[mechanism], scale, 6_000)
    assert gof_pvalue(samples, mechanism, scale) > P_MIN


@pytest.mark.heavy
@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", [*SCALES, 0.3, 12.25, 1000.0])
def test_bulk_path_fits_exact_pmf_heavy(mechanism: str, scale: float) -> None:
    samples = SAMPLERS[mechanism](scale, 3_000_000)
    assert gof_pvalue(samples, mechanism, scale) > P_MIN


@pytest.mark.heavy
@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", SCALES)
def test_small_path_fits_exact_pmf_heavy(mechanism: str, scale: float) -> None:
    samples = small_path(SAMPLERS[mechanism], scale, 100_000)
    assert gof_pvalue(samples, mechanism, scale) > P_MIN


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_negative_control_rejects_wrong_scale(mechanism: str, scale: float) -> None:
    """The test has power: draws at 1.1× the scale are rejected decisively."""
    samples = SAMPLERS[mechanism](1.1 * scale, 200_000)
    assert gof_pvalue(samples, mechanism, scale) < 1e-6


# ---------------------------------------------------------------------------------- moments / bias


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("scale", SCALES)
def test_unbiased_and_variance_matches_theory(mechanism: str, scale: float) -> None:
    n = 200_000
    x = SAMPLERS[mechanism](scale, n).astype(np.float64)
    var = laplace_variance(scale) if mechanism == "laplace" else gauss_variance(scale)
    assert abs(x.mean()) < 5 * math.sqrt(var / n)
    kurt = 6.0 if mechanism == "laplace" else 3.0  # upper bounds of E Z^4 / (E Z^2)^2 here
    assert abs((x * x).mean() / var - 1.0) < 5 * math.sqrt((kurt - 1.0) / n)


# ------------------------------------------------------------------------------------ vs OpenDP 0.16


def test_opendp_laplace_has_the_same_distribution() -> None:
    """OpenDP's discrete Laplace fits our pmf and is indistinguishable from our sampler."""
    scale = 3.7
    meas = dp.m.make_laplace(dp.vector_domain(dp.atom_domain(T=int)), dp.l1_distance(T=int), scale=scale)
    theirs = np.asarray(meas([0] * 15_000), dtype=np.int64)
    assert gof_pvalue(theirs, "laplace", scale) > P_MIN
    ours = discrete_laplace(scale, 15_000)
    _assert_same_distribution(theirs, ours)


def test_opendp_gaussian_has_the_same_distribution() -> None:
    sigma = 3.7
    meas = dp.m.make_gaussian(dp.vector_domain(dp.atom_domain(T=int)), dp.l2_distance(T=float), scale=sigma)
    theirs = np.asarray(meas([0] * 15_000), dtype=np.int64)
    assert gof_pvalue(theirs, "gaussian", sigma) > P_MIN
    ours = discrete_gaussian(sigma, 15_000)
    _assert_same_distribution(theirs, ours)


def _assert_same_distribution(a: np.ndarray, b: np.ndarray) -> None:
    edges = np.unique(np.quantile(np.concatenate([a, b]), np.linspace(0, 1, 21)[1:-1]))
    ca = np.bincount(np.searchsorted(edges, a, side="right"), minlength=edges.size + 1)
    cb = np.bincount(np.searchsorted(edges, b, side="right"), minlength=edges.size + 1)
    table = np.vstack([ca, cb])
    table = table[:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > P_MIN


# ------------------------------------------------------------------------------------------- hygiene


@pytest.mark.parametrize("size", [1, 5, 1_000])
@pytest.mark.parametrize("sampler", [discrete_laplace, discrete_gaussian])
def test_no_python_or_numpy_prng_state(sampler: Sampler, size: int) -> None:
    """Seeding `random`/`numpy.random` neither reproduces outputs nor is their state touched."""
    draws = []
    for _ in range(3):
        random.seed(1234)
        np.random.seed(1234)
        py_state, np_state = random.getstate(), np.random.get_state()
        draws.append(np.concatenate([sampler(1e6, size) for _ in range(3)]))
        assert random.getstate() == py_state
        after = np.random.get_state()
        assert isinstance(after, tuple) and isinstance(np_state, tuple)  # the legacy form (numpy's default)
        assert np.array_equal(after[1], np_state[1]) and after[2] == np_state[2]
    assert not np.array_equal(draws[0], draws[1]) or not np.array_equal(draws[1], draws[2])


@pytest.mark.parametrize("sampler", [discrete_laplace, discrete_gaussian])
def test_shapes_and_argument_checks(sampler: Sampler) -> None:
    assert sampler(2.0, 0).shape == (0,)
    assert sampler(2.0, 3).dtype == np.int64
    assert sampler(2.0, 100).shape == (100,)
    for bad_scale in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            sampler(bad_scale, 3)
    with pytest.raises(ValueError):
        sampler(1.0, -1)


def test_speed_budget() -> None:
    """Generous bounds: 10^6 Laplace draws and single draws stay cheap. The process's CPU time, not the
    wall clock, so other work on shared CI cores (other tests, other workers) does not fail it."""
    import time

    start = time.process_time()
    discrete_laplace(3.7, 1_000_000)
    assert time.process_time() - start < 6.0
    start = time.process_time()
    for _ in range(2_000):
        discrete_laplace(3.7, 1)
    assert (time.process_time() - start) / 2_000 < 200e-6
