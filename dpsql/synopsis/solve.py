"""Least-squares consistency over a synopsis's noisy marginals (Hay et al. 2010; HDMM, Census TopDown).

A synopsis measures several marginals of one cube (every combination of its keys' public domains), each
with independent noise of a known variance. The estimate of the cube is the weighted least-squares
solution ``x̂ = N⁺ Σ_l Aₗᵀ yₗ / vₗ`` with ``N = Σ_l Aₗᵀ Aₗ / vₗ``, where ``Aₗ`` sums the cube into marginal
``l``. Every marginal of ``x̂`` is then consistent with every other (a total equals the sum of its parts, in
every chart), and a coarse total combines its direct measurement with the sum of its finer cells, so it is
more accurate than either. A linear query ``q`` inside the span of the measured marginals has the unique
estimate ``qᵀx̂`` (whichever marginal expresses it) with variance ``qᵀ N⁺ q``.

Privacy: ``x̂`` and its variances are functions of the released noisy values and of public noise scales
and domains only: post-processing, free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsql.noise.mechanisms import NoiseSpec

#: Largest cube a synopsis may have: the pseudo-inverse is O(cells³) once per loaded synopsis.
MAX_CELLS = 2048


def noise_variance(spec: NoiseSpec) -> float:
    """Variance of the noise one released value carries (value units): the discrete Laplace's
    ``2e^{-1/b}/(1-e^{-1/b})²`` or the discrete Gaussian's σ² (an upper bound), times the grid²."""
    if spec.mechanism == "laplace":
        a = math.exp(-1.0 / spec.scale)
        units = 2.0 * a / (1.0 - a) ** 2
    else:
        units = spec.scale**2
    return units * spec.grid**2


@dataclass(frozen=True)
class Marginal:
    """One measured marginal: which cube axes it keeps, and its noisy values (row-major over those axes)
    with their common noise variance."""

    axes: tuple[int, ...]
    values: Sequence[float]
    variance: float


@dataclass(frozen=True)
class Estimate:
    """The consistent cube estimate and its covariance ``N⁺`` (row-major over the cube)."""

    cube: np.ndarray
    covariance: np.ndarray

    def total(self, cells: np.ndarray) -> tuple[float, float]:
        """The estimate and variance of the sum over ``cells`` (indices into the cube)."""
        if cells.size == 0:
            return 0.0, 0.0
        value = float(self.cube[cells].sum())
        variance = float(self.covariance[np.ix_(cells, cells)].sum())
        return value, max(variance, 0.0)


def marginal_index(shape: Sequence[int], axes: Sequence[int]) -> np.ndarray:
    """For every cube cell (row-major), the index of the marginal cell it adds to."""
    grid = np.indices(tuple(shape)).reshape(len(shape), -1)
    index = np.zeros(grid.shape[1], dtype=np.int64)
    for axis in axes:
        index = index * shape[axis] + grid[axis]
    return index


def solve(shape: Sequence[int], marginals: Sequence[Marginal]) -> Estimate:
    """The weighted least-squares cube over ``marginals`` (see the module docstring)."""
    n = math.prod(shape)
    if n > MAX_CELLS:
        raise ValueError(f"a synopsis cube of {n} cells is larger than {MAX_CELLS}")
    normal = np.zeros((n, n))
    rhs = np.zeros(n)
    for marginal in marginals:
        index = marginal_index(shape, marginal.axes)
        weight = 1.0 / marginal.variance
        normal += weight * (index[:, None] == index[None, :])
        rhs += weight * np.asarray(marginal.values, dtype=float)[index]
    covariance = np.linalg.pinv(normal, hermitian=True)
    return Estimate(covariance @ rhs, covariance)
