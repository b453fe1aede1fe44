"""The privacy accountant: what a query costs, how costs compose, and what is left.

One module for every privacy-budget figure dpsql shows or checks: the ledger's reserve, the
engine's NOTICE and ``remaining_epsilon``, ``dpsql budget`` and the server all call
:func:`remaining_budget` / :func:`check_budget` here, and every ρ → ε conversion is the exact
one (:func:`rho_to_epsilon`, Canonne–Kamath–Steinke 2020, as OpenDP) — there is no looser
fallback for a caller to pick.

Composition: under ``"pure"`` accounting ε and δ add (basic composition). Under ``"zcdp"``
the accountant is approximate zCDP (Bun & Steinke 2016, Def. 8.1; OpenDP's
``Approximate<ZeroConcentratedDivergence>``): each charge is a pair (ρ, δ_sel) where ρ is the
zCDP cost of the noisy measurements (a pure ε-DP charge counts as ρ = ε²/2) and δ_sel the
probability of the bad event of partition selection, which is not a zCDP quantity. Both add
up, and the total converts to (ε(Σρ, δ_budget − Σδ_sel), δ_budget)-DP. Under ``"pld"`` the
ledger composes every recorded charge by its privacy-loss distribution (:mod:`dpsql.pld`, the
optimal composition of (ε, δ)-DP releases); the functions here see running sums only, so under
``"pld"`` they answer by basic composition, a bound PLD is never looser than (see
:func:`check_budget`, :func:`remaining_budget`).

Budget figures are typed, immutable values: :class:`Cost` (one release; ``+`` composes two and
:meth:`Cost.total` several: the one rule for every statement of several DP parts), :class:`Spent`
(recorded sums; ``spent + cost`` is one more charge, ``spent + spent`` two analysts together),
:class:`Allowance` (a limit: the policy's budget ``+`` the curator's grants) and :class:`Remaining`.
Everything here is a pure function of budget figures: no data, no I/O.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

from dpsql.errors import PrivacyBudgetExhausted

Accounting = Literal["pure", "zcdp", "pld"]
#: The accountings a policy may name (``pld`` needs the ``pld`` extra: :func:`dpsql.pld.available`).
ACCOUNTINGS: tuple[Accounting, ...] = ("pure", "zcdp", "pld")

#: Relative slack so that spending exactly the budget in k equal float steps succeeds.
REL_TOLERANCE = 1e-9

HINT_EXHAUSTED = "Ask the data curator for more budget, or lower ε with SET dpsql.epsilon."
HINT_SELECTION = (
    "Ask the data curator for more budget, lower δ with SET dpsql.delta, "
    "or group by columns with a public domain (no partition selection)."
)


class BudgetLike(Protocol):
    """Anything with a total (ε, δ): ``dpsql.policy.Budget`` in practice."""

    @property
    def epsilon(self) -> float: ...

    @property
    def delta(self) -> float: ...


@dataclass(frozen=True)
class Cost:
    """The privacy cost of one release.

    ``epsilon``/``delta`` are its (ε, δ)-DP guarantee; ``rho`` its zCDP cost (Gaussian
    queries under ``zcdp`` accounting); ``selection_delta`` the part of ``delta`` spent on
    partition selection (≤ ``delta``), which zCDP accounting adds up separately. Under
    ``zcdp``, a cost with ``rho == 0`` whose δ is all selection δ is ε-DP apart from the
    selection event and counts as ρ = ε²/2.

    ``mechanism`` optionally names the one mechanism the release is, for privacy-loss-distribution
    accounting (:data:`dpsql.pld.PLD_MECHANISMS` lists the names and what each claims); ``None``, the
    default and what ``+`` returns (a composition is no single mechanism), claims nothing beyond
    (ε, δ) and gets the worst-case PLD. The ledger does not record it.
    """

    epsilon: float
    delta: float = 0.0
    rho: float = 0.0
    selection_delta: float = 0.0
    mechanism: str | None = None

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta", "rho", "selection_delta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Cost.{name} must be a finite number >= 0, got {value!r}")
        if self.delta >= 1:
            raise ValueError(f"Cost.delta must be < 1, got {self.delta!r}")
        if self.selection_delta > self.delta:
            raise ValueError(f"Cost.selection_delta must be <= delta, got {self.selection_delta!r}")

    def __add__(self, other: Cost) -> Cost:
        """Sequential composition of two releases: ε, δ and the selection δ add, and so does ρ, each
        side counted as :meth:`zcdp_rho` charges it (a pure-ε side as ε²/2, never as 0). When a side
        has no ρ (an (ε, δ>0) cost), neither has the sum: the ledger then composes ε and δ only."""
        if not isinstance(other, Cost):
            return NotImplemented
        try:
            rho = self.zcdp_rho() + other.zcdp_rho()
        except ValueError:
            rho = 0.0
        return Cost(
            self.epsilon + other.epsilon,
            self.delta + other.delta,
            rho,
            self.selection_delta + other.selection_delta,
        )

    @staticmethod
    def total(costs: Iterable[Cost]) -> Cost:
        """The composition of several releases (``sum`` with the right zero): the one rule every
        statement of several DP parts is charged by."""
        result = Cost(0.0)
        for cost in costs:
            result = result + cost
        return result

    def zcdp_rho(self) -> float:
        """ρ charged under zCDP accounting; an (ε, δ>0) cost without ρ cannot be composed there
        (unless its δ is only partition selection's, which is charged as ``selection_delta``)."""
        if self.rho > 0:
            return self.rho
        if self.delta == self.selection_delta:
            return self.epsilon * self.epsilon / 2
        raise ValueError("an (ε, δ>0) cost needs its zCDP rho to be charged under zcdp accounting")


@dataclass(frozen=True)
class Spent:
    """Raw sums of recorded charges (ε and δ by basic composition, ρ by zCDP composition,
    ``selection_delta`` the partition-selection δ that zCDP accounting adds to its conversion)."""

    epsilon: float = 0.0
    delta: float = 0.0
    rho: float = 0.0
    queries: int = 0
    selection_delta: float = 0.0

    def __add__(self, other: Spent | Cost) -> Spent:
        """``spent + cost``: one more recorded charge (its ρ as recorded); ``spent + spent``: the
        spending of two analysts together (the dataset's total sums every analyst's: they may collude)."""
        if isinstance(other, Cost):
            return Spent(
                self.epsilon + other.epsilon,
                self.delta + other.delta,
                self.rho + other.rho,
                self.queries + 1,
                self.selection_delta + other.selection_delta,
            )
        if isinstance(other, Spent):
            return Spent(
                self.epsilon + other.epsilon,
                self.delta + other.delta,
                self.rho + other.rho,
                self.queries + other.queries,
                self.selection_delta + other.selection_delta,
            )
        return NotImplemented

    @staticmethod
    def total(parts: Iterable[Spent]) -> Spent:
        """The sum of several spendings (``sum`` with the right zero)."""
        result = Spent()
        for part in parts:
            result = result + part
        return result

    def privacy_loss(
        self,
        accounting: Accounting,
        delta: float,
    ) -> tuple[float, float]:
        """The (ε, δ) this spending amounts to; under zCDP, (ε(ρ, δ − Σδ_sel), δ); under PLD, from
        sums alone, basic composition's (Σε, Σδ) (an upper bound: the ledger composes the charges)."""
        if accounting != "zcdp":
            return self.epsilon, self.delta
        if self.rho == 0:
            return 0.0, self.selection_delta
        return zcdp_epsilon(self.rho, self.selection_delta, delta), delta


@dataclass(frozen=True)
class Allowance:
    """A total (ε, δ) budget as a value: the policy's budget for an analyst plus every curator grant.

    ``+`` adds a grant (ε and δ add: a grant of (ε', δ') lets the analyst compose one more
    (ε', δ')-DP release, by basic composition under pure accounting and through the one
    conversion under zcdp). ``<=`` is the componentwise partial order (both ε and δ no larger).
    Nothing ever subtracts from an allowance: budget given is never taken back.
    """

    epsilon: float
    delta: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"Allowance.epsilon must be a finite number >= 0, got {self.epsilon!r}")
        if not (math.isfinite(self.delta) and 0 <= self.delta < 1):
            raise ValueError(f"Allowance.delta must be in [0, 1), got {self.delta!r}")

    @classmethod
    def of(cls, budget: BudgetLike) -> Allowance:
        return budget if isinstance(budget, Allowance) else cls(float(budget.epsilon), float(budget.delta))

    def __add__(self, other: BudgetLike) -> Allowance:
        if not (hasattr(other, "epsilon") and hasattr(other, "delta")):
            return NotImplemented
        return Allowance(self.epsilon + other.epsilon, self.delta + other.delta)

    def __le__(self, other: BudgetLike) -> bool:
        return self.epsilon <= other.epsilon and self.delta <= other.delta

    def __ge__(self, other: BudgetLike) -> bool:
        return self.epsilon >= other.epsilon and self.delta >= other.delta


