"""Partition selection: which group keys without a public domain are released.

A GROUP BY key without a public domain is released only when a noisy count of the *distinct
privacy units* in its group (:func:`dpsql.plan.selection_count`) reaches a threshold τ
(:func:`selection_threshold`), as PipelineDP and Tumult do. After contribution bounding a unit
touches at most L0 = ``plan.max_groups`` groups and adds at most 1 to each one's distinct-unit
count, however many rows it holds there: the count's sensitivity is L0 (L1) or √L0 (L2), and a key
held by the differing unit alone has count 1. So τ depends on L0, never on ``max_rows_per_unit``;
counting rows instead made a person with 20 rows look like 20 people and τ 20× higher.

The quantile and mode mechanisms (pure math) are :mod:`dpsql.noise.exponential`.
"""

from __future__ import annotations

from dpsql.noise.mechanisms import NoiseSpec, partition_threshold
from dpsql.plan import Plan


def selection_contribution(plan: Plan) -> int:
    """What one unit adds at most to one group's selection count: 1 for a distinct-unit count; a
    row count (a policy-less plan built by hand) gets ``max_rows``."""
    assert plan.selection_measure is not None
    return 1 if plan.measures[plan.selection_measure].aggregate.once_per_unit else plan.max_rows


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
