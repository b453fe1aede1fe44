"""The release path's samplers: several scales in one exact draw (``discrete_laplace_many``), the buffered
CSPRNG words under it, and ``release_many``: goodness of fit against the exact pmf at every scale of a
draw (tiny to 2^40), independence of a draw's cells, no global PRNG state, a forked child's own entropy."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from scipy import stats

from dpsql.noise.mechanisms import NoiseSpec, exact_spec, gaussian_spec, laplace_spec, release, release_many
from dpsql.noise.samplers import (
    _POOL,
    BULK_THRESHOLD,
    _dlap_mixed,
    _words,
    discrete_laplace_many,
    laplace_rational_scale,
)

from ._stats import P_MIN, gof_pvalue


def mixed_samples(scales: list[float], per_call: list[int], calls: int) -> list[np.ndarray]:
    """Each scale's samples over ``calls`` draws of ``discrete_laplace_many(scales, per_call)``."""
    parts: list[list[np.ndarray]] = [[] for _ in scales]
    for _ in range(calls):
        for i, draw in enumerate(discrete_laplace_many(scales, per_call)):
            assert draw.dtype == np.int64 and draw.shape == (per_call[i],)
            parts[i].append(draw)
    return [np.concatenate(p) for p in parts]


def exact_cdf(scale: float, x: np.ndarray) -> np.ndarray:
    """P(Z ≤ x) of the discrete Laplace at the rational scale sampled (α = e^{-s/t}), any magnitude."""
    t, s = laplace_rational_scale(scale)
    log_alpha, norm = -s / t, 1.0 + math.exp(-s / t)
    x = x.astype(np.float64)
    upper = 1.0 - np.exp((x + 1.0) * log_alpha) / norm  # x ≥ 0: 1 − P(Z ≥ x + 1)
    lower = np.exp(-x * log_alpha) / norm  # x < 0: P(Z ≥ −x)
    out: np.ndarray = np.where(x >= 0, upper, lower)
    return out


def binned_pvalue(samples: np.ndarray, scale: float, bins: int = 24) -> float:
    """Chi-square of ``samples`` over ~equiprobable integer bins, each bin's mass from the exact cdf: usable
    at scales whose support is too wide to list (2^40)."""
    t, s = laplace_rational_scale(scale)
    b = t / s
    q = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    continuous = np.where(q < 0.5, b * np.log(2 * q), -b * np.log(2 * (1 - q)))  # Laplace(b) quantiles
    edges = np.unique(np.floor(continuous).astype(np.int64))  # bin j: (edges[j-1], edges[j]]
    cdf = exact_cdf(scale, edges)
    probs = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    observed = np.bincount(np.searchsorted(edges, samples, side="left"), minlength=edges.size + 1)
    keep = probs * samples.size >= 5
    assert keep.sum() >= 5, "too few usable bins"
    expected = probs[keep] * samples.size
    return float(stats.chisquare(observed[keep], expected * observed[keep].sum() / expected.sum()).pvalue)


@pytest.mark.parametrize(
    ("per_call", "calls"),
    [([7, 5, 3, 6], 1000), ([400, 300, 200, 500], 25)],  # few pending (8 proposals each) and many (3 each)
)
def test_every_scale_of_a_mixed_draw_fits_its_exact_pmf(per_call: list[int], calls: int) -> None:
    scales = [0.5, 1.0, 3.7, 50.0]
    for scale, samples in zip(scales, mixed_samples(scales, per_call, calls), strict=True):
        assert gof_pvalue(samples, "laplace", scale) > P_MIN, scale


def test_huge_and_tiny_scales_in_one_draw() -> None:
    """2^40 (the largest scale in use is 2^50) against the exact cdf in bins; 10^-3 is exactly 0 but for
    a mass below e^-1000."""
    huge, tiny, mid = mixed_samples([2.0**40, 1e-3, 12.25], [9, 4, 5], 1000)
    assert binned_pvalue(huge, 2.0**40) > P_MIN
    assert np.all(tiny == 0)
    assert np.abs(huge).max() < 2**62
    assert gof_pvalue(mid, "laplace", 12.25) > P_MIN


@pytest.mark.parametrize("scale", [40.0, 2.0**20])
def test_binned_fit_of_each_scale_alone(scale: float) -> None:
    (samples,) = mixed_samples([scale], [11], 800)
    assert binned_pvalue(samples, scale) > P_MIN


def test_binned_check_has_power() -> None:
    """Negative control: draws at 1.1× the scale are rejected (the 2^40 check above means something)."""
    (samples,) = mixed_samples([1.1 * 2.0**40], [500], 60)
    assert binned_pvalue(samples, 2.0**40) < 1e-6


@pytest.mark.parametrize("rounds", [1, 40])  # 3·1,800 pending (3 proposals each); 3·45 (8 each)
def test_the_mixed_pass_itself_fits_every_scale(rounds: int) -> None:
    """``_dlap_mixed`` straight (the pool serves repeated scales above): interleaved scales, each its pmf."""
    scales = [0.5, 3.7, 50.0]
    rational = [laplace_rational_scale(scale) for scale in scales]
    per = 5400 // rounds // len(scales)
    t = np.tile(np.array([r[0] for r in rational], dtype=np.int64), per)
    s = np.tile(np.array([r[1] for r in rational], dtype=np.int64), per)
    drawn = np.concatenate([_dlap_mixed(t, s).reshape(per, len(scales)) for _ in range(rounds)])
    for j, scale in enumerate(scales):
        assert gof_pvalue(drawn[:, j], "laplace", scale) > P_MIN, scale


