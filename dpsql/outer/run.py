"""Running the DP parts of a composite statement: pricing, the result cache, one reservation, release.

Shared by post-processing over sub-queries (:mod:`dpsql.outer`) and the series limit
(:mod:`dpsql.outer.series`). The cache holds each *inner* query's released rows, under the key an
ordinary query of the same text gets (:meth:`Engine._result_key`: normalised SQL, parameters, privacy
settings, confidence level, database identity, data stamp, policy hash), so a composite statement at
another confidence level releases its inner queries afresh, charged. Caching the released inner rows
rather than the final answer is the better choice: the outer statement is post-processing, free to recompute;
an inner answer already released (alone or inside any other composite) is public and is never
charged or noised again, so two dashboards wrapping one aggregate differently share one release, and
averaging fresh noise over repeats is impossible. Whether an entry exists depends on what was
released before, never on the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsql.accountant import Cost
from dpsql.audit import note_cache_hit
from dpsql.session import Result, Session

if TYPE_CHECKING:
    from dpsql.engine import Engine, Prepared
    from dpsql.ledger import Charge

CACHED_NOTICE = "dpsql: every DP sub-query was answered from the result cache; no budget charged"


@dataclass(slots=True)
class Part:
    """One DP query of a composite statement, with its cache key and, on a hit, its stored release."""

    prepared: Prepared
    key: str | None = None
    hit: Result | None = None

    @property
    def charged(self) -> bool:
        """Whether releasing it costs budget: it measures something, is not free and is not cached."""
        return bool(self.prepared.plan.measures) and self.prepared.local is None and self.hit is None


def lookup(engine: Engine, prepared: Prepared, confidence: float) -> Part:
    """``prepared`` with its stored release, if this exact query was released before at this confidence
    level (nothing charged)."""
    if engine.cache is None or not prepared.plan.measures or prepared.local is not None:
        return Part(prepared)
    key = engine._result_key(prepared, confidence)
    entry = engine.cache.get_entry(key)
    return Part(prepared, key, entry[0] if entry is not None else None)


def total(parts: list[Part]) -> Cost | None:
    """The sum of the costs of the parts that will be released now (sequential composition), None when
    none costs anything (free, or cached)."""
    costs = [p.prepared.budgeting.cost for p in parts if p.charged]
    if not costs:
        return None
    rho = 0.0
    for c in costs:
        try:
            rho += c.zcdp_rho()
        except ValueError:  # an (ε, δ) cost without ρ: the ledger composes ε and δ only
            rho = 0.0
            break
    return Cost(
        epsilon=sum(c.epsilon for c in costs),
        delta=sum(c.delta for c in costs),
        rho=rho,
        selection_delta=sum(c.selection_delta for c in costs),
    )


def release(engine: Engine, part: Part, confidence: float) -> Result:
    """The part's released rows: its stored release, or run and noised exactly as :meth:`Engine.execute`
    does after its reservation (then stored, so any later exact repeat is free)."""
    if part.hit is not None:
        note_cache_hit()
        return part.hit
    prepared = part.prepared
    if prepared.local is not None:
        return engine._release_local(prepared, confidence)
    result = engine._measure(prepared, confidence)
    if engine.cache is not None and part.key is not None:
        engine.cache.put(part.key, result)
    return result


def reserve(engine: Engine, cost: Cost | None, session: Session, sql: str) -> Charge | None:
    """One durable reservation for every part released now (None: nothing to charge)."""
    return engine.reserve(cost, session, engine.fingerprint(sql)) if cost is not None else None


def charged_notice(
    engine: Engine, result: Result, cost: Cost | None, charge: Charge | None, session: Session, parts: list[Part]
) -> None:
    """Set the result's spent and remaining budget and its charge (or cache) notice."""
    result.epsilon_spent = cost.epsilon if cost else 0.0
    result.delta_spent = cost.delta if cost else 0.0
    if charge is None or cost is None:
        if any(p.hit is not None for p in parts):
            result.notices.append(CACHED_NOTICE)
        return
    queries = sum(p.charged for p in parts)
    result.remaining_epsilon = charge.remaining(engine.policy.budget.accounting).epsilon  # min(analyst, dataset)
    result.notices.append(
        f"dpsql: charged ε={cost.epsilon:g}"
        + (f", δ={cost.delta:g}" if cost.delta else "")
        + f" for {queries} DP sub-quer{'y' if queries == 1 else 'ies'}"
        + f'; remaining ε={result.remaining_epsilon:g} for analyst "{session.analyst}"'
    )
