"""The composed privacy-loss distribution of a ledger's charges, kept and updated one charge at a time.

PLD accounting (:mod:`dpsql.pld`) composes every recorded charge as the generic PLD of its (ε, δ): the
worst-case (ε, δ)-DP mechanism, whose privacy loss is +ε with probability (1 − δ)·e^ε/(1 + e^ε), −ε with
probability (1 − δ)/(1 + e^ε) and +∞ with probability δ (Kairouz–Oh–Viswanath 2015; dp_accounting's
``from_privacy_parameters``). Composing all of a history at every reservation costs O(distinct charges)
each time, forever (issue #41: 10,000 distinct ε took 1.4–3.4 s per reservation). So the ledger keeps
the composition itself, :class:`LossState`, next to the totals and composes each new charge into it:

* losses live on a lattice of step :data:`GRID` (the same 10⁻⁴ as :data:`dpsql.pld.DISCRETIZATION`);
  a charge's +ε is rounded up to the lattice and its −ε up (towards 0), so the state is *pessimistic*:
  each loss is at least the true one, and the hockey-stick divergence read off is never below the exact
  composition's (the dominance argument of dp_accounting's pessimistic estimates);
* composing one charge is two shifted, scaled copies of the probabilities: O(support), whatever the
  number of past charges;
* the support is bounded: the lightest tails (:data:`TAIL` of mass on each side) are moved, the left
  one *up* to the lowest loss kept, the right one to +∞ — both only increase losses, so both stay
  pessimistic. Its width then follows the spread of the loss (≈ 20·√Σε² / GRID points), which the
  budget itself bounds, never the number of charges;
* :meth:`LossState.epsilon` inverts δ(ε) = P(∞) + Σ_{l>ε} p_l (1 − e^{ε−l}) exactly between two
  lattice points.

A state serialises to bytes (:meth:`LossState.to_bytes`) for the ledger, which signs it (see
:mod:`dpsql.ledger.pld`). Pure functions of budget figures: no data, no I/O.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpsql.accountant import HINT_SELECTION, REL_TOLERANCE, BudgetLike, Cost, Spent, fmt, refusal

if TYPE_CHECKING:  # NumPy (~0.4 s to import) is loaded by the functions that compute, not by `dpsql budget`
    import numpy as np

#: Step of the loss lattice (as :data:`dpsql.pld.DISCRETIZATION`: the same pessimism as before).
GRID = 1e-4
#: Mass moved off each tail at a time (left: up to the lowest kept loss; right: to +∞).
TAIL = 1e-15
#: Releases composed between two trims of the tails (when several are composed at once).
_TRIM_EVERY = 16
#: Relative slack against float error in the rounding of ε to the lattice (never rounds a loss down).
_SLACK = 1e-12
_HEADER = struct.Struct("<4sqqd")
_MAGIC = b"PLD1"
#: The most lattice points a stored state may have (800 MB of float64 is no state dpsql writes).
_MAX_POINTS = 100_000_000


def _steps(epsilon: float) -> tuple[int, int]:
    """(⌈ε/GRID⌉, ⌊ε/GRID⌋): the lattice steps of the +ε and the −ε loss, each rounded up. A ratio within
    float error of an integer counts as that integer (the result's ε is scaled up by that error at the end)."""
    ratio = epsilon / GRID
    near = round(ratio)
    if abs(ratio - near) <= _SLACK * max(1.0, ratio):
        return int(near), int(near)
    return math.ceil(ratio), math.floor(ratio)


def _light_end(probs: np.ndarray) -> tuple[int, float]:
    """How many leading entries of ``probs`` hold at most :data:`TAIL` together, and their mass (scanning only
    as far as needed: the tails are short)."""
    import numpy as np

    size = 16
    while True:
        sums = np.cumsum(probs[:size])
        count = int(np.searchsorted(sums, TAIL, side="right"))
        if count < len(sums) or size >= len(probs):
            return count, float(sums[count - 1]) if count else 0.0
        size *= 4


def _trim(probs: np.ndarray, offset: int, infinity: float) -> tuple[int, np.ndarray, float]:
    """Move the lightest tails (pessimistically): the left one up to the lowest loss kept, the right one to +∞."""
    import numpy as np

    cut, left = _light_end(probs)
    cut = min(cut, len(probs) - 1)
    drop, right = _light_end(probs[::-1])
    drop = min(drop, len(probs) - 1 - cut)
    kept = probs[cut : len(probs) - drop]
    if cut:
        kept = kept.copy()
        kept[0] += left
    # float error may lose finite mass: what is missing counts as +∞ (never as a smaller loss)
    infinity = max(infinity + right, 1.0 - float(np.sum(kept)))
    return offset + cut, kept, min(1.0, infinity)


@dataclass(frozen=True, eq=False)
class LossState:
    """A composed PLD on the lattice: ``probs[i]`` is the mass at loss (``offset`` + i)·GRID, ``infinity``
    the mass at +∞. Immutable: :meth:`compose` returns a new state."""

    offset: int
    probs: np.ndarray
    infinity: float = 0.0

    @classmethod
    def identity(cls) -> LossState:
        """No release yet: loss 0 with probability 1."""
        import numpy as np

        return cls(0, np.ones(1))

    @classmethod
    def exhausted(cls) -> LossState:
        """Loss +∞ with probability 1: what :data:`MAX_LOSS` and :data:`MAX_WIDTH` fall back to (only basic
        composition's Σε then says anything, and still does)."""
        import numpy as np

        return cls(0, np.zeros(1), 1.0)

    def compose(self, epsilon: float, delta: float = 0.0, count: int = 1) -> LossState:
        """This state composed with ``count`` releases of the generic (ε, δ) PLD (δ: the δ that is part of
        the mechanism's guarantee, without partition selection's; see :mod:`dpsql.pld`)."""
        return self.compose_all([(epsilon, delta)] * count)

    def compose_all(self, releases: Sequence[tuple[float, float]]) -> LossState:
        """This state composed with each generic (ε, δ) PLD of ``releases`` in turn; the tails are trimmed
        every :data:`_TRIM_EVERY` releases and at the end (in between the state is only more exact)."""
        import numpy as np

        probs, offset, infinity = self.probs, self.offset, self.infinity
        for index, (epsilon, delta) in enumerate(releases):
            if not (math.isfinite(epsilon) and epsilon >= 0 and 0 <= delta < 1):
                raise ValueError(f"not a composable (ε, δ): ({epsilon!r}, {delta!r})")
            if epsilon == 0 and delta == 0:
                continue
            if epsilon > MAX_LOSS or len(probs) > MAX_WIDTH:
                return LossState.exhausted()
            up, down = _steps(epsilon)
            # p(+ε) = (1 − δ)·e^ε/(1 + e^ε) = (1 − δ)/(1 + e^−ε); p(−ε) = (1 − δ)/(1 + e^ε)
            plus = (1.0 - delta) / (1.0 + math.exp(-epsilon))
            minus = (1.0 - delta) / (1.0 + math.exp(epsilon)) if epsilon < 700 else 0.0
            n = len(probs)
            out = np.zeros(n + up + down)
            np.multiply(probs, minus, out=out[:n])
            out[up + down :] += plus * probs
            probs, offset, infinity = out, offset - down, infinity + delta - infinity * delta
            if index % _TRIM_EVERY == _TRIM_EVERY - 1:
                offset, probs, infinity = _trim(probs, offset, infinity)
        if probs is self.probs:
            return self
        return LossState(*_trim(probs, offset, infinity))

    def _losses(self) -> np.ndarray:
        import numpy as np

        return (self.offset + np.arange(len(self.probs))) * GRID

    def delta_at(self, epsilon: float) -> float:
        """δ(ε) = P(∞) + Σ_{l > ε} p_l (1 − e^{ε − l}): the hockey-stick divergence at ``epsilon``."""
        import numpy as np

        losses = self._losses()
        above = losses > epsilon
        return self.infinity + float(np.sum(self.probs[above] * -np.expm1(epsilon - losses[above])))

    def epsilon(self, delta: float) -> float:
        """The least ε ≥ 0 with δ(ε) ≤ ``delta`` (``math.inf`` when the +∞ mass alone exceeds it).

        δ at every lattice point at once from two suffix sums, δ(l_j) = P(∞) + Σ_{i>j} p_i − e^{l_j}·Σ_{i>j} p_i
        e^{−l_i}, to find the bracket; then δ solved exactly on it from sums taken afresh (no cancellation)."""
        import numpy as np

        if self.infinity > delta:
            return math.inf
        if self.delta_at(0.0) <= delta:
            return 0.0
        losses = self._losses()
        positive = losses > 0
        probs, points = self.probs[positive], losses[positive]
        if len(points) == 0:
            return 0.0
        weights = probs * np.exp(points[0] - points)  # ≤ 1: no overflow whatever the losses
        tail = np.cumsum(probs[::-1])[::-1]  # Σ_{i ≥ j}
        tail_w = np.cumsum(weights[::-1])[::-1]
        above = np.append(tail[1:], 0.0)  # Σ_{i > j}
        above_w = np.append(tail_w[1:], 0.0)
        at_points = self.infinity + above - np.exp(points - points[0]) * above_w
        over = np.nonzero(at_points > delta)[0]
        start = float(points[over[-1]]) if len(over) else 0.0
        # up to the next lattice point the losses above are fixed: δ(ε) = P(∞) + A − e^{ε − start}·B, solved for ε
        beyond = losses > start
        a = float(np.sum(self.probs[beyond]))
        b = float(np.sum(self.probs[beyond] * np.exp(start - losses[beyond])))
        if b <= 0 or self.infinity + a - delta <= b:
            return start * (1 + _SLACK)
        return (start + math.log((self.infinity + a - delta) / b)) * (1 + _SLACK)

    def to_bytes(self) -> bytes:
        """Offset, length, +∞ mass and the float64 probabilities, little-endian, deflated (a few large
        charges leave long runs of zeros between their losses)."""
        import numpy as np

        raw = self.probs.astype("<f8").tobytes()
        sparse = 2 * int(np.count_nonzero(self.probs)) < len(self.probs)  # deflate pays only on runs of zeros
        body = b"z" + zlib.compress(raw, 1) if sparse else b"r" + raw
        return _HEADER.pack(_MAGIC, self.offset, len(self.probs), self.infinity) + body

    @classmethod
    def from_bytes(cls, data: bytes) -> LossState:
        """The state :meth:`to_bytes` wrote; ValueError for anything else (a truncated or foreign blob)."""
        import numpy as np

        try:
            magic, offset, length, infinity = _HEADER.unpack_from(data)
        except struct.error:
            raise ValueError("not a PLD state") from None
        if not 1 <= length <= _MAX_POINTS:
            raise ValueError("not a PLD state")
        kind, body = data[_HEADER.size : _HEADER.size + 1], data[_HEADER.size + 1 :]
        try:
            if kind == b"z":
                stream = zlib.decompressobj()
                body = stream.decompress(body, 8 * length + 1)
                if not stream.eof or stream.unused_data:  # a stream cut short (or with bytes after it)
                    raise zlib.error("incomplete")
            elif kind != b"r":
                raise zlib.error(kind)
        except zlib.error:
            raise ValueError("not a PLD state") from None
        if magic != _MAGIC or length < 1 or len(body) != 8 * length:
            raise ValueError("not a PLD state")
        probs = np.frombuffer(body, dtype="<f8").astype(np.float64)
        if not (0 <= infinity <= 1 and np.all(np.isfinite(probs)) and np.all(probs >= 0)):
            raise ValueError("not a PLD state")
        return cls(int(offset), probs, float(infinity))


#: Significant digits of the grid a charge is quantised to under ``pld`` accounting (rounded up).
GRID_DIGITS = 3


def on_grid(value: float) -> float:
    """``value`` rounded *up* to :data:`GRID_DIGITS` significant digits (0 stays 0): 0.012345 → 0.0124,
    0.03 → 0.03, 1/3 → 0.334. At most 1 % above ``value``; a value already on the grid is unchanged."""
    if value <= 0 or not math.isfinite(value):
        return value
    step = 10.0 ** (math.floor(math.log10(value)) - (GRID_DIGITS - 1))
    ratio = value / step
    near = round(ratio)
    steps = near if abs(ratio - near) <= 1e-9 * ratio else math.ceil(ratio)
    rounded = float(f"{steps * step:.{GRID_DIGITS + 2}g}")  # the decimal figure, not 0.30000000000000004
    return rounded if rounded >= value else value


def quantised(cost: Cost) -> Cost:
    """The charge of ``cost`` under ``pld`` accounting: ε, δ and the selection δ on the grid (:func:`on_grid`,
    rounded up, so never below what the release spends), ρ kept. Bounds the distinct figures a history can
    hold (900 per decade), whatever ε an analyst asks for; the mechanism tag is dropped (never composed)."""
    selection = on_grid(cost.selection_delta)
    delta = max(on_grid(cost.delta), selection)
    return Cost(on_grid(cost.epsilon), min(delta, math.nextafter(1.0, 0.0)), cost.rho, selection)


#: A charge whose ε is beyond this is composed as a loss of +∞ (its PLD would span 200,000 lattice points;
#: at such an ε only basic composition's Σε can say anything, and it still does).
MAX_LOSS = 10.0
#: A composition spread over more lattice points than this is replaced by loss +∞ with probability 1, so
#: that only basic composition's Σε applies from then on (pessimistic; a spread of ±50 in ε).
MAX_WIDTH = 1_000_000


@dataclass(frozen=True, eq=False)
class Composed:
    """A :class:`LossState` and the sums of what it composed (ε, δ, δ_sel and the number of charges), so
    that a reservation can tell what the recorded sums hold beyond it (:meth:`covering`)."""

    state: LossState
    spent: Spent = field(default_factory=Spent)

    @classmethod
    def empty(cls) -> Composed:
        return cls(LossState.identity())

    def add(self, cost: Cost) -> Composed:
        """One more charge of ``cost``, as the generic PLD of (ε, δ − δ_sel): partition selection's δ is no PLD
        quantity (see :mod:`dpsql.pld`) and only adds up in the sums."""
        return self.add_all([cost])

    def add_all(self, costs: Sequence[Cost]) -> Composed:
        """Each of ``costs`` in turn (see :meth:`add`), composed in one pass."""
        if not costs:
            return self
        state = self.state.compose_all([(c.epsilon, c.delta - c.selection_delta) for c in costs])
        spent = self.spent
        for cost in costs:
            spent = spent + Cost(cost.epsilon, cost.delta, 0.0, cost.selection_delta)
        return Composed(state, spent)

    def covering(self, recorded: Spent) -> Composed:
        """This composition, plus, when the reconciled ``recorded`` sums exceed its own (charge rows deleted
        by hand, or not composed yet), the difference as one more (Δε, Δδ) charge: the missing charges
        composed are at most that by basic composition, so a state that lags never gives budget back."""
        gap = [
            _excess(recorded.epsilon, self.spent.epsilon),
            _excess(recorded.delta, self.spent.delta),
            _excess(recorded.selection_delta, self.spent.selection_delta),
        ]
        if not any(gap):
            return self
        return self.add(Cost(gap[0], max(gap[1], gap[2]), 0.0, gap[2]))

    def epsilon(self, delta: float) -> float:
        """ε at ``delta`` of this composition: the PLD read at δ − Σδ_sel, capped by basic composition's Σε
        when Σδ ≤ ``delta`` (both bounds are valid: as :func:`dpsql.pld.pld_epsilon`)."""
        composed = self
        spent = composed.spent
        selection = spent.selection_delta
        at = delta - selection * (1 + REL_TOLERANCE) if selection > 0 else delta
        epsilon = composed.state.epsilon(at) if at >= 0 else math.inf
        if spent.delta <= delta * (1 + REL_TOLERANCE):
            epsilon = min(epsilon, spent.epsilon)
        return epsilon


def _excess(recorded: float, composed: float) -> float:
    """How far a reconciled sum exceeds the composed one, beyond float rounding (0 when it does not)."""
    return recorded - composed if recorded > composed + 1e-9 * max(abs(recorded), abs(composed)) + 1e-15 else 0.0


def check_composed(
    *, who: str, name: str, composed: Composed, recorded: Spent, cost: Cost, budget: BudgetLike
) -> tuple[float, Composed]:
    """The reservation's check under ``pld`` accounting: raise 53P01 unless the charges so far (``composed``,
    covering the reconciled ``recorded`` sums) and ``cost`` stay within ``budget`` by PLD; return the
    composed ε they reach and ``composed`` with ``cost`` added (what the ledger keeps). Same refusals and
    wording as :func:`dpsql.pld.check_pld_budget`: the selection δs beyond the δ budget, or the composed ε at
    the budget's δ beyond its ε (with the accountant's slack). Every cost is composed untagged (the generic
    PLD of its (ε, δ) dominates any mechanism)."""
    before = composed.covering(recorded)
    this = Cost(cost.epsilon, cost.delta, cost.rho, cost.selection_delta)
    selection = before.spent.selection_delta + this.selection_delta
    if this.selection_delta > 0 and selection > budget.delta * (1 + REL_TOLERANCE):
        detail = (
            f"spent partition-selection δ={fmt(before.spent.selection_delta)} of {fmt(budget.delta)}, "
            f"this query needs δ={fmt(this.selection_delta)}"
        )
        raise refusal(who, name, this, detail, HINT_SELECTION)
    after = before.add(this)
    total = after.epsilon(budget.delta)
    if not total <= budget.epsilon * (1 + REL_TOLERANCE):
        spent = before.epsilon(budget.delta) if who != "dataset" else math.nan
        detail = (
            f"spent ε={fmt(spent)} (composed by PLD at δ={fmt(budget.delta)}) of {fmt(budget.epsilon)}, "
            f"this query needs ε={fmt(this.epsilon)}"
            + (f", δ={fmt(this.delta)}" if this.delta else "")
            + f", which would total ε={fmt(total)}"
        )
        raise refusal(who, name, this, detail)
    return total, after if before is composed else composed.add(this)
