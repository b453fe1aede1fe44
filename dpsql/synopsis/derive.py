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

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpsql.cache import ResultCache
from dpsql.ledger import Ledger
from dpsql.notices import Notice, NoticeKind, typed
from dpsql.plan import Plan
from dpsql.policy import Policy
from dpsql.postprocess.finish import finish, released_at
from dpsql.release.accuracy import bias_note
from dpsql.release.apply import ReleaseCache, widths_at
from dpsql.release.calibrate import Budgeting
from dpsql.session import Result
from dpsql.synopsis.answer import Cells, Derived, combine, derived, estimate
from dpsql.synopsis.current import Synopses
from dpsql.synopsis.reuse import Index, indexable
from dpsql.synopsis.solve import noise_variance
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
    """Derived answers over one policy, its ledger's synopses and the result cache's index: the one call
    the DP step asks (:meth:`answer`), and the one it tells of each release (:meth:`remember`)."""

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

    def answer(
        self,
        plan: Plan,
        budgeting: Budgeting,
        release_cache: ReleaseCache,
        confidence: float,
        *,
        synopses: Ledger | None,
        database: str,
        stamp: str | None,
        policy: str,
        widening: float | None = None,
    ) -> Result | None:
        """The query finished from released values, with its notices: the declared synopses stored in
        ``synopses`` (a ledger) that cover it, combined with earlier releases' cells on this ``database``
        at ``stamp`` under ``policy`` (its hash); without a ledger, those cells alone. None when nothing
        answers it accurately enough (:meth:`derive`). Post-processing of released values, free."""
        if plan.tau is not None:  # a cap of its own: released values were bounded at another
            return None
        current = self.synopses(synopses, database) if synopses is not None else []
        if synopses is not None and not current:
            return None
        index = None if stamp is None else (database, stamp, policy)
        found = self.derive(plan, budgeting, confidence, synopses=current, index=index, widening=widening)
        if found is None:
            return None
        result = typed(finish(plan, *found.answered, release_cache))
        result.notices.append(Notice(found.source_text(), NoticeKind.FREE))
        result.notices.append(
            Notice(
                f"dpsql: ± are {confidence:.0%} intervals of {found.noise_text()} (its standard deviation times the "
                "Laplace or normal quantile); they cover noise only, not the bias of the caps and bounds"
            )
        )
        if (wider := found.widening_text(budgeting.epsilon)) is not None:
            result.notices.append(Notice(wider))
        if (bias := bias_note(plan, confidence)) is not None:
            result.notices.append(Notice.of(bias))
        return result

    def remember(
        self, plan: Plan, budgeting: Budgeting, columns: list[list[Any]], *, database: str, stamp: str, policy: str
    ) -> None:
        """Index a fresh release's noisy columns (in the order :func:`dpsql.release.apply.apply` releases
        them), with each measure's public noise variance and mechanism, so a coarser query can be
        answered from its cells (:mod:`dpsql.synopsis.reuse`); nothing when it cannot serve one."""
        if self.index is None or not indexable(plan):
            return
        variances = [noise_variance(s) for s in budgeting.specs if s is not None]
        self.index.record(
            plan,
            columns,
            variances,
            database=database,
            stamp=stamp,
            policy=policy,
            built_at=time.time(),
            mechanism=budgeting.mechanism,
        )
