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

Small requests are served from a per-thread pool of samples drawn ahead in bulk (``_NoisePool``);
``discrete_laplace_many`` draws several scales' samples in one vectorised pass (a release's cells). Uniform
words come from a per-thread buffer of OS CSPRNG bytes (``_Entropy``, one ``os.urandom`` per 64 KiB, each
byte handed out once, reset in a forked child), not one system call per loop step.

Nothing here reads or advances the ``random`` or ``numpy.random`` global PRNG state.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import lru_cache

import numpy as np

__all__ = [
    "BULK_THRESHOLD",
    "discrete_gaussian",
    "discrete_laplace",
    "discrete_laplace_many",
    "laplace_rational_scale",
]

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
    A distribution's first draw is small (``FIRST``); each refill draws 4× the last, up to ``BATCH``:
    a scale asked once (a new ε) costs what it asks, not a full batch.
    """

    BATCH = 4096
    FIRST = 64
    MAX_DISTRIBUTIONS = 64

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, key: tuple[object, ...], n: int, draw: Callable[[int], np.ndarray]) -> np.ndarray:
        reservoirs = self._reservoirs()
        entry = reservoirs.get(key)
        if entry is None or entry[1] + n > len(entry[0]):
            if len(reservoirs) >= self.MAX_DISTRIBUTIONS:
                reservoirs.clear()
            batch = self.FIRST if entry is None else min(self.BATCH, 4 * entry[2])
            entry = (draw(max(batch, n)), 0, batch)
        samples, start, batch = entry
        reservoirs[key] = (samples, start + n, batch)
        return samples[start : start + n].copy()

    def take_many(
        self,
        keys: Sequence[tuple[object, ...]],
        counts: Sequence[int],
        draw: Callable[[list[tuple[object, ...]], list[int]], list[np.ndarray]],
    ) -> list[np.ndarray]:
        """``counts[i]`` samples of distribution ``keys[i]`` each, every reservoir short of them refilled by
        one ``draw(keys, sizes)`` call. A distribution met for the first time draws just what it is asked
        (a scale used once costs nothing more); met again, ``FIRST``, then 4× each refill up to ``BATCH``."""
        reservoirs = self._reservoirs()
        need: dict[tuple[object, ...], int] = {}
        for key, n in zip(keys, counts, strict=True):
            need[key] = need.get(key, 0) + n
        if len(reservoirs) + sum(key not in reservoirs for key in need) > self.MAX_DISTRIBUTIONS:
            reservoirs.clear()
        refill: dict[tuple[object, ...], int] = {}  # key → its next batch
        for key, n in need.items():
            entry = reservoirs.get(key)
            if entry is None or entry[1] + n > len(entry[0]):
                refill[key] = 0 if entry is None else self.FIRST if not entry[2] else min(self.BATCH, 4 * entry[2])
        if refill:
            wanted = list(refill)
            for key, fresh in zip(wanted, draw(wanted, [max(refill[k], need[k]) for k in wanted]), strict=True):
                reservoirs[key] = (fresh, 0, refill[key])  # (what the old one had left is never used)
        out = []
        for key, n in zip(keys, counts, strict=True):
            samples, start, batch = reservoirs[key]
            reservoirs[key] = (samples, start + n, batch)
            out.append(samples[start : start + n].copy())
        return out

    def _reservoirs(self) -> dict[tuple[object, ...], tuple[np.ndarray, int, int]]:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.pid, local.reservoirs = os.getpid(), {}
        reservoirs: dict[tuple[object, ...], tuple[np.ndarray, int, int]] = local.reservoirs
        return reservoirs


_POOL = _NoisePool()


# --------------------------------------------------------------------------------------------------
# Bulk path: vectorised numpy on OS CSPRNG words (exact integer arithmetic)
# --------------------------------------------------------------------------------------------------


class _Entropy(threading.local):
    """A per-thread buffer of OS CSPRNG bytes, handed out once each, in order.

    The bulk samplers ask for a few words per loop step (thousands of steps per release at ~1 µs of
    system call each); reading 64 KiB ahead serves them from memory. Reading ahead changes nothing
    about the bytes (independent uniform either way) and, like the noise pool, each byte is used once.
    Per thread (no lock, no sharing) and per process: a forked child drops its parent's buffer, whose
    bytes the parent may still hand out.
    """

    WORDS = 8192  # 64 KiB

    def __init__(self) -> None:
        self.pid = -1
        self.buffer = np.empty(0, dtype=np.uint64)
        self.used = 0

    def words(self, n: int) -> np.ndarray:
        if n > self.WORDS:
            return np.frombuffer(os.urandom(8 * n), dtype=np.uint64).copy()
        if self.pid != os.getpid() or self.used + n > self.buffer.size:
            self.pid = os.getpid()
            self.buffer = np.frombuffer(os.urandom(8 * self.WORDS), dtype=np.uint64)
            self.used = 0
        start = self.used
        self.used += n
        return self.buffer[start : self.used].copy()


_ENTROPY = _Entropy()


def _words(n: int) -> np.ndarray:
    """``n`` uniform uint64 words from the OS CSPRNG (a fresh, writable array)."""
    return _ENTROPY.words(n)


def _bits(n: int) -> np.ndarray:
    """``n`` fair coin flips (bool) from the OS CSPRNG."""
    return np.unpackbits(_words((n + 63) // 64).view(np.uint8), count=n).astype(bool)


def _uniform_below(m: np.ndarray | int, n: int) -> np.ndarray:
    """Exactly uniform int64 draws in ``[0, m)`` (``m`` scalar or length-``n`` array, 1 <= m < 2^63).

    A word ``r`` is accepted iff ``r >= 2^64 mod m``; the accepted range has a length divisible by
    ``m``, so ``r mod m`` is exactly uniform.  Rejection probability < m / 2^64.
    """
    mu = np.asarray(m, dtype=np.int64).astype(np.uint64)
    floor = (np.uint64(0) - mu) % mu  # 2^64 mod m
    r = _words(n)
    idx = np.flatnonzero(r < floor)
    while idx.size:  # redraw only the rejected words
        r[idx] = _words(idx.size)
        idx = idx[r[idx] < (floor if floor.ndim == 0 else floor[idx])]
    return (r % mu).astype(np.int64)


def _bern_exp_frac_bulk(num: np.ndarray, den: np.ndarray | int) -> np.ndarray:
    """Vectorised exact Bernoulli(exp(-num/den)), 0 <= num <= den (``den`` scalar or one per ``num``),
    via the CKS K-loop: step k continues while a uniform draw in [0, k·den) falls below num."""
    n = num.size
    result = np.empty(n, dtype=bool)
    idx = np.arange(n)
    cur = num
    per = np.ndim(den) > 0
    d: np.ndarray | int = np.asarray(den, dtype=np.int64) if per else int(den)
    k = 1
    while idx.size:
        a = _uniform_below(d * k, idx.size) < cur
        stop = ~a
        result[idx[stop]] = k % 2 == 1
        idx = idx[a]
        cur = cur[a]
        if per:
            d = d[a]  # type: ignore[index]
        k += 1
    return result


def _bern_exp1_bulk(n: int) -> np.ndarray:
    return _bern_exp_frac_bulk(np.ones(n, dtype=np.int64), 1)


def _geometric_exp1_bulk(n: int) -> np.ndarray:
    """Number of Bernoulli(e^-1) successes before the first failure, vectorised.

    Small requests draw 4 trials per pending sample per round (its first failure among them ends it; all 4
    successes, probability e^-4, go on): the same i.i.d. sequence read in chunks, so the same count, in
    ~1 round instead of ~log n, each a loop of numpy calls. Large ones draw one trial per round (less work)."""
    chunk = 4 if n <= 4096 else 1
    v = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)
    while idx.size:
        failed = ~_bern_exp1_bulk(idx.size * chunk).reshape(idx.size, chunk)
        ended = failed.any(axis=1)
        v[idx] += np.where(ended, failed.argmax(axis=1), chunk)
        idx = idx[~ended]
    return v


def _dlap_candidates(t: np.ndarray | int, s: np.ndarray | int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``m`` proposals of CKS Alg. 2 at scale t/s (scalars, or one per proposal): (accepted mask, value).

    U uniform in [0, t) kept with probability exp(-U/t), V ~ Geometric(1 - e^-1), Y = ⌊(U + t·V)/s⌋, a
    fair sign, and (−, 0) rejected: an accepted proposal is exactly discrete Laplace at t/s."""
    u = _uniform_below(t, m)
    ok = _bern_exp_frac_bulk(u, t)
    v = np.zeros(m, dtype=np.int64)
    v[ok] = _geometric_exp1_bulk(int(ok.sum()))
    y = (u + t * v) // s  # t < 2^41 and v ≪ 2^20: no overflow
    negative = _bits(m)
    ok &= ~(negative & (y == 0))
    return ok, np.where(negative, -y, y)


