"""Derived answers: a query answered from released values alone — declared synopses and the cells of
earlier releases (:mod:`dpsql.synopsis.reuse`) — combined across all that answer it, when accurate enough.

Every source that answers the query exactly (:func:`dpsql.synopsis.answer.estimate`) gives each output
cell an estimate with a public noise variance; the sources' noises are independent (each release drew
its own), so they are combined cell by cell by inverse variance (:func:`dpsql.synopsis.answer.combine`,
never less accurate than the best one alone). Then:

* with a declared synopsis among them, the answer is used whatever its width (the curator released the
  synopsis for this), unless the analyst asked for an accuracy (``dpsql.accuracy``, then met or a fresh
  query) or set ``dpsql.max_widening`` = k (a fresh, charged answer when the ± would be more than k× a
  fresh one's);
* from earlier releases alone, only when no wider than the fresh query's own ± at its ε (or within
  ``dpsql.accuracy``).

Privacy: everything read is released values, public variances and domains; which sources exist depends
on what was released before (not on the data), and whether the answer is used on public widths only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dpsql.cache import ResultCache
from dpsql.ledger import Ledger
from dpsql.plan import Plan
from dpsql.policy import Policy
from dpsql.postprocess.finish import released_at
from dpsql.release.apply import widths_at
from dpsql.release.calibrate import Budgeting
from dpsql.synopsis.answer import Cells, Derived, combine, derived, estimate
from dpsql.synopsis.current import Synopses
from dpsql.synopsis.reuse import Index
from dpsql.synopsis.store import Released


@dataclass(frozen=True)
class Source:
    """A release an answer was derived from: a declared synopsis, or an earlier query's cells."""

    released: Released
    #: When it was released (seconds since the epoch).
    created: float
    synopsis: bool


@dataclass(frozen=True)
class Derivation:
    """A derived answer before post-processing, with where it came from."""

    answered: Derived
    sources: tuple[Source, ...]
    #: The largest ratio of its ± to the fresh answer's at the query's ε (None: none to compare with).
    widening: float | None

    @property
    def from_synopsis(self) -> bool:
        return any(s.synopsis for s in self.sources)

    def source_text(self) -> str:
        """Where the answer came from, for the notice that says nothing was charged."""
        synopses = [s.released for s in self.sources if s.synopsis]
        releases = sorted(s.created for s in self.sources if not s.synopsis)
        if synopses:
            named = "; ".join(
                f'synopsis "{r.name}" released {r.released_at} ({_cost(r)} charged once to dataset "{r.dataset}")'
                for r in synopses
            )
            more = f", combined with the cells of {_count(len(releases))} earlier release" if releases else ""
            return f"dpsql: answered from {named}{more}{'s' if len(releases) > 1 else ''}; no budget charged"
        if len(releases) == 1:
            return (
                f"dpsql: answered by summing the cells of an earlier, finer release (first released at "
                f"{released_at(releases[0])}: the same table, filters and measures on this database and data); "
                "no budget charged"
            )
        times = ", ".join(released_at(t) for t in releases)
        return (
            f"dpsql: answered by summing the cells of {len(releases)} earlier, finer releases, combined (released "
            f"at {times}: the same table and filters on this database and data); no budget charged"
        )

    def noise_text(self) -> str:
        """What the ± are intervals of."""
        if len(self.sources) > 1:
            return "the released cells' noise, combined by inverse variance"
        return (
            "the synopsis's noise after least-squares consistency" if self.from_synopsis else "the summed cells' noise"
        )

    def widening_text(self, epsilon: float) -> str | None:
        """How much wider than a fresh answer a synopsis's ± are, when they are."""
        if not self.from_synopsis or self.widening is None or self.widening <= 1.0 + 1e-9:
            return None
        return (
            f"dpsql: these ± are up to {self.widening:.3g}× those of a fresh answer at ε={epsilon:g} (the synopsis "
            "spreads its ε over every chart); SET dpsql.max_widening to a factor to get a fresh, charged answer "
            "instead when it is wider than that"
        )


def _cost(released: Released) -> str:
    return f"ε={released.epsilon:g}" + (f", δ={released.delta:g}" if released.delta else "")


def _count(n: int) -> str:
    return "one" if n == 1 else str(n)


def _within(widths: Sequence[float | None], limits: Sequence[float | None]) -> bool:
    """Whether every half-width is at most its limit (a missing one never is)."""
    return all(
        w is not None and lim is not None and w <= lim * (1 + 1e-9) for w, lim in zip(widths, limits, strict=True)
    )


def _widening(widths: Sequence[Sequence[float | None]], fresh: Sequence[float | None]) -> float | None:
    ratios = [w / f for row in widths for w, f in zip(row, fresh, strict=True) if w is not None and f]
    return max(ratios) if ratios else None


class Deriver:
    """Derived answers over one policy, its ledger's synopses and the result cache's index."""

    def __init__(self, policy: Policy, cache: ResultCache | None) -> None:
        self.policy = policy
        self.index = Index(cache) if cache is not None else None
        self._synopses: Synopses | None = None

    def synopses(self, ledger: Ledger, identity: str) -> list[Released]:
        """The newest release of each declared synopsis on this database."""
        if not self.policy.synopses:
            return []
        if self._synopses is None or self._synopses.ledger is not ledger:  # a ledger swapped in
            self._synopses = Synopses(self.policy, ledger)
        return self._synopses.current(identity)

    def derive(
        self,
        plan: Plan,
        budgeting: Budgeting,
        confidence: float,
        *,
        synopses: Sequence[Released],
        index: tuple[str, str, str] | None,
        widening: float | None = None,
    ) -> Derivation | None:
        """The plan answered from ``synopses`` (None when none of them answers it) and, with ``index``
        (database, data stamp, policy hash), the indexed releases; None when not accurate enough."""
        found: list[tuple[Source, Cells]] = []
        for released in synopses:
            cells = estimate(plan, released, self.policy)
            if cells is not None:
                found.append((Source(released, released.built_at, True), cells))
        if synopses and not found:
            return None
        if index is not None and self.index is not None:
            database, stamp, policy = index
            for released, residual, created in self.index.candidates(
                plan, database=database, stamp=stamp, policy=policy
            ):
                cells = estimate(replace(plan, where=residual), released, self.policy)
                if cells is not None:
                    found.append((Source(released, created, False), cells))
        if not found:
            return None
        answered = derived(plan, combine([cells for _, cells in found]), confidence)
        fresh = widths_at(budgeting, confidence)
        ratio = _widening(answered[2], fresh)
        target = budgeting.accuracy  # SET dpsql.accuracy: met, or a fresh query
        if target is not None:
            if not all(_within(row, [target] * len(row)) for row in answered[2]):
                return None
        elif synopses:
            if widening is not None and ratio is not None and ratio > widening * (1 + 1e-9):
                return None
        elif not all(_within(row, fresh) for row in answered[2]):
            return None
        if self.index is not None:
            for source, _ in found:
                if not source.synopsis:
                    self.index.used(source.released)
        return Derivation(answered, tuple(source for source, _ in found), ratio)
