"""Noise calibration, release, accuracy and partition-selection thresholds.

Every released value is ``grid · (round(x / grid) + Z)`` with ``Z`` exact integer noise from
``samplers`` and ``grid`` a power of two (1 for integer aggregates, unless their noise scale would
exceed what the samplers draw exactly, see ``_MAX_INTEGER_SCALE``).  ``round(x / grid)`` is computed
exactly (float division by a power of two, or exact rationals for wide integers and decimals) and
``k + Z`` is exact integer arithmetic (Python integers once it leaves the int64-safe range), so the
output depends on the data only through the integer ``round(x / grid)``; converting that noisy
integer to float afterwards is post-processing.  This closes Mironov's floating-point side channel
(noise on a grid, exact sampler, no data-dependent float rounding before the noise).  Snapping can
move two neighbouring inputs one extra grid step apart per affected cell, which the calibration adds
to the sensitivity.

All functions here are pure and cheap (results cached by their hashable arguments), except
``release``/``release_many``/``sample_noise`` which draw from the OS CSPRNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from statistics import NormalDist
from typing import Protocol

import numpy as np

from dpsql.accountant import Cost, cdp_delta, epsilon_to_rho, rho_to_epsilon
from dpsql.noise.names import Mechanism, mechanism_names
from dpsql.noise.samplers import (
    _MAX_SCALE,
    discrete_gaussian,
    discrete_laplace,
    discrete_laplace_many,
    laplace_rational_scale,
)

__all__ = [
    "MECHANISMS",
    "Mechanism",
    "NoiseMechanism",
    "NoiseSpec",
    "Split",
    "cdp_delta",
    "check_samplable",
    "epsilon_to_rho",
    "exact_spec",
    "gaussian_spec",
    "half_width",
    "laplace_spec",
    "mechanism_named",
    "mechanism_names",
    "mechanism_of",
    "noise_tail",
    "partition_threshold",
    "release",
    "release_many",
    "rho_to_epsilon",
    "sample_noise",
    "sample_noise_many",
    "snap",
]

#: Real-valued grids are at most this fraction of min(sensitivity, noise scale): rounding then costs
#: ≤ 2^-10 relative sensitivity (per affected cell) and ≤ 2^-11 scale of extra error.
GRID_BITS = 10
#: Above this σ the discrete-Gaussian tails come from a conservative normal bound instead of a table.
_GAUSS_TABLE_MAX_SIGMA = 2.0e4
#: Grid units up to this stay on the int64 fast path (|k + Z| far inside int64); beyond, Python ints.
_INT64_SAFE_UNITS = 2**52
#: |round(x/grid)| is clipped here (only ±inf and absurd magnitudes reach it; clipping is a monotone
#: contraction, so it never increases sensitivity) so that float(k + Z)·grid stays finite for grid ≤ 1.
_MAX_GRID_UNITS = 2**1000
#: Integer aggregates use grid 1 while their noise scale (b or σ, grid units) is at most this; beyond,
#: a power-of-two grid ≥ 1 chosen from the sensitivity and ε (public, never from the data) keeps the
#: scale inside what the exact samplers draw (2^50 for discrete Laplace, 2^44 for the Gaussian).
_MAX_INTEGER_SCALE = 2.0**44


@dataclass(frozen=True)
class NoiseSpec:
    """A calibrated noise distribution.

    ``scale`` is the discrete-Laplace scale b or the discrete-Gaussian σ, in grid units; the noise
    added to a value is ``grid · Z``.  ``epsilon``/``delta`` is the (ε, δ)-DP guarantee of one release
    at the sensitivity the spec was built for; ``rho`` is the zCDP ρ for Gaussian specs (``None`` for
    Laplace, which is pure ε-DP and has ``delta == 0``).
    """

    mechanism: Mechanism
    scale: float
    grid: float
    epsilon: float
    delta: float
    rho: float | None = None


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def _probability(name: str, value: float) -> float:
    v = float(value)
    if not (0.0 < v < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def _pow2_floor(x: float) -> float:
    """Largest power of two ≤ x (x > 0)."""
    _mantissa, e = math.frexp(x)  # x = m·2^e with 0.5 <= m < 1
    return math.ldexp(1.0, e - 1)


def _real_grid(*quantities: float) -> float:
    return _pow2_floor(min(quantities) / 2**GRID_BITS)


def _integer_grid(sensitivity: float, scale: float) -> float:
    """Grid for an integer aggregate: 1, or the real-valued grid (≥ 1) when ``scale`` is too large."""
    if scale <= _MAX_INTEGER_SCALE:
        return 1.0
    return max(1.0, _real_grid(sensitivity, scale))


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------


def exact_spec(mechanism: Mechanism, epsilon: float) -> NoiseSpec:
    """No noise, for a query of sensitivity 0 (``SUM(x * 0)``): its value is the same on every pair of
    neighbouring databases, so releasing it exactly is 0-DP. Grid 1: such a sum is exactly 0."""
    return NoiseSpec(mechanism, 0.0, 1.0, epsilon, 0.0, None)


def check_samplable(spec: NoiseSpec) -> None:
    """Raise ``ValueError`` unless the exact samplers can draw ``spec``'s noise (scale ≤ 2^50 grid units
    for Laplace, σ ≤ 2^44 for Gaussian): checked at calibration, before any budget is charged."""
    limit = mechanism_of(spec).max_scale
    if not spec.scale <= limit:
        raise ValueError(f"noise scale {spec.scale:.4g} grid units exceeds the exact samplers' maximum {limit:.4g}")


def laplace_spec(l1_sensitivity: float, epsilon: float, *, integer: bool, cells: int = 1) -> NoiseSpec:
    """Discrete-Laplace noise giving ε-DP for a query of L1 sensitivity Δ.

    Integer aggregates: grid 1, scale ⌈Δ⌉/ε (an integer-valued query changes by an integer ≤ Δ); when
    that scale exceeds 2^44 (huge declared bounds) they are treated like real aggregates, on a grid
    g ≥ 1.  Real aggregates: grid g = largest power of two ≤ min(Δ, Δ/ε)/2^10.  Snapped neighbours satisfy
    |round(x/g) − round(x'/g)| ≤ ⌈Δ/g⌉ + 1 per cell, so across the ``cells`` output cells one unit can
    change the grid-unit L1 sensitivity is ⌈Δ/g⌉ + cells and scale = that / ε.  Integer noise with
    that scale is ε-DP on the snapped value (pmf ratio ≤ e^{Δ_g/b}); multiplying by g is
    post-processing.
    """
    eps = _positive("epsilon", epsilon)
    if l1_sensitivity == 0:
        return exact_spec("laplace", eps)
    delta_ = _positive("l1_sensitivity", l1_sensitivity)
    if cells < 1:
        raise ValueError("cells must be ≥ 1")
    g = _integer_grid(delta_, delta_ / eps) if integer else _real_grid(delta_, delta_ / eps)
    if integer and g == 1.0:
        return NoiseSpec("laplace", math.ceil(delta_) / eps, 1.0, eps, 0.0, None)
    sens = math.ceil(delta_ / g) + cells
    return NoiseSpec("laplace", sens / eps, g, eps, 0.0, None)


def gaussian_spec(l2_sensitivity: float, epsilon: float, delta: float, *, integer: bool, cells: int = 1) -> NoiseSpec:
    """Discrete-Gaussian noise giving (ε, δ)-DP for a query of L2 sensitivity Δ, via zCDP.

    ρ = ``epsilon_to_rho(ε, δ)``; the discrete Gaussian with σ = Δ_g/√(2ρ) is ρ-zCDP for integer
    vectors at L2 distance ≤ Δ_g (CKS20, Thm. 4), which converts to (ε, δ)-DP.  Integer aggregates use
    Δ_g = Δ (unless σ would exceed 2^44: then the real-valued rule, with g ≥ 1).  Real aggregates use
    grid g = largest power of two ≤ min(Δ, Δ/√(2ρ))/2^10; snapping adds at most one grid step per
    affected cell, so Δ_g = Δ/g + √cells.
    """
    eps = _positive("epsilon", epsilon)
    dlt = _probability("delta", delta)
    if l2_sensitivity == 0:
        return exact_spec("gaussian", eps)
    d = _positive("l2_sensitivity", l2_sensitivity)
    rho = epsilon_to_rho(eps, dlt)
    if cells < 1:
        raise ValueError("cells must be ≥ 1")
    sigma = d / math.sqrt(2.0 * rho)
    g = _integer_grid(d, sigma) if integer else _real_grid(d, sigma)
    if integer and g == 1.0:
        return NoiseSpec("gaussian", sigma, 1.0, eps, dlt, rho)
    sens = d / g + math.sqrt(cells)
    return NoiseSpec("gaussian", sens / math.sqrt(2.0 * rho), g, eps, dlt, rho)


# --------------------------------------------------------------------------------------------------
# Release
# --------------------------------------------------------------------------------------------------


def snap(x: float | Sequence[float] | np.ndarray, grid: float) -> np.ndarray:
    """Round to the nearest multiple of ``grid`` (ties to even), as float64."""
    return np.rint(np.asarray(x, dtype=np.float64) / grid) * grid


def sample_noise(spec: NoiseSpec, size: int) -> np.ndarray:
    """Integer noise (grid units) for ``spec``, from the OS CSPRNG."""
    if spec.scale == 0:
        return np.zeros(size, dtype=np.int64)
    return mechanism_of(spec).sample(spec.scale, size)


def _exact_units(value: object, grid: float) -> int:
    """round(value / grid), ties to even, computed exactly (ints, floats, Decimals), clipped to ±2^1000."""
    exact: Fraction
    if isinstance(value, bool | np.bool_ | int | np.integer):
        exact = Fraction(int(value))
    elif isinstance(value, Decimal):
        if value.is_nan():
            raise ValueError("release() needs non-NULL, non-NaN aggregates; handle NULLs before noising")
        if value.is_infinite():
            return _MAX_GRID_UNITS if value > 0 else -_MAX_GRID_UNITS
        exact = Fraction(value)
    else:
        f = float(value)  # type: ignore[arg-type]
        if math.isnan(f):
            raise ValueError("release() needs non-NULL, non-NaN aggregates; handle NULLs before noising")
        if math.isinf(f):
            return _MAX_GRID_UNITS if f > 0 else -_MAX_GRID_UNITS
        exact = Fraction(f)
    units = round(exact / Fraction(grid))
    return max(-_MAX_GRID_UNITS, min(_MAX_GRID_UNITS, units))


def _grid_units(values: Sequence[object] | np.ndarray, grid: float) -> np.ndarray:
    """The exact integers round(x / grid): int64 when all are ≤ 2^52 in magnitude, else Python ints."""
    arr = np.asarray(values)
    if (
        arr.dtype.kind in "iub"
        and grid == 1.0
        and arr.size
        and np.abs(arr, dtype=np.float64).max() <= _INT64_SAFE_UNITS
    ):
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        if np.isnan(arr).any():
            raise ValueError("release() needs non-NULL, non-NaN aggregates; handle NULLs before noising")
        with np.errstate(over="ignore"):
            units = np.rint(arr.astype(np.float64) / grid)  # exact: grid is a power of two
        if not units.size or np.abs(units).max() <= _INT64_SAFE_UNITS:
            return units.astype(np.int64)
        # wide: the float units are exact integers (±inf where x/grid overflowed: clipped)
        wide = [_exact_units(u, 1.0) for u in units.ravel().tolist()]
    else:
        wide = [_exact_units(v, grid) for v in arr.ravel().tolist()]
    if not wide or max(abs(u) for u in wide) <= _INT64_SAFE_UNITS:
        return np.array(wide, dtype=np.int64).reshape(arr.shape)
    out = np.empty(len(wide), dtype=object)
    out[:] = wide
    return out.reshape(arr.shape)


def release(values: Sequence[object] | np.ndarray, spec: NoiseSpec) -> np.ndarray:
    """Snap ``values`` to ``spec.grid``, add exact integer noise, return values on the grid.

    Returns integers when ``grid == 1`` (int64, or Python ints in an object array beyond int64) else
    float64 multiples of ``grid``; the shape of ``values`` is kept.  The privacy guarantee is the spec's,
    provided the caller's sensitivity covers the whole vector.  No finite magnitude is clipped below
    2^1000 grid units: int, float and Decimal aggregates beyond 2^52 are noised in exact Python-integer
    arithmetic (the noise is unbiased at every magnitude).  The final float conversion of a wide
    ``k + Z`` rounds a value that is already private (post-processing).
    """
    k = _grid_units(values, spec.grid)
    return _noised(k, sample_noise(spec, k.size).reshape(k.shape), spec.grid)


def release_many(items: Sequence[tuple[Sequence[object] | np.ndarray, NoiseSpec]]) -> list[np.ndarray]:
    """:func:`release` of each (values, spec), every noise independent, drawn together: one bulk draw per
    mechanism for all the cells of a release (:meth:`NoiseMechanism.sample_many`), not one per spec."""
    units = [_grid_units(values, spec.grid) for values, spec in items]
    noise = sample_noise_many([spec for _, spec in items], [k.size for k in units])
    return [_noised(k, z.reshape(k.shape), spec.grid) for k, z, (_, spec) in zip(units, noise, items, strict=True)]


def sample_noise_many(specs: Sequence[NoiseSpec], sizes: Sequence[int]) -> list[np.ndarray]:
    """:func:`sample_noise` of each (spec, size), independent, drawn per mechanism in one call."""
    out = [np.zeros(size, dtype=np.int64) for size in sizes]
    drawn: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.scale != 0 and sizes[i]:
            drawn.setdefault(mechanism_of(spec).name, []).append(i)
    for name, which in drawn.items():
        draws = MECHANISMS[name].sample_many([specs[i].scale for i in which], [sizes[i] for i in which])
        for i, z in zip(which, draws, strict=True):
            out[i] = z
    return out


def _noised(k: np.ndarray, z: np.ndarray, grid: float) -> np.ndarray:
    """``grid · (k + z)``: exact integer addition (Python integers beyond int64), then the grid."""
    if k.dtype != object:
        out: np.ndarray = k + z  # |k| ≤ 2^52 and |Z| ≪ 2^62: no int64 overflow
        if grid == 1.0:
            return out
        scaled: np.ndarray = out.astype(np.float64) * grid
        return scaled
    wide = [int(a) + int(b) for a, b in zip(k.ravel().tolist(), z.ravel().tolist(), strict=True)]
    if grid == 1.0:
        if max(abs(u) for u in wide) < 2**63:
            return np.array(wide, dtype=np.int64).reshape(k.shape)
        obj = np.empty(len(wide), dtype=object)
        obj[:] = wide
        return obj.reshape(k.shape)
    with np.errstate(over="ignore"):
        return (np.array([float(u) for u in wide], dtype=np.float64) * grid).reshape(k.shape)


# --------------------------------------------------------------------------------------------------
# Tails, accuracy, thresholds
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _laplace_alpha_log(scale: float) -> float:
    """−1/b for the scale actually sampled (b rounded up as in ``laplace_rational_scale``)."""
    t, s = laplace_rational_scale(scale)
    return -s / t


@lru_cache(maxsize=32)
def _gauss_upper_table(sigma: float) -> np.ndarray:
    """upper[j] = P(Z ≥ j) for j = 0..K of the discrete Gaussian; summed tail-first for accuracy."""
    k_max = math.ceil(39.0 * sigma) + 2  # exp(-j²/2σ²) underflows beyond ~38.6σ
    j = np.arange(k_max + 1, dtype=np.float64)
    w = np.exp(-(j * j) / (2.0 * sigma * sigma))
    norm = w[0] + 2.0 * w[1:].sum()
    upper: np.ndarray = np.cumsum(w[::-1])[::-1] / norm
    upper.setflags(write=False)
    return upper


def _normal_q(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _normal_q_inv(p: float) -> float:
    """x with Q(x) = p (bisection; p in (0, 0.5])."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _normal_q(mid) > p:
            lo = mid
        else:
            hi = mid
    return hi


def noise_tail(spec: NoiseSpec, j: int) -> float:
    """P(Z ≥ j) for the spec's integer noise Z (grid units).

    Discrete Laplace (α = e^{-1/b}): α^j/(1+α) for j ≥ 1, by symmetry 1 − α^{1−j}/(1+α) otherwise.
    Discrete Gaussian: exact pmf sums for σ ≤ 2·10^4; beyond, the upper bound Q((j−1)/σ) for j ≥ 1
    (the pmf is decreasing and its normaliser is ≥ σ√(2π) by Poisson summation), which is tight to
    O(1/σ) relative and errs on the side of more noise/higher thresholds.
    """
    return mechanism_of(spec).tail(spec.scale, int(j))


def _smallest_j(spec: NoiseSpec, target: float, start: int) -> int:
    """Smallest integer j with noise_tail(spec, j) ≤ target, searching from a close guess."""
    j = start
    while noise_tail(spec, j) > target:
        j += 1
    while noise_tail(spec, j - 1) <= target:
        j -= 1
    return j


def _tail_guess(spec: NoiseSpec, target: float) -> int:
    return mechanism_of(spec).tail_guess(spec.scale, target)


@lru_cache(maxsize=4096)
def half_width(spec: NoiseSpec, confidence: float = 0.95) -> float:
    """Half-width h (output units) with P(|noise| ≤ h) ≥ ``confidence``, the smallest such on the grid.

    Uses the exact tail of the discrete noise (closed form for Laplace: P(|Z| ≥ k) = 2α^k/(1+α));
    for σ > 2·10^4 Gaussians the conservative normal bound (see ``noise_tail``).
    """
    c = _probability("confidence", confidence)
    if spec.scale == 0:
        return 0.0
    target = (1.0 - c) / 2.0  # P(|Z| > k) = 2·P(Z ≥ k+1)
    j = _smallest_j(spec, target, _tail_guess(spec, target))
    return max(0, j - 1) * spec.grid


@lru_cache(maxsize=4096)
def partition_threshold(spec: NoiseSpec, delta: float, *, max_partitions: int = 1, max_rows: int = 1) -> int:
    """Smallest τ with P(max_rows + Z ≥ τ) ≤ δ / max_partitions, for noisy-count partition selection.

    Release a group key only when its noisy count is ≥ τ.  Keys present in both neighbouring
    datasets are covered by the count's own ε (or (ε, δ_spec)) guarantee; a key present in only one
    has true count ≤ ``max_rows`` (it comes from the single differing unit), and that unit touches
    ≤ ``max_partitions`` keys, so by a union bound all such keys together appear with probability
    ≤ δ.  The released key set plus counts is therefore (ε, δ + spec.delta)-DP.  Needs ``grid == 1``.
    """
    if spec.grid != 1.0:
        raise ValueError("partition thresholds apply to integer counts (grid 1)")
    d = _probability("delta", delta)
    if max_partitions < 1 or max_rows < 0:
        raise ValueError("max_partitions must be ≥ 1 and max_rows ≥ 0")
    target = d / max_partitions
    return int(max_rows) + _smallest_j(spec, target, _tail_guess(spec, target))


# --------------------------------------------------------------------------------------------------
# The mechanisms, registered
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """How one query's (ε, δ) is divided among its ``k`` measures, and what the query is charged.

    Additive measures are calibrated at (``epsilon``, ``delta``) each; a selection measure (quantile,
    mode: exponential mechanism) gets the pure-ε ``share``; ``selection_delta`` is the δ left for
    partition selection's threshold when the query selects keys.
    """

    epsilon: float
    delta: float
    share: float
    cost: Cost
    selection_delta: float


class NoiseMechanism(Protocol):
    """An additive noise mechanism: its budget split, calibration, exact sampler and exact tail."""

    #: The name policies, sessions, ``SET dpsql.mechanism`` and the CLI use.
    name: str
    #: Whether it needs δ > 0 (approximate DP).
    uses_delta: bool
    #: Largest scale (grid units) its exact sampler draws.
    max_scale: float

    def split(self, epsilon: float, delta: float, k: int, selecting: bool) -> Split: ...

    def calibrate(
        self, sensitivities: tuple[float, float], split: Split, *, integer: bool, cells: int
    ) -> NoiseSpec: ...

    def sample(self, scale: float, size: int) -> np.ndarray: ...

    def sample_many(self, scales: Sequence[float], sizes: Sequence[int]) -> list[np.ndarray]:
        """``sizes[i]`` draws at ``scales[i]`` each, all independent (a release's cells, in as few bulk
        draws as the sampler allows)."""
        ...

    def tail(self, scale: float, j: int) -> float: ...

    def tail_guess(self, scale: float, target: float) -> int: ...

    def variance(self, scale: float) -> float:
        """The variance of one draw at ``scale``, in grid units (an upper bound where not exact)."""
        ...

    def sum_quantile(self, confidence: float) -> float:
        """Half-width per standard deviation of a sum of independent draws (any scales) at ``confidence``:
        what a derived answer's ± is (:mod:`dpsql.synopsis.answer`), so it never undercovers."""
        ...


class Laplace:
    """Discrete Laplace: pure ε-DP on the L1 sensitivity; ε is split evenly over the measures."""

    name = "laplace"
    uses_delta = False
    max_scale = _MAX_SCALE

    def split(self, epsilon: float, delta: float, k: int, selecting: bool) -> Split:
        # ε-DP measurements (ρ = ε²/2 under zcdp) plus δ for the partition-selection event only
        cost = Cost(epsilon=epsilon, delta=delta if selecting else 0.0, selection_delta=delta if selecting else 0.0)
        return Split(epsilon / k, 0.0, epsilon / k, cost, delta)

    def calibrate(self, sensitivities: tuple[float, float], split: Split, *, integer: bool, cells: int) -> NoiseSpec:
        return laplace_spec(sensitivities[0], split.epsilon, integer=integer, cells=cells)

    def sample(self, scale: float, size: int) -> np.ndarray:
        return discrete_laplace(scale, size)

    def sample_many(self, scales: Sequence[float], sizes: Sequence[int]) -> list[np.ndarray]:
        return discrete_laplace_many(scales, sizes)

    def tail(self, scale: float, j: int) -> float:
        la = _laplace_alpha_log(scale)  # ln α
        log1p_alpha = math.log1p(math.exp(la))
        if j >= 1:
            return math.exp(j * la - log1p_alpha)
        return -math.expm1((1 - j) * la - log1p_alpha)

    def tail_guess(self, scale: float, target: float) -> int:
        # solve α^j/(1+α) = target exactly; the search then moves ±1
        la = _laplace_alpha_log(scale)
        return max(1, math.ceil((math.log(target) + math.log1p(math.exp(la))) / la))

    def variance(self, scale: float) -> float:
        # the discrete Laplace's 2α/(1-α)² with α = e^{-1/b}
        a = math.exp(-1.0 / scale)
        return 2.0 * a / (1.0 - a) ** 2

    def sum_quantile(self, confidence: float) -> float:
        # a sum of Laplace noises lies between one Laplace (ln(1/(1−c))/√2 per σ) and a normal: the larger
        return max(_normal_quantile(confidence), math.log(1 / (1 - confidence)) / math.sqrt(2))


class Gaussian:
    """Discrete Gaussian: ρ-zCDP on the L2 sensitivity; the query's ρ (from its (ε, δ)) is split evenly.

    With partition selection, half of δ converts ρ and half goes to the threshold. Selection measures
    get the ε whose ε-DP (ε²/8-zCDP for a bounded-range mechanism) fits their ρ share.
    """

    name = "gaussian"
    uses_delta = True
    max_scale = _MAX_SCALE / 64

    def split(self, epsilon: float, delta: float, k: int, selecting: bool) -> Split:
        conversion_delta = delta / 2 if selecting else delta
        rho = epsilon_to_rho(epsilon, conversion_delta)
        share = rho_to_epsilon(rho / k, conversion_delta)  # the ε whose zCDP ρ is this measure's share
        cost = Cost(epsilon=epsilon, delta=delta, rho=rho, selection_delta=delta / 2 if selecting else 0.0)
        # ε-DP selection is ε²/8-zCDP (bounded range)
        return Split(share, conversion_delta, math.sqrt(8 * rho / k), cost, delta / 2)

    def calibrate(self, sensitivities: tuple[float, float], split: Split, *, integer: bool, cells: int) -> NoiseSpec:
        return gaussian_spec(sensitivities[1], split.epsilon, split.delta, integer=integer, cells=cells)

    def sample(self, scale: float, size: int) -> np.ndarray:
        return discrete_gaussian(scale, size)

    def sample_many(self, scales: Sequence[float], sizes: Sequence[int]) -> list[np.ndarray]:
        return [discrete_gaussian(scale, size) for scale, size in zip(scales, sizes, strict=True)]

    def tail(self, sigma: float, j: int) -> float:
        if sigma <= _GAUSS_TABLE_MAX_SIGMA:
            upper = _gauss_upper_table(sigma)
            if j >= 1:
                return float(upper[j]) if j < upper.size else 0.0
            m = 1 - j
            return 1.0 - (float(upper[m]) if m < upper.size else 0.0)
        if j >= 1:
            return min(1.0, _normal_q((j - 1) / sigma))
        return 1.0  # P(Z ≥ j) ≥ 1/2 for j ≤ 0; 1 is the conservative upper bound

    def tail_guess(self, sigma: float, target: float) -> int:
        return max(1, math.ceil(sigma * _normal_q_inv(min(target, 0.5))))

    def variance(self, sigma: float) -> float:
        # the discrete Gaussian's variance is at most σ² (Canonne, Kamath, Steinke 2020)
        return sigma**2

    def sum_quantile(self, confidence: float) -> float:
        return _normal_quantile(confidence)  # a sum of Gaussians is one


def _normal_quantile(confidence: float) -> float:
    return NormalDist().inv_cdf((1 + confidence) / 2)


#: Every noise mechanism, by name: what policies, sessions, the server and the CLI validate against.
MECHANISMS: dict[str, NoiseMechanism] = {m.name: m for m in (Laplace(), Gaussian())}


if mechanism_names() != tuple(MECHANISMS):
    raise ImportError("noise.mechanisms: the Mechanism names and the MECHANISMS registry differ")


def mechanism_of(spec: NoiseSpec) -> NoiseMechanism:
    """The registered mechanism that draws ``spec``'s noise; ValueError when none is."""
    try:
        return MECHANISMS[spec.mechanism]
    except KeyError:
        raise ValueError(f"unknown mechanism {spec.mechanism!r}") from None


def mechanism_named(name: str) -> NoiseMechanism:
    """The registered mechanism called ``name`` (a stored release's); ValueError when none is: a stored
    name this dpsql does not register is never read as another mechanism."""
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r} (registered: {', '.join(MECHANISMS)})") from None
