"""The engine: prepare → reserve → run → release → finish.

Every front door (DB-API driver, CLI, wire server) calls :meth:`Engine.execute`. The
order inside is the privacy argument: the query is validated and priced before anything is
charged, then the DP step (:mod:`dpsql.step`, shared with composite statements in
:mod:`dpsql.outer`) reserves the cost durably in the ledger *before* the backend runs; raw
measures never leave :mod:`dpsql.release.apply` un-noised, and what follows the noise is
post-processing (:mod:`dpsql.postprocess`). Each stage's code lives with its stage: analysis
in :mod:`dpsql.analyze`, SQL in :mod:`dpsql.rewrite`, calibration, release and accuracy in
:mod:`dpsql.release`, EXPLAIN in :mod:`dpsql.explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from sqlglot import exp

from dpsql import budget_view
from dpsql.accountant import Cost
from dpsql.analyze import analyze_tree, infer_parameter_types
from dpsql.analyze.fold import reads_clock
from dpsql.analyze.in_lists import shrink_in_lists
from dpsql.analyze.parse import (
    Params,
    bind_parameters,
    dialect,
    params_key,
    placeholder_value,
    too_complex,
)
from dpsql.analyze.randomized import LocalQuery, local_query
from dpsql.analyze.statement import CACHE_BYTES as PLAN_CACHE_BYTES
from dpsql.analyze.statement import Kind, Statements, tree_bytes
from dpsql.backends import DEFAULT_STATEMENT_TIMEOUT_MS, Backend, open_backend, quote_ident
from dpsql.cache import ResultCache, cache_key, measurement_key
from dpsql.errors import Error, FeatureNotSupported, InvalidAuthorization
from dpsql.explain import Explanation, explain, explain_format
from dpsql.fingerprint import fingerprint_key, keyed, row_selection_salt, statement_shape, tree_shape
from dpsql.ledger import Ledger, resolve_ledger_url
from dpsql.ledger.audit import AuditTrail
from dpsql.lru import LRU
from dpsql.notices import typed
from dpsql.outer import describe as describe_outer
from dpsql.outer import explain as explain_outer
from dpsql.outer import route as route_outer
from dpsql.outer.explain import CompositeExplanation
from dpsql.outer.public import describe as describe_public
from dpsql.outer.public import explain as explain_public
from dpsql.outer.public import route as route_public
from dpsql.plan import Plan
from dpsql.policy import Policy, load_policy
from dpsql.postprocess.trim import trim_time, trimming_on
from dpsql.prepared import Description, Prepared
from dpsql.release.accuracy import caps_cut
from dpsql.release.accuracy import confidence as confidence_level
from dpsql.release.bias import BiasEstimate
from dpsql.release.bias import rest as bias_rest
from dpsql.release.bias import shape as bias_shape
from dpsql.release.calibrate import FREE, budget
from dpsql.release.cap import CapChoice
from dpsql.release.cap import candidates as cap_candidates
from dpsql.release.cap import split as split_epsilon
from dpsql.release.rounding import round_result, rounding_on
from dpsql.rewrite import histogram_queries, rewrite
from dpsql.rewrite.cap import units_above
from dpsql.rewrite.physical import StoredTypes, choose_physical, data_version
from dpsql.session import AUTO, Result, Session
from dpsql.step import Step
from dpsql.writes import insert

__all__ = ["Description", "Engine", "Explanation", "Prepared"]

_PLAN_CACHE_SIZE = 1024
#: A public table column with more stored values than this gets no domain from them (partition selection).
MAX_PUBLIC_VALUES = 10_000


@dataclass(frozen=True, slots=True)
class _Shape:
    """A statement prepared up to its privacy settings (:meth:`Engine._shape`); immutable, shared by the
    :class:`Prepared` of every ε, δ and mechanism it is priced at."""

    fingerprint: str
    plan: Plan
    local: LocalQuery | None
    version: int
    #: The measurement's SQL, the quantiles' histograms' and the normalised statement (the cache key's).
    sql: str
    histograms: tuple[tuple[int, str], ...]
    normalised: str
    #: ``dpsql.max_rows_per_unit = auto``: the candidate caps and the SQL counting units above each.
    candidates: tuple[int, ...] | None
    units_sql: str | None
    #: The bias estimate before its ε (:meth:`dpsql.release.bias.BiasEstimate.at`).
    estimate: BiasEstimate | None
    #: Whether it reads the clock (NOW() folded at this statement's start: never kept nor reused).
    clock: bool
    #: What it weighs in the plan caches (:func:`tree_bytes`).
    weight: int
    #: ``repr`` of what the measurement's columns mean (keys, measures, selection count): its key's part.
    measured: str


class _Verbatim:
    """Text that stands for an object in a key's material (its ``repr``, computed once)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class Engine:
    """Answers aggregate SQL over one policy's tables with differential privacy."""

    def __init__(self, policy: Policy, backend: Backend, ledger: Ledger, cache: ResultCache | None = None) -> None:
        self.policy = policy
        self.backend = backend
        #: The DP step (lookup, reserve, measure, store, notice), shared with composite statements;
        #: it holds the ledger and the result cache.
        self.step = Step(policy, backend, ledger, cache)
        #: Plans hold their rewritten trees: bounded in bytes too (see :func:`tree_bytes`).
        self._plans: LRU[tuple[Any, ...], Prepared] = LRU(_PLAN_CACHE_SIZE, PLAN_CACHE_BYTES)
        #: What preparing a statement builds that no privacy setting changes (:meth:`_shape`), by text,
        #: parameters, cap setting, ``dpsql.bias`` and data version: a new ε is priced, not planned again.
        self._shapes: LRU[tuple[Any, ...], _Shape] = LRU(_PLAN_CACHE_SIZE, PLAN_CACHE_BYTES)
        #: Parsed statements by text (and which texts are plain single queries: :mod:`dpsql.outer`).
        self.statements = Statements(_PLAN_CACHE_SIZE, self._shrink, tree_shape)
        #: Keys the per-row hash choosing which rows of a heavy unit are kept (never shown to analysts;
        #: derived from the ledger's installation key, so every process on one ledger keeps the same rows).
        self._salt = row_selection_salt(ledger.installation_key())
        if cache is not None:  # entries are signed under the signing key: no one else (no ledger writer) can write one
            cache.use_installation_key(ledger.signing_key())
        #: Keys the query fingerprints (log and ledger); derived from the ledger's installation key.
        self._fingerprint_key: bytes | None = None
        #: Refuses columns stored as text but declared typed (schema only, read once per data version).
        self._stored_types = StoredTypes(backend)
        #: Public table columns' stored values, the domains of keys the policy lists none for.
        self._public_domains: LRU[tuple[str, str, int], tuple[tuple[Any, ...] | None]] = LRU(256)
        #: One audit row per statement (shape, cost, outcome), written to the ledger off the query's path.
        self.audit = AuditTrail(ledger, policy.dataset, lambda sql: (self.fingerprint(sql), self.shape(sql)))

    @property
    def ledger(self) -> Ledger:
        return self.step.ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:  # one copy: a ledger swapped in charges every release
        self.step.ledger = ledger

    @property
    def cache(self) -> ResultCache | None:
        return self.step.cache

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
        # accuracy-first's ε depends on the target, the confidence it is met at, and (its refusal) on the
        # analyst's whole budget
        accuracy = (
            None
            if session.accuracy is None
            else (
                session.accuracy,
                confidence_level(self.policy, session),
                self.policy.analyst_budget(session.analyst).epsilon,
            )
        )
        return (
            sql,
            params_key(params),
            (session.epsilon, session.delta, session.mechanism, accuracy, self._cap_setting(session), session.bias),
            data_version(self.backend),
        )

    def _public_values(self, table: str, column: str) -> tuple[Any, ...] | None:
        """A public table column's stored values (sorted, NULL last), None beyond :data:`MAX_PUBLIC_VALUES`:
        a key's domain when the policy lists none (a public table's rows are public; read once per data
        version). Free: it reads no person's data."""
        key = (table, column, data_version(self.backend))
        found = self._public_domains.get(key)
        if found is None:
            col = quote_ident(column)
            _, rows = self.backend.execute(
                f"SELECT DISTINCT {col} FROM {quote_ident(table)} ORDER BY 1 NULLS LAST LIMIT {MAX_PUBLIC_VALUES + 1}"
            )
            values = tuple(r[0] for r in rows if r[0] is not None)
            found = self._public_domains.put(key, (None if len(rows) > MAX_PUBLIC_VALUES else values,))
        return found[0]

    def _cap_setting(self, session: Session) -> int | str | None:
        """The session's ``dpsql.max_rows_per_unit``, else the policy's default (None: each table's cap)."""
        if session.max_rows_per_unit is not None:
            return session.max_rows_per_unit
        return self.policy.defaults.max_rows_per_unit

    def prepare(
        self, sql: str, session: Session, params: Params = None, tree: exp.Expression | None = None
    ) -> Prepared:
        """Analyze, rewrite and budget ``sql`` (``tree``: already parsed); cached on text, parameters and settings."""
        key = self._plan_key(sql, session, params)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        try:
            shape_key = self._shape_key(sql, session, params)
            shape = self._shapes.get(shape_key)
            if shape is None:
                tree = (tree or self.statements.get(sql).tree).copy()
                clock = reads_clock(tree)  # NOW() is folded to this statement's start: never reuse its plan
                shape = self._shape(sql, tree, session, params, clock)
                if not clock:
                    self._shapes.put(shape_key, shape, shape.weight)
            prepared = self._priced(shape, session, params)
        except RecursionError:
            raise too_complex() from None
        return prepared if shape.clock else self._plans.put(key, prepared, shape.weight)

    def _shape_key(self, sql: str, session: Session, params: Params) -> tuple[Any, ...]:
        # everything _shape reads from the session: the cap setting, dpsql.bias and whether accuracy-first
        return (
            sql,
            params_key(params),
            (self._cap_setting(session), session.bias, session.accuracy is None),
            data_version(self.backend),
        )

    def fingerprint(self, sql: str, shape: str | None = None) -> str:
        """The keyed fingerprint of a statement's shape (constants removed): what the server logs and
        the ledger records for it. Equal shapes, equal fingerprints; never a function of constants.
        ``shape``: :func:`statement_shape` of ``sql`` already computed (the server's helper process)."""
        if self._fingerprint_key is None:
            self._fingerprint_key = fingerprint_key(self.ledger.installation_key())
        return keyed(self._fingerprint_key, self.shape(sql) if shape is None else shape)

    def shape(self, sql: str) -> str:
        """:func:`statement_shape` of ``sql``, read from its tree when this engine parsed (or refused) it already."""
        return self.statements.shape(sql) or statement_shape(sql)

    def _shrink(self, tree: exp.Expression) -> None:
        """A new query's IN lists shrunk (:func:`shrink_in_lists`), but for a read of ``dpsql_budget``: its
        lists are over the analyst's own row, not the policy's columns."""
        if not budget_view.reads_only_budget(tree) or self.policy.table(budget_view.BUDGET_RELATION) is not None:
            shrink_in_lists(tree, self.policy)

    def _budget_tree(self, sql: str) -> exp.Expr | None:
        """The parsed statement when ``sql`` reads only the analyst's own ``dpsql_budget`` row, else None
        (parsed once, through :attr:`statements`). A text the engine's parse refuses is read as the budget
        view always read it (its own parse, no length cap: a 300 kB predicate there is 54001, as before)."""
        if not budget_view.may_read_budget(sql, self.policy):
            return None
        try:
            tree: exp.Expr | None = self.statements.get(sql).tree
        except Error:
            failed = self.statements.failure(sql)
            tree = failed.tree if failed is not None and failed.tree is not None else budget_view.parse(sql)
        return tree if budget_view.reads_only_budget(tree) else None

    def _prepare(self, sql: str, tree: exp.Expression, session: Session, params: Params) -> Prepared:
        """``sql`` planned from its ``tree`` and priced, no cache read nor written (bench/overhead.py's
        uncached stage)."""
        return self._priced(self._shape(sql, tree, session, params, reads_clock(tree)), session, params)

    def _shape(self, sql: str, tree: exp.Expression, session: Session, params: Params, clock: bool) -> _Shape:
        """What preparing ``sql`` builds that no privacy setting (ε, δ, mechanism, confidence) changes: the
        analysis, physical choices, the rewrite and its SQL, the bias estimate's SQL; kept per shape key
        (:meth:`_shape_key`) so a new ε re-prices the statement without planning it again."""
        fingerprint = self.fingerprint(sql)
        plan = analyze_tree(tree, self.policy, params, self._public_values)
        self._stored_types.check(plan)
        local = local_query(plan, self.backend.render)
        version = data_version(self.backend)
        plan = replace(plan, physical=choose_physical(plan, self.backend, self._salt))
        plan, candidates, units_sql = self._cap(plan, session, local is None)
        select = rewrite(plan)
        estimate = self._bias(plan, session, candidates, local is None, select)
        normalised = tree.sql(dialect=dialect("postgres"), normalize=True, copy=False)  # tree is not used afterwards
        histograms = tuple(histogram_queries(plan, self.backend.render))
        measurement = self.backend.render(select, copy=False)
        measured = repr((plan.keys, plan.measures, plan.selection_measure))  # (its trees' repr is not cheap)
        return _Shape(
            fingerprint, plan, local, version, measurement, histograms, normalised, candidates, units_sql, estimate,
            clock, tree_bytes(sql, tree), measured,
        )  # fmt: skip

    def _priced(self, shape: _Shape, session: Session, params: Params) -> Prepared:
        """``shape`` calibrated at the session's privacy settings: the cap's choice and the bias estimate at
        their shares of its ε, the budgeting, and the keys its releases are stored under."""
        plan, estimate, choice = shape.plan, None, None
        if shape.candidates is not None:  # dpsql.max_rows_per_unit = auto: a share of ε chooses the cap
            spent, rest = split_epsilon(session, self._epsilon(session))
            assert shape.units_sql is not None
            choice = CapChoice(shape.candidates, spent, shape.units_sql, rest)
        if shape.estimate is not None:
            estimate = shape.estimate.at(self._epsilon(session))
            if choice is not None and estimate.epsilon:  # taken from what the cap's choice leaves
                choice = replace(
                    choice, session=bias_rest(choice.session, self._epsilon(choice.session), estimate.epsilon)
                )
        calibrated = session if choice is None else choice.session  # (the choice's: less the estimate's share)
        if choice is None and estimate is not None and estimate.epsilon:
            calibrated = bias_rest(session, self._epsilon(session), estimate.epsilon)
        budgeting = budget(self.policy, plan, calibrated, confidence_level(self.policy, session))
        shares = ([] if choice is None else [choice.epsilon]) + (
            [] if estimate is None or not estimate.epsilon else [estimate.epsilon]
        )
        if shares:  # the cap's choice, the bias estimate and the measurement, composed: the query's ε in all
            costs = [Cost(epsilon=e) for e in shares] + [budgeting.cost]
            budgeting = replace(budgeting, epsilon=self._epsilon(session), cost=Cost.total(costs))
        settings = (
            budgeting.epsilon,
            budgeting.delta,
            budgeting.mechanism,
            self._cap_setting(session),
            estimate is not None,
        )
        key = cache_key(self.policy.dataset, shape.normalised, params_key(params), settings)
        histograms = list(shape.histograms)
        measured = _Verbatim(shape.measured)  # what the measurement's columns mean
        measurement = measurement_key(
            self.policy.dataset, shape.sql, histograms, params_key(params), measured, budgeting
        )
        if shape.local is not None:
            budgeting = FREE
        return Prepared(
            plan, shape.sql, budgeting, shape.fingerprint, histograms, key, shape.local, shape.version, measurement,
            cap=choice, bias=estimate,
        )  # fmt: skip

    def _epsilon(self, session: Session) -> float:
        return session.epsilon if session.epsilon is not None else self.policy.defaults.epsilon

    def _bias(
        self, plan: Plan, session: Session, candidates: tuple[int, ...] | None, measured: bool, select: exp.Select
    ) -> BiasEstimate | None:
        """How the query's cap/clamp bias is estimated under DP (``dpsql.bias``, on by default;
        :mod:`dpsql.release.bias`), its ε not yet set (:meth:`BiasEstimate.at`: a share of the query's, taken
        from what the cap's choice leaves, if any). None when off, free, accuracy-first (its ε is set by the ±
        asked for) or nothing can be cut. On DuckDB at a cap not chosen at run time, folded into the
        measurement ``select`` where it can be."""
        if session.bias is False or not measured or not plan.measures or session.accuracy is not None:
            return None
        render = partial(self.backend.render, copy=False)
        fold = select if candidates is None and getattr(self.backend, "dialect", None) == "duckdb" else None
        return bias_shape(plan, caps_cut(plan), (plan.max_rows,) if candidates is None else candidates, render, fold)

    def _cap(self, plan: Plan, session: Session, measured: bool) -> tuple[Plan, tuple[int, ...] | None, str | None]:
        """The plan at the session's (or policy's) per-unit cap; with ``auto``, at the largest candidate,
        with the candidates and the SQL counting units above each, from which it is chosen when the query
        runs (:mod:`dpsql.release.cap`; its share of ε is set by :meth:`_priced`)."""
        setting = self._cap_setting(session)
        if setting is None or plan.unit is None or not plan.measures or not measured:
            return plan, None, None
        if setting != AUTO:
            return replace(plan, tau=int(setting), tau_origin="set"), None, None
        if session.accuracy is not None:
            raise FeatureNotSupported(
                "dpsql.max_rows_per_unit = auto cannot be combined with dpsql.accuracy",
                hint="Accuracy-first needs the ± before the query runs; set a number of rows, e.g. "
                "SET dpsql.max_rows_per_unit = 8, or RESET dpsql.accuracy.",
            )
        chosen = cap_candidates(plan.max_rows)
        plan = replace(plan, tau=chosen[-1], tau_origin="auto")
        return plan, chosen, self.backend.render(units_above(plan, chosen), copy=False)

    # -- front-door API ------------------------------------------------------------------------

    def describe(self, sql: str, session: Session) -> Description:
        """Output columns and parameter types, without running the query or spending budget."""
        if (budget := self._budget_tree(sql)) is not None:  # the analyst's own row: ledger only, free
            own = budget_view.own_budget(self.ledger, self.policy, session.analyst)
            return Description(budget_view.answer(sql, own, budget).columns, [])
        statement = self.statements.get(sql)
        if statement.kind is Kind.INSERT:  # stored at Execute; no result columns
            return Description([], [])
        public = describe_public(self, sql, session, statement.tree)  # public tables only: exact
        if public is not None:
            return public
        described = describe_outer(self, sql, session, statement.tree)  # probes; post-processing over sub-queries
        if described is not None:
            return described
        tree = statement.tree.copy()
        param_types = infer_parameter_types(tree, self.policy)
        placeholders = [placeholder_value(t) for t in param_types]
        plan = analyze_tree(tree, self.policy, placeholders or None)
        return Description([o.column for o in plan.outputs], param_types)

    def explain(
        self, sql: str, session: Session, params: Params = None, *, actual: bool = True
    ) -> Explanation | CompositeExplanation:
        """Cost, sensitivity, noise scale and expected error per output; spends nothing. ``actual``: what it
        would really cost (nothing, when released values would answer it); a composite's parts are priced
        as charged (its header composes them)."""
        tree = self.statements.get(sql).tree
        public = explain_public(self, sql, session, params, tree)  # public tables only: exact and free
        if public is not None:
            return public
        composite = explain_outer(self, sql, session, params, tree)
        if composite is not None:  # every DP part and the post-processing
            return composite
        prepared = self.prepare(sql, session, params)
        # Every clamp shown, proven redundant or not: which ones the statistics prove is data-dependent.
        shown_sql = self.step.clamped_sql(prepared.plan).replace(self._salt, "<secret>")
        confidence = confidence_level(self.policy, session)
        explanation = explain(prepared.plan, prepared.budgeting, confidence, shown_sql)
        if prepared.bias is not None:  # what the estimate spends, stated
            explanation = replace(explanation, bias=prepared.bias.explain_text(prepared.budgeting.epsilon))
        free = self.step.free_answer(prepared, confidence, session.max_widening) if actual else None
        return explanation if free is None else explanation.answered_by(free)

    def execute(self, sql: str, session: Session, params: Params = None) -> Result:
        """Answer one DP query: reserve the budget, run, noise, post-process; audited however it ends.
        Every notice of the result is a typed :class:`dpsql.notices.Notice`."""
        with self.audit.recording(sql, session.analyst):
            result = typed(self._answer(sql, session, params))
        if trimming_on(session):  # post-processing, per session
            result = trim_time(result, confidence_level(self.policy, session))
        return round_result(result) if rounding_on(session) else result

    def _answer(self, sql: str, session: Session, params: Params) -> Result:
        if self.policy.analyst(session.analyst) is None:
            raise InvalidAuthorization(f'role "{session.analyst}" does not exist')
        if (budget := self._budget_tree(sql)) is not None:  # the analyst's own budget: ledger only, free
            return budget_view.answer(sql, budget_view.own_budget(self.ledger, self.policy, session.analyst), budget)
        self.ledger.check_not_frozen(self.policy.dataset, session.analyst)  # 42501 before anything runs
        statement = self.statements.get(sql)  # parsed once per text; classified on the tree
        if statement.kind is Kind.EXPLAIN:
            return self.explain(statement.target, session, params).as_result(explain_format(sql))
        if statement.kind is Kind.INSERT:
            return insert(self.backend, self.policy, bind_parameters(statement.tree.copy(), params))
        public = route_public(self, sql, session, params, statement.tree)  # public tables only: exact, free
        if public is not None:
            return public
        routed = route_outer(self, sql, session, params, statement.tree)  # probes; queries over DP results
        if routed is not None:
            return routed
        prepared = self.prepare(sql, session, params, statement.tree)
        confidence = confidence_level(self.policy, session)  # validated before anything is charged
        return self.step.answer(prepared, session, confidence)
