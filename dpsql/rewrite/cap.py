"""The query that chooses a query's cap under DP: per candidate τ, the units with more than τ rows.

It reads what the measurement reads (the sources, their joins and WHERE, the unit) and counts rows
per unit; one row comes back, one count of units per candidate (:mod:`dpsql.release.cap`). Each unit's
count is of its own rows only, so one unit moves each candidate's count by at most 1.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan
from dpsql.rewrite.bounding import over_sources
from dpsql.rewrite.filter import filter_rows
from dpsql.rewrite.measures import select_measures


def units_above(plan: Plan, candidates: tuple[int, ...]) -> exp.Select:
    """``SELECT SUM(CASE WHEN n > τ THEN 1 ELSE 0 END), … FROM (rows per unit)``."""
    assert plan.unit is not None
    base = filter_rows(select_measures(exp.select(), plan), plan)  # the measurement's sources, joins, WHERE
    per_unit = over_sources(base, exp.alias_(exp.Count(this=exp.Star(), big_int=True), "__n")).group_by(
        plan.unit.copy(), copy=False
    )
    n = exp.column("__n", quoted=True)
    counts = [
        exp.alias_(
            exp.Coalesce(
                this=exp.Sum(
                    this=exp.Case()
                    .when(exp.GT(this=n.copy(), expression=exp.Literal.number(tau)), exp.Literal.number(1))
                    .else_(exp.Literal.number(0))
                ),
                expressions=[exp.Literal.number(0)],
            ),
            f"a{i}",
        )
        for i, tau in enumerate(candidates)
    ]
    return exp.select(*counts).from_("__per_unit").with_("__per_unit", as_=per_unit, copy=False)
