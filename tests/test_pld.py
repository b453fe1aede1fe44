"""PLD accounting (dpsql/pld.py, issue #29 item 5): never below the exact ε, never worse than basic
composition or zCDP, Gaussian composition as dp_accounting's RDP and the closed form say."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("dp_accounting")

from scipy.stats import norm

from dpsql.accountant import Allowance, Cost, rho_to_epsilon
from dpsql.pld import DISCRETIZATION, pld_epsilon, pld_fits

pytestmark = pytest.mark.unit

BUDGET = Allowance(1.0, 1e-6)


def laplace(epsilon: float, selection_delta: float = 0.0) -> Cost:
    return Cost(epsilon, selection_delta, selection_delta=selection_delta, mechanism="continuous_laplace")


def gaussian(rho: float, mechanism: str = "continuous_gaussian") -> Cost:
    return Cost(rho_to_epsilon(rho, 1e-6), 1e-6, rho=rho, mechanism=mechanism)


def most_that_fit(cost: Cost, budget: Allowance = BUDGET, limit: int = 2000) -> int:
    """Largest k with k copies of ``cost`` within ``budget`` (fitting is monotone in k)."""
    lo, hi = 0, 1
    while hi <= limit and pld_fits([cost] * hi, budget):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pld_fits([cost] * mid, budget) else (lo, mid)
    return lo


def exact_laplace_epsilon(epsilon: float, delta: float) -> float:
    """Laplace of scale Δ/ε: δ(ε') = 1 − exp((ε' − ε)/2) for 0 ≤ ε' ≤ ε."""
    return max(0.0, epsilon + 2 * math.log1p(-delta))


