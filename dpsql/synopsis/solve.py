"""Least-squares consistency over a synopsis's noisy marginals (Hay et al. 2010; HDMM, Census TopDown),
in closed form.

A synopsis measures several marginals of one cube (every combination of its keys' public domains), each
with independent noise of a known variance. The estimate of the cube is the weighted least-squares
solution ``x̂ = N⁺ b`` with ``N = Σ_l Aₗᵀ Aₗ / vₗ`` and ``b = Σ_l Aₗᵀ yₗ / vₗ``, where ``Aₗ`` sums the cube into
marginal ``l``. Every marginal of ``x̂`` is then consistent with every other (a total equals the sum of its
parts, in every chart), and a coarse total combines its direct measurement with the sum of its finer
cells, so it is more accurate than either. A linear query ``q`` inside the span of the measured marginals
has the unique estimate ``qᵀx̂`` (whichever marginal expresses it) with variance ``qᵀ N⁺ q``.

No matrix is ever formed or inverted (issue #37: a free answer in milliseconds). ``AₛᵀAₛ`` is the
Kronecker product ``Kₛ = ⊗ᵢ (I if i ∈ S else J)`` (``J`` all ones); these ``2ᵏ`` matrices are closed under
products (``Kₛ K_T = Π_{i ∉ S∪T} nᵢ · K_{S∩T}``) and share one eigenbasis: per axis the constant vector
and its complement. So ``N⁺ = Σₛ uₛ Kₛ`` with ``uₛ`` from ``k`` axes' sizes and the marginals' weights
(:func:`_coefficients`, McKenna et al.'s marginal algebra, HDMM 2018), ``x̂ = Σₛ uₛ Aₛᵀ(Aₛ b)`` and
``qᵀN⁺q = Σₛ uₛ ‖Aₛ q‖²``: sums over the cube, ``O(cells · 2ᵏ)`` per release and per query. This equals
the dense pseudo-inverse exactly (``tests/synopsis/test_solve.py`` compares them).

Privacy: ``x̂`` and its variances are functions of the released noisy values and of public noise scales
and domains only: post-processing, free.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

from dpsql.noise.mechanisms import NoiseSpec, mechanism_of

#: Largest cube a synopsis or an indexed release may have (cells): a derived answer reads every cell.
MAX_CELLS = 16384


class _Counter:
    """How many cube estimates were computed in this process (:func:`solve` calls): what bench/derived.py
    counts per statement (issue #37: solves per statement bounded and counted)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


SOLVES = _Counter()


def noise_variance(spec: NoiseSpec) -> float:
    """Variance of the noise one released value carries (value units): its mechanism's variance in grid
    units (:meth:`dpsql.noise.mechanisms.NoiseMechanism.variance`), times the grid²; ValueError for a
    mechanism that is not registered."""
    return mechanism_of(spec).variance(spec.scale) * spec.grid**2


@dataclass(frozen=True)
class Marginal:
    """One measured marginal: which cube axes it keeps, and its noisy values (row-major over those axes)
    with their common noise variance."""

    axes: tuple[int, ...]
    values: Sequence[float]
    variance: float


@lru_cache(maxsize=256)
def marginal_index(shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """For every cube cell (row-major), the index of the marginal cell it adds to (read-only; cached)."""
    index = np.zeros(math.prod(shape), dtype=np.int64)
    if index.size:
        grid = np.indices(shape).reshape(len(shape), -1)
        for axis in axes:
            index = index * shape[axis] + grid[axis]
    index.setflags(write=False)
    return index


def _size(shape: Sequence[int], axes: Sequence[int]) -> int:
    return math.prod(shape[a] for a in axes)


class Totals(Protocol):
    """What an answer reads of a cube's estimate: each group's sum and its variance."""

    def totals(self, groups: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class Estimate:
    """The consistent cube estimate, and its covariance ``N⁺ = Σ uₛ Kₛ`` as ``(axes S, uₛ)`` terms."""

    shape: tuple[int, ...]
    cube: np.ndarray
    terms: tuple[tuple[tuple[int, ...], float], ...]

    def totals(self, groups: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The estimate and variance of each group's sum: ``groups`` labels every cube cell with its group
        (0 … ``count``-1) or -1 (in none)."""
        kept = groups >= 0
        labels = groups[kept]
        values = np.bincount(labels, weights=self.cube[kept], minlength=count)
        variances = np.zeros(count)
        for axes, coefficient in self.terms:
            size = _size(self.shape, axes)
            combined = labels * size + marginal_index(self.shape, axes)[kept]
            cells, members = np.unique(combined, return_counts=True)
            # ‖Aₛ q‖²: per group, the squared number of its cells in each marginal cell of S
            variances += coefficient * np.bincount(cells // size, weights=members.astype(float) ** 2, minlength=count)
        return values, np.maximum(variances, 0.0)

    def total(self, cells: np.ndarray) -> tuple[float, float]:
        """The estimate and variance of the sum over ``cells`` (indices into the cube)."""
        groups = np.full(self.cube.size, -1, dtype=np.int64)
        groups[np.asarray(cells, dtype=np.int64)] = 0
        values, variances = self.totals(groups, 1)
        return float(values[0]), float(variances[0])


def _coefficients(shape: tuple[int, ...], weights: dict[int, float]) -> dict[int, float]:
    """``uₛ`` of ``N⁺ = Σ uₛ Kₛ`` for ``N = Σ_T w_T K_T`` (sets of axes as bit masks).

    ``Kₛ`` acts on the eigenspace ``R`` (the axes where a vector sums to zero) as ``[R ⊆ S]·Π_{i∉S} nᵢ``,
    so ``N`` as ``μ(R) = Σ_{T⊇R} w_T Π_{i∉T} nᵢ``; ``N⁺ = Σ_{μ(R)>0} P_R / μ(R)`` over the projections
    ``P_R = ⊗_{i∈R}(I − J/nᵢ) ⊗_{i∉R} J/nᵢ = Σ_{S⊆R} (−1)^{|R∖S|} Π_{i∉S} nᵢ⁻¹ · Kₛ``. Only sets inside a
    measured marginal have ``μ > 0`` (the rest is the pseudo-inverse's null space); an axis of one value
    has no complement, so sets holding one are empty spaces and skipped."""
    k = len(shape)
    measured = list(weights)
    single = sum(1 << i for i in range(k) if shape[i] < 2)
    inside = sorted({r for t in measured for r in _submasks(t) if not r & single})

    def outside(mask: int) -> float:
        return math.prod(shape[i] for i in range(k) if not mask >> i & 1)

    inverse = {}
    for r in inside:
        mu = sum(w * outside(t) for t, w in weights.items() if t & r == r)
        if mu > 0:
            inverse[r] = 1.0 / mu
    coefficients: dict[int, float] = {}
    for s in {s for r in inverse for s in _submasks(r)}:
        total = sum((-1) ** bin(r & ~s).count("1") * v for r, v in inverse.items() if r & s == s)
        if total:
            coefficients[s] = total / outside(s)
    return coefficients


def _submasks(mask: int) -> list[int]:
    """Every subset of ``mask`` (itself and 0 included)."""
    found, sub = [], mask
    while True:
        found.append(sub)
        if sub == 0:
            return found
        sub = (sub - 1) & mask


def _axes(mask: int, k: int) -> tuple[int, ...]:
    return tuple(i for i in range(k) if mask >> i & 1)


def solve(shape: Sequence[int], marginals: Sequence[Marginal]) -> Estimate:
    """The weighted least-squares cube over ``marginals`` (see the module docstring)."""
    shape = tuple(int(n) for n in shape)
    n = math.prod(shape)
    if n > MAX_CELLS:
        raise ValueError(f"a synopsis cube of {n} cells is larger than {MAX_CELLS}")
    SOLVES.add()
    k = len(shape)
    weights: dict[int, float] = {}
    rhs = np.zeros(n)
    for marginal in marginals:
        mask = sum(1 << a for a in set(marginal.axes))
        weight = 1.0 / marginal.variance
        weights[mask] = weights.get(mask, 0.0) + weight
        values = np.asarray(marginal.values, dtype=float)
        rhs += weight * values[marginal_index(shape, tuple(marginal.axes))]
    terms = tuple((_axes(s, k), u) for s, u in sorted(_coefficients(shape, weights).items()))
    cube = np.zeros(n)
    for axes, coefficient in terms:
        index = marginal_index(shape, axes)
        cube += coefficient * np.bincount(index, weights=rhs, minlength=_size(shape, axes))[index]
    return Estimate(shape, cube, terms)
