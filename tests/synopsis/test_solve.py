"""The closed-form least squares of :mod:`dpsql.synopsis.solve` equals the dense pseudo-inverse it
replaced (issue #37 item 1), on random cubes, marginal sets and queries, including axes of one value,
marginals measured twice and sets no marginal covers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpsql.synopsis.solve import Estimate, Marginal, marginal_index, solve

pytestmark = pytest.mark.unit


def dense(shape: tuple[int, ...], marginals: list[Marginal]) -> tuple[np.ndarray, np.ndarray]:
    """The former O(cells³) solution: ``N⁺ b`` and ``N⁺``."""
    n = math.prod(shape)
    normal, rhs = np.zeros((n, n)), np.zeros(n)
    for marginal in marginals:
        index = marginal_index(shape, marginal.axes)
        normal += (index[:, None] == index[None, :]) / marginal.variance
        rhs += np.asarray(marginal.values)[index] / marginal.variance
    covariance = np.linalg.pinv(normal, hermitian=True)
    return covariance @ rhs, covariance


def random_case(rng: np.random.Generator) -> tuple[tuple[int, ...], list[Marginal]]:
    k = int(rng.integers(1, 5))
    shape = tuple(int(rng.integers(1, 6)) for _ in range(k))
    subsets = [s for r in range(k + 1) for s in itertools.combinations(range(k), r)]
    chosen = [subsets[int(i)] for i in rng.choice(len(subsets), size=int(rng.integers(1, 5)))]
    marginals = []
    for axes in chosen:
        order = tuple(int(a) for a in rng.permutation(list(axes))) if axes else ()
        size = math.prod(shape[a] for a in order)
        marginals.append(Marginal(order, list(rng.normal(50, 20, size)), float(rng.uniform(0.5, 9.0))))
    return shape, marginals


def test_closed_form_equals_the_pseudo_inverse() -> None:
    compared = 0
    for seed in range(80):
        rng = np.random.default_rng(seed)
        shape, marginals = random_case(rng)
        estimate = solve(shape, marginals)
        cube, covariance = dense(shape, marginals)
        assert np.allclose(estimate.cube, cube, rtol=1e-9, atol=1e-6), seed
        n = math.prod(shape)
        groups = rng.integers(-1, 3, size=n)
        values, variances = estimate.totals(groups, 3)
        projection = np.linalg.pinv(covariance, hermitian=True) @ covariance
        for g in range(3):
            q = (groups == g).astype(float)
            assert values[g] == pytest.approx(q @ cube, rel=1e-9, abs=1e-6)
            assert variances[g] == pytest.approx(q @ covariance @ q, rel=1e-9, abs=1e-9)
            compared += bool(np.allclose(projection @ q, q, atol=1e-6))  # in the measured span: answerable
    assert compared > 60


def test_one_marginal_over_every_axis_is_its_own_cells() -> None:
    values = [3.0, 5.0, 8.0, 13.0, 21.0, 34.0]
    estimate: Estimate = solve((2, 3), [Marginal((0, 1), values, 4.0)])
    assert list(estimate.cube) == pytest.approx(values)
    assert estimate.terms == (((0, 1), 4.0),)
    assert estimate.total(np.array([0, 4, 5])) == pytest.approx((3.0 + 21.0 + 34.0, 12.0))
