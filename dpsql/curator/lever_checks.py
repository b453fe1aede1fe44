"""The curator's levers on an analyst's budget: ``grant``, ``revoke``, ``freeze``, ``unfreeze``.

One home for their checks, shared by ``dpsql budget grant|revoke|freeze|unfreeze``
(:mod:`dpsql.curator.ledger_cli`) and the dashboard's form (:mod:`dpsql.dashboard.pages`). Every
lever is a new ledger row (who, when, why): nothing is ever changed, so the history of an analyst's
limit is the audit; a revoke is its own row taking grants back (never budget already spent). A
running ``dpsql serve`` needs no restart: it reads the levers inside every reservation and checks the
freeze before analysing each statement.

Privacy meaning: a grant of (ε, δ) lets the analyst release that much more about the data; it is
the curator's decision and is recorded as such. The dataset's total (the policy's
``budget.dataset``) is not raised by a grant — it bounds what all analysts together may learn.
"""

from __future__ import annotations

import math

from dpsql.errors import InvalidParameterValue, UndefinedObject
from dpsql.ledger import Ledger
from dpsql.policy import Policy


def apply_lever(
    ledger: Ledger,
    policy: Policy,
    lever: str,
    analyst: str,
    *,
    by: str,
    reason: str,
    epsilon: float = 0.0,
    delta: float = 0.0,
) -> list[str]:
    """Validate and append one curator lever (``grant``, ``revoke``, ``freeze``, ``unfreeze``) to the
    ledger; returns warnings for the curator (applied anyway).

    The one home of the levers' checks, shared by ``dpsql budget`` and ``dpsql dashboard``: an
    unknown analyst is 42704; a non-finite or negative grant, one taking δ to 1, or one taking the
    analyst's grants beyond the dataset's budget (which bounds every analyst's spending anyway) is 22023,
    and so is a revoke of more than the analyst's grants or below what they already spent. A grant
    larger than what the dataset has left warns: the analyst can never spend more than that."""
    if policy.analyst(analyst) is None:
        raise UndefinedObject(
            f'analyst "{analyst}" is not in the policy',
            hint="Name one of the policy's analysts (see dpsql budget).",
        )
    base = policy.analyst_budget(analyst)
    warnings: list[str] = []
    if lever in ("grant", "revoke") and (
        not (math.isfinite(epsilon) and math.isfinite(delta)) or epsilon < 0 or delta < 0
    ):
        raise InvalidParameterValue(
            f"invalid {lever}: ε={epsilon:g}, δ={delta:g}", hint=f"{lever.capitalize()} a finite ε ≥ 0 and δ ≥ 0."
        )
    if lever == "grant":
        limit = ledger.levers(policy.dataset, analyst).limit(base)
        if limit.delta + delta >= 1:
            raise InvalidParameterValue(
                f"invalid grant: δ would reach {limit.delta + delta:g}", hint="An analyst's δ stays below 1."
            )
        ledger.grant(
            dataset=policy.dataset,
            analyst=analyst,
            epsilon=epsilon,
            delta=delta,
            by=by,
            reason=reason,
            dataset_budget=policy.budget.dataset,
        )
        left = ledger.remaining(policy.dataset, budget=policy.budget.dataset, accounting=policy.budget.accounting)
        if epsilon > left.epsilon or delta > left.delta:
            warnings.append(
                f"the grant of ε={epsilon:g}, δ={delta:g} is more than the dataset has left "
                f"(ε={left.epsilon:g}, δ={left.delta:g}, shared by all analysts): "
                f'analyst "{analyst}" can spend at most that'
            )
    elif lever == "revoke":
        ledger.revoke(
            dataset=policy.dataset,
            analyst=analyst,
            epsilon=epsilon,
            delta=delta,
            by=by,
            reason=reason,
            analyst_budget=base,
            accounting=policy.budget.accounting,
        )
    elif lever == "freeze":
        ledger.freeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    elif lever == "unfreeze":
        ledger.unfreeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    else:
        raise InvalidParameterValue(f"unknown lever {lever!r}", hint="Use grant, revoke, freeze or unfreeze.")
    return warnings
