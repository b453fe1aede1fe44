"""Exact pmfs and a pooled-tail chi-square goodness-of-fit test for the integer noise samplers."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from dpsql.release import laplace_rational_scale

#: Per-test false-rejection rate of the goodness-of-fit checks.
P_MIN = 1e-4


def dlap_pmf(scale: float, support: np.ndarray) -> np.ndarray:
    """Exact discrete-Laplace pmf at the scale the sampler actually uses (t/s ≥ scale)."""
    t, s = laplace_rational_scale(scale)
    alpha = math.exp(-s / t)
    return (1.0 - alpha) / (1.0 + alpha) * alpha ** np.abs(support).astype(np.float64)


def dgauss_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    """Exact discrete-Gaussian pmf (normaliser summed over ±40σ, beyond which terms underflow)."""
    k = np.arange(-math.ceil(40 * sigma) - 2, math.ceil(40 * sigma) + 3, dtype=np.float64)
    norm = np.exp(-(k * k) / (2 * sigma * sigma)).sum()
    s = support.astype(np.float64)
    return np.exp(-(s * s) / (2 * sigma * sigma)) / norm


def support_for(mechanism: str, scale: float) -> np.ndarray:
    width = math.ceil((60 if mechanism == "laplace" else 12) * scale) + 5
    return np.arange(-width, width + 1)


def pmf(mechanism: str, scale: float, support: np.ndarray) -> np.ndarray:
    return dlap_pmf(scale, support) if mechanism == "laplace" else dgauss_pmf(scale, support)


def gof_pvalue(samples: np.ndarray, mechanism: str, scale: float) -> float:
    """Chi-square p-value of ``samples`` against the exact pmf.

    Bins are the integers in [-h, h] plus the two pooled tails Z < -h and Z > h, with h the largest
    value for which every bin, tails included, expects at least 5 observations.
    """
    n = samples.size
    support = support_for(mechanism, scale)
    probs = pmf(mechanism, scale, support)
    centre = support.size // 2  # support[centre] == 0
    right = probs[centre + 1 :]
    tail_beyond = np.cumsum(right[::-1])[::-1]  # tail_beyond[i] = P(Z >= i + 1)
    h = 0
    while h + 1 < right.size and n * right[h] >= 5.0 and n * tail_beyond[h + 1] >= 5.0:
        h += 1  # bin h is big enough and so is the tail beyond it
    if n * tail_beyond[h] < 5.0:
        h -= 1  # no room for a tail bin at all: fold it into the last bin
    inner = np.arange(-h, h + 1)
    exp_inner = n * pmf(mechanism, scale, inner)
    tail = max(0.0, (1.0 - exp_inner.sum() / n) / 2.0)
    obs_inner = np.bincount(samples[(samples >= -h) & (samples <= h)] + h, minlength=inner.size)
    obs = np.concatenate([[np.sum(samples < -h)], obs_inner, [np.sum(samples > h)]])
    exp = np.concatenate([[n * tail], exp_inner, [n * tail]])
    return float(stats.chisquare(obs, exp * (n / exp.sum())).pvalue)


def laplace_variance(scale: float) -> float:
    t, s = laplace_rational_scale(scale)
    alpha = math.exp(-s / t)
    return 2 * alpha / (1 - alpha) ** 2


def gauss_variance(sigma: float) -> float:
    k = np.arange(-math.ceil(40 * sigma) - 2, math.ceil(40 * sigma) + 3, dtype=np.float64)
    w = np.exp(-(k * k) / (2 * sigma * sigma))
    return float((w * k * k).sum() / w.sum())