#: No grant at all.
NO_GRANT = Allowance(0.0, 0.0)


@dataclass(frozen=True)
class Remaining:
    """What is left of a budget: (ε, δ) and, under zCDP, the largest ρ still affordable.

    Under zCDP, ``delta`` is the δ still available to partition selection (δ_budget − Σδ_sel),
    and ``epsilon`` is ε_budget − ε(Σρ, δ_budget − Σδ_sel): the same conversion the ledger checks.
    """

    epsilon: float
    delta: float
    rho: float


# --- ρ-zCDP ⇒ (ε, δ)-DP: the exact conversion ----------------------------------------------


def remainder(total: float, part: float) -> float:
    """``total − part``, lowered by an ulp where needed so that ``part + remainder ≤ total`` in floating point:
    a query whose ε is split (a DP cap choice, a bias estimate, the measurement) is never charged more than
    the ε asked for (a synopsis of three marginals at ε=1.25 was charged 1.2500000000000002)."""
    rest = total - part
    while rest > 0 and part + rest > total:
        rest = math.nextafter(rest, 0.0)
    return rest


def cdp_delta(rho: float, epsilon: float) -> float:
    """Smallest δ such that ρ-zCDP implies (ε, δ)-DP (Canonne–Kamath–Steinke 2020, Prop. 12).

    δ = min over α > 1 of exp((α−1)(αρ−ε)) / (α−1) · (1 − 1/α)^α; the objective is convex in α, so the
    minimiser is found by bisection on the sign of its derivative.  Same algorithm as OpenDP's
    ``cdp_delta`` (without its directed rounding).
    """
    if rho < 0 or epsilon < 0:
        raise ValueError("rho and epsilon must be non-negative")
    if rho == 0 or math.isinf(epsilon):
        return 0.0
    if math.isinf(rho):
        return 1.0
    a_min, a_max = 1.01, (epsilon + 1.0) / (2.0 * rho) + 2.0
    while True:
        a_mid = a_min + (a_max - a_min) / 2.0
        if a_mid in (a_min, a_max):
            break
        deriv = (2.0 * a_mid - 1.0) * rho - epsilon + math.log1p(-1.0 / a_mid)
        if deriv < 0:
            a_min = a_mid
        else:
            a_max = a_mid
    a = a_max
    log_delta = (a - 1.0) * (a * rho - epsilon) + a * math.log1p(-1.0 / a) - math.log(a - 1.0)
    return min(1.0, math.exp(log_delta)) if log_delta < 700 else 1.0