def _dlap_bulk(t: int, s: int, size: int) -> np.ndarray:
    """Vectorised exact discrete Laplace with scale t/s (CKS Alg. 2 with batched rejection)."""
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        need = size - filled
        m = int(need * 2.2) + 32  # acceptance is ≥ ~0.45 for every scale
        ok, y = _dlap_candidates(t, s, m)
        z = y[ok]
        take = min(z.size, need)
        out[filled : filled + take] = z[:take]
        filled += take
    return out


#: Proposals per pending sample and round of :func:`_dlap_mixed` (P(none accepted) ≤ 0.55^k): many for a
#: few samples, whose cost is the rounds' fixed numpy overhead, fewer for many, whose cost is the work.
_TRIES_FEW, _TRIES_MANY = 8, 3


def _dlap_mixed(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """One exact discrete-Laplace draw at scale ``t[i]/s[i]`` for every i, vectorised over mixed scales.

    Each pending sample gets several i.i.d. proposals at its own scale per round and takes the first
    accepted one (rejection sampling: that one has exactly the target pmf; the others are discarded
    unused); samples with none accepted try again in the next round."""
    out = np.empty(t.size, dtype=np.int64)
    pending = np.arange(t.size)
    while pending.size:
        tries = _TRIES_FEW if pending.size <= 512 else _TRIES_MANY
        slot = np.repeat(pending, tries)  # sorted: a sample's proposals are adjacent, in order
        ok, y = _dlap_candidates(t[slot], s[slot], slot.size)
        slot, y = slot[ok], y[ok]
        first = np.flatnonzero(np.concatenate(([True], slot[1:] != slot[:-1]))) if slot.size else slot
        out[slot[first]] = y[first]
        done = np.zeros(t.size, dtype=bool)
        done[slot] = True
        pending = pending[~done[pending]]
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


def discrete_laplace_many(scales: Sequence[float], sizes: Sequence[int]) -> list[np.ndarray]:
    """``sizes[i]`` i.i.d. draws at ``scales[i]`` for each i, as :func:`discrete_laplace` draws them, all
    independent: the cells of one release, several scales, served from the pool where it holds them and
    the rest drawn in one vectorised pass (not one bulk draw per scale). Requests larger than
    ``BULK_THRESHOLD`` are drawn on their own by the bulk sampler."""
    if len(scales) != len(sizes):
        raise ValueError("discrete_laplace_many needs one size per scale")
    ns = [_check_size(n) for n in sizes]
    rational = [laplace_rational_scale(float(scale)) for scale in scales]
    keys: list[tuple[object, ...]] = [("laplace", t, s) for t, s in rational]  # (the pool's, as discrete_laplace's)
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(ns)
    small = [i for i, n in enumerate(ns) if 0 < n <= BULK_THRESHOLD]
    for i, n in enumerate(ns):
        if n > BULK_THRESHOLD:
            out[i] = _dlap_bulk(*rational[i], n)
    drawn = _POOL.take_many([keys[i] for i in small], [ns[i] for i in small], _draw_mixed)
    for i, part in zip(small, drawn, strict=True):
        out[i] = part
    return out


def _draw_mixed(keys: list[tuple[object, ...]], sizes: list[int]) -> list[np.ndarray]:
    """``sizes[i]`` draws of the discrete Laplace ``keys[i]`` (``("laplace", t, s)``) each, in one pass."""
    t = np.repeat(np.array([k[1] for k in keys], dtype=np.int64), sizes)
    s = np.repeat(np.array([k[2] for k in keys], dtype=np.int64), sizes)
    return list(np.split(_dlap_mixed(t, s), np.cumsum(sizes)[:-1]))


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
