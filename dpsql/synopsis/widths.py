"""What each chart shape of a declared synopsis will get (issue #38 item 2): its ± from the synopsis beside
the ± of the same chart asked alone, before anything is released.

A chart shape is a measured marginal (its keys) and a measure. Its ± from the synopsis is the least-squares
variance of one of its cells (:mod:`dpsql.synopsis.solve`: every cell of a marginal has the same one), which
depends on the cube's shape and the marginals' noise variances only — public figures of the declaration
and the policy, no data; the fresh ± is the same chart's at the policy's default ε. ``dpsql policy check``
and ``dpsql synopsis build`` print both and warn where the synopsis's is more than :data:`WARN_RATIO`×.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsql.analyze import analyze_tree
from dpsql.analyze.parse import parse_statement
from dpsql.noise.mechanisms import half_width
from dpsql.plan import Plan
from dpsql.policy import Policy
from dpsql.release.calibrate import budget
from dpsql.session import Session
from dpsql.synopsis.answer import half_width_factor
from dpsql.synopsis.solve import Marginal, marginal_index, noise_variance, solve

#: A chart whose ± from the synopsis is more than this many times its fresh ± is warned about.
WARN_RATIO = 2.0


@dataclass(frozen=True)
class ChartWidth:
    """One chart shape: its keys, its measure, its ± from the synopsis and alone at the default ε."""

    keys: tuple[str, ...]
    measure: str
    synopsis: float
    fresh: float

    @property
    def ratio(self) -> float:
        return self.synopsis / self.fresh if self.fresh else math.inf

    def line(self, name: str, epsilon: float) -> str:
        by = ", ".join(self.keys) or "no key (a total)"
        return (
            f'synopsis "{name}": {self.measure} by {by}: ±{self.synopsis:.4g} from the synopsis, ±{self.fresh:.4g} '
            f"alone at ε={epsilon:g} ({self.ratio:.2g}×)"
        )


def chart_widths(
    policy: Policy, name: str, plans: Sequence[Plan], full: Plan, confidence: float | None = None
) -> list[ChartWidth]:
    """Every measured marginal's chart shapes (``plans``: the marginals' analysed queries, in the order of
    ``measured``; ``full``: the query over every key, whose keys give the cube's shape)."""
    synopsis = policy.synopses[name]
    level = confidence if confidence is not None else policy.defaults.confidence
    share = len(synopsis.measured)
    measuring = Session(
        f"synopsis:{name}",
        epsilon=synopsis.epsilon / share,
        delta=synopsis.delta / share,
        mechanism=synopsis.mechanism or policy.defaults.mechanism,
    )
    alone = Session(f"synopsis:{name}")  # the policy's defaults: what a chart asked alone gets
    shape = tuple(len(k.domain or ()) for k in full.keys)
    found: list[ChartWidth] = []
    for j, measure in enumerate(synopsis.measures):
        marginals, fresh, mechanisms = [], [], set()
        for axes, plan in zip(synopsis.measured, plans, strict=True):
            i = plan.outputs[len(plan.keys) + j].measures[0]
            spec = budget(policy, plan, measuring, level).specs[i]
            chart = _chart(policy, name, axes, measure)  # the chart asked alone: this measure only
            single = budget(policy, chart, alone, level).specs[chart.outputs[len(chart.keys)].measures[0]]
            assert spec is not None and single is not None
            mechanisms.add(spec.mechanism)
            size = math.prod(shape[a] for a in axes)
            marginals.append(Marginal(tuple(axes), [0.0] * size, noise_variance(spec)))
            fresh.append(half_width(single, level))
        estimate = solve(shape, marginals)
        z = half_width_factor(level, mechanisms) if mechanisms else 0.0  # no marginal measured: no chart
        for axes, width in zip(synopsis.measured, fresh, strict=True):
            count = math.prod(shape[a] for a in axes)
            _, variances = estimate.totals(marginal_index(shape, tuple(axes)), count)
            keys = tuple(synopsis.axes[a] for a in axes)
            found.append(ChartWidth(keys, measure, z * math.sqrt(float(np.max(variances))), width))
    return found


def _chart(policy: Policy, name: str, axes: Sequence[int], measure: str) -> Plan:
    synopsis = policy.synopses[name]
    keys = ", ".join(synopsis.axes[a] for a in axes)
    sql = f"SELECT {keys + ', ' if keys else ''}{measure} FROM {synopsis.table}" + (f" GROUP BY {keys}" if keys else "")
    return analyze_tree(parse_statement(sql), policy, None)
