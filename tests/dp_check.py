"""The empirical ε-DP check several neighbour tests share: outcome counts on two neighbours, compared
bin by bin with Clopper–Pearson bounds in both directions."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable
from typing import TypeVar

from scipy.stats import beta

T = TypeVar("T", bound=Hashable)


def assert_counts_epsilon_dp(a: Counter[T], b: Counter[T], n: int, epsilon: float, context: object = None) -> set[T]:
    """Each outcome seen ``k_a`` times of ``n`` on one neighbour and ``k_b`` on the other: the lower bound of
    its probability on one is at most e^ε times the upper bound on the other (α = 0.001 over all outcomes and
    both directions). Returns the outcomes seen, for the caller's non-vacuity check."""
    outcomes = set(a) | set(b)
    alpha = 0.001 / (2 * len(outcomes))
    for outcome in outcomes:
        for one, other in ((a, b), (b, a)):
            k_a, k_b = one[outcome], other[outcome]
            if k_a == 0:
                continue
            low_a = beta.ppf(alpha, k_a, n - k_a + 1)
            high_b = beta.ppf(1 - alpha, k_b + 1, n - k_b) if k_b < n else 1.0
            assert low_a <= math.exp(epsilon) * high_b, (context, outcome, k_a, k_b)
    return outcomes