def test_a_scale_met_once_draws_only_what_it_asks() -> None:
    """A new scale (a new ε) is drawn for exactly its cells, nothing kept; met again, the pool keeps a batch."""
    scale = 1.0 + float(np.frombuffer(os.urandom(4), dtype=np.uint32)[0]) * 1e-9  # a scale no other test uses
    key = ("laplace", *laplace_rational_scale(scale))
    discrete_laplace_many([scale], [3])
    samples, used, _ = _POOL._reservoirs()[key]
    assert samples.size == used == 3
    discrete_laplace_many([scale], [3])
    samples, used, _ = _POOL._reservoirs()[key]
    assert samples.size == _POOL.FIRST and used == 3


def test_cells_of_one_draw_are_independent() -> None:
    """Two cells of one draw at one scale: their joint counts factor (chi-square of independence), and the
    first cell is not more often equal to the second than independent draws would be."""
    pairs = np.stack([np.concatenate(discrete_laplace_many([1.0, 1.0], [1, 1])) for _ in range(3000)])
    a, b = np.clip(pairs[:, 0], -3, 3), np.clip(pairs[:, 1], -3, 3)
    table = np.zeros((7, 7), dtype=np.int64)
    np.add.at(table, (a + 3, b + 3), 1)
    table = table[table.sum(axis=1) > 0][:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > P_MIN


def test_large_requests_go_through_the_bulk_sampler() -> None:
    big, small = discrete_laplace_many([3.7, 3.7], [BULK_THRESHOLD + 1, 3])
    assert big.shape == (BULK_THRESHOLD + 1,) and small.shape == (3,)
    assert gof_pvalue(np.concatenate([big, *mixed_samples([3.7], [BULK_THRESHOLD + 500], 4)]), "laplace", 3.7) > P_MIN


def test_argument_checks() -> None:
    assert [d.shape for d in discrete_laplace_many([1.0, 2.0], [0, 0])] == [(0,), (0,)]
    assert discrete_laplace_many([], []) == []
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            discrete_laplace_many([1.0, bad], [1, 1])
    with pytest.raises(ValueError):
        discrete_laplace_many([1.0], [-1])
    with pytest.raises(ValueError):
        discrete_laplace_many([1.0, 2.0], [1])


def _numpy_state() -> tuple[Any, ...]:
    state = np.random.get_state()
    assert isinstance(state, tuple)
    return state


def test_no_python_or_numpy_prng_state() -> None:
    """Seeding `random`/`numpy.random` neither reproduces the draws nor is their state read or advanced."""
    draws = []
    for _ in range(3):
        random.seed(99)
        np.random.seed(99)
        py_state, np_state = random.getstate(), _numpy_state()
        got = discrete_laplace_many([1e6, 3.0, 2.0**40], [5, 700, 2])
        specs = [laplace_spec(1.0, 1.0, integer=True), gaussian_spec(1.0, 1.0, 1e-6, integer=True)]
        released = release_many([([0] * 4, specs[0]), ([0] * 4, specs[1])])
        draws.append(np.concatenate([*got, *released]))
        assert random.getstate() == py_state
        after = _numpy_state()
        assert np.array_equal(after[1], np_state[1]) and after[2] == np_state[2]
    assert not np.array_equal(draws[0], draws[1]) or not np.array_equal(draws[1], draws[2])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_reuses_buffered_entropy() -> None:
    """The words buffered before a fork are the parent's: the child reads its own from the OS."""
    _words(1)  # the buffer is filled, most of it unread
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: send its next words and leave at once
        try:
            os.write(write, _words(32).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    child = b""
    while len(child) < 256:
        chunk = os.read(read, 256 - len(child))
        if not chunk:
            break
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 256
    assert child != _words(32).tobytes()


def test_release_many_is_release_of_each() -> None:
    """Same types, shapes and exactness as one ``release`` per item (ints on grid 1, grid multiples, wide
    Python integers, an exact spec untouched), each item's noise its own."""
    int_spec = laplace_spec(1.0, 1.0, integer=True)
    real_spec = laplace_spec(10.0, 1.0, integer=False)
    gauss = gaussian_spec(2.0, 1.0, 1e-6, integer=True)
    wide = [2**70, -(2**70)]
    items: list[tuple[Sequence[object] | np.ndarray, NoiseSpec]] = [
        (np.array([[1, 2], [3, 4]]), int_spec),
        ([1.5, 2.25, 1e300], real_spec),
        (wide, int_spec),
        ([Decimal("1.5")], real_spec),
        ([7, 8, 9], gauss),
        ([5, 6], exact_spec("laplace", 1.0)),
    ]
    many = release_many(items)
    for (values, spec), got in zip(items, many, strict=True):
        one = release(values, spec)
        assert got.shape == one.shape and got.dtype == one.dtype
        if spec.grid != 1.0:
            assert np.all(np.mod(got[np.isfinite(got)], spec.grid) == 0)
    assert many[5].tolist() == [5, 6]
    assert all(abs(int(v) - w) < 200 for v, w in zip(many[2].tolist(), wide, strict=True))
    assert release_many([]) == []
