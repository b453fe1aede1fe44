"""The rows one person keeps, chosen under DP per query (``SET dpsql.max_rows_per_unit = auto``).

A policy's caps are set for every query at once, so they are loose for most: a join or a filter that
leaves each person a handful of rows is still bounded (and noised) at the table's cap, and the error
is the cap's. Any cap τ is private — bounding keeps at most τ rows per unit after the joins and every
sensitivity follows τ — so τ may be chosen from the data if the choice itself is DP.

The choice, after R2T (Dong et al., SIGMOD 2022: geometric candidates, the best chosen privately):
candidates 1, 2, 4, … up to the cap the policy would use (:func:`candidates`); one query counts, per
candidate τ, the units with more than τ rows in the query's joined and filtered rows, N(τ); an
exponential mechanism picks τ maximising −(N(τ) + w·τ), where w·τ is the noise a cap of τ adds to a
count (√2·τ/ε of the measurement, counted in rows) and N(τ) the persons it cuts (each loses at least a
row). Privacy: one unit moves every N(τ) by at most 1, all in the same direction (adding a unit can
only raise them), so report-noisy-max with exponential noise of scale 1/ε_τ is ε_τ-DP
(:func:`dpsql.noise.exponential.select_cap`); w and the candidates are public. The measurement then
runs at τ with the rest of the query's ε: the charge is the query's ε, composed sequentially.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dpsql.accountant import remainder
from dpsql.noise.exponential import select_cap
from dpsql.session import Session

#: Share of a query's ε spent choosing its cap.
SHARE = 0.1


@dataclass(frozen=True, slots=True)
class CapChoice:
    """How one query's cap is chosen at run time (prepared once with the query)."""

    #: Caps to choose from, increasing; the last is the cap the policy would use.
    candidates: tuple[int, ...]
    #: ε spent choosing (a pure-ε share of the query's).
    epsilon: float
    #: SQL counting, per candidate, the units with more rows than it (one row, one column each).
    sql: str
    #: The settings the measurement is calibrated with at the chosen cap: the session's, with the rest of ε.
    session: Session

    @property
    def weight(self) -> float:
        """Rows of noise per row of cap: √2·τ/ε is a Laplace count's standard deviation at cap τ."""
        assert self.session.epsilon is not None
        return math.sqrt(2.0) / self.session.epsilon

    def choose(self, above: Sequence[int]) -> int:
        """The cap chosen (ε_τ-DP) from the counts of units above each candidate."""
        scores = [-(float(n) + self.weight * tau) for n, tau in zip(above, self.candidates, strict=True)]
        return self.candidates[select_cap(scores, self.epsilon)]


def candidates(cap: int) -> tuple[int, ...]:
    """1, 2, 4, … below ``cap``, then ``cap`` itself."""
    out, tau = [], 1
    while tau < cap:
        out.append(tau)
        tau *= 2
    return (*out, cap)


def split(session: Session, epsilon: float) -> tuple[float, Session]:
    """(ε spent choosing, the settings the measurement is calibrated with)."""
    chosen = epsilon * SHARE
    rest = Session(
        session.analyst,
        epsilon=remainder(epsilon, chosen),
        delta=session.delta,
        mechanism=session.mechanism,
        confidence=session.confidence,
    )
    return chosen, rest
