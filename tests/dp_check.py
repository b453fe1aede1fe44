"""The empirical ε-DP check several neighbour tests share: outcome counts on two neighbours, compared
bin by bin with Clopper–Pearson bounds in both directions."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import replace
from typing import TypeVar

from scipy.stats import beta

from dpsql.engine import Engine
from dpsql.plan import Physical
from dpsql.prepared import Prepared

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


#: Interval ends sampled per release input (:func:`sampled_interval_ends`), for the test session.
_SAMPLED: dict[str, tuple[Counter[float], Counter[float]]] = {}


def _typed(rows: list[tuple[object, ...]]) -> list[tuple[tuple[str, str], ...]]:
    return [tuple((type(v).__name__, repr(v)) for v in row) for row in rows]


def sampled_interval_ends(engine: Engine, prepared: Prepared, n: int) -> tuple[Counter[float], Counter[float]]:
    """The lower and upper ends of the first measure's interval (first row) in ``n`` releases of ``prepared``
    from the rows and histograms ``engine``'s backend measures.

    A release is a function of the plan less its :class:`~dpsql.plan.Physical` choices (they shape the SQL
    only), the budgeting, the measured rows and the histograms' cell counts (in any row order): equal
    inputs give equally distributed ends, so they are sampled once per session, keyed by those inputs with
    their Python types (a backend returning ``Decimal`` where another returns ``int`` is sampled on its
    own). A neighbour shared by several comparisons (the absent person) and a second backend that counts
    alike reuse the samples: every comparison keeps its full n and power, for fewer draws."""
    rows = engine.step.query(prepared.sql)
    histograms = {i: engine.step.query(q) for i, q in prepared.histograms}
    key = repr(
        (
            n,
            replace(prepared.plan, physical=Physical()),
            prepared.budgeting,
            _typed(rows),
            {i: sorted(_typed(h)) for i, h in histograms.items()},
        )
    )
    if key not in _SAMPLED:
        ends = [engine.step.release_rows(prepared, rows, 0.95, histograms).intervals[0][0] for _ in range(n)]
        _SAMPLED[key] = (Counter(e[0] for e in ends if e is not None), Counter(e[1] for e in ends if e is not None))
    return _SAMPLED[key]
