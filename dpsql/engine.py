"""The engine: analyze → rewrite → budget → execute → noise → post-process.

Every front door (DB-API driver, CLI, wire server) calls :meth:`Engine.execute`. The
order inside is the privacy argument: the cost is reserved durably in the ledger
*before* the backend runs, raw measures never leave this module un-noised, and what
follows the noise is post-processing.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.analyze import analyze_tree, infer_parameter_types, parse_statement
from dpsql.analyze.parse import Params, bind_parameters, dialect, literal_for, skip_comments, too_complex
from dpsql.backends import (
    DEFAULT_STATEMENT_TIMEOUT_MS,
    Backend,
    log_database_error,
    open_backend,
    stored_type_mismatches,
)
from dpsql.cache import ResultCache, cache_key, data_stamp, database_identity, policy_hash, result_key
from dpsql.errors import (
    BackendError,
    DataError,
    DatatypeMismatch,
    Error,
    FeatureNotSupported,
    InsufficientPrivilege,
    InvalidAuthorization,
    InvalidParameterValue,
    ReadOnlyViolation,
    SyntaxError_,
    UndefinedColumn,
    UndefinedTable,
)
from dpsql.fingerprint import fingerprint_key, keyed, statement_shape
from dpsql.ledger import Cost, Ledger, remaining_budget, resolve_ledger_url
from dpsql.localdp import RandomizedResponse, perturb_rows
from dpsql.plan import Measure, Plan
from dpsql.policy import Policy, TablePolicy, load_policy
from dpsql.postprocess import compile_expression, order_rows
from dpsql.release import (
    NoiseSpec,
    check_samplable,
    epsilon_to_rho,
    gaussian_spec,
    half_width,
    laplace_spec,
    partition_threshold,
    release,
    rho_to_epsilon,
)
from dpsql.release.selection import (
    QUANTILE_BINS,
    bin_midpoint,
    rank_error_bound,
    select_mode,
    select_quantile_bin,
)
from dpsql.rewrite import centre_rows, histogram_query, rewrite
from dpsql.session import OutputColumn, Result, Session
from dpsql.writes import write_oracles

#: Largest cross product of public key domains released in one query.
MAX_PUBLIC_GROUPS = 1_000_000
_PLAN_CACHE_SIZE = 1024


@dataclass(frozen=True, slots=True)
class Description:
    """What a query would return, known without running it or spending budget."""

    columns: list[OutputColumn]
    param_types: list[str]


@dataclass(slots=True)
class Budgeting:
    """How one query's (ε, δ) is spent: a noise spec per measure and the charge."""

    epsilon: float
    delta: float
    mechanism: str
    #: Noise per measure; None for quantile measures (exponential mechanism, see ``shares``).
    specs: list[NoiseSpec | None]
    cost: Cost
    #: Pure-ε share of each measure (what the exponential mechanism of a quantile uses).
    shares: list[float] = field(default_factory=list)
    #: Partition-selection threshold on the COUNT(*) measure (None when keys are public).
    threshold: int | None = None
    selection_delta: float = 0.0


@dataclass(slots=True)
class Prepared:
    """A planned query: its plan, generated SQL and budgeting, cached per text and settings."""

    plan: Plan
    sql: str
    budgeting: Budgeting
    fingerprint: str
    #: (measure index, SQL) of the histogram each quantile measure is selected from.
    histograms: list[tuple[int, str]] = field(default_factory=list)
    #: Result-cache key: the normalised statement, its parameters and the session's privacy settings.
    cache_key: str = ""
    #: Set when the query only counts a randomized-response column: answered from stored values, at no cost.
    local: LocalQuery | None = None
    #: The backend's data version the clamp proofs (``plan.proven``) were read at.
    data_version: int = 0


@dataclass(frozen=True, slots=True)
class LocalQuery:
    """A count over a randomized-response column: which column, mechanism, and value filter."""

    mechanism: RandomizedResponse
    sql: str
    value: Any = None
    filtered: bool = False


@dataclass
class Explanation:
    """``dpsql explain`` / ``EXPLAIN``: what a query would cost and how accurate it would be."""

    sql: str
    epsilon: float
    delta: float
    mechanism: str
    columns: list[dict[str, Any]] = field(default_factory=list)
    keys: str = "none"
    unit: str = ""

    def as_result(self) -> Result:
        lines = [
            f"DP Aggregate  (mechanism={self.mechanism} epsilon={self.epsilon:g} delta={self.delta:g})",
            f"  Privacy unit: {self.unit}",
            f"  Group keys: {self.keys}",
        ]
        for c in self.columns:
            if "rank_error95" in c:
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  epsilon={c['epsilon']:g} "
                    f"rank error <= {c['rank_error95']:.4g} at 95%"
                )
            elif c["noisy"] and math.isnan(c["ci"]):
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  sensitivity={c['sensitivity']:g} "
                    f"scale={c['scale']:g} epsilon={c['epsilon']:g}"
                )
            elif c["noisy"]:
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  sensitivity={c['sensitivity']:g} "
                    f"scale={c['scale']:g} epsilon={c['epsilon']:g} ci95=±{c['ci']:.4g}"
                )
            else:
                lines.append(f"  Output {c['name']}: {c['measure']}")
        lines.append(f"  Backend SQL: {self.sql}")
        return Result(
            columns=[OutputColumn("QUERY PLAN", "text")],
            rows=[(line,) for line in lines],
            accuracy=[(None,) for _ in lines],
            epsilon_spent=0.0,
            delta_spent=0.0,
            command_tag="EXPLAIN",
        )


