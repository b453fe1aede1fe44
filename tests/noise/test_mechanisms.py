"""Calibration, release, accuracy and partition-threshold tests (against OpenDP and by simulation)."""

from __future__ import annotations

import math

import numpy as np
import opendp.prelude as dp
import pytest

from dpsql.noise.mechanisms import (
    NoiseSpec,
    cdp_delta,
    epsilon_to_rho,
    gaussian_spec,
    half_width,
    laplace_spec,
    noise_tail,
    partition_threshold,
    release,
    rho_to_epsilon,
    sample_noise,
    snap,
)

from ._stats import gauss_variance, laplace_variance

dp.enable_features("contrib")


# ------------------------------------------------------------------------------ zCDP <-> (ε, δ)


@pytest.mark.parametrize("sigma", [0.4, 1.0, 2.0, 5.0, 30.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-9, 1e-12])
def test_rho_to_epsilon_matches_opendp(sigma: float, delta: float) -> None:
    gauss = dp.m.make_gaussian(dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float), scale=sigma)
    rho = gauss.map(1.0)
    expected = dp.c.make_zCDP_to_approxDP(gauss).map(1.0).epsilon(delta)
    assert rho_to_epsilon(rho, delta) == pytest.approx(expected, rel=5e-4)  # 3 significant digits
    assert rho_to_epsilon(rho, delta) >= expected * (1 - 1e-9)  # never optimistic beyond round-off


