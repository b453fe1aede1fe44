"""Integer noise samplers driven only by the OS CSPRNG.

Why integers: releasing ``x + noise`` computed in floating point leaks ``x`` through the low-order bits
(Mironov 2012).  dpsql therefore adds *integer* noise to values snapped to a grid (see ``mechanisms``),
so the output is a deterministic function of (snapped value, integer noise).

Algorithms are those of Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential Privacy"
(NeurIPS 2020), built on an exact Bernoulli(exp(-γ)) sampler for rational γ.

What is exact
-------------
* Uniform integers: 64-bit words from ``os.urandom`` with rejection, so every draw in ``[0, m)`` is
  exactly uniform (no modulo bias).
* ``discrete_laplace``: exact.  The requested scale ``b`` is replaced by the rational
  ``t/s >= b`` (``s`` a power of two, relative increase ≤ 2^-39, i.e. *more* noise, never less); the
  output pmf is then exactly ``P(k) ∝ exp(-|k|·s/t)``.  No floating-point operation touches a sample.
* ``discrete_gaussian``: the proposal (an exact discrete Laplace) is exact; the acceptance
  probability ``exp(-γ)`` is evaluated in float64 and then used exactly (53-bit uniform compared with
  ``p·2^53``).  This perturbs each pmf value by a relative factor ≤ ~1e-12, i.e. the privacy loss by
  ≤ ~1e-12 nats; outcomes with ``γ > 745`` (beyond ~38σ, exact mass < 1e-300) get probability 0.

Small requests are served from a per-thread pool of samples drawn ahead in bulk (``_NoisePool``).

Nothing here reads or advances the ``random`` or ``numpy.random`` global PRNG state.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache

import numpy as np

__all__ = ["BULK_THRESHOLD", "discrete_gaussian", "discrete_laplace", "laplace_rational_scale"]

#: Sizes up to this are served from the pool of pre-drawn samples (a bulk draw costs ~0.3 ms of fixed numpy
#: overhead however few samples it returns); larger ones are drawn directly.
BULK_THRESHOLD = 1024

_MAX_SCALE = 2.0**50  # keeps t·V and U·K comfortably inside int64 on the bulk path
_TWO53 = float(2**53)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def laplace_rational_scale(scale: float) -> tuple[int, int]:
    """Return ``(t, s)`` with ``t/s >= scale`` the exact rational scale actually sampled.

    ``s`` is a power of two and ``t < 2^41``, so ``t/s`` exceeds ``scale`` by a relative ≤ 2^-39.
    Rounding *up* only adds noise, so the privacy guarantee for ``scale`` still holds.
    """
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"noise scale must be a positive finite number, got {scale!r}")
    if scale > _MAX_SCALE:
        raise ValueError(f"noise scale {scale!r} exceeds the supported maximum 2^50")
    k = min(62, max(0, 40 - math.ceil(math.log2(scale))))
    exact = Fraction(scale) * (1 << k)
    t = math.ceil(exact)
    frac = Fraction(t, 1 << k)  # reduced: small denominators keep the uniform draws cheap
    return frac.numerator, frac.denominator


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise ValueError(f"size must be a non-negative integer, got {size!r}")
    return int(size)


def _check_sigma(sigma: float) -> float:
    if not (math.isfinite(sigma) and sigma > 0.0):
        raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
    if sigma > _MAX_SCALE / 64:
        raise ValueError(f"sigma {sigma!r} exceeds the supported maximum 2^44")
    return float(sigma)


# --------------------------------------------------------------------------------------------------
# Noise pool: small requests are served from samples drawn ahead, in bulk
# --------------------------------------------------------------------------------------------------


class _NoisePool:
    """Per-distribution reservoirs of exact samples drawn ahead of time by the bulk sampler.

    Noise is independent of the data, so drawing it early changes nothing about privacy; each
    sample is handed out exactly once. It makes a small release cost ~1 µs instead of ~15 µs of
    Python per sample, and keeps sampling work (whose duration varies) off the request path.
    Reservoirs are per thread and per process: a forked child never reuses its parent's noise.
    """

    BATCH = 4096
    MAX_DISTRIBUTIONS = 64

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, key: tuple[object, ...], n: int, draw: Callable[[int], np.ndarray]) -> np.ndarray:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.pid, local.reservoirs = os.getpid(), {}
        reservoirs: dict[tuple[object, ...], tuple[np.ndarray, int]] = local.reservoirs
        entry = reservoirs.get(key)
        if entry is None or entry[1] + n > len(entry[0]):
            if len(reservoirs) >= self.MAX_DISTRIBUTIONS:
                reservoirs.clear()
            entry = (draw(max(self.BATCH, n)), 0)
        samples, start = entry
        reservoirs[key] = (samples, start + n)
        return samples[start : start + n].copy()


_POOL = _NoisePool()


# --------------------------------------------------------------------------------------------------
# Bulk path: vectorised numpy on os.urandom words (exact integer arithmetic)
# --------------------------------------------------------------------------------------------------


def _words(n: int) -> np.ndarray:
    """``n`` uniform uint64 words from the OS CSPRNG."""
    return np.frombuffer(os.urandom(8 * n), dtype=np.uint64)


def _bits(n: int) -> np.ndarray:
    """``n`` fair coin flips (bool) from the OS CSPRNG."""
    return np.unpackbits(np.frombuffer(os.urandom((n + 7) // 8), dtype=np.uint8), count=n).astype(bool)


def _uniform_below(m: np.ndarray | int, n: int) -> np.ndarray:
    """Exactly uniform int64 draws in ``[0, m)`` (``m`` scalar or length-``n`` array, 1 <= m < 2^63).

    A word ``r`` is accepted iff ``r >= 2^64 mod m``; the accepted range has a length divisible by
    ``m``, so ``r mod m`` is exactly uniform.  Rejection probability < m / 2^64.
    """
    mu = np.asarray(m, dtype=np.int64).astype(np.uint64)
    floor = (np.uint64(0) - mu) % mu  # 2^64 mod m
    r = _words(n).copy()
    idx = np.flatnonzero(r < floor)
    while idx.size:  # redraw only the rejected words
        r[idx] = _words(idx.size)
        idx = idx[r[idx] < (floor if floor.ndim == 0 else floor[idx])]
    return (r % mu).astype(np.int64)


def _bern_exp_frac_bulk(num: np.ndarray, den: int) -> np.ndarray:
    """Vectorised exact Bernoulli(exp(-num/den)), 0 <= num <= den, via the CKS K-loop."""
    n = num.size
    result = np.empty(n, dtype=bool)
    idx = np.arange(n)
    cur = num
    k = 1
    while idx.size:
        a = _uniform_below(den * k, idx.size) < cur
        stop = ~a
        result[idx[stop]] = k % 2 == 1
        idx = idx[a]
        cur = cur[a]
        k += 1
    return result


def _bern_exp1_bulk(n: int) -> np.ndarray:
    return _bern_exp_frac_bulk(np.ones(n, dtype=np.int64), 1)


def _geometric_exp1_bulk(n: int) -> np.ndarray:
    """Number of Bernoulli(e^-1) successes before the first failure, vectorised."""
    v = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)
    while idx.size:
        a = _bern_exp1_bulk(idx.size)
        idx = idx[a]
        v[idx] += 1
    return v


def _dlap_bulk(t: int, s: int, size: int) -> np.ndarray:
    """Vectorised exact discrete Laplace with scale t/s (CKS Alg. 2 with batched rejection)."""
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        need = size - filled
        m = int(need * 2.2) + 32  # acceptance is ≥ ~0.45 for every scale
        u = _uniform_below(t, m)
        u = u[_bern_exp_frac_bulk(u, t)]
        v = _geometric_exp1_bulk(u.size)
        y = (u + t * v) // s
        negative = _bits(u.size)
        keep = ~(negative & (y == 0))
        z = np.where(negative, -y, y)[keep]
        take = min(z.size, need)
        out[filled : filled + take] = z[:take]
        filled += take
    return out


def _dgauss_bulk(sigma: float, size: int) -> np.ndarray:
    """Vectorised discrete Gaussian: exact DLap(t) proposal, float64-evaluated acceptance."""
    t = math.floor(sigma) + 1
    sigma2 = sigma * sigma
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        need = size - filled
        m = int(need * 1.8) + 32  # acceptance ≥ ~0.6
        y = _dlap_bulk(t, 1, m)
        gamma = (np.abs(y) - sigma2 / t) ** 2 / (2.0 * sigma2)
        threshold = np.exp(-gamma) * _TWO53
        u53 = (_words(m) >> np.uint64(11)).astype(np.float64)  # exact: < 2^53
        z = y[u53 < threshold]
        take = min(z.size, need)
        out[filled : filled + take] = z[:take]
        filled += take
    return out


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def discrete_laplace(scale: float, size: int) -> np.ndarray:
    """``size`` i.i.d. draws with ``P(k) ∝ exp(-|k|/scale)`` as int64 (scale rounded up by ≤ 2^-39).

    Privacy: for an integer query of L1 sensitivity Δ, adding this noise with scale Δ/ε is ε-DP since
    the pmf ratio at shifted points is ≤ exp(Δ/scale).  Exact sampling (no floats) keeps that bound
    true for the implemented distribution, not just the ideal one.
    """
    n = _check_size(size)
    t, s = laplace_rational_scale(float(scale))
    if n <= BULK_THRESHOLD:
        return _POOL.take(("laplace", t, s), n, lambda m: _dlap_bulk(t, s, m))
    return _dlap_bulk(t, s, n)


def discrete_gaussian(sigma: float, size: int) -> np.ndarray:
    """``size`` i.i.d. draws with ``P(k) ∝ exp(-k²/(2σ²))`` as int64.

    Privacy: for integer-valued queries of L2 sensitivity Δ this is (Δ²/2σ²)-zCDP (CKS20, Thm. 4).
    All sizes use the bulk sampler (small ones through the pool); its float64 acceptance step moves the privacy loss
    by at most ~1e-12 (see module docstring).
    """
    n = _check_size(size)
    sig = _check_sigma(float(sigma))
    if n <= BULK_THRESHOLD:
        return _POOL.take(("gaussian", sig), n, lambda m: _dgauss_bulk(sig, m))
    return _dgauss_bulk(sig, n)
