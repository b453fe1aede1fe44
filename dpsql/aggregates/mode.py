"""MODE over a public domain: report-noisy-max over the candidates' counts, once per group."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlglot import exp

from dpsql.aggregates.base import Recognised, Rows, Scope, Selection, Spending, measure_var
from dpsql.aggregates.notes import Counts, Interval
from dpsql.errors import FeatureNotSupported
from dpsql.noise.exponential import select_mode
from dpsql.pgtypes import PgType
from dpsql.plan import Measure, OutputItem, Plan
from dpsql.plan.sources import resolve_ref
from dpsql.policy import PG_TYPE_NAMES
from dpsql.session import ci_label


class Mode(Selection):
    kind = "mode"
    recognises = (exp.Mode,)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        """mode() WITHIN GROUP (ORDER BY col): report-noisy-max over the column's public domain."""
        order = node.expression if isinstance(node, exp.WithinGroup) else None
        ordered = order.expressions[0] if isinstance(order, exp.Order) and len(order.expressions) == 1 else None
        if ordered is None or not isinstance(ordered.this, exp.Column):
            raise FeatureNotSupported("mode() needs exactly one ORDER BY column")
        source, name, policy = resolve_ref(ordered.this, scope.sources)
        domain = policy.release_domain()
        if domain is None:
            raise FeatureNotSupported(
                f'mode() needs a public domain for column "{name}"',
                hint=f'Declare the possible values of "{name}" (domain) in the policy: '
                "the winner is chosen among them.",
            )
        measure = Measure(kind="mode", column=name, table=source.alias, domain=domain, integer=False)
        index = scope.measure(measure)
        return Recognised(measure_var(index), self.kind, (index,))

    def label(self, measure: Measure) -> str:
        return f"MODE({measure.column}) over {len(measure.domain or ())} public values"

    def converter(self, measure: Measure) -> Callable[[Any], Any]:
        return lambda value: value

    def select(
        self,
        plan: Plan,
        index: int,
        rows: Rows,
        histogram: Rows,
        epsilon: float,
        *,
        level: float = 0.95,
        cut: float = 0.0,
    ) -> list[Any]:
        """Report-noisy-max, once per released group, over the counts of the public candidates."""
        nkeys = len(plan.keys)
        measure = plan.measures[index]
        candidates = list(measure.domain or ())
        position = {value: i for i, value in enumerate(candidates)}
        counts: dict[tuple[Any, ...], list[int]] = {}
        for row in histogram:
            slot = position.get(row[nkeys])
            if slot is not None:  # values outside the public domain are never candidates
                counts.setdefault(tuple(row[:nkeys]), [0] * len(candidates))[slot] += int(row[nkeys + 1])
        sensitivity = plan.sensitivities(measure)[0]
        empty = [0] * len(candidates)
        return [candidates[select_mode(counts.get(tuple(row[:nkeys]), empty), epsilon, sensitivity)] for row in rows]

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        measure = scope.measures[measures[0]]
        return PG_TYPE_NAMES[scope.sources.column_policy(measure.table, measure.column).type]

    def notes(
        self,
        out: OutputItem,
        plan: Plan,
        budgeting: Spending,
        level: float,
        values: list[Any],
        counts: Mapping[str | None, Counts],
        intervals: Sequence[tuple[str, Interval | None]] | None = None,
    ) -> list[str] | None:
        i = out.measures[0]
        return [_mode_note(out.column.name, plan.measures[i], plan, budgeting.shares[i], level, ci_label(level))]

    def explain(self, out: OutputItem, plan: Plan, budgeting: Spending, confidence: float) -> dict[str, Any]:
        i = out.measures[0]
        return {
            "measure": f"{plan.measures[i].label}: report-noisy-max",
            "sensitivity": plan.sensitivities(plan.measures[i])[0],
            "scale": plan.sensitivities(plan.measures[i])[0] / budgeting.shares[i],
            "epsilon": budgeting.shares[i],
            "ci": float("nan"),
        }


def _mode_note(name: str, measure: Measure, plan: Plan, epsilon: float, level: float, pct: str) -> str:
    """Report-noisy-max with exponential noise of scale b = Δ/ε over N candidates: every noise is at
    most b·ln(N/β) with probability ≥ 1 − β (union bound), so the winner's count is at most that far
    below the most frequent candidate's (the noises are non-negative)."""
    candidates = len(measure.domain or ())
    scale = plan.sensitivities(measure)[0] / epsilon
    gap = scale * math.log(max(candidates, 1) / (1.0 - level))
    return (
        f"dpsql: {name} has no ± interval (report-noisy-max among {candidates} public values): at {pct}% "
        f"the chosen value's count is within {gap:.4g} of the most frequent value's count"
    )
