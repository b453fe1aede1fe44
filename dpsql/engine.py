"""The engine: prepare → reserve → run → release → finish.

Every front door (DB-API driver, CLI, wire server) calls :meth:`Engine.execute`. The
order inside is the privacy argument: the cost is reserved durably in the ledger
*before* the backend runs, raw measures never leave :mod:`dpsql.release.apply` un-noised,
and what follows the noise is post-processing (:mod:`dpsql.postprocess`). Each stage's code
lives with its stage: analysis in :mod:`dpsql.analyze`, SQL in :mod:`dpsql.rewrite`,
calibration, release and accuracy in :mod:`dpsql.release`, EXPLAIN in :mod:`dpsql.explain`.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlglot import exp

from dpsql import budget_view
from dpsql.accountant import Cost
from dpsql.analyze import analyze_tree, infer_parameter_types
from dpsql.analyze.fold import reads_clock
from dpsql.analyze.insert import insert
from dpsql.analyze.parse import (
    Params,
    bind_parameters,
    dialect,
    params_key,
    placeholder_value,
    too_complex,
)
from dpsql.analyze.randomized import local_query
from dpsql.analyze.statement import CACHE_BYTES as PLAN_CACHE_BYTES
from dpsql.analyze.statement import Kind, Statements, tree_bytes
from dpsql.audit import AuditTrail, note_cache_hit, note_charge
from dpsql.backends import DEFAULT_STATEMENT_TIMEOUT_MS, Backend, log_database_error, open_backend
from dpsql.cache import ResultCache, cache_key, data_stamp, database_identity, policy_hash, result_key
from dpsql.errors import BackendError, Error, InvalidAuthorization, charged_on_failure
from dpsql.explain import Explanation, explain, explain_format
from dpsql.fingerprint import fingerprint_key, keyed, row_selection_salt, statement_shape
from dpsql.ledger import Charge, Ledger, resolve_ledger_url
from dpsql.lru import LRU
from dpsql.outer import describe as describe_outer
from dpsql.outer import explain as explain_outer
from dpsql.outer import route as route_outer
from dpsql.outer.explain import CompositeExplanation
from dpsql.plan import Plan
from dpsql.policy import Policy, load_policy
from dpsql.postprocess.finish import finish, from_cache
from dpsql.prepared import Description, Prepared
from dpsql.release.accuracy import accuracy_notes, bias_note
from dpsql.release.accuracy import confidence as confidence_level
from dpsql.release.apply import apply, apply_local
from dpsql.release.calibrate import FREE, budget
from dpsql.release.rounding import round_result, rounding_on
from dpsql.rewrite import histogram_queries, rewrite
from dpsql.rewrite.physical import StoredTypes, choose_physical, data_version
from dpsql.session import Result, Session

__all__ = ["Description", "Engine", "Explanation", "Prepared"]

_PLAN_CACHE_SIZE = 1024


class Engine:
    """Answers aggregate SQL over one policy's tables with differential privacy."""

    def __init__(self, policy: Policy, backend: Backend, ledger: Ledger, cache: ResultCache | None = None) -> None:
        self.policy = policy
        self.backend = backend
        self.ledger = ledger
        self.cache = cache
        self._policy_hash = policy_hash(policy)
        self._database_identity: str | None = None
        #: Plans hold their rewritten trees: bounded in bytes too (see :func:`tree_bytes`).
        self._plans: LRU[tuple[Any, ...], Prepared] = LRU(_PLAN_CACHE_SIZE, PLAN_CACHE_BYTES)
        self._statements = Statements(_PLAN_CACHE_SIZE)
        #: Keys the per-row hash choosing which rows of a heavy unit are kept (never shown to analysts;
        #: derived from the ledger's installation key, so every process on one ledger keeps the same rows).
        self._salt = row_selection_salt(ledger.installation_key())
        if cache is not None:  # entries are signed under the installation key: no one else can write one
            cache.use_installation_key(ledger.installation_key())
        #: Keys the query fingerprints (log and ledger); derived from the ledger's installation key.
        self._fingerprint_key: bytes | None = None
        #: Refuses columns stored as text but declared typed (schema only, read once per data version).
        self._stored_types = StoredTypes(backend)
        #: One audit row per statement (shape, cost, outcome), written to the ledger off the query's path.
        self.audit = AuditTrail(ledger, policy.dataset, lambda sql: (self.fingerprint(sql), statement_shape(sql)))

    @classmethod
    def open(
        cls,
        policy: str | Path | Policy,
        database: str,
        ledger: str | None = None,
        cache: str | None = None,
        *,
        statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
    ) -> Engine:
        """Open an engine from a policy (file or object), a database URL, a ledger URL and a cache URL.

        Without ``ledger``: the persistent per-dataset ledger the CLI uses (one budget for every
        engine of a dataset); in memory only when asked (``ledger="memory"``). The result cache lives
        beside the ledger (persisted and shared exactly as the budget it protects). Database
        statements are cancelled after ``statement_timeout_ms`` (57014; 0 = never)."""
        loaded = policy if isinstance(policy, Policy) else load_policy(policy)
        ledger_url = resolve_ledger_url(ledger, loaded.dataset)
        read_only = not loaded.writes.randomized_response  # a DuckDB file then shared with other processes
        backend = open_backend(database, statement_timeout_ms=statement_timeout_ms, read_only=read_only)
        results = ResultCache.open(cache) if cache else ResultCache.beside(ledger_url)
        return cls(loaded, backend, Ledger.open(ledger_url), results)

    def close(self) -> None:
        self.audit.close()
        self.backend.close()
        self.ledger.close()
        if self.cache is not None:
            self.cache.close()

    # -- planning ------------------------------------------------------------------------------

    def _plan_key(self, sql: str, session: Session, params: Params) -> tuple[Any, ...]:
        return (
            sql,
            params_key(params),
            (session.epsilon, session.delta, session.mechanism),
            data_version(self.backend),
        )

    def prepare(
        self, sql: str, session: Session, params: Params = None, tree: exp.Expression | None = None
    ) -> Prepared:
        """Analyze, rewrite and budget ``sql`` (``tree``: already parsed); cached on text, parameters and settings."""
        key = self._plan_key(sql, session, params)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        try:
            tree = (tree or self._statements.get(sql).tree).copy()
            clock = reads_clock(tree)  # NOW() is folded to this statement's start: never reuse its plan
            prepared = self._prepare(sql, tree, session, params)
        except RecursionError:
            raise too_complex() from None
        return prepared if clock else self._plans.put(key, prepared, tree_bytes(sql, tree))

    def fingerprint(self, sql: str) -> str:
        """The keyed fingerprint of a statement's shape (constants removed): what the server logs and
        the ledger records for it. Equal shapes, equal fingerprints; never a function of constants."""
        if self._fingerprint_key is None:
            self._fingerprint_key = fingerprint_key(self.ledger.installation_key())
        return keyed(self._fingerprint_key, statement_shape(sql))

    def _prepare(self, sql: str, tree: exp.Expression, session: Session, params: Params) -> Prepared:
        fingerprint = self.fingerprint(sql)
        plan = analyze_tree(tree, self.policy, params)
        self._stored_types.check(plan)
        local = local_query(plan, self.backend.dialect)
        version = data_version(self.backend)
        plan = replace(plan, physical=choose_physical(plan, self.backend, self._salt))
        select = rewrite(plan)
        budgeting = budget(self.policy, plan, session)
        normalised = tree.sql(dialect=dialect("postgres"), normalize=True, copy=False)  # tree is not used afterwards
        histograms = histogram_queries(plan, dialect(self.backend.dialect))
        settings = (budgeting.epsilon, budgeting.delta, budgeting.mechanism)
        key = cache_key(self.policy.dataset, normalised, params_key(params), settings)
        if local is not None:
            budgeting = FREE
        sql = select.sql(dialect=dialect(self.backend.dialect), copy=False)
        return Prepared(plan, sql, budgeting, fingerprint, histograms, key, local, version)

    # -- front-door API ------------------------------------------------------------------------

    def describe(self, sql: str, session: Session) -> Description:
        """Output columns and parameter types, without running the query or spending budget."""
        if budget_view.is_budget_query(sql, self.policy):  # the analyst's own row: ledger only, free
            own = budget_view.own_budget(self.ledger, self.policy, session.analyst)
            return Description(budget_view.answer(sql, own).columns, [])
        statement = self._statements.get(sql)
        if statement.kind is Kind.INSERT:  # stored at Execute; no result columns
            return Description([], [])
        described = describe_outer(self, sql, session, statement.tree)  # probes; post-processing over sub-queries
        if described is not None:
            return described
        tree = statement.tree.copy()
        param_types = infer_parameter_types(tree, self.policy)
        placeholders = [placeholder_value(t) for t in param_types]
        plan = analyze_tree(tree, self.policy, placeholders or None)
        return Description([o.column for o in plan.outputs], param_types)

    def explain(self, sql: str, session: Session, params: Params = None) -> Explanation | CompositeExplanation:
        """Cost, sensitivity, noise scale and expected error per output; spends nothing."""
        composite = explain_outer(self, sql, session, params, self._statements.get(sql).tree)
        if composite is not None:  # every DP part and the post-processing
            return composite
        prepared = self.prepare(sql, session, params)
        # Every clamp shown, proven redundant or not: which ones the statistics prove is data-dependent.
        shown_sql = self._clamped_sql(prepared.plan).replace(self._salt, "<secret>")
        return explain(prepared.plan, prepared.budgeting, confidence_level(self.policy, session), shown_sql)

    def execute(self, sql: str, session: Session, params: Params = None) -> Result:
        """Answer one DP query: reserve the budget, run, noise, post-process; audited however it ends."""
        with self.audit.recording(sql, session.analyst):
            result = self._answer(sql, session, params)
        return round_result(result) if rounding_on(session) else result  # post-processing, per session

    def reserve(self, cost: Cost, session: Session, fingerprint: str) -> Charge:
        """Charge ``cost`` to the analyst and the dataset, durably, before anything runs (audited)."""
        return note_charge(
            self.ledger.reserve(
                dataset=self.policy.dataset,
                analyst=session.analyst,
                cost=cost,
                dataset_budget=self.policy.budget.dataset,
                analyst_budget=self.policy.analyst_budget(session.analyst),
                fingerprint=fingerprint,
                accounting=self.policy.budget.accounting,
            )
        )

    def _answer(self, sql: str, session: Session, params: Params) -> Result:
        if self.policy.analyst(session.analyst) is None:
            raise InvalidAuthorization(f'role "{session.analyst}" does not exist')
        if budget_view.is_budget_query(sql, self.policy):  # the analyst's own budget: ledger only, free
            return budget_view.answer(sql, budget_view.own_budget(self.ledger, self.policy, session.analyst))
        self.ledger.check_not_frozen(self.policy.dataset, session.analyst)  # 42501 before anything runs
        statement = self._statements.get(sql)  # parsed once per text; classified on the tree
        if statement.kind is Kind.EXPLAIN:
            return self.explain(statement.target, session, params).as_result(explain_format(sql))
        if statement.kind is Kind.INSERT:
            return insert(self.backend, self.policy, bind_parameters(statement.tree.copy(), params))
        routed = route_outer(self, sql, session, params, statement.tree)  # probes; queries over DP results
        if routed is not None:
            return routed
        prepared = self.prepare(sql, session, params, statement.tree)
        budgeting = prepared.budgeting
        confidence = confidence_level(self.policy, session)  # validated before anything is charged
        if prepared.local is not None:
            return self._release_local(prepared, confidence)
        stored_key = None
        if self.cache is not None and prepared.plan.measures:
            stored_key = self._result_key(prepared, confidence)
            entry = self.cache.get_entry(stored_key)
            if entry is not None:
                note_cache_hit()
                return from_cache(*entry)
        charge = self.reserve(budgeting.cost, session, prepared.fingerprint) if prepared.plan.measures else None
        with charged_on_failure(budgeting.epsilon if charge is not None else 0.0):
            result = self._measure(prepared, confidence)
        if charge is not None:
            # the ledger's own accountant (Σε under pure, ε(Σρ, δ − Σδ_sel) under zcdp) on the policy's budget plus
            # the curator's grants, capped by what the dataset has left: what the analyst can really spend
            result.remaining_epsilon = charge.remaining(self.policy.budget.accounting).epsilon
            result.notices.append(
                f"dpsql: charged ε={budgeting.epsilon:g}"
                + (f", δ={budgeting.delta:g}" if budgeting.delta else "")
                + f'; remaining ε={result.remaining_epsilon:g} for analyst "{session.analyst}"'
            )
        if self.cache is not None and stored_key is not None:
            self.cache.put(stored_key, result)
        return result

    def _measure(self, prepared: Prepared, confidence: float) -> Result:
        """Run the measurement query (and its histograms) and release the noisy result; called only
        after the reservation (here and for each DP part of a composite statement)."""
        rows = self._run(prepared.sql)
        if prepared.plan.physical.proven and data_version(self.backend) != prepared.data_version:
            # a write raced the proof: run it again with every clamp in place
            rows = self._run(self._clamped_sql(prepared.plan))
        histograms = {i: self._run(sql) for i, sql in prepared.histograms}
        return self._release(prepared, rows, confidence, histograms)

    def _result_key(self, prepared: Prepared, confidence: float) -> str:
        """The result-cache key: the query's, on this database, at its current data version, under this
        policy, at this confidence level (a stored answer's intervals and notes are computed at it)."""
        if self._database_identity is None:
            self._database_identity = database_identity(self.backend)
        try:
            stamp = data_stamp(self.backend)
        except Exception:  # no version readable: a key no other query shares (never served stale)
            stamp = secrets.token_hex(16)
        return result_key(prepared.cache_key, self._database_identity, stamp, self._policy_hash, confidence)

    def _release_local(self, prepared: Prepared, confidence: float) -> Result:
        """Counts of a randomized-response column, debiased from its stored (perturbed) values; free."""
        local = prepared.local
        assert local is not None
        observed = {value: int(count) for value, count in self._run(local.sql)}
        result = finish(prepared.plan, *apply_local(prepared.plan, local, observed, confidence), prepared.cache)
        result.notices.append("dpsql: randomized-response estimate from perturbed answers; no budget charged")
        return result

    def _clamped_sql(self, plan: Plan) -> str:
        """The measurement query with every clamp in place, whatever the statistics prove."""
        if plan.physical.proven:
            plan = replace(plan, physical=replace(plan.physical, proven=frozenset()))
        return rewrite(plan).sql(dialect=self.backend.dialect)

    def _run(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            _, rows = self.backend.execute(sql)
        except Error:
            raise
        except Exception as exc:  # never surface the database's own text: it may depend on data
            log_database_error("reading the query's result failed", exc)
            raise BackendError("the database failed to run the query") from None
        return rows

    def _release(
        self,
        prepared: Prepared,
        rows: list[tuple[Any, ...]],
        confidence: float,
        histograms: dict[int, list[tuple[Any, ...]]] | None = None,
    ) -> Result:
        """Noise the measures (:func:`dpsql.release.apply.apply`), then post-process the released values."""
        plan, budgeting = prepared.plan, prepared.budgeting
        released = apply(plan, budgeting, rows, confidence, histograms, prepared.cache)
        result = finish(plan, *released, prepared.cache)
        result.epsilon_spent, result.delta_spent = budgeting.epsilon, budgeting.delta
        result.notices.extend(accuracy_notes(plan, budgeting, confidence, result, released))  # what ± cannot say
        if (bias := bias_note(plan, confidence)) is not None:  # nor what it leaves out
            result.notices.append(bias)
        return result
