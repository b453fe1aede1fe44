"""Privacy-loss-distribution (PLD) accounting: the ε a sequence of releases amounts to at a δ.

The privacy argument and design notes: docs/internals.md, section dpsql/pld.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING

from dpsql.accountant import HINT_SELECTION, REL_TOLERANCE, BudgetLike, Cost, fmt, refusal

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

#: Width of the privacy-loss grid: finer is tighter (by at most about one step per composed
#: release) and slower.
DISCRETIZATION = 1e-4

#: The ``Cost.mechanism`` names a PLD is known for, and what a cost carrying one claims. The
#: names say *continuous* or *discrete* on purpose: dpsql's own noise (``dpsql.noise``) is
#: discrete, and a discrete mechanism is not always dominated by its continuous namesake. Its
#: discrete Laplace on a count (sensitivity one grid step) has exactly the worst-case ε-DP PLD
#: (loss ±ε), i.e. ``None``; its discrete Gaussian at sensitivity 1 is ``"discrete_gaussian"``
#: (measured: ε at δ = 10⁻⁶ about 1 % *above* the continuous Gaussian's at σ = 2 and 5).
PLD_MECHANISMS: dict[str, str] = {
    "continuous_laplace": "one release of a scalar plus continuous Laplace noise of scale Δ/ε (rho == 0, "
    "no δ but partition selection's)",
    "continuous_gaussian": "one release of a vector plus continuous Gaussian noise of σ/Δ₂ = 1/√(2ρ) (rho > 0)",
    "discrete_gaussian": "one release of an integer scalar of sensitivity 1 plus discrete Gaussian noise of "
    "parameter σ = 1/√(2ρ) (rho > 0)",
}


def pld_epsilon(
    costs: Iterable[Cost], delta: float, *, discretization: float = DISCRETIZATION, basic: bool = True
) -> float:
    """ε of the (ε, ``delta``)-DP guarantee of the composition of ``costs`` under PLD accounting.

    The composed PLD is read at ``delta`` − Σ selection δ (``math.inf`` when that is negative or
    no finite ε reaches it). With ``basic`` (the default) the result is also capped by basic
    composition's Σε when Σδ ≤ ``delta``: both are valid bounds, and the pessimistic rounding can
    leave a PLD a few grid steps above Σε when basic composition is already tight.
    """
    return composed_epsilon(Counter(costs).items(), delta, discretization=discretization, basic=basic)


def composed_epsilon(
    groups: Iterable[tuple[Cost, int]], delta: float, *, discretization: float = DISCRETIZATION, basic: bool = True
) -> float:
    """:func:`pld_epsilon` of ``count`` copies of each cost of ``groups`` (``(cost, count)`` pairs, as the
    ledger reads its charges): equal releases self-compose, so the work grows with distinct costs only."""
    groups = [(cost, count) for cost, count in groups if count > 0]
    if not (0.0 <= delta < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    counts: Counter[tuple[str, float, float]] = Counter()
    for cost, count in groups:
        counts[_key(cost)] += count  # checks every tag, whatever happens next
    selection = math.fsum(c.selection_delta * n for c, n in groups)
    at = delta - selection * (1 + REL_TOLERANCE) if selection > 0 else delta
    epsilon = _composed(counts, discretization).get_epsilon_for_delta(at) if at >= 0 else math.inf
    epsilon = float(epsilon)
    if basic and math.fsum(c.delta * n for c, n in groups) <= delta * (1 + REL_TOLERANCE):
        epsilon = min(epsilon, math.fsum(c.epsilon * n for c, n in groups))
    return epsilon


def pld_fits(costs: Iterable[Cost], budget: BudgetLike, *, discretization: float = DISCRETIZATION) -> bool:
    """Whether the composition of ``costs`` stays within ``budget`` (ε at the budget's δ), with the
    accountant's relative slack so that spending exactly the budget fits."""
    epsilon = pld_epsilon(costs, budget.delta, discretization=discretization)
    return epsilon <= budget.epsilon * (1 + REL_TOLERANCE)


def check_pld_budget(
    *, who: str, name: str, previous: Iterable[tuple[Cost, int]], cost: Cost, budget: BudgetLike
) -> float:
    """The ledger's check under ``pld`` accounting: raise :class:`~dpsql.errors.PrivacyBudgetExhausted`
    (53P01, :func:`dpsql.accountant.check_budget`'s message shape) unless the ``previous`` charges
    and ``cost`` composed by PLD stay within ``budget``; return the composed ε they reach.

    Every cost is composed untagged (:data:`PLD_MECHANISMS`' tags are dropped): the generic PLD of its
    (ε, δ) dominates whatever mechanism produced it. Refused when the selection δs add up beyond
    the δ budget (they are no PLD quantity, see the module docstring) or when the composed ε at the
    budget's δ exceeds its ε (with the accountant's relative slack). Pure function of budget figures
    only: the figures in a refusal are the analyst's own (the dataset's refusal shows none)."""
    spent = [(_untagged(c), n) for c, n in previous if n > 0]
    this = _untagged(cost)
    selection = math.fsum([c.selection_delta * n for c, n in spent] + [this.selection_delta])
    if this.selection_delta > 0 and selection > budget.delta * (1 + REL_TOLERANCE):
        spent_selection = selection - this.selection_delta
        detail = (
            f"spent partition-selection δ={fmt(spent_selection)} of {fmt(budget.delta)}, "
            f"this query needs δ={fmt(this.selection_delta)}"
        )
        raise refusal(who, name, this, detail, HINT_SELECTION)
    total = composed_epsilon([*spent, (this, 1)], budget.delta)
    if not total <= budget.epsilon * (1 + REL_TOLERANCE):
        before = composed_epsilon(spent, budget.delta) if who != "dataset" else math.nan
        detail = (
            f"spent ε={fmt(before)} (composed by PLD at δ={fmt(budget.delta)}) of {fmt(budget.epsilon)}, "
            f"this query needs ε={fmt(this.epsilon)}"
            + (f", δ={fmt(this.delta)}" if this.delta else "")
            + f", which would total ε={fmt(total)}"
        )
        raise refusal(who, name, this, detail)
    return total


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether Google's ``dp-accounting`` (the ``pld`` extra) can be imported: ``budget.accounting: pld``
    is refused at policy load without it, never at the first query."""
    try:
        from dp_accounting.pld import privacy_loss_distribution  # noqa: F401
    except ImportError:
        return False
    return True


def _untagged(cost: Cost) -> Cost:
    return cost if cost.mechanism is None else Cost(cost.epsilon, cost.delta, cost.rho, cost.selection_delta)


def _composed(counts: Counter[tuple[str, float, float]], discretization: float) -> PrivacyLossDistribution:
    """The PLD of the whole sequence: equal releases by self-composition, then the groups composed."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    result = pld_lib.identity(value_discretization_interval=discretization)
    for key, count in sorted(counts.items(), key=repr):
        single = _single(key, discretization)
        if single is not None:
            result = result.compose(single.self_compose(count) if count > 1 else single)
    return result


def _key(cost: Cost) -> tuple[str, float, float]:
    """What a cost's PLD depends on: its mechanism and its parameters (ε and δ − δ_sel, ε, or ρ)."""
    if cost.mechanism is None:
        return ("generic", cost.epsilon, cost.delta - cost.selection_delta)
    if cost.mechanism not in PLD_MECHANISMS:
        raise ValueError(f"unknown PLD mechanism {cost.mechanism!r}; known: {', '.join(PLD_MECHANISMS)}")
    if cost.mechanism == "continuous_laplace":
        if cost.rho != 0 or cost.delta != cost.selection_delta:
            raise ValueError("a continuous_laplace cost is pure ε-DP: rho must be 0 and its δ selection δ only")
        return (cost.mechanism, cost.epsilon, 0.0)
    if cost.rho <= 0:
        raise ValueError(f"a {cost.mechanism} cost needs its rho > 0")
    return (cost.mechanism, cost.rho, 0.0)


@lru_cache(maxsize=256)
def _single(key: tuple[str, float, float], discretization: float) -> PrivacyLossDistribution | None:
    """One release's PLD (``None`` for a free one); PLDs are never mutated, so sharing them is safe."""
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    name, value, delta = key
    if name == "generic":
        if value == 0 and delta == 0:
            return None
        params = common.DifferentialPrivacyParameters(value, delta)
        return pld_lib.from_privacy_parameters(params, value_discretization_interval=discretization)
    if value == 0:
        return None
    if name == "continuous_laplace":
        return pld_lib.from_laplace_mechanism(1.0 / value, value_discretization_interval=discretization)
    sigma = 1.0 / math.sqrt(2.0 * value)
    if name == "continuous_gaussian":
        return pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=discretization)
    return pld_lib.from_discrete_gaussian_mechanism(sigma, value_discretization_interval=discretization)
