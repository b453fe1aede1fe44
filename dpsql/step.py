"""The DP step: look up → reserve → measure → store → notice, written once for every release.

The privacy argument and design notes: docs/internals.md, section dpsql/step.py.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from dpsql.accountant import BudgetLike, Cost, fmt
from dpsql.backends import Backend, log_database_error
from dpsql.cache import (
    ResultCache,
    data_stamp,
    database_identity,
    measurement_result,
    measurements,
    policy_hash,
    result_key,
    stored_measurement_key,
)
from dpsql.errors import BackendError, Error, charged_on_failure
from dpsql.ledger import Charge, Ledger
from dpsql.ledger.audit import gated, note_cache_hit, note_charge
from dpsql.notices import ALL_CACHED, ALL_RELEASED, LOCAL, Notice, NoticeKind, Severity, typed
from dpsql.plan import Plan
from dpsql.policy import Policy
from dpsql.postprocess.finish import finish, from_cache, from_release
from dpsql.prepared import Prepared
from dpsql.release.accuracy import accuracy_notes, bias_note
from dpsql.release.apply import Released, apply, apply_local, released_again
from dpsql.release.bias import BIAS_SUFFIX, BiasFigures, split_folded, widen
from dpsql.release.calibrate import accuracy_guard, budget, threshold_at
from dpsql.release.selection import empty_selection_note
from dpsql.rewrite import histogram_queries, rewrite
from dpsql.rewrite.physical import data_version
from dpsql.session import Result, Session
from dpsql.synopsis.derive import Deriver
from dpsql.unit_keys import KeyGuard, chain_keys

__all__ = ["Notice", "NoticeKind", "Part", "Severity", "Step"]  # the notice types: dpsql.notices, re-exported


@dataclass(slots=True)
class Part:
    """One DP query of a statement, with its result-cache key and, on a hit, its stored release."""

    prepared: Prepared
    key: str | None = None
    hit: Result | None = None
    #: When the stored release was first computed (seconds since the epoch), on a hit.
    created: float = 0.0
    #: The stored key of its measurements (:func:`dpsql.cache.stored_measurement_key`), when cached.
    measurement: str | None = None
    #: Whether the hit was finished from an earlier release's measurements (not this exact query's answer).
    reused: bool = False
    #: Whether the hit was derived by post-processing other released values (a curator synopsis, or the
    #: cells of an earlier finer release); its notices already say so.
    derived: bool = False
    #: The data stamp the lookup saw (what a release made now is indexed under).
    stamp: str | None = None

    @property
    def charged(self) -> bool:
        """Whether releasing it costs budget: it measures something, is not free and is not cached."""
        return bool(self.prepared.plan.measures) and self.prepared.local is None and self.hit is None

    @property
    def cost(self) -> Cost:
        return self.prepared.budgeting.cost


class Step:
    """The DP step over one engine's policy, backend, ledger and result cache."""

    def __init__(self, policy: Policy, backend: Backend, ledger: Ledger, cache: ResultCache | None) -> None:
        self.policy = policy
        self.backend = backend
        self.ledger = ledger
        self.cache = cache
        self._policy_hash = policy_hash(policy)
        self._database_identity: str | None = None
        self._keys = KeyGuard(policy, backend)
        #: Derived answers: declared synopses and the index of earlier releases' cells.
        self.deriver = Deriver(policy, cache)

    # -- a query alone ---------------------------------------------------------------------------

    def answer(self, prepared: Prepared, session: Session, confidence: float) -> Result:
        """A validated, priced query: its stored release (free), or its cost reserved, then measured,
        stored and noticed. Its one cost is charged as it is (nothing to compose)."""
        part = self.lookup(prepared, confidence, session.max_widening)
        if part.derived and part.hit is not None:
            return part.hit
        if part.hit is not None:
            note_cache_hit()
            return typed((from_release if part.reused else from_cache)(part.hit, part.created))
        cost = part.cost if part.charged else None
        with self.reserved(cost, session, prepared.fingerprint) as charge:
            result = self.release(part, confidence)
        self.notice(result, cost, charge, session)
        return result

    def free_answer(self, prepared: Prepared, confidence: float, widening: float | None = None) -> Result | None:
        """What :meth:`answer` would return at no charge (a stored or derived answer), else None: what
        EXPLAIN reports as the statement's real cost. Reads released values only; charges nothing."""
        part = self.lookup(prepared, confidence, widening)
        if part.hit is None or part.derived:
            return part.hit
        return typed((from_release if part.reused else from_cache)(part.hit, part.created))

    # -- the parts, shared with composite statements ------------------------------------------------

    def lookup(self, prepared: Prepared, confidence: float, widening: float | None = None) -> Part:
        """``prepared`` with its stored release, if this exact query was released before at this
        confidence level, or else finished again from the stored measurements of an earlier release
        of the same measurement (nothing charged either way), or derived from released values (a curator
        synopsis that covers it first, else earlier releases' cells: :meth:`derived`). Free and unmeasured
        queries are never cached. ``widening``: ``dpsql.max_widening``."""
        if not prepared.plan.measures or prepared.local is not None:
            return Part(prepared)
        stamp = self._data_stamp() if self.cache is not None else None
        synopsis = self.derived(prepared, confidence, stamp, widening, synopses=True)
        if synopsis is not None:
            return Part(prepared, hit=synopsis, derived=True)
        if self.cache is None or stamp is None:
            self._check_keys(prepared, None)
            return Part(prepared)
        key = self.result_key(prepared, confidence, stamp)
        entry = self.cache.get_entry(key)
        if entry is not None:
            return Part(prepared, key, typed(entry[0]), entry[1])
        assert self._database_identity is not None
        measurement = stored_measurement_key(
            prepared.measurement_key, self._database_identity, stamp, self._policy_hash
        )
        stored = self.cache.get_entry(measurement)
        found = (
            None if stored is None else measurements(stored[0], len(prepared.plan.keys), len(prepared.plan.measures))
        )
        if stored is None or found is None:
            coarser = self.derived(prepared, confidence, stamp, widening, synopses=False)
            if coarser is not None:
                return Part(prepared, key, coarser, measurement=measurement, derived=True, stamp=stamp)
            self._check_keys(prepared, stamp)
            return Part(prepared, key, measurement=measurement, stamp=stamp)
        figures = self._stored_figures(prepared, measurement, confidence)
        if prepared.bias is not None and figures is None:  # its bias estimate not kept: released again
            self._check_keys(prepared, stamp)
            return Part(prepared, key, measurement=measurement, stamp=stamp)
        released = released_again(prepared.budgeting, *found, confidence)
        result = self.finish_released(prepared, released, confidence, figures)
        return Part(prepared, key, result, stored[1], measurement, True)

    def _stored_figures(self, prepared: Prepared, measurement: str, confidence: float) -> BiasFigures | None:
        """The bias estimate released with a stored measurement (:mod:`dpsql.release.bias`), if any."""
        if prepared.bias is None or self.cache is None:
            return None
        entry = self.cache.get_entry(measurement + BIAS_SUFFIX)
        if entry is None:
            return None
        return BiasFigures.from_rows(prepared.bias, entry[0].rows, confidence)

    def _check_keys(self, prepared: Prepared, stamp: str | None) -> None:
        """Before anything is charged: the keys the query reaches its persons through are unique on this
        data (:mod:`dpsql.unit_keys`; 23505 otherwise). Free queries read no data and are not checked."""
        if not prepared.plan.measures or prepared.local is not None or not chain_keys(prepared.plan):
            return
        self._keys.check(prepared.plan, stamp if stamp is not None else self._data_stamp())

    def derived(
        self, prepared: Prepared, confidence: float, stamp: str | None, widening: float | None, *, synopses: bool
    ) -> Result | None:
        """The query answered from released values (:meth:`dpsql.synopsis.derive.Deriver.answer`): the
        declared synopses that cover it (``synopses``), combined with earlier releases' cells, or those
        cells alone. Post-processing of released values, free; None when nothing answers it."""
        if self._database_identity is None:
            self._database_identity = database_identity(self.backend)
        return self.deriver.answer(
            prepared.plan,
            prepared.budgeting,
            prepared.cache,
            confidence,
            synopses=self.ledger if synopses else None,
            database=self._database_identity,
            stamp=stamp,
            policy=self._policy_hash,
            widening=widening,
        )

    @staticmethod
    def total(parts: Sequence[Part]) -> Cost | None:
        """The cost of the parts released now, composed by the accountant (sequential composition);
        None when none costs anything (free, or cached)."""
        costs = [p.cost for p in parts if p.charged]
        return Cost.total(costs) if costs else None

    def reserve(self, cost: Cost, session: Session, fingerprint: str) -> Charge:
        """Charge ``cost`` to the analyst and the dataset, durably, before anything runs (audited).
        Under a server job the reservation is gated (:func:`dpsql.ledger.audit.gated`): refused once
        the client stopped waiting, else recorded before the client is told what was charged."""
        self._guard(cost, session)
        return reserve_charge(self.ledger, self.policy, cost, who=session.analyst, fingerprint=fingerprint)

    def _guard(self, cost: Cost, session: Session) -> None:
        """Accuracy-first's guard against what the analyst really has left, grants included
        (:func:`dpsql.release.calibrate.accuracy_guard`); read from the ledger before the charge."""
        if session.accuracy is None:
            return
        dataset, budget = self.policy.dataset, self.policy.analyst_budget(session.analyst)
        left = self.ledger.remaining(
            dataset,
            session.analyst,
            budget=budget,
            accounting=self.policy.budget.accounting,
            dataset_budget=self.policy.budget.dataset,
        )
        total = self.ledger.levers(dataset, session.analyst).limit(budget).epsilon
        accuracy_guard(cost.epsilon, session, left.epsilon, total)

    @contextlib.contextmanager
    def reserved(self, cost: Cost | None, session: Session, fingerprint: str) -> Iterator[Charge | None]:
        """Reserve ``cost`` (None: nothing to charge) before the work inside runs; a dpsql error raised
        there says what was charged, and nothing is refunded."""
        charge = self.reserve(cost, session, fingerprint) if cost is not None else None
        with charged_on_failure(0.0 if cost is None else cost.epsilon):
            yield charge

    def release(self, part: Part, confidence: float) -> Result:
        """The part's released rows: its stored release, a free randomized-response estimate, or
        measured and noised (called only inside :meth:`reserved`), then stored so an exact repeat is free."""
        if part.hit is not None:
            note_cache_hit()
            return part.hit
        prepared = part.prepared
        if prepared.local is not None:
            return self._release_local(prepared, confidence)
        result = self.measure(prepared, confidence, part.measurement, part.stamp)
        if self.cache is not None and part.key is not None:
            self.cache.put(part.key, result)
        return result

    def notice(
        self,
        result: Result,
        cost: Cost | None,
        charge: Charge | None,
        session: Session,
        parts: Sequence[Part] | None = None,
    ) -> None:
        """Set what the statement spent and has left, and say so (``parts``: a composite's DP queries,
        counted in the notice, or all answered from the cache)."""
        result.epsilon_spent = cost.epsilon if cost is not None else 0.0
        result.delta_spent = cost.delta if cost is not None else 0.0
        if charge is None or cost is None:
            if parts is not None and any(p.hit is not None for p in parts):
                result.notices.append(ALL_RELEASED if any(p.derived for p in parts) else ALL_CACHED)
            return
        # the ledger's own accountant (Σε under pure, ε(Σρ, δ − Σδ_sel) under zcdp) on the policy's budget plus
        # the curator's grants, capped by what the dataset has left: what the analyst can really spend
        result.remaining_epsilon = charge.remaining(self.policy.budget.accounting).epsilon
        queries = None if parts is None else sum(p.charged for p in parts)
        result.notices.append(Notice.charged(cost, result.remaining_epsilon, session.analyst, queries))

    # -- measuring and releasing ----------------------------------------------------------------

    def measure(
        self, prepared: Prepared, confidence: float, measurement: str | None = None, stamp: str | None = None
    ) -> Result:
        """Run the measurement query (and its histograms) and release the noisy result; only ever
        after the reservation. The released measurements are stored under ``measurement`` (if given)."""
        chosen = None
        if prepared.cap is not None:
            # released at a cap chosen from the data: its measurements are not the ones the key names
            above = self.query(prepared.cap.sql)[0]
            prepared, chosen = self.at_cap(prepared, prepared.cap.choose([int(n or 0) for n in above]))
            measurement = stamp = None
        # the cap/clamp bias, estimated under DP at its share of the reserved ε (noised with the released keys)
        folded = None if prepared.bias is None or chosen is not None else prepared.bias.folded
        bias: list[tuple[Any, ...]] | None
        if folded is not None:  # the measurement and the bias totals in one statement (dpsql.release.bias.folded_query)
            rows, bias = split_folded(self.query(folded[0]), folded[1], len(prepared.plan.keys))
        else:
            totals = None if prepared.bias is None else prepared.bias.sql_at(prepared.plan.max_rows)
            bias = None if prepared.bias is None else [] if totals is None else self.query(totals)
            rows = self.query(prepared.sql)
        if prepared.plan.physical.proven and data_version(self.backend) != prepared.data_version:
            # a write raced the proof: run it again with every clamp in place
            rows = self.query(self.clamped_sql(prepared.plan))
        read: dict[str, list[tuple[Any, ...]]] = {}  # a quantile's interval ends share its histogram
        histograms = {
            i: read[sql] if sql in read else read.setdefault(sql, self.query(sql)) for i, sql in prepared.histograms
        }
        result = self.release_rows(prepared, rows, confidence, histograms, measurement, stamp, bias)
        if chosen is not None:
            result.notices.append(chosen)
        return result

    def at_cap(self, prepared: Prepared, tau: int) -> tuple[Prepared, Notice]:
        """``prepared`` at the per-unit cap ``tau`` chosen under DP (:mod:`dpsql.release.cap`), with the
        rest of its ε, and the notice saying so; only ever after the reservation of the whole ε."""
        choice = prepared.cap
        assert choice is not None
        plan = replace(prepared.plan, tau=tau, tau_origin="chosen")
        budgeting = budget(self.policy, plan, choice.session)
        budgeting = replace(budgeting, epsilon=prepared.budgeting.epsilon, cost=prepared.budgeting.cost)
        sql = self.backend.render(rewrite(plan), copy=False)
        histograms = histogram_queries(plan, self.backend.render)
        shown = ", ".join(map(str, choice.candidates))
        notice = Notice(
            f"dpsql: at most {tau} row{'s' if tau > 1 else ''} per {plan.sources.unit_description} kept, a cap "
            f"chosen under DP among {shown} (ε={fmt(choice.epsilon)} of this query's ε={fmt(budgeting.epsilon)})"
        )
        return replace(prepared, plan=plan, sql=sql, budgeting=budgeting, histograms=histograms, cap=None), notice

    def release_rows(
        self,
        prepared: Prepared,
        rows: list[tuple[Any, ...]],
        confidence: float,
        histograms: dict[int, list[tuple[Any, ...]]] | None = None,
        measurement: str | None = None,
        stamp: str | None = None,
        bias: list[tuple[Any, ...]] | None = None,
    ) -> Result:
        """Noise the measures (:func:`dpsql.release.apply.apply`), store the released measurements under
        ``measurement`` (if given), then post-process the released values."""
        plan = prepared.plan
        released = apply(plan, prepared.budgeting, rows, confidence, histograms, prepared.cache)
        # the keys only: the raw measures apply leaves in its rows are never stored nor post-processed
        nkeys = len(plan.keys)
        released = Released([row[:nkeys] for row in released.rows], released.columns, released.widths)
        figures = None
        if prepared.bias is not None and bias is not None:  # ε-DP over the released groups (dpsql.release.bias)
            figures = prepared.bias.release(bias, released.rows if nkeys else [()], confidence)
        if self.cache is not None and measurement is not None:
            self.cache.put(measurement, measurement_result(nkeys, released.rows, released.columns))
            if figures is not None:
                self.cache.put(measurement + BIAS_SUFFIX, measurement_result(*figures.stored()))
            if stamp is not None and self._database_identity is not None:
                self.deriver.remember(
                    plan,
                    prepared.budgeting,
                    released.columns,
                    database=self._database_identity,
                    stamp=stamp,
                    policy=self._policy_hash,
                )
        return self.finish_released(prepared, released, confidence, figures)

    def finish_released(
        self, prepared: Prepared, released: Released, confidence: float, figures: BiasFigures | None = None
    ) -> Result:
        """Post-process released measurements: outputs, HAVING, ORDER BY, LIMIT, intervals and notes
        (``figures``: the released bias estimate, added to the ± it covers)."""
        plan, budgeting = prepared.plan, prepared.budgeting
        result = typed(finish(plan, *released, prepared.cache))
        result.epsilon_spent, result.delta_spent = budgeting.epsilon, budgeting.delta
        # ± covering the cap/clamp bias estimated under DP (dpsql.release.bias)
        widened = widen(plan, result, figures, released) if figures is not None else set()
        # what ± cannot say, nor what it leaves out
        notes = accuracy_notes(plan, budgeting, confidence, result, released, widened)
        result.notices.extend(Notice.of(n) for n in notes)
        bias = (
            bias_note(plan, confidence, budgeting.interval_cut)
            if figures is None
            else figures.note(plan, confidence, bool(widened))
        )
        if bias is not None:
            result.notices.append(Notice.of(bias))
        if budgeting.threshold is not None and plan.selection_measure is not None and not released.rows:
            result.notices.append(Notice(empty_selection_note(plan, budgeting.epsilon, budgeting.threshold,
                                                              partial(threshold_at, plan, budgeting))))  # fmt: skip
        return result

    def _release_local(self, prepared: Prepared, confidence: float) -> Result:
        """Counts of a randomized-response column, debiased from its stored (perturbed) values; free."""
        local = prepared.local
        assert local is not None
        observed = {value: int(count) for value, count in self.query(local.sql)}
        result = typed(finish(prepared.plan, *apply_local(prepared.plan, local, observed, confidence), prepared.cache))
        result.notices.append(LOCAL)
        return result

    def result_key(self, prepared: Prepared, confidence: float, stamp: str | None = None) -> str:
        """The result-cache key: the query's, on this database, at its current data version (or
        ``stamp``), under this policy, at this confidence level (a stored answer's intervals and notes
        are computed at it)."""
        if self._database_identity is None:
            self._database_identity = database_identity(self.backend)
        if stamp is None:
            stamp = self._data_stamp()
        return result_key(prepared.cache_key, self._database_identity, stamp, self._policy_hash, confidence)

    def _data_stamp(self) -> str:
        try:
            return data_stamp(self.backend)
        except Exception:  # no version readable: a key no other query shares (never served stale)
            return secrets.token_hex(16)

    def clamped_sql(self, plan: Plan) -> str:
        """The measurement query with every clamp in place, whatever the statistics prove."""
        if plan.physical.proven:
            plan = replace(plan, physical=replace(plan.physical, proven=frozenset()))
        return self.backend.render(rewrite(plan), copy=False)

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` on the backend; the database's own error text is never surfaced."""
        try:
            _, rows = self.backend.execute(sql)
        except Error:
            raise
        except Exception as exc:  # its text may depend on data
            log_database_error("reading the query's result failed", exc)
            raise BackendError("the database failed to run the query") from None
        return rows


# -- the one charge path -------------------------------------------------------------------------


def reserve_charge(
    ledger: Ledger,
    policy: Policy,
    cost: Cost,
    *,
    who: str,
    fingerprint: str,
    analyst_budget: BudgetLike | None = None,
    claim: tuple[str, str] | None = None,
) -> Charge:
    """Charge ``cost`` to ``who`` and the policy's dataset, durably, before anything is measured: the only
    call of :meth:`dpsql.ledger.Ledger.reserve` outside the ledger (``scripts/check_layers.py`` checks it).
    Every release reserves here, whoever measures: :meth:`Step.reserve` (queries), a synopsis build
    (:mod:`dpsql.curator.synopsis_cli`, with its generation's ``claim``) and the curator's DP bounds
    (:mod:`dpsql.curator.dp_bounds`). Under a server job the reservation is gated
    (:func:`dpsql.ledger.audit.gated`: refused once the client stopped waiting, else recorded before the
    client is told), and the charge is noted on the statement being recorded (its audit row).
    ``analyst_budget``: the budget ``who`` is checked against (default: the policy's for ``who``)."""
    with gated() as record:
        charge = note_charge(
            ledger.reserve(
                dataset=policy.dataset,
                analyst=who,
                cost=cost,
                dataset_budget=policy.budget.dataset,
                analyst_budget=policy.analyst_budget(who) if analyst_budget is None else analyst_budget,
                fingerprint=fingerprint,
                accounting=policy.budget.accounting,
                claim=claim,
            )
        )
        record(cost.epsilon)
    return charge
