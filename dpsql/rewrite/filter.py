"""Pass 6, ``filter_rows``: the analysed WHERE clause."""

from __future__ import annotations

from sqlglot import exp

from dpsql.plan import Plan


def filter_rows(select: exp.Select, plan: Plan) -> exp.Select:
    return select.where(plan.where.copy(), copy=False) if plan.where is not None else select