def exact_generic_epsilon(epsilon: float, delta: float) -> float:
    """Randomized response, the worst ε-DP mechanism: δ(ε') = (e^ε − e^ε')/(1 + e^ε)."""
    inner = math.exp(epsilon) - delta * (1 + math.exp(epsilon))
    return max(0.0, math.log(inner)) if inner > 0 else 0.0


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Gaussian of σ/Δ = 1/μ (Balle–Wang 2018): δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ); bisection on ε."""

    def d(eps: float) -> float:
        return float(norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu))

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if d(mid) <= delta else (mid, hi)
    return hi


@pytest.mark.parametrize("epsilon", [0.01, 0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [0.0, 1e-12, 1e-6, 1e-3])
def test_one_release_never_below_its_exact_epsilon(epsilon: float, delta: float) -> None:
    """Never below (up to float rounding, 1e-12 relative); within two grid steps above for δ > 0. At
    δ = 0 the continuous Laplace PLD reads ∞ (its truncated tails count as infinite loss), and the
    basic-composition cap gives back ε exactly."""
    floor = 1 - 1e-12
    for cost, exact in (
        (laplace(epsilon), exact_laplace_epsilon(epsilon, delta)),
        (Cost(epsilon), exact_generic_epsilon(epsilon, delta)),
    ):
        raw = pld_epsilon([cost], delta, basic=False)
        assert raw >= exact * floor
        if delta > 0 or cost.mechanism is None:
            assert raw <= exact + 2 * DISCRETIZATION
        assert exact * floor <= pld_epsilon([cost], delta) <= epsilon


@pytest.mark.parametrize("epsilon", [0.05, 0.1, 0.25, 0.3])
def test_k_laplace_queries_fit_at_least_as_many_as_basic_composition(epsilon: float) -> None:
    basic = math.floor(BUDGET.epsilon / epsilon * (1 + 1e-9))
    assert most_that_fit(laplace(epsilon)) >= basic
    assert most_that_fit(Cost(epsilon)) >= basic


def test_the_bar_figures_without_the_basic_cap() -> None:
    """The issue's bar: ε = 0.1 Laplace queries in a (1, 1e-6) budget. The PLD alone (no basic cap)
    already fits the 10 basic composition fits, and not 11 (basic composition is nearly tight there)."""
    for cost in (laplace(0.1), Cost(0.1)):
        assert pld_epsilon([cost] * 10, 1e-6, basic=False) <= 1.0
        assert pld_epsilon([cost] * 11, 1e-6, basic=False) > 1.0


def test_many_small_releases_fit_more_than_basic_and_zcdp() -> None:
    # ε = 0.01: basic composition fits 100; zCDP (ρ = ε²/2 each) fits max_rho/5e-5 ≈ 487
    n_lap, n_generic = most_that_fit(laplace(0.01)), most_that_fit(Cost(0.01))
    zcdp = 0
    while rho_to_epsilon((zcdp + 1) * 0.01**2 / 2, 1e-6) <= 1.0:
        zcdp += 1
    assert n_lap >= n_generic > zcdp > 100


@pytest.mark.parametrize("epsilon", [0.1, 0.5])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_generic_pld_is_never_below_laplace_pld(epsilon: float, k: int) -> None:
    for delta in (1e-9, 1e-6, 1e-3):
        assert pld_epsilon([Cost(epsilon)] * k, delta, basic=False) >= pld_epsilon(
            [laplace(epsilon)] * k, delta, basic=False
        )


@pytest.mark.parametrize("sigma", [1.0, 5.0, 20.0])
@pytest.mark.parametrize("k", [1, 10, 50])
def test_gaussian_composition_matches_the_closed_form_and_rdp(sigma: float, k: int) -> None:
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    rho = 1 / (2 * sigma**2)
    pld = pld_epsilon([gaussian(rho)] * k, 1e-6)
    exact = exact_gaussian_epsilon(math.sqrt(k) / sigma, 1e-6)
    assert exact - 1e-9 <= pld <= exact * 1.01 + k * DISCRETIZATION
    rdp = RdpAccountant().compose(SelfComposedDpEvent(GaussianDpEvent(sigma), k)).get_epsilon(1e-6)
    assert 0.7 * rdp <= pld <= rdp
    assert pld <= rho_to_epsilon(k * rho, 1e-6)  # the zCDP conversion dpsql's accountant uses


def test_discrete_gaussian_is_not_dominated_by_the_continuous_one() -> None:
    """Why dpsql's discrete Gaussian needs its own tag: at σ = 5 its ε is above the continuous one's."""
    rho = 1 / (2 * 5.0**2)
    continuous = pld_epsilon([gaussian(rho)], 1e-6)
    discrete = pld_epsilon([gaussian(rho, "discrete_gaussian")], 1e-6)
    assert discrete > continuous
    assert discrete <= rho_to_epsilon(rho, 1e-6)  # still within its zCDP bound (CKS 2020)


def test_mixed_composition_within_zcdp_and_basic() -> None:
    costs = [laplace(0.1)] * 3 + [Cost(0.2)] * 2 + [gaussian(0.002)] * 4
    pld = pld_epsilon(costs, 1e-6, basic=False)
    assert pld <= rho_to_epsilon(3 * 0.1**2 / 2 + 2 * 0.2**2 / 2 + 4 * 0.002, 1e-6)
    assert pld >= pld_epsilon(costs[:5], 1e-6, basic=False)  # composing more never lowers ε


def test_selection_delta_is_added_to_delta() -> None:
    plain = pld_epsilon([laplace(0.1)] * 5, 1e-6 - 5e-8, basic=False)
    assert pld_epsilon([laplace(0.1, 1e-8)] * 5, 1e-6, basic=False) == pytest.approx(plain, abs=1e-9)
    # selection spending the whole δ leaves nothing for the PLD: only basic composition remains
    spent = [laplace(0.1, 1e-7)] * 10
    assert pld_epsilon(spent, 1e-6, basic=False) == math.inf
    assert pld_epsilon(spent, 1e-6) == pytest.approx(1.0)
    assert pld_fits(spent, BUDGET)
    assert not pld_fits([*spent, laplace(0.1, 1e-7)], BUDGET)


def test_free_releases_and_empty_sequences_cost_nothing() -> None:
    assert pld_epsilon([], 1e-6) == 0.0
    assert pld_epsilon([Cost(0.0), Cost(0.0, mechanism="continuous_laplace")], 1e-6, basic=False) == 0.0


def test_mechanism_tags_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown PLD mechanism"):
        pld_epsilon([Cost(0.1, mechanism="laplace")], 1e-6)
    with pytest.raises(ValueError, match="pure"):
        pld_epsilon([Cost(0.1, 1e-7, mechanism="continuous_laplace")], 1e-6)
    with pytest.raises(ValueError, match="rho > 0"):
        pld_epsilon([Cost(0.1, mechanism="continuous_gaussian")], 1e-6)
    with pytest.raises(ValueError, match="delta"):
        pld_epsilon([Cost(0.1)], 1.0)


def test_cost_tag_is_not_carried_by_composition() -> None:
    """``+`` and ``Cost.total`` are unchanged: a composition is no single mechanism, so it is untagged."""
    tagged = laplace(0.1)
    assert (tagged + tagged).mechanism is None
    assert Cost.total([tagged, tagged]) == Cost(0.2, rho=0.1**2 / 2 + 0.1**2 / 2)
    assert Cost(0.1) == Cost(0.1, 0.0, 0.0, 0.0)