@pytest.mark.parametrize("epsilon", [0.05, 0.5, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
def test_epsilon_to_rho_inverts_and_is_conservative(epsilon: float, delta: float) -> None:
    rho = epsilon_to_rho(epsilon, delta)
    assert cdp_delta(rho, epsilon) <= delta
    assert rho_to_epsilon(rho, delta) == pytest.approx(epsilon, rel=1e-9)
    assert rho < epsilon**2 / 2 or epsilon > 5  # zCDP→DP always costs something at small δ


def test_conversion_monotonic() -> None:
    rhos = [0.001, 0.01, 0.1, 1.0]
    eps = [rho_to_epsilon(r, 1e-6) for r in rhos]
    assert eps == sorted(eps)
    assert rho_to_epsilon(0.1, 1e-9) > rho_to_epsilon(0.1, 1e-3)


# -------------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("sens,eps", [(1, 1.0), (3, 0.5), (2, 0.1)])
def test_integer_laplace_spec_matches_opendp(sens: int, eps: float) -> None:
    spec = laplace_spec(sens, eps, integer=True)
    assert (spec.mechanism, spec.grid, spec.delta, spec.rho) == ("laplace", 1.0, 0.0, None)
    meas = dp.m.make_laplace(dp.atom_domain(T=int), dp.absolute_distance(T=int), scale=spec.scale)
    assert meas.map(sens) == pytest.approx(eps, rel=1e-9)


@pytest.mark.parametrize("sens,eps", [(1.0, 1.0), (3.5, 0.5), (1e6, 0.1), (0.01, 10.0)])
def test_real_laplace_spec_grid_and_sensitivity(sens: float, eps: float) -> None:
    spec = laplace_spec(sens, eps, integer=False)
    mantissa, _ = math.frexp(spec.grid)
    assert mantissa == 0.5  # power of two
    assert spec.grid <= min(sens, sens / eps) / 2**10
    assert spec.scale >= (math.ceil(sens / spec.grid) + 1) / eps
    assert spec.scale * eps * spec.grid <= sens * 1.01  # rounding costs < 1% extra noise


def test_gaussian_spec_matches_opendp_conversion() -> None:
    spec = gaussian_spec(2.0, 1.0, 1e-6, integer=True)
    assert spec.rho == pytest.approx(epsilon_to_rho(1.0, 1e-6))
    meas = dp.m.make_gaussian(dp.atom_domain(T=int), dp.absolute_distance(T=float), scale=spec.scale)
    assert meas.map(2.0) == pytest.approx(spec.rho, rel=1e-9)
    eps = dp.c.make_zCDP_to_approxDP(meas).map(2.0).epsilon(1e-6)
    assert eps == pytest.approx(1.0, rel=1e-6)
    real = gaussian_spec(2.0, 1.0, 1e-6, integer=False, cells=4)
    assert real.scale * real.grid >= spec.scale  # never less noise than the integer calibration


def test_zero_sensitivity_is_released_exactly() -> None:
    """A query of sensitivity 0 has one value on all neighbours: exact release is 0-DP."""
    for spec in (laplace_spec(0, 1.0, integer=True), gaussian_spec(0, 1.0, 1e-6, integer=False)):
        assert spec.scale == 0 and half_width(spec) == 0.0
        assert release([0, 0, 0], spec).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: laplace_spec(-1, 1.0, integer=True),
        lambda: laplace_spec(1, 0.0, integer=True),
        lambda: laplace_spec(1, math.inf, integer=False),
        lambda: gaussian_spec(1, 1.0, 0.0, integer=True),
        lambda: gaussian_spec(1, 1.0, 1.0, integer=True),
    ],
)
def test_spec_rejects_bad_parameters(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


# ------------------------------------------------------------------------------------------ release


def test_release_integer_shapes_and_types() -> None:
    spec = laplace_spec(1, 1.0, integer=True)
    out = release([10, 20, 30], spec)
    assert out.dtype == np.int64 and out.shape == (3,)
    table = release(np.zeros((4, 5), dtype=np.int64), spec)
    assert table.shape == (4, 5)
    assert release(np.array([2.6, -2.5]), laplace_spec(1, 1e9, integer=True)).tolist() == [3, -2]


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_release_on_real_grid_gives_exact_multiples(mechanism: str) -> None:
    spec = (
        laplace_spec(3.3, 0.7, integer=False)
        if mechanism == "laplace"
        else gaussian_spec(3.3, 0.7, 1e-6, integer=False)
    )
    values = np.array([0.1, 1 / 3, math.pi * 1e5, -2.718281828, 1e-9] * 200)
    out = release(values, spec)
    assert out.dtype == np.float64
    units = out / spec.grid
    assert np.array_equal(units, np.rint(units))  # exact multiples of the grid
    assert np.all(np.mod(out, spec.grid) == 0)
    assert np.abs(out - values).max() < 60 * spec.scale * spec.grid


def test_release_refuses_nan_and_clips_infinities() -> None:
    spec = laplace_spec(1.0, 1.0, integer=False)
    with pytest.raises(ValueError):
        release([math.nan], spec)
    out = release([math.inf, -math.inf], spec)
    assert np.all(np.isfinite(out))


def test_snap() -> None:
    assert snap([0.3, 0.7, -1.26], 0.5).tolist() == [0.5, 0.5, -1.5]


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_count_rmse_at_epsilon_one(mechanism: str) -> None:
    """RMSE of a released count at ε=1 matches the exact noise variance within 5%.

    20,000 draws (not 2,000): with Laplace kurtosis 6 the RMSE estimate from 2,000 draws has a 2.5%
    standard error, so a 5% band would fail ~5% of runs; here the band is ~6 standard errors.
    """
    spec = laplace_spec(1, 1.0, integer=True) if mechanism == "laplace" else gaussian_spec(1, 1.0, 1e-6, integer=True)
    true = 1234
    out = release(np.full(20_000, true), spec)
    rmse = float(np.sqrt(np.mean((out - true) ** 2.0)))
    theory = math.sqrt(laplace_variance(spec.scale) if mechanism == "laplace" else gauss_variance(spec.scale))
    assert rmse == pytest.approx(theory, rel=0.05)
    assert abs(float(np.mean(out - true))) < 5 * theory / math.sqrt(out.size)


# -------------------------------------------------------------------------------------- half width


@pytest.mark.parametrize(
    "spec",
    [laplace_spec(1, 0.1, integer=True), NoiseSpec("gaussian", 30.0, 1.0, 1.0, 1e-6, 0.01)],
    ids=["laplace-b10", "gaussian-s30"],
)
def test_half_width_coverage(spec: NoiseSpec) -> None:
    h = int(half_width(spec, 0.95))
    exact = 1.0 - 2.0 * noise_tail(spec, h + 1)
    assert exact >= 0.95 > 1.0 - 2.0 * noise_tail(spec, h)  # smallest covering integer
    z = sample_noise(spec, 20_000)
    coverage = float(np.mean(np.abs(z) <= h))
    assert abs(coverage - 0.95) <= 0.01
    assert abs(coverage - exact) <= 5 * math.sqrt(exact * (1 - exact) / z.size)


def test_half_width_closed_form_laplace() -> None:
    spec = laplace_spec(1, 1.0, integer=True)
    alpha = math.exp(-1.0)
    # P(|Z| >= k) = 2α^k/(1+α): k=3 gives 0.0728 > 5%, k=4 gives 0.0268 ≤ 5%  ⇒  half width 3
    assert half_width(spec) == 3.0
    assert 2 * alpha**4 / (1 + alpha) <= 0.05 < 2 * alpha**3 / (1 + alpha)
    assert half_width(spec, 0.99) > half_width(spec, 0.95) > half_width(spec, 0.5)
    real = laplace_spec(1.0, 1.0, integer=False)
    assert half_width(real) / real.grid == float(int(half_width(real) / real.grid))


def test_half_width_gaussian_large_sigma_bound_is_tight() -> None:
    small = NoiseSpec("gaussian", 2.0e4, 1.0, 1.0, 1e-6, 1e-9)  # table path
    large = NoiseSpec("gaussian", 2.0e4 + 1.0, 1.0, 1.0, 1e-6, 1e-9)  # normal-bound path
    assert half_width(small) <= half_width(large) <= half_width(small) + 3
    assert half_width(large) == pytest.approx(1.959964 * 2.0e4, rel=1e-4)


# ------------------------------------------------------------------------------ partition threshold


@pytest.mark.parametrize(
    "spec",
    [laplace_spec(1, 1.0, integer=True), gaussian_spec(1, 1.0, 1e-6, integer=True)],
    ids=["laplace", "gaussian"],
)
def test_partition_threshold_release_probability(spec: NoiseSpec) -> None:
    delta = 1e-2
    tau = partition_threshold(spec, delta)
    assert noise_tail(spec, tau - 1) <= delta < noise_tail(spec, tau - 2)  # exact and smallest
    n = 100_000
    released = float(np.mean(release(np.ones(n, dtype=np.int64), spec) >= tau))
    assert released <= delta + 4 * math.sqrt(delta / n)
    p = noise_tail(spec, tau - 1)
    assert abs(released - p) <= 5 * math.sqrt(p / n) + 1e-4


def test_partition_threshold_laplace_formula() -> None:
    spec = laplace_spec(1, 1.0, integer=True)
    alpha = math.exp(-1.0)
    for delta in (1e-2, 1e-6, 1e-12):
        tau = partition_threshold(spec, delta)
        j = tau - 1
        assert alpha**j / (1 + alpha) <= delta < alpha ** (j - 1) / (1 + alpha)


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_partition_threshold_monotonic(mechanism: str) -> None:
    def spec(eps: float) -> NoiseSpec:
        if mechanism == "laplace":
            return laplace_spec(1, eps, integer=True)
        return gaussian_spec(1, eps, 1e-6, integer=True)

    base = spec(1.0)
    deltas = [1e-1, 1e-2, 1e-4, 1e-6, 1e-9, 1e-12]
    taus = [partition_threshold(base, d) for d in deltas]
    assert taus == sorted(taus)
    assert partition_threshold(base, 1e-6, max_partitions=10) >= partition_threshold(base, 1e-6)
    assert partition_threshold(base, 1e-6, max_rows=5) == partition_threshold(base, 1e-6) + 4
    by_eps = [partition_threshold(spec(e), 1e-6) for e in (4.0, 1.0, 0.25, 0.05)]
    assert by_eps == sorted(by_eps)
    with pytest.raises(ValueError):
        partition_threshold(laplace_spec(1.0, 1.0, integer=False), 1e-6)
