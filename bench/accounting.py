"""Benchmark: how many queries one (ε = 1, δ = 10⁻⁶) budget answers under each accounting (issue #29 item 5).

Per-query mechanism × accounting, each figure the largest k such that k equal queries fit:

* **pure**: basic composition, dpsql's ``pure`` accounting (``dpsql.accountant.check_budget``, as the
  ledger calls it). A Gaussian query is charged its zCDP conversion (ε(ρ, δ/k), δ/k): δ split evenly.
* **zCDP**: dpsql's ``zcdp`` accounting, same calls: a pure ε charge counts ρ = ε²/2, a Gaussian its ρ,
  and Σρ converts to ε at the budget's δ (Canonne–Kamath–Steinke).
* **PLD**: ``dpsql.pld`` (Google's ``dp-accounting``, the ``pld`` extra), pessimistic discretization
  10⁻⁴: the continuous mechanism, dpsql's discrete one, and the generic worst case of an ε-DP
  mechanism. dpsql's discrete Laplace on a count (sensitivity one grid step) has exactly that
  worst-case PLD (loss ±ε), so its column is the generic one.

``python bench/accounting.py`` prints the table alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from common import ANALYST, Section

from dpsql.accountant import Accounting, Allowance, Cost, Spent, check_budget, rho_to_epsilon
from dpsql.errors import PrivacyBudgetExhausted

BUDGET = Allowance(1.0, 1e-6)
#: Per-query ε of the Laplace rows; 0.1 is the issue's bar.
LAPLACE_EPSILONS = (0.1, 0.03, 0.01)
#: σ/Δ of the Gaussian rows (ρ = 1/(2σ²); σ = 10 is the ρ zCDP charges an ε = 0.1 Laplace query).
GAUSSIAN_SIGMAS = (10.0, 30.0)
LIMIT = 20_000


def largest(fits: Callable[[int], bool], limit: int = LIMIT) -> int:
    """Largest k ≤ ``limit`` with ``fits(k)``, for a ``fits`` monotone in k (galloping, then bisection)."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def ledger_fits(charge: Callable[[int], Cost], accounting: Accounting) -> Callable[[int], bool]:
    """Whether k charges of ``charge(k)`` pass dpsql's accountant one by one, recorded as the ledger does."""

    def fits(k: int) -> bool:
        spent = Spent()
        cost = charge(k)
        rho = cost.zcdp_rho() if accounting == "zcdp" else cost.rho
        recorded = Cost(cost.epsilon, cost.delta, rho, cost.selection_delta)
        for _ in range(k):
            try:
                check_budget(who="analyst", name=ANALYST, spent=spent, cost=cost, budget=BUDGET, accounting=accounting)
            except PrivacyBudgetExhausted:
                return False
            spent = spent + recorded
        return True

    return fits


def run(quick: bool) -> Section:
    section = Section(
        "accounting",
        f"queries a (ε={BUDGET.epsilon:g}, δ={BUDGET.delta:g}) budget answers, by accounting",
        ["queries of", "pure", "zCDP", "PLD continuous", "PLD dpsql's discrete", "PLD generic", "PLD / best other"],
    )
    try:
        import dp_accounting  # noqa: F401
    except ImportError as exc:
        section.headers = ["status", "reason"]
        section.rows.append(["skipped", f"dp-accounting is not installed ({exc}); install the 'pld' extra"])
        section.data["skipped"] = str(exc)
        return section
    from dpsql.pld import pld_fits

    def pld(cost: Cost) -> int:
        return largest(lambda k: pld_fits([cost] * k, BUDGET))

    results: list[dict[str, object]] = []

    def add(label: str, pure: int, zcdp: int, continuous: int, discrete: int, generic: int | None) -> None:
        best = max(pure, zcdp)
        ratio = discrete / best if best else None
        section.rows.append([label, pure, zcdp, continuous, discrete, generic, ratio])
        results.append(
            {
                "queries": label,
                "pure": pure,
                "zcdp": zcdp,
                "pld_continuous": continuous,
                "pld_dpsql_discrete": discrete,
                "pld_generic": generic,
                "pld_over_best_other": ratio,
            }
        )

    for eps in LAPLACE_EPSILONS:
        generic = pld(Cost(eps))
        add(
            f"Laplace ε={eps:g}",
            largest(ledger_fits(lambda k, eps=eps: Cost(eps), "pure")),
            largest(ledger_fits(lambda k, eps=eps: Cost(eps), "zcdp")),
            pld(Cost(eps, mechanism="continuous_laplace")),
            generic,  # dpsql's discrete Laplace on a count: exactly the generic PLD
            generic,
        )
    for sigma in GAUSSIAN_SIGMAS:
        rho = 1 / (2 * sigma**2)

        def pure_charge(k: int, rho: float = rho, delta: float = BUDGET.delta) -> Cost:
            return Cost(rho_to_epsilon(rho, delta / k), delta / k, rho)

        def zcdp_charge(k: int, rho: float = rho, delta: float = BUDGET.delta) -> Cost:
            return Cost(rho_to_epsilon(rho, delta), delta, rho)

        one = zcdp_charge(1)  # the (ε, δ) dpsql states for one query, and its ρ
        add(
            f"Gaussian σ/Δ={sigma:g} (ρ={rho:.3g})",
            largest(ledger_fits(pure_charge, "pure")),
            largest(ledger_fits(zcdp_charge, "zcdp")),
            pld(Cost(one.epsilon, one.delta, rho, mechanism="continuous_gaussian")),
            pld(Cost(one.epsilon, one.delta, rho, mechanism="discrete_gaussian")),
            None,
        )
    section.notes += [
        "PLD / best other: dpsql's discrete column over the better of pure and zCDP (dpsql offers both)",
        "dpsql's discrete Laplace on a count has exactly the generic ε-DP PLD (loss ±ε): same column",
        "a Gaussian under pure accounting is charged ε(ρ, δ/k) with δ split evenly over the k queries",
    ]
    section.data.update({"budget": {"epsilon": BUDGET.epsilon, "delta": BUDGET.delta}, "results": results})
    return section


if __name__ == "__main__":
    run("--quick" in sys.argv).print()
