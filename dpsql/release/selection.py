"""Private selection: which group keys are released (partition selection), the exponential
mechanism for quantiles (MIN, MAX, median, percentiles) and report-noisy-max for the mode.

Partition selection. A GROUP BY key without a public domain is released only when a noisy count
of the *distinct privacy units* in its group reaches a threshold τ (:func:`selection_count`,
:func:`selection_threshold`), as PipelineDP and Tumult do. After contribution bounding a unit
touches at most L0 = ``plan.max_groups`` groups and adds at most 1 to each one's distinct-unit
count, however many rows it holds there: the count's sensitivity is L0 (L1) or √L0 (L2), and a key
held by the differing unit alone has count 1. So τ depends on L0, never on ``max_rows_per_unit``;
counting rows instead made a person with 20 rows look like 20 people and τ 20× higher.

Privacy argument. Values are clamped to the column bounds [L, U] and counted in B equal
bins (in SQL, after contribution bounding, so one unit changes at most ``max_rows`` of
the counts by one each). For a target rank t = q·n, bin j gets utility

    u_j = −max(0, C_j − t, t − C_{j+1})      (C_j = number of values below bin j)

i.e. minus the distance from the target rank to the ranks the bin covers. Adding or
removing one value changes every C_j by at most 1 and t by at most q ≤ 1, so every
u_j moves by at most 1 (``max_rows`` for a unit): Δu = max_rows. OpenDP's
``make_noisy_max`` (report-noisy-max with exponential noise = the exponential
mechanism, [MS20]) with scale 2Δu/ε selects a bin ε-DP; it samples exactly from the
OS CSPRNG. The released value is the bin's midpoint — post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import opendp.prelude as dp

from dpsql.release.mechanisms import NoiseSpec, partition_threshold

if TYPE_CHECKING:
    from dpsql.analyze.sources import Sources
    from dpsql.plan import Measure, Plan

dp.enable_features("contrib")


def selection_count(sources: Sources) -> Measure:
    """The count partition selection thresholds: distinct privacy units per group.

    With a unit (rows bounded per unit) it is ``COUNT(DISTINCT unit)`` over the bounded rows: each unit
    adds 1 to each of at most ``max_groups`` groups. Without one every row is a person, and with
    ``max_rows`` = 1 a unit keeps one row: ``COUNT(*)`` then already counts units, and is shared with
    the query's own ``COUNT(*)`` (one measure, no budget split).
    """
    from dpsql.plan import Measure  # the plan imports the analyzer, which imports this module

    unit = sources.unit
    if unit is None or sources.max_rows == 1:  # one row per unit: COUNT(*) counts units
        return Measure(kind="count_star")
    return Measure(kind="count_units", column=unit.name, table=unit.table)


def selection_contribution(plan: Plan) -> int:
    """What one unit adds at most to one group's selection count: 1 for a distinct-unit count; a
    row count (a policy-less plan built by hand) gets ``max_rows``."""
    assert plan.selection_measure is not None
    return 1 if plan.measures[plan.selection_measure].kind == "count_units" else plan.max_rows


def selection_threshold(plan: Plan, spec: NoiseSpec, delta: float) -> int:
    """τ for the plan's selection count, calibrated exactly on its noise ``spec`` (Laplace or Gaussian).

    Privacy argument. Keys present in both neighbours are covered by the count's own noise. A key
    present in only one neighbour is held by the differing unit alone: its selection count is at
    most c = :func:`selection_contribution` (1), and that unit holds at most L0 = ``max_groups`` such
    keys. τ is the smallest integer with P(c + Z ≥ τ) ≤ δ/L0 for the exact discrete noise Z, so by a
    union bound any of them is released with probability ≤ δ: the key set plus the counts is
    (ε, δ + spec.δ)-DP, the same form of δ accounting as before.
    """
    return partition_threshold(spec, delta, max_partitions=plan.max_groups, max_rows=selection_contribution(plan))


#: Bins per quantile: resolution (U − L)/512, well under the 1% of range analysts expect.
QUANTILE_BINS = 512


@lru_cache(maxsize=256)
def _noisy_max(scale: float) -> Any:
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=float), dp.max_divergence(), scale=scale)


def quantile_utilities(
    counts: Mapping[int, int], q: float, bins: int = QUANTILE_BINS, *, extreme_rank: float = 1.0
) -> list[float]:
    """Utility of each bin for the q-quantile of the histogram ``counts`` (bin index → count).

    A bin covering ranks (C_j, C_{j+1}] scores minus its distance to the target rank. For
    MIN and MAX (q = 0 or 1) the target is the ``extreme_rank``-th value from the bottom or
    the top, a constant: below the true minimum every empty bin is one rank away from rank
    1, so no DP mechanism can find the exact minimum; aiming ``extreme_rank`` values in
    makes the answer land between the true extreme and that rank with high probability.
    Either way each utility changes by at most 1 per added or removed value.
    """
    total = sum(counts.values())
    flip = q == 1.0
    target = extreme_rank if q in (0.0, 1.0) else q * total
    ordered = range(bins - 1, -1, -1) if flip else range(bins)
    utilities = [0.0] * bins
    below = 0.0
    for j in ordered:
        above = below + counts.get(j, 0)
        utilities[j] = (
            -max(0.0, below + 0.5 - target, target - above)
            if q in (0.0, 1.0)
            else -max(0.0, below - target, target - above)
        )
        below = above
    return utilities


def select_quantile_bin(counts: Mapping[int, int], q: float, epsilon: float, sensitivity: float) -> int:
    """The exponential mechanism: an ε-DP choice of the bin holding the q-quantile."""
    extreme = max(1.0, rank_error_bound(epsilon, sensitivity))
    utilities = quantile_utilities(counts, q, extreme_rank=extreme)
    return int(_noisy_max(2.0 * sensitivity / epsilon)(utilities))


def bin_midpoint(index: int, lower: float, upper: float, bins: int = QUANTILE_BINS) -> float:
    return lower + (index + 0.5) * (upper - lower) / bins


def rank_error_bound(epsilon: float, sensitivity: float, confidence: float = 0.95, bins: int = QUANTILE_BINS) -> float:
    """With probability ≥ ``confidence`` the chosen bin's utility is within this many ranks of the best.

    The exponential mechanism's standard bound: OPT − (2Δ/ε)·ln(B/β) with β = 1 − confidence.
    It bounds the *rank* error; the value error depends on the data's spread and is not
    reported per cell (it would depend on private data).
    """
    return 2.0 * sensitivity / epsilon * math.log(bins / (1.0 - confidence))


@lru_cache(maxsize=256)
def _noisy_max_monotonic(scale: float) -> Any:
    domain = dp.vector_domain(dp.atom_domain(T=int))
    return dp.m.make_noisy_max(domain, dp.linf_distance(T=int, monotonic=True), dp.max_divergence(), scale=scale)


def select_mode(counts: list[int], epsilon: float, sensitivity: float) -> int:
    """Report-noisy-max over candidate counts: an ε-DP arg-max.

    Privacy argument. Candidates are the column's public domain, so which candidates exist
    reveals nothing. One unit changes the counts by at most ``sensitivity`` each, all in the
    same direction (adding rows only raises counts): the utility is monotonic, and OpenDP's
    noisy max with exponential noise of scale Δ/ε is then ε-DP ([MS20], exact CSPRNG sampling).
    The released value is the winning candidate only, never its count.
    """
    return int(_noisy_max_monotonic(sensitivity / epsilon)(counts))