@lru_cache(maxsize=4096)
def rho_to_epsilon(rho: float, delta: float) -> float:
    """Smallest ε such that ρ-zCDP implies (ε, δ)-DP; matches OpenDP's zCDP→approxDP profile.

    Bisection on ε of the (decreasing) ``cdp_delta(ρ, ·)``; the classical bound
    ρ + 2·sqrt(ρ·ln(1/δ)) brackets it from above.
    """
    rho = float(rho)
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho must be a non-negative finite number, got {rho!r}")
    delta = _probability("delta", delta)
    if rho == 0:
        return 0.0
    lo, hi = 0.0, rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta)) + 1e-12
    if cdp_delta(rho, lo) <= delta:
        return 0.0
    while hi - lo > 1e-13 * max(1.0, hi):
        mid = (lo + hi) / 2.0
        if cdp_delta(rho, mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


@lru_cache(maxsize=4096)
def epsilon_to_rho(epsilon: float, delta: float) -> float:
    """Largest ρ whose zCDP→(ε, δ) conversion stays within ``epsilon`` (inverse of ``rho_to_epsilon``).

    ``cdp_delta`` is increasing in ρ, so bisection returns the lower end of the bracket: the ρ
    returned always satisfies cdp_delta(ρ, ε) ≤ δ (conservative).
    """
    epsilon = _positive("epsilon", epsilon)
    delta = _probability("delta", delta)
    lo, hi = 0.0, epsilon  # ε ≥ ρ for any δ < 1, so ρ ≤ ε
    while hi - lo > 1e-15 * max(hi, 1e-300):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if cdp_delta(mid, epsilon) <= delta:
            lo = mid
        else:
            hi = mid
    if lo == 0.0:
        raise ValueError(f"no positive rho reaches epsilon={epsilon} at delta={delta}")
    return lo


# --- composition and checks --------------------------------------------------------------------


def max_rho(epsilon: float, delta: float) -> float:
    """Largest ρ with ε(ρ, δ) ≤ ``epsilon`` under the exact conversion (0 when none is positive)."""
    if epsilon <= 0 or delta <= 0:
        return 0.0
    lo, hi = 0.0, epsilon  # ε(ρ, δ) ≥ ρ for every sound conversion
    for _ in range(200):
        mid = (lo + hi) / 2
        if rho_to_epsilon(mid, delta) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


def zcdp_epsilon(rho: float, selection_delta: float, delta: float) -> float:
    """ε of (ε, δ)-DP implied by ρ-zCDP plus an additive ``selection_delta``: ε(ρ, δ − δ_sel).

    Infinite when no δ is left for the conversion (and ρ > 0), and for a non-finite ρ (a corrupt
    ledger total reads as spent without bound, never as an error in every reader).
    """
    if rho <= 0:
        return 0.0
    if not math.isfinite(rho):
        return math.inf
    conversion_delta = _left_for_conversion(delta, selection_delta)
    if conversion_delta <= 0 or not delta > 0:
        return math.inf
    return rho_to_epsilon(rho, conversion_delta)


def _within(total: float, budget: float) -> bool:
    return total <= budget + REL_TOLERANCE * budget


#: Significant digits an ε or δ is shown with (the ledger, ``--json`` and the DB-API keep every digit).
SHOWN_DIGITS = 4


def fmt(value: float, *, down: bool = False, up: bool = False) -> str:
    """An ε or δ as people read it: at most :data:`SHOWN_DIGITS` significant digits (``0.3333``, ``3.7``,
    ``12350`` rather than ``1.235e+04``), rounded as :func:`shown` rounds."""
    rounded = shown(value, down=down, up=up)
    if 1e4 <= abs(rounded) < 1e15:
        return str(int(rounded))
    return f"{rounded:.{SHOWN_DIGITS}g}"


def shown(value: float, *, down: bool = False, up: bool = False) -> float:
    """``value`` to :data:`SHOWN_DIGITS` significant digits for display: to the nearest, or ``down`` (what
    is left: a figure shown never promises budget that is not there) or ``up`` (what was spent). Float
    noise (3.6999999999999993) is rounded away at 12 digits first, so it never shows as 3.699."""
    if not math.isfinite(value) or value == 0:
        return value
    clean = decimal.Decimal(f"{value:.12g}")
    rounding = decimal.ROUND_FLOOR if down else decimal.ROUND_CEILING if up else decimal.ROUND_HALF_EVEN
    step = decimal.Decimal(1).scaleb(clean.adjusted() - SHOWN_DIGITS + 1)
    return float(clean.quantize(step, rounding=rounding))


def _conversion_delta(budget: BudgetLike, rho_delta: float | None) -> float:
    # A smaller δ only makes the converted ε more conservative, so never exceed the budget's δ.
    return budget.delta if rho_delta is None else min(rho_delta, budget.delta)


def _left_for_conversion(delta: float, selection_delta: float) -> float:
    # Σδ_sel is a float sum that may fall an ulp short of the true total: round it up, so that
    # selection spending the whole δ budget never leaves a spurious 1e-21 to convert ρ at.
    return delta - selection_delta * (1 + REL_TOLERANCE) if selection_delta > 0 else delta


def _zcdp_delta(budget: BudgetLike, rho_delta: float | None, selection_delta: float) -> float:
    """The δ the total ρ is converted at: the budget's δ (or ``rho_delta``) less the selection δ."""
    return min(_conversion_delta(budget, rho_delta), _left_for_conversion(budget.delta, selection_delta))


def check_budget(
    *,
    who: str,
    name: str,
    spent: Spent,
    cost: Cost,
    budget: BudgetLike,
    accounting: Accounting,
    rho_delta: float | None = None,
) -> None:
    """Raise :class:`PrivacyBudgetExhausted` if ``spent`` plus ``cost`` exceeds ``budget``.

    Pure function of budget figures only, so its messages can never reveal data. The figures
    in the DETAIL are the analyst's own; for the dataset's budget (``who="dataset"``: every
    analyst's spend together) the refusal says only that it is exhausted and what this query
    needs, never what the others have spent (see :func:`_dataset_refusal`).

    Under ``"pld"`` running sums cannot be composed by PLD, so this checks basic composition (a
    bound PLD is never looser than: stricter, never unsound); the ledger's reserve composes the
    recorded charges instead (:func:`dpsql.pld.check_pld_budget`).
    """
    message = f'privacy budget exhausted for {who} "{name}"'
    if who == "dataset":
        _check_dataset_budget(message, spent, cost, budget, accounting, rho_delta)
        return
    if accounting != "zcdp":
        if not _within(spent.epsilon + cost.epsilon, budget.epsilon):
            detail = f"spent ε={fmt(spent.epsilon)} of {fmt(budget.epsilon)}, this query needs ε={fmt(cost.epsilon)}"
            raise PrivacyBudgetExhausted(message, detail=detail, hint=HINT_EXHAUSTED)
        if not _within(spent.delta + cost.delta, budget.delta):
            detail = f"spent δ={fmt(spent.delta)} of {fmt(budget.delta)}, this query needs δ={fmt(cost.delta)}"
            raise PrivacyBudgetExhausted(
                message,
                detail=detail,
                hint="Ask the data curator for more budget, or lower δ with SET dpsql.delta "
                "(or use the Laplace mechanism, which spends no δ).",
            )
        return
    selection_total = spent.selection_delta + cost.selection_delta
    if cost.selection_delta > 0 and not _within(selection_total, budget.delta):
        detail = (
            f"spent partition-selection δ={fmt(spent.selection_delta)} of {fmt(budget.delta)}, "
            f"this query needs δ={fmt(cost.selection_delta)}"
        )
        raise PrivacyBudgetExhausted(
            message,
            detail=detail,
            hint=HINT_SELECTION,
        )
    delta = _zcdp_delta(budget, rho_delta, selection_total)
    rho_cost = cost.zcdp_rho()
    total = spent.rho + rho_cost
    epsilon_total = zcdp_epsilon(total, 0.0, delta)
    if not _within(epsilon_total, budget.epsilon):
        epsilon_spent = zcdp_epsilon(spent.rho, 0.0, delta)
        detail = (
            f"spent ρ={fmt(spent.rho)} (ε={fmt(epsilon_spent)} at δ={fmt(delta)}) "
            f"of ε={fmt(budget.epsilon)}, "
            f"this query needs ρ={fmt(rho_cost)}"
            + (f" and selection δ={fmt(cost.selection_delta)}" if cost.selection_delta else "")
            + f", which would total ε={fmt(epsilon_total)}"
        )
        raise PrivacyBudgetExhausted(message, detail=detail, hint=HINT_EXHAUSTED)


def _check_dataset_budget(
    message: str,
    spent: Spent,
    cost: Cost,
    budget: BudgetLike,
    accounting: Accounting,
    rho_delta: float | None,
) -> None:
    """The dataset-wide check: same arithmetic as for an analyst, a refusal without others' figures."""
    try:
        check_budget(
            who="analyst",  # the arithmetic only; its message (with the totals) is discarded
            name="",
            spent=spent,
            cost=cost,
            budget=budget,
            accounting=accounting,
            rho_delta=rho_delta,
        )
    except PrivacyBudgetExhausted:
        raise _dataset_refusal(message, cost) from None


def refusal(who: str, name: str, cost: Cost, detail: str, hint: str = HINT_EXHAUSTED) -> PrivacyBudgetExhausted:
    """53P01 as :func:`check_budget` raises it, for an accountant of its own (:mod:`dpsql.pld`): the
    analyst's ``detail``, or for ``who="dataset"`` only what this query needs."""
    message = f'privacy budget exhausted for {who} "{name}"'
    if who == "dataset":
        return _dataset_refusal(message, cost)
    return PrivacyBudgetExhausted(message, detail=detail, hint=hint)


def _dataset_refusal(message: str, cost: Cost) -> PrivacyBudgetExhausted:
    """53P01 for the dataset's budget: what this query needs (the analyst's own figure), nothing more."""
    needs = f"ε={fmt(cost.epsilon)}" + (f", δ={fmt(cost.delta)}" if cost.delta else "")
    return PrivacyBudgetExhausted(
        message,
        detail=f"The dataset's total privacy budget cannot cover this query (it needs {needs}).",
        hint="The dataset budget is shared by all analysts; ask the data curator for more.",
    )


def remaining_budget(
    spent: Spent,
    budget: BudgetLike,
    accounting: Accounting = "pure",
    *,
    rho_delta: float | None = None,
) -> Remaining:
    """Budget left after ``spent``; never negative. Under ``"pld"``, from sums alone, what basic
    composition leaves (a lower bound: the ledger's ``remaining`` composes the charges by PLD)."""
    if accounting != "zcdp":
        return Remaining(
            epsilon=max(0.0, budget.epsilon - spent.epsilon),
            delta=max(0.0, budget.delta - spent.delta),
            rho=0.0,
        )
    delta = _zcdp_delta(budget, rho_delta, spent.selection_delta)
    used = zcdp_epsilon(spent.rho, 0.0, delta)
    rho_left = max(0.0, max_rho(budget.epsilon, delta) - spent.rho) if delta > 0 else 0.0
    delta_left = max(0.0, budget.delta - spent.selection_delta)
    return Remaining(epsilon=max(0.0, budget.epsilon - used), delta=delta_left, rho=rho_left)


def _probability(name: str, value: float) -> float:
    v = float(value)
    if not (0.0 < v < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v
