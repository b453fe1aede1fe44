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

from collections.abc import Callable

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


#: How much more ε the empty-answer note prices (τ at each multiple of the query's ε).
_MORE_EPSILON = (2, 4, 10)


def empty_selection_note(
    plan: Plan, epsilon: float, threshold: int, threshold_at: Callable[[float], int | None]
) -> str:
    """Why a query released no group at all: partition selection kept none. Says the threshold τ the
    noisy distinct-person counts had to reach, and what would release groups: a public domain for the
    keys (declared, so every value is released without selection), a coarser key (fewer, larger groups),
    or more ε (τ at a few larger ε, from ``threshold_at``). Every figure comes from the policy, the SQL
    and the settings, and "none passed" is what the empty answer already shows: the note is the same on
    every neighbouring database."""
    keys = ", ".join(k.column if k.expr is not None or not k.table else f"{k.table}.{k.column}" for k in plan.keys
                     if k.domain is None)  # fmt: skip
    offers = []
    for factor in _MORE_EPSILON:
        tau = threshold_at(epsilon * factor)
        if tau is not None and tau < threshold:
            offers.append(f"τ={tau} at ε={epsilon * factor:g}")
    more = f"more ε ({', '.join(offers)})" if offers else "more ε"
    counted = f"distinct {plan.sources.unit_description}" if plan.unit is not None else "rows (one per person)"
    return (
        f"dpsql: no group was released: a group of {keys} (no public domain) is released only when its noisy "
        f"count of {counted} reaches τ={threshold} at ε={epsilon:g}, and none did. "
        f"To release groups: declare a domain for {keys} in the policy (every value is then released, none "
        f"selected), group by a coarser key, or ask with {more}"
    )