class Engine:
    """Answers aggregate SQL over one policy's tables with differential privacy."""

    def __init__(self, policy: Policy, backend: Backend, ledger: Ledger, cache: ResultCache | None = None) -> None:
        self.policy = policy
        self.backend = backend
        self.ledger = ledger
        self.cache = cache
        self._policy_hash = policy_hash(policy)
        self._database_identity: str | None = None
        self._plans: OrderedDict[tuple[Any, ...], Prepared] = OrderedDict()
        self._lock = threading.Lock()
        #: Keys the per-row hash choosing which rows of a heavy unit are kept; never leaves the process.
        self._salt = secrets.token_hex(16)
        #: Keys the query fingerprints (log and ledger); derived from the ledger's installation key.
        self._fingerprint_key: bytes | None = None
        #: (table, data version) → stored-type mismatches found (schema only, read once per version).
        self._checked_tables: dict[tuple[str, int], list[tuple[str, str]]] = {}

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

        Without ``ledger`` the engine uses the persistent per-dataset ledger the CLI uses
        (:func:`dpsql.ledger.default_ledger`, SQLite under ``$DPSQL_HOME``), so every engine and
        connection of a dataset draws on one budget; a fresh in-memory budget only when asked for
        explicitly (``ledger="memory"`` or ``"sqlite:///:memory:"``). The result cache defaults to
        the ledger's SQLite file (so it persists exactly as long as the budget it protects), or
        memory when the ledger is not a SQLite file. Every statement sent to the database is
        cancelled after ``statement_timeout_ms`` (57014; 0 = never).
        """
        loaded = policy if isinstance(policy, Policy) else load_policy(policy)
        ledger_url = resolve_ledger_url(ledger, loaded.dataset)
        cache_url = cache or (ledger_url if ledger_url.startswith("sqlite:///") else "memory")
        backend = open_backend(database, statement_timeout_ms=statement_timeout_ms)
        return cls(loaded, backend, Ledger.open(ledger_url), ResultCache.open(cache_url))

    def close(self) -> None:
        self.backend.close()
        self.ledger.close()
        if self.cache is not None:
            self.cache.close()

    # -- planning ------------------------------------------------------------------------------

    def prepare(self, sql: str, session: Session, params: Params = None) -> Prepared:
        """Analyze, rewrite and budget ``sql``; cached on text, parameters and session settings."""
        settings = (session.epsilon, session.delta, session.mechanism)
        key = (sql, _hashable(params), settings, _data_version(self.backend))
        with self._lock:
            cached = self._plans.get(key)
            if cached is not None:
                self._plans.move_to_end(key)
                return cached
        try:
            prepared = self._prepare(sql, parse_statement(sql), session, params)
        except RecursionError:
            raise too_complex() from None
        with self._lock:
            self._plans[key] = prepared
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return prepared

    def fingerprint(self, sql: str) -> str:
        """The keyed fingerprint of a statement's shape (constants removed): what the server logs and
        the ledger records for it. Equal shapes, equal fingerprints; never a function of constants."""
        return keyed(self._fingerprinting_key(), statement_shape(sql))

    def _fingerprinting_key(self) -> bytes:
        if self._fingerprint_key is None:
            self._fingerprint_key = fingerprint_key(self.ledger.installation_key())
        return self._fingerprint_key

    def _prepare(self, sql: str, tree: exp.Expression, session: Session, params: Params) -> Prepared:
        fingerprint = self.fingerprint(sql)
        plan = analyze_tree(tree, self.policy, params)
        self._check_stored_types(plan)
        plan.salt = self._salt
        local = _local_query(plan, self.backend.dialect)
        version = _data_version(self.backend)
        plan.proven = _proven_in_bounds(plan, self.backend)
        plan.bound_cells = getattr(self.backend, "bounds_cells", False)
        select = rewrite(plan)
        budgeting = self._budget(plan, session)
        normalised = tree.sql(dialect=dialect("postgres"), normalize=True, copy=False)  # tree is not used afterwards
        histograms = [
            (i, histogram_query(plan, i).sql(dialect=dialect(self.backend.dialect)))
            for i, m in enumerate(plan.measures)
            if m.kind in ("quantile", "mode")
        ]
        key = cache_key(
            self.policy.dataset,
            normalised,
            _hashable(params),
            (budgeting.epsilon, budgeting.delta, budgeting.mechanism),
        )
        if local is not None:
            budgeting = Budgeting(0.0, 0.0, "randomized response", [None], Cost(epsilon=0.0), [0.0])
        sql = select.sql(dialect=dialect(self.backend.dialect), copy=False)
        return Prepared(plan, sql, budgeting, fingerprint, histograms, key, local, version)

    def _check_stored_types(self, plan: Plan) -> None:
        """Refuse a query over a column the database stores as text while the policy declares a number,
        date or boolean: its cast would fail on some rows only (see ``stored_type_mismatches``)."""
        for source in plan.sources.sources:
            table = source.table.source or source.name
            key = (table, _data_version(self.backend))
            if key not in self._checked_tables:
                declared = {name: column.type for name, column in source.table.columns.items()}
                self._checked_tables[key] = stored_type_mismatches(self.backend, table, declared)
            for column, stored in self._checked_tables[key]:
                raise DatatypeMismatch(
                    f'column "{column}" of table "{source.name}" is stored as {stored}, '
                    f"but the policy declares {source.table.columns[column].type}",
                    hint="Fix the column's type in the policy or in the database: a cast of stored text "
                    "could fail on some rows only, so dpsql refuses the table's columns until they agree.",
                )

    def _budget(self, plan: Plan, session: Session) -> Budgeting:
        defaults = self.policy.defaults
        epsilon = session.epsilon if session.epsilon is not None else defaults.epsilon
        delta = session.delta if session.delta is not None else defaults.delta
        mechanism = session.mechanism or defaults.mechanism
        if epsilon <= 0 or not math.isfinite(epsilon):
            raise InvalidParameterValue("dpsql.epsilon must be a positive number")
        if not 0 <= delta < 1:
            raise InvalidParameterValue("dpsql.delta must be in [0, 1)")
        if not plan.measures:
            return Budgeting(0.0, 0.0, mechanism, [], Cost(epsilon=0.0))
        selecting = plan.selection_measure is not None
        _check_query_delta(self.policy, delta, selecting or mechanism == "gaussian")
        if (selecting or mechanism == "gaussian") and delta == 0:
            raise InvalidParameterValue(
                "this query needs δ > 0",
                hint="Grouping by a column without a public domain, and the Gaussian mechanism, "
                "need SET dpsql.delta to a small positive value.",
            )
        try:
            budgeting = self._calibrate(plan, epsilon, delta, mechanism, selecting)
        except ValueError as exc:  # calibration's own checks: a setting no exact sampler can serve
            raise InvalidParameterValue(
                f"cannot calibrate noise for ε={epsilon:g}, δ={delta:g}: {exc}",
                hint="Use a larger dpsql.epsilon (or a smaller dpsql.delta) for this query.",
            ) from None
        return budgeting

    @staticmethod
    def _calibrate(plan: Plan, epsilon: float, delta: float, mechanism: str, selecting: bool) -> Budgeting:
        """Noise per measure and the charge, from validated settings; every spec checked samplable."""
        k = len(plan.measures)
        if mechanism == "gaussian":
            conversion_delta = delta / 2 if selecting else delta
            rho = epsilon_to_rho(epsilon, conversion_delta)
            share = rho_to_epsilon(rho / k, conversion_delta)  # the ε whose zCDP ρ is this measure's share
            specs: list[NoiseSpec | None] = [
                None
                if m.kind in ("quantile", "mode")
                else gaussian_spec(
                    plan.sensitivities(m)[1],
                    share,
                    conversion_delta,
                    integer=_integer(m),
                    cells=plan.max_groups,
                )
                for m in plan.measures
            ]
            shares = [math.sqrt(8 * rho / k)] * k  # ε-DP selection is ε²/8-zCDP (bounded range)
            cost = Cost(epsilon=epsilon, delta=delta, rho=rho, selection_delta=delta / 2 if selecting else 0.0)
        else:
            specs = [
                None
                if m.kind in ("quantile", "mode")
                else laplace_spec(plan.sensitivities(m)[0], epsilon / k, integer=_integer(m), cells=plan.max_groups)
                for m in plan.measures
            ]
            shares = [epsilon / k] * k
            # ε-DP measurements (ρ = ε²/2 under zcdp) plus δ for the partition-selection event only
            cost = Cost(epsilon=epsilon, delta=delta if selecting else 0.0, selection_delta=delta if selecting else 0.0)
        budgeting = Budgeting(epsilon, cost.delta, mechanism, specs, cost, shares)
        if selecting:
            assert plan.selection_measure is not None
            budgeting.selection_delta = delta / 2 if mechanism == "gaussian" else delta
            spec = specs[plan.selection_measure]
            assert spec is not None
            budgeting.threshold = partition_threshold(
                spec, budgeting.selection_delta, max_partitions=plan.max_groups, max_rows=plan.max_rows
            )
        for noise in specs:
            if noise is not None:
                check_samplable(noise)
        return budgeting

    # -- front-door API ------------------------------------------------------------------------

    def describe(self, sql: str, session: Session) -> Description:
        """Output columns and parameter types, without running the query or spending budget."""
        tree = parse_statement(sql)
        param_types = infer_parameter_types(tree, self.policy)
        placeholders = [_placeholder_value(t) for t in param_types]
        plan = analyze_tree(tree, self.policy, placeholders or None)
        return Description([o.column for o in plan.outputs], param_types)

    def explain(self, sql: str, session: Session, params: Params = None) -> Explanation:
        """Cost, sensitivity, noise scale and expected error per output; spends nothing."""
        prepared = self.prepare(sql, session, params)
        plan, budgeting = prepared.plan, prepared.budgeting
        confidence = self._confidence(session)
        columns = []
        for out in plan.outputs:
            entry: dict[str, Any] = {"name": out.column.name, "type": out.column.type, "noisy": out.noisy}
            if out.kind == "mode":
                i = out.measures[0]
                entry.update(
                    measure=f"{plan.measures[i].label}: report-noisy-max",
                    sensitivity=plan.sensitivities(plan.measures[i])[0],
                    scale=plan.sensitivities(plan.measures[i])[0] / budgeting.shares[i],
                    epsilon=budgeting.shares[i],
                    ci=float("nan"),
                )
            elif out.kind == "quantile":
                i = out.measures[0]
                sensitivity = plan.sensitivities(plan.measures[i])[0]
                entry.update(
                    measure=f"{plan.measures[i].label}: exponential mechanism over {QUANTILE_BINS} bins",
                    sensitivity=sensitivity,
                    scale=2 * sensitivity / budgeting.shares[i],
                    epsilon=budgeting.shares[i],
                    ci=float("nan"),
                    rank_error95=rank_error_bound(budgeting.shares[i], sensitivity, confidence),
                )
            elif out.noisy:
                specs = [s for s in (budgeting.specs[i] for i in out.measures) if s is not None]
                entry.update(
                    measure=" + ".join(plan.measures[i].label for i in out.measures),
                    sensitivity=max(plan.sensitivities(plan.measures[i])[0] for i in out.measures),
                    scale=max(s.scale * s.grid for s in specs),
                    epsilon=budgeting.epsilon * len(out.measures) / len(plan.measures),
                    ci=half_width(specs[0], confidence) if out.kind in ("count", "sum") else float("nan"),
                )
                if out.kind == "avg":
                    entry["measure"] = "AVG = centre + noisy centred SUM / noisy COUNT"
            else:
                entry["measure"] = "group key" if out.kind == "key" else "constant"
            columns.append(entry)
        if not plan.keys:
            keys = "none"
        elif plan.public_keys:
            keys = "public domain: " + ", ".join(k.column for k in plan.keys)
        else:
            keys = (
                ", ".join(k.column for k in plan.keys)
                + f" (partition selection: noisy COUNT(*) >= {budgeting.threshold}, δ={budgeting.selection_delta:g})"
            )
        unit = plan.sources.unit_description
        if plan.unit is not None:
            unit += f" (at most {plan.max_rows} rows and {plan.max_groups} groups per unit)"
        # Every clamp shown, proven redundant or not: which ones the statistics prove is data-dependent.
        shown_sql = self._clamped_sql(plan).replace(self._salt, "<secret>")
        return Explanation(shown_sql, budgeting.epsilon, budgeting.delta, budgeting.mechanism, columns, keys, unit)

    def _confidence(self, session: Session) -> float:
        """The session's CI level (or the policy's), checked: a bad one fails before any charge."""
        confidence = session.confidence if session.confidence is not None else self.policy.defaults.confidence
        if not 0 < confidence < 1:  # NaN fails too
            raise InvalidParameterValue(
                f"dpsql.confidence must be between 0 and 1 (exclusive), got {confidence:g}",
                hint="For example SET dpsql.confidence = 0.95.",
            )
        return confidence

    def execute(self, sql: str, session: Session, params: Params = None) -> Result:
        """Answer one DP query: reserve the budget, run, noise, post-process."""
        if self.policy.analyst(session.analyst) is None:
            raise InvalidAuthorization(f'role "{session.analyst}" does not exist')
        head = skip_comments(sql)
        explain_target = _explain_target(head)
        if explain_target is not None:
            return self.explain(explain_target, session, params).as_result()
        if head[:6].upper() == "INSERT":
            return self._insert(parse_statement(sql), params)
        prepared = self.prepare(sql, session, params)
        budgeting = prepared.budgeting
        confidence = self._confidence(session)  # validated before anything is charged
        if prepared.local is not None:
            return self._release_local(prepared, confidence)
        stored_key = None
        if self.cache is not None and prepared.plan.measures:
            stored_key = self._result_key(prepared)
            entry = self.cache.get_entry(stored_key)
            if entry is not None:
                return _from_cache(*entry)
        charge = None
        if prepared.plan.measures:
            charge = self.ledger.reserve(
                dataset=self.policy.dataset,
                analyst=session.analyst,
                cost=budgeting.cost,
                dataset_budget=self.policy.budget.dataset,
                analyst_budget=self.policy.analyst_budget(session.analyst),
                fingerprint=prepared.fingerprint,
                accounting=self.policy.budget.accounting,
                rho_to_epsilon=rho_to_epsilon,
            )
        rows = self._run(prepared.sql)
        if prepared.plan.proven and _data_version(self.backend) != prepared.data_version:
            # a write raced the proof: run it again with every clamp in place
            rows = self._run(self._clamped_sql(prepared.plan))
        histograms = {i: self._run(sql) for i, sql in prepared.histograms}
        result = self._release(prepared, rows, confidence, histograms)
        if charge is not None:
            result.remaining_epsilon = remaining_budget(
                charge.analyst_spent,
                self.policy.analyst_budget(session.analyst),
                self.policy.budget.accounting,
                rho_to_epsilon=rho_to_epsilon,
            ).epsilon  # the ledger's own accountant: Σε under pure, ε(Σρ, δ − Σδ_sel) under zcdp
            result.notices.append(
                f"dpsql: charged ε={budgeting.epsilon:g}"
                + (f", δ={budgeting.delta:g}" if budgeting.delta else "")
                + f'; remaining ε={result.remaining_epsilon:g} for analyst "{session.analyst}"'
            )
        if self.cache is not None and stored_key is not None:
            self.cache.put(stored_key, result)
        return result

    def _result_key(self, prepared: Prepared) -> str:
        """The result-cache key: the query's, on this database, at its current data version, under this policy."""
        if self._database_identity is None:
            self._database_identity = database_identity(self.backend)
        try:
            stamp = data_stamp(self.backend)
        except Exception:  # no version readable: a key no other query shares (never served stale)
            stamp = secrets.token_hex(16)
        return result_key(prepared.cache_key, self._database_identity, stamp, self._policy_hash)

    def _insert(self, tree: exp.Expression, params: Params) -> Result:
        """The opt-in write path: store rows with their randomized-response columns perturbed.

        The outcome must not depend on stored data (else it is a membership oracle): the
        columns an analyst may give are checked by :func:`parse_insert`, the table's catalog
        by :func:`dpsql.writes.write_oracles` (no key, foreign key or trigger relating the new
        row to stored ones), both before anything runs; and every failure of the write itself
        is reported as one fixed error, whatever the database's reason.
        """
        table, columns, rows = parse_insert(bind_parameters(tree, params), self.policy)
        target = table.source or tree.this.this.name
        try:
            oracles = write_oracles(self.backend, target, columns)
        except Error:
            oracles = ["the catalog could not be read"]
        if oracles:
            raise ReadOnlyViolation(
                "cannot execute INSERT in a read-only transaction",
                hint=f'The table "{tree.this.this.name}" has {oracles[0]}: whether an INSERT succeeded would '
                "depend on rows already stored, so dpsql does not write to it.",
            )
        mechanisms = [table.columns[c].local_mechanism() for c in columns]
        stored = perturb_rows(rows, mechanisms)
        values = exp.values([tuple(literal_for(v) for v in row) for row in stored])
        statement = exp.Insert(
            this=exp.Schema(
                this=exp.table_(table.source or tree.this.this.name, quoted=True),
                expressions=[exp.to_identifier(c, quoted=True) for c in columns],
            ),
            expression=values,
        )
        try:
            self.backend.execute_script(statement.sql(dialect=self.backend.dialect))
        except Exception:  # one error for every cause (NOT NULL, CHECK, type, connection): nothing data-dependent
            raise BackendError(
                "the database failed to store the rows",
                hint="Nothing was stored. The reason is withheld: it could depend on other rows.",
            ) from None
        perturbed = [f"{c} (ε={m.epsilon:g})" for c, m in zip(columns, mechanisms, strict=True) if m is not None]
        return Result(
            columns=[],
            rows=[],
            accuracy=[],
            epsilon_spent=0.0,
            delta_spent=0.0,
            notices=[f"dpsql: stored {len(stored)} row(s); randomized response applied to {', '.join(perturbed)}"],
            command_tag=f"INSERT 0 {len(stored)}",
        )

    def _release_local(self, prepared: Prepared, confidence: float) -> Result:
        """Counts of a randomized-response column, debiased; post-processing of stored values, free."""
        local = prepared.local
        assert local is not None
        observed = {value: int(count) for value, count in self._run(local.sql)}
        estimates = local.mechanism.estimate(observed, confidence)
        total = sum(observed.get(v, 0) for v in local.mechanism.domain)
        rows: list[tuple[Any, ...]]
        widths: list[list[float | None]]
        if prepared.plan.keys:
            rows = [(value, estimates[value][0]) for value in local.mechanism.domain]
            widths = [[estimates[value][1]] for value in local.mechanism.domain]
        elif local.filtered:
            rows, widths = [(estimates[local.value][0],)], [[estimates[local.value][1]]]
        else:
            rows, widths = [(total,)], [[0.0]]
        result = self._postprocess(prepared.plan, rows, [[round(r[-1]) for r in rows]], widths)
        result.notices.append("dpsql: randomized-response estimate from perturbed answers; no budget charged")
        return result

    def _clamped_sql(self, plan: Plan) -> str:
        """The measurement query with every clamp in place, whatever the statistics prove."""
        return rewrite(replace(plan, proven=frozenset()) if plan.proven else plan).sql(dialect=self.backend.dialect)

    def _run(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            _, rows = self.backend.execute(sql)
        except Error:
            raise
        except Exception as exc:  # never surface the database's own text: it may depend on data
            log_database_error("reading the query's result failed", exc)
            raise BackendError("the database failed to run the query") from None
        return rows

    # -- release --------------------------------------------------------------------------------

    def _release(
        self,
        prepared: Prepared,
        rows: list[tuple[Any, ...]],
        confidence: float,
        histograms: dict[int, list[tuple[Any, ...]]] | None = None,
    ) -> Result:
        plan, budgeting = prepared.plan, prepared.budgeting
        nkeys = len(plan.keys)
        rows = centre_rows(plan, rows)
        measured: list[list[Any]] | None = None
        if plan.keys and plan.public_keys:
            rows, measured = _public_key_rows(plan, rows)
        if not rows and not plan.keys:
            rows = [tuple([0] * len(plan.measures))]
        noisy: list[Any] = []
        for i, spec in enumerate(budgeting.specs):
            if spec is None:
                select = _select_modes if plan.measures[i].kind == "mode" else _select_quantiles
                noisy.append(select(plan, i, rows, (histograms or {}).get(i, []), budgeting.shares[i]))
                continue
            if measured is not None:
                values = measured[i]
            else:
                values = [0 if r[nkeys + i] is None else r[nkeys + i] for r in rows]
            noisy.append(release(values, spec) if values else np.zeros(0))
        widths = [None if spec is None else half_width(spec, confidence) for spec in budgeting.specs]
        columns = [values.tolist() if isinstance(values, np.ndarray) else values for values in noisy]
        if budgeting.threshold is not None and plan.selection_measure is not None:
            counts = columns[plan.selection_measure]
            keep = [j for j in range(len(rows)) if counts[j] >= budgeting.threshold]
            rows = [rows[j] for j in keep]
            columns = [[values[j] for j in keep] for values in columns]
        result = self._postprocess(plan, rows, columns, [widths] * len(rows))
        result.epsilon_spent, result.delta_spent = budgeting.epsilon, budgeting.delta
        return result

    @staticmethod
    def _postprocess(
        plan: Plan, rows: list[tuple[Any, ...]], columns: list[list[Any]], widths: list[list[float | None]]
    ) -> Result:
        """Outputs, HAVING, DISTINCT, ORDER BY and LIMIT over released values (row j: keys, measures, widths)."""
        direct = _direct_columns(plan)
        if direct is not None and (not widths or all(w is widths[0] for w in widths)):
            return _postprocess_direct(plan, rows, columns, widths[0] if widths else [], direct)
        nkeys = len(plan.keys)
        released: list[tuple[tuple[Any, ...], tuple[Any, ...], tuple[float | None, ...]]] = []
        key_names = [f"k{i}" for i in range(nkeys)]
        measure_names = [f"m{i}" for i in range(len(columns))]
        converters = [_converter(m) for m in plan.measures]
        if plan.compiled is None:
            plan.compiled = (
                [compile_expression(out.expr) for out in plan.outputs],
                None if plan.having is None else compile_expression(plan.having),
                [compile_expression(term) for term, _, _ in plan.order],
            )
        outputs, having, order = plan.compiled
        for j, row in enumerate(rows):
            env: dict[str, Any] = dict(zip(key_names, row, strict=False))
            for name, values, convert in zip(measure_names, columns, converters, strict=True):
                env[name] = convert(values[j])
            out_values, out_acc = [], []
            for o, out in enumerate(plan.outputs):
                value = _evaluate_released(outputs[o], env)
                if out.kind == "count" and value is not None:
                    value = max(round(value), 0)
                elif out.kind == "quantile" and out.column.type == "bigint" and value is not None:
                    value = math.floor(value)  # MIN/MAX/percentile_disc of an int column: a value of the column's type
                if out.clamp is not None and value is not None:
                    value = min(max(value, out.clamp[0]), out.clamp[1])
                env[f"o{o}"] = value
                out_values.append(value)
                out_acc.append(_accuracy(out, env, widths[j], plan))
            if having is not None and _evaluate_released(having, env) is not True:
                continue
            sort_key = tuple(_evaluate_released(term, env) for term in order)
            released.append((sort_key, tuple(out_values), tuple(out_acc)))
        if plan.distinct:
            seen: dict[tuple[Any, ...], Any] = {}
            for item in released:
                seen.setdefault(item[1], item)
            released = list(seen.values())
        if plan.order:
            spec = [(desc, nulls_first) for _, desc, nulls_first in plan.order]
            released = order_rows([(item[0], item) for item in released], spec)
        end = None if plan.limit is None else plan.offset + plan.limit
        released = released[plan.offset : end]
        return Result(
            columns=[o.column for o in plan.outputs],
            rows=[item[1] for item in released],
            accuracy=[item[2] for item in released],
            epsilon_spent=0.0,
            delta_spent=0.0,
        )


# --- helpers ------------------------------------------------------------------------------------


def _check_query_delta(policy: Policy, delta: float, uses_delta: bool) -> None:
    """Cap a query's δ before any charge, under either accounting.

    δ is the probability that the guarantee fails outright (a rare key released, a Gaussian tail):
    it must be ≤ ``budget.max_query_delta`` (default 10⁻³) and below the dataset's δ budget. Under
    zcdp the selection δ is added up, not converted; under pure accounting a large δ would also
    make the Gaussian calibration degenerate (δ = 0.99 gives ε → 0). The analyst's own δ budget is
    then enforced by the ledger (53P01) before the query runs.
    """
    budget = policy.budget
    if not uses_delta or delta == 0:
        return
    if delta > budget.max_query_delta or delta >= budget.dataset.delta:
        raise InvalidParameterValue(
            f"dpsql.delta={delta:g} is too large for one query",
            hint=f"A query's δ must be ≤ {budget.max_query_delta:g} "
            f"and below the dataset's δ budget {budget.dataset.delta:g}; use e.g. SET dpsql.delta = 1e-7.",
        )


def _local_query(plan: Plan, dialect: str) -> LocalQuery | None:
    """A count over one randomized-response column, answered from its perturbed values; None otherwise.

    Queries that read such a column in any other way are refused: central noise on perturbed
    data would spend budget to estimate nothing useful, and mixing in other columns would
    release central data without noise.
    """
    local_columns = [
        (source, name, column.local_mechanism())
        for source in plan.sources.sources
        for name, column in source.table.columns.items()
        if column.randomized_response is not None
    ]
    if not local_columns:
        return None
    used = _columns_used(plan)
    touched = [(s, n, m) for s, n, m in local_columns if (s.alias, n) in used]
    if not touched:
        return None
    source, name, mechanism = touched[0]
    key_ok = all((k.table, k.column) == (source.alias, name) for k in plan.keys) and len(plan.keys) <= 1
    value = _equality_value(plan.where, source.alias, name)
    where_ok = plan.where is None or value is not None
    only_counts = all(m.kind == "count_star" for m in plan.measures)
    shape_ok = key_ok and where_ok and only_counts
    if len(touched) > 1 or plan.sources.joins or used - {(source.alias, name)} or not shape_ok:
        raise FeatureNotSupported(
            f'"{name}" is collected with randomized response: it can only be counted on its own',
            hint=f"Ask SELECT {name}, COUNT(*) FROM {source.name} GROUP BY {name}, "
            f"or SELECT COUNT(*) FROM {source.name} WHERE {name} = <value>.",
        )
    assert mechanism is not None
    if value is not None and value not in mechanism.domain:
        raise InvalidParameterValue(f'"{value}" is not a possible answer for "{name}"')
    column = exp.column(name, quoted=True)
    sql = (
        exp.select(column, exp.Count(this=exp.Star(), big_int=True))
        .from_(exp.table_(source.table.source or source.name, quoted=True))
        .group_by(column.copy())
        .sql(dialect=dialect)
    )
    return LocalQuery(mechanism, sql, value, value is not None)


def _columns_used(plan: Plan) -> set[tuple[str | None, str | None]]:
    used: set[tuple[str | None, str | None]] = {(k.table, k.column) for k in plan.keys}
    used |= {(m.table, m.column) for m in plan.measures if m.kind != "count_star"}
    if plan.where is not None:
        used |= {(c.table, c.name) for c in plan.where.find_all(exp.Column)}
    return used


def _equality_value(where: exp.Expression | None, alias: str, name: str) -> Any:
    if not isinstance(where, exp.EQ):
        return None
    column, literal = (where.this, where.expression)
    if not isinstance(column, exp.Column) or (column.table, column.name) != (alias, name):
        return None
    if isinstance(literal, exp.Boolean):
        return bool(literal.this)
    if isinstance(literal, exp.Literal):
        return literal.name if literal.is_string else float(literal.name)
    return None


def parse_insert(tree: exp.Expression, policy: Policy) -> tuple[TablePolicy, list[str], list[tuple[Any, ...]]]:
    """``INSERT INTO t (cols) VALUES (...)`` with constants, into a table with randomized-response columns.

    Analysts give values only for randomized-response columns and columns the policy marks
    ``writable: true``; identifiers (and every other column) are refused with 42501 before
    anything runs: whether a given respondent is already stored must never decide the outcome.
    """
    if not policy.writes.randomized_response:
        raise ReadOnlyViolation(
            "cannot execute INSERT in a read-only transaction",
            hint="dpsql is read-only unless the policy enables writes: {randomized_response: true}.",
        )
    schema, values = tree.this, tree.args.get("expression")
    if not isinstance(schema, exp.Schema) or not isinstance(values, exp.Values) or tree.args.get("returning"):
        raise FeatureNotSupported("only INSERT INTO <table> (<columns>) VALUES (...) is supported")
    name = schema.this.name
    table = policy.tables.get(name)
    if table is None:
        raise UndefinedTable(f'relation "{name}" does not exist')
    if not any(c.randomized_response for c in table.columns.values()):
        raise ReadOnlyViolation(
            "cannot execute INSERT in a read-only transaction",
            hint=f'Only tables with randomized-response columns accept writes; "{name}" has none.',
        )
    columns = [c.name for c in schema.expressions]
    for column in columns:
        if column not in table.columns:
            raise UndefinedColumn(f'column "{column}" of relation "{name}" does not exist')
    for column in columns:
        policy_column = table.columns[column]
        if policy_column.randomized_response is None and (policy_column.identifier or not policy_column.writable):
            raise InsufficientPrivilege(
                f'permission denied to write column "{column}" of relation "{name}"',
                hint=(
                    "Identifier columns are filled by the database, never by an INSERT: whether an identifier "
                    "is already stored would decide the outcome."
                    if policy_column.identifier
                    else "An INSERT may give only randomized-response columns and columns the policy marks "
                    "'writable: true'."
                ),
            )
    rows = []
    for row in values.expressions:
        cells = [_constant(v) for v in row.expressions]
        if len(cells) != len(columns):
            raise SyntaxError_("INSERT has more expressions than target columns", sqlstate="42601")
        for column, value in zip(columns, cells, strict=True):
            mechanism = table.columns[column].local_mechanism()
            if mechanism is not None and value not in mechanism.domain:
                raise InvalidParameterValue(
                    f'invalid value for randomized-response column "{column}"',
                    hint=f"Answers must be one of: {', '.join(map(str, mechanism.domain))}.",
                )
        rows.append(tuple(cells))
    missing = [c for c, p in table.columns.items() if p.randomized_response and c not in columns]
    if missing:
        raise InvalidParameterValue(f'INSERT must give a value for randomized-response column "{missing[0]}"')
    return table, columns, rows


def _constant(node: exp.Expression) -> Any:
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
        return -_constant(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        return float(node.name) if any(ch in node.name for ch in ".eE") else int(node.name)
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        return node.this.name
    raise FeatureNotSupported("INSERT values must be constants")


def _direct_columns(plan: Plan) -> list[tuple[str, int]] | None:
    """For plans whose outputs are bare keys, counts and sums (no HAVING/ORDER BY/DISTINCT): where each comes from.

    Such plans — the common shape of large grouped results — skip the per-row interpreter.
    """
    if plan.having is not None or plan.order or plan.distinct:
        return None
    sources: list[tuple[str, int]] = []
    for out in plan.outputs:
        if not isinstance(out.expr, exp.Var) or out.kind not in ("key", "count", "sum") or out.clamp is not None:
            return None
        sources.append((out.kind, int(out.expr.name[1:])))
    return sources


def _postprocess_direct(
    plan: Plan,
    rows: list[tuple[Any, ...]],
    columns: list[list[Any]],
    widths: list[float | None],
    direct: list[tuple[str, int]],
) -> Result:
    """Column-wise release of key/count/sum outputs: same values as the interpreter, without it."""
    end = None if plan.limit is None else plan.offset + plan.limit
    window = slice(plan.offset, end)
    rows = rows[window]
    cells: list[list[Any]] = []
    accuracy: list[float | None] = []
    for kind, index in direct:
        if kind == "key":
            cells.append([row[index] for row in rows])
            accuracy.append(None)
            continue
        values = columns[index][window]
        convert = _converter(plan.measures[index])
        cells.append([max(round(v), 0) for v in values] if kind == "count" else [convert(v) for v in values])
        accuracy.append(widths[index] if widths else None)
    released = list(zip(*cells, strict=True)) if cells else []
    return Result(
        columns=[o.column for o in plan.outputs],
        rows=released,
        accuracy=[tuple(accuracy)] * len(released),
        epsilon_spent=0.0,
        delta_spent=0.0,
    )


def _evaluate_released(expr: Callable[[dict[str, Any]], Any], env: dict[str, Any]) -> Any:
    """Post-processing never fails with a Python exception: it reads only noisy values, so a
    PostgreSQL-style data error is safe to report."""
    try:
        return expr(env)
    except Error:
        raise
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise DataError("could not compute an output from the released values", detail=str(exc)) from None


def _from_cache(cached: Result, created: float) -> Result:
    """A stored answer, re-released: same values, nothing charged."""
    when = dt.datetime.fromtimestamp(created, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Result(
        columns=cached.columns,
        rows=cached.rows,
        accuracy=cached.accuracy,
        epsilon_spent=0.0,
        delta_spent=0.0,
        notices=[
            f"dpsql: answered from the result cache (first computed at {when}; this exact query was already "
            "released on this database and data); no budget charged"
        ],
    )


def _select_modes(
    plan: Plan, index: int, rows: list[tuple[Any, ...]], histogram: list[tuple[Any, ...]], epsilon: float
) -> list[Any]:
    """Report-noisy-max, once per released group, over the counts of the public candidates."""
    nkeys = len(plan.keys)
    measure = plan.measures[index]
    candidates = list(measure.domain or ())
    position = {value: i for i, value in enumerate(candidates)}
    counts: dict[tuple[Any, ...], list[int]] = {}
    for row in histogram:
        slot = position.get(row[nkeys])
        if slot is not None:  # values outside the public domain are never candidates
            counts.setdefault(tuple(row[:nkeys]), [0] * len(candidates))[slot] += int(row[nkeys + 1])
    sensitivity = plan.sensitivities(measure)[0]
    empty = [0] * len(candidates)
    return [candidates[select_mode(counts.get(tuple(row[:nkeys]), empty), epsilon, sensitivity)] for row in rows]


def _select_quantiles(
    plan: Plan, index: int, rows: list[tuple[Any, ...]], histogram: list[tuple[Any, ...]], epsilon: float
) -> list[float]:
    """The exponential mechanism, once per released group, over that group's bin counts."""
    nkeys = len(plan.keys)
    measure = plan.measures[index]
    assert measure.lower is not None and measure.upper is not None and measure.q is not None
    counts: dict[tuple[Any, ...], dict[int, int]] = {}
    for row in histogram:
        bin_ = row[nkeys]
        if bin_ is not None:
            group = counts.setdefault(tuple(row[:nkeys]), {})
            clamped = min(max(int(bin_), 0), QUANTILE_BINS - 1)  # the upper bound itself falls in bin B
            group[clamped] = group.get(clamped, 0) + int(row[nkeys + 1])
    sensitivity = plan.sensitivities(measure)[0]
    values = []
    for row in rows:
        chosen = select_quantile_bin(counts.get(tuple(row[:nkeys]), {}), measure.q, epsilon, sensitivity)
        values.append(bin_midpoint(chosen, measure.lower, measure.upper))
    return values


def _converter(measure: Measure) -> Any:
    """How a released value of this measure becomes a Python value: int, float, or a chosen key."""
    if measure.kind == "mode":
        return lambda value: value
    return int if _integer(measure) and measure.kind != "quantile" else float


def _data_version(backend: Backend) -> int:
    """A counter the backend bumps before every write (0 for backends that prove nothing)."""
    return int(getattr(backend, "data_version", 0))


def _proven_in_bounds(plan: Plan, backend: Backend) -> frozenset[int]:
    """Sum measures over a plain column whose every stored value the database's own statistics place
    inside the declared bounds. Clamping those is the identity, so releasing them unclamped gives the
    same numbers; only backends with exact (conservative) min/max statistics implement this."""
    ranges = getattr(backend, "proven_ranges", None)
    if ranges is None:
        return frozenset()
    wanted: dict[int, tuple[str, str]] = {}
    for i, m in enumerate(plan.measures):
        if m.kind == "sum" and m.expr is None and m.column is not None and m.table is not None:
            source = next((s for s in plan.sources.sources if s.alias == m.table), None)
            if source is not None:
                wanted[i] = (source.table.source or source.name, m.column)
    if not wanted:
        return frozenset()
    found = {
        (table, column): bounds
        for table in {t for t, _ in wanted.values()}
        for column, bounds in ranges(table, sorted({c for t, c in wanted.values() if t == table})).items()
    }
    return frozenset(i for i, where in wanted.items() if _inside(found.get(where), plan.measures[i]))


def _inside(bounds: tuple[Any, Any] | None, measure: Measure) -> bool:
    """Whether proven (min, max) lie within the measure's bounds (NaN compares false: not inside)."""
    if bounds is None or measure.lower is None or measure.upper is None:
        return False
    return bool(measure.lower <= bounds[0] and bounds[1] <= measure.upper)


def _integer(measure: Measure) -> bool:
    return measure.integer and float(measure.centre).is_integer()


def _accuracy(out: Any, env: dict[str, Any], widths: list[float | None], plan: Plan) -> float | None:
    """Half-width of the confidence interval of one released cell, from the scales used."""
    if out.kind in ("count", "sum"):
        return widths[out.measures[0]]
    if out.kind == "avg":
        total_i, count_i = out.measures
        count = max(float(env[f"m{count_i}"]), 1.0)
        total = float(env[f"m{total_i}"])
        # delta method for (centre + S/N): independent noises on S and N
        total_w, count_w = widths[total_i], widths[count_i]
        assert total_w is not None and count_w is not None
        return math.hypot(total_w / count, count_w * abs(total) / count**2)
    if out.kind == "variance":
        return _variance_accuracy(out, env, widths)
    if isinstance(out.expr, exp.Var) and out.expr.name.startswith("m") and out.kind != "mode":
        return widths[int(out.expr.name[1:])]
    return None


def _variance_accuracy(out: Any, env: dict[str, Any], widths: list[float | None]) -> float | None:
    """Delta method for var = S2/N − (S1/N)² (and its square root), from the three noises' half-widths."""
    squares_i, total_i, count_i = out.measures
    w2, w1, wn = widths[squares_i], widths[total_i], widths[count_i]
    sample = bool(out.expr.expressions[3].this)
    if w2 is None or w1 is None or wn is None or (sample and float(env[f"m{count_i}"]) < 2):
        return None
    n = max(float(env[f"m{count_i}"]), 1.0)
    s2, s1 = float(env[f"m{squares_i}"]), float(env[f"m{total_i}"])
    width = math.sqrt((w2 / n) ** 2 + (2 * s1 * w1 / n**2) ** 2 + (wn * (s2 / n**2 - 2 * s1 * s1 / n**3)) ** 2)
    root = bool(out.expr.expressions[4].this)
    variance = max(s2 / n - (s1 / n) ** 2, 0.0)
    if sample:
        width *= n / (n - 1)
        variance *= n / (n - 1)
    if not root:
        return width
    return width / (2 * math.sqrt(variance)) if variance > 0 else math.sqrt(width)


def _public_key_rows(plan: Plan, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], list[list[Any]]]:
    """Every combination of the public domains, in domain order (key tuples), and each measure's
    column over them: absent combinations get zeros.

    Keys outside the declared domain are dropped: releasing them would reveal that
    someone holds an undeclared value. The combinations and their positions are built once per plan.
    """
    if plan.key_grid is None:
        domains = [k.domain or () for k in plan.keys]
        size = math.prod(len(d) for d in domains)
        if size > MAX_PUBLIC_GROUPS:
            raise FeatureNotSupported(
                f"GROUP BY would release {size} groups (more than {MAX_PUBLIC_GROUPS})",
                hint="Group by fewer columns.",
            )
        combos = list(itertools.product(*domains))
        keys = [c[0] for c in combos] if len(domains) == 1 else combos  # one key: look up bare values
        plan.key_grid = (combos, {key: j for j, key in enumerate(keys)})
    combos, position = plan.key_grid
    nkeys = len(plan.keys)
    found = map(position.get, (r[0] for r in rows) if nkeys == 1 else (r[:nkeys] for r in rows))
    hits = [(j, row) for j, row in zip(found, rows, strict=True) if j is not None]
    measured: list[list[Any]] = []
    for i in range(nkeys, nkeys + len(plan.measures)):
        column: list[Any] = [0] * len(combos)
        for j, row in hits:
            if row[i] is not None:
                column[j] = row[i]
        measured.append(column)
    return combos, measured


def _hashable(params: Params) -> Any:
    if params is None:
        return None
    if isinstance(params, dict):
        return tuple(sorted((k, repr(v)) for k, v in params.items()))
    return tuple(repr(v) for v in params)


def _placeholder_value(pg_type: str) -> Any:
    return {"bigint": 0, "double precision": 0.0, "boolean": False, "date": dt.date(2000, 1, 1)}.get(pg_type, "")


def _explain_target(sql: str) -> str | None:
    """The query inside ``EXPLAIN <query>``; EXPLAIN ANALYZE is refused (it reveals timings and row counts)."""
    stripped = skip_comments(sql)
    if stripped[:7].upper() != "EXPLAIN" or stripped[7:8].isalnum() or stripped[7:8] == "_":
        return None
    rest = skip_comments(stripped[7:])
    if rest[:1] == "(" or rest.split(None, 1)[0].upper() in ("ANALYZE", "ANALYSE", "VERBOSE"):
        raise FeatureNotSupported(
            "EXPLAIN options are not supported",
            hint="EXPLAIN ANALYZE would reveal exact row counts and timings; use plain EXPLAIN.",
        )
    return rest
