"""Randomized response: columns collected under *local* DP, and the estimates read from them.

Privacy argument (the seeds' coin-flip mechanism, generalised to k values). When a value
of a ``randomized_response`` column is written through dpsql, it is kept with probability
p = e^ε/(e^ε + k − 1) and otherwise replaced by one of the k − 1 other values uniformly
(probability q = 1/(e^ε + k − 1) each). For any two true values the probability of any
stored value differs by at most p/q = e^ε: the stored value is ε-LDP, and the database
never holds the truth. Everything computed from stored values alone — here the debiased
frequency t̂_v = (c_v − q·n)/(p − q) — is post-processing and costs no central budget.
Only the number of respondents n is released exactly: under this model who answered is
public; what they answered is protected.

Coins come from the OS CSPRNG (``secrets``); the keep probability is compared with a
53-bit uniform, so it is exact to within 2^-53 (the ε guarantee moves by < 1e-15).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any


@dataclass(frozen=True)
class RandomizedResponse:
    """k-ary randomized response at ε over ``domain``."""

    epsilon: float
    domain: tuple[Any, ...]

    @property
    def keep(self) -> float:
        """p: probability that the stored value is the true one."""
        e = math.exp(self.epsilon)
        return e / (e + len(self.domain) - 1)

    @property
    def flip(self) -> float:
        """q: probability of storing one particular other value."""
        return 1.0 / (math.exp(self.epsilon) + len(self.domain) - 1)

    def perturb(self, value: Any) -> Any:
        """The value to store for a respondent whose true answer is ``value``."""
        if secrets.randbits(53) < int(self.keep * 2**53):
            return value
        others = [v for v in self.domain if v != value]
        return others[secrets.randbelow(len(others))]

    def estimate(self, observed: Mapping[Any, int], confidence: float) -> dict[Any, tuple[float, float]]:
        """Unbiased count of each true value, with the half-width of its normal-approximation interval."""
        n = sum(observed.get(v, 0) for v in self.domain)
        p, q = self.keep, self.flip
        z = NormalDist().inv_cdf(0.5 + confidence / 2)
        estimates = {}
        for value in self.domain:
            c = observed.get(value, 0)
            rate = c / n if n else 0.0
            estimates[value] = ((c - q * n) / (p - q), z * math.sqrt(n * rate * (1 - rate)) / (p - q))
        return estimates


def perturb_rows(
    rows: Sequence[Sequence[Any]], mechanisms: Sequence[RandomizedResponse | None]
) -> list[tuple[Any, ...]]:
    """Rows as they will be stored: randomized-response columns perturbed, the rest unchanged."""
    return [
        tuple(value if rr is None else rr.perturb(value) for value, rr in zip(row, mechanisms, strict=True))
        for row in rows
    ]
