"""``dpsql synopsis build|refresh|list``: release a policy's declared synopses, charged once to the dataset.

A build measures each marginal of the synopsis as an ordinary DP query of the engine (the same analysis,
contribution bounding, clamping and calibration every analyst query gets, at an equal share of the
synopsis's (ε, δ)), charges the composed cost *once*, durably, before anything runs, to the dataset under
the ledger identity ``synopsis:<name>`` (not to any analyst), then stores only the released noisy marginals
(:mod:`dpsql.synopsis.store`). A refresh is a new release, charged again; answers then come from the newest.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from dpsql.accountant import Cost, fmt
from dpsql.cache import database_identity
from dpsql.commands import open_engine
from dpsql.console import require_policy
from dpsql.engine import Engine
from dpsql.errors import FeatureNotSupported, InvalidParameterValue, charged_on_failure
from dpsql.ledger import Ledger
from dpsql.ledger.base import Claimed
from dpsql.plan import Plan
from dpsql.policy import Policy, Synopsis
from dpsql.prepared import Prepared
from dpsql.release.apply import apply
from dpsql.session import Session
from dpsql.step import reserve_charge
from dpsql.synopsis import Released, Synopses, store
from dpsql.synopsis.answer import key_signature
from dpsql.synopsis.grains import bucket_end, normal, time_columns
from dpsql.synopsis.solve import MAX_CELLS, Marginal, noise_variance
from dpsql.synopsis.store import SynopsisKey, SynopsisMeasure, declaration_hash, prefix, release_key, unseal
from dpsql.synopsis.widths import WARN_RATIO, chart_widths


def ledger_identity(name: str) -> str:
    """Who a synopsis's charge is recorded as: the dataset pays, no analyst does."""
    return f"synopsis:{name}"


def marginal_sql(policy: Policy, name: str, axes: tuple[int, ...], where: str | None = None) -> str:
    """The DP query measuring one marginal: the keys on ``axes`` and every measure, grouped by those keys
    (``where``: a continual refresh's new periods)."""
    synopsis = policy.synopses[name]
    keys = ", ".join(synopsis.axes[a] for a in axes)
    select = ", ".join([*(synopsis.axes[a] for a in axes), *synopsis.measures])
    sql = f"SELECT {select} FROM {synopsis.table}" + (f" WHERE {where}" if where else "")
    return sql + (f" GROUP BY {keys}" if keys else "")


def check_plan(name: str, sql: str, plan: Plan) -> None:
    """A synopsis measures public cells only, of COUNT(*) and plain SUMs: refused before any charge."""
    if not plan.public_keys or plan.selection_measure is not None:
        raise FeatureNotSupported(
            f'synopsis "{name}": every key needs a public domain',
            detail=sql,
            hint="Use keys with a declared domain, or a time grain (DATE_TRUNC) of a bounded column.",
        )
    for measure in plan.measures:
        plain_sum = measure.clamped_sum and measure.expr is None and not measure.square and not measure.centre
        if not measure.star and not plain_sum:
            raise FeatureNotSupported(
                f'synopsis "{name}": only COUNT(*) and SUM(column) can be measured',
                detail=sql,
                hint="AVG is answered from a synopsis that has SUM(column) and COUNT(*).",
            )


def cube_cells(plan: Plan) -> int:
    return math.prod(len(key.domain or ()) for key in plan.keys)


def declared(policy: Policy, name: str) -> Synopsis:
    """The policy's declaration of synopsis ``name`` (22023 when there is none)."""
    synopsis = policy.synopses.get(name)
    if synopsis is None:
        names = ", ".join(sorted(policy.synopses)) or "none"
        raise InvalidParameterValue(
            f'synopsis "{name}" is not declared in the policy', hint=f"Declared synopses: {names}."
        )
    return synopsis


def prepare(engine: Engine, name: str, where: str | None = None) -> tuple[list[Prepared], Prepared]:
    """Each measured marginal's prepared query, and the query over all keys (its keys' domains); validated
    and priced, nothing charged (``where``: only the periods a continual refresh releases)."""
    synopsis = declared(engine.policy, name)
    share = len(synopsis.measured)
    session = Session(
        ledger_identity(name),
        epsilon=synopsis.epsilon / share,
        delta=synopsis.delta / share,
        mechanism=synopsis.mechanism or engine.policy.defaults.mechanism,
    )
    every = tuple(range(len(synopsis.axes)))
    full = engine.prepare(marginal_sql(engine.policy, name, every, where), session)
    check_plan(name, marginal_sql(engine.policy, name, every, where), full.plan)
    cells = cube_cells(full.plan)
    if cells > MAX_CELLS:
        raise FeatureNotSupported(
            f'synopsis "{name}" has {cells} cells (more than {MAX_CELLS})', hint="Use fewer keys or a coarser grain."
        )
    parts = []
    for axes in synopsis.measured:
        sql = marginal_sql(engine.policy, name, axes, where)
        prepared = engine.prepare(sql, session)
        check_plan(name, sql, prepared.plan)
        parts.append(prepared)
    return parts, full


@dataclass(frozen=True)
class Built:
    """What a build did: the release now stored for its generation, and whether this build charged it
    (False: a concurrent build did, or this one repaired a paid release that was never stored)."""

    released: Released
    charged: bool


def claim_key(dataset: str, name: str, generation: int) -> str:
    """The ledger row a build claims, in its charge's transaction, for one generation of a synopsis."""
    return f"synopsis-claim:{dataset}:{name}:g{generation:08d}"


def _generations(ledger: Ledger, dataset: str, name: str) -> tuple[set[int], dict[int, dict[str, Any]]]:
    """The generations stored, and the ones claimed (charged) with what each claim says."""
    stored = {int(k.rsplit(":g", 1)[1]) for k in ledger.synopsis_keys(prefix(dataset, name) + "g")}
    claims: dict[int, dict[str, Any]] = {}
    for key in ledger.synopsis_keys(f"synopsis-claim:{dataset}:{name}:g"):
        text = ledger.synopsis_document(key)
        try:
            claims[int(key.rsplit(":g", 1)[1])] = json.loads(text or "")
        except ValueError:
            continue
    return stored, claims


def build(engine: Engine, name: str) -> Released:
    """Release synopsis ``name`` as a new generation, charged once: :func:`release`."""
    return release(engine, name, after=latest(engine.ledger, engine.policy.dataset, name)).released


def latest(ledger: Ledger, dataset: str, name: str) -> int:
    """The newest generation of a synopsis stored or claimed (0: none)."""
    stored, claims = _generations(ledger, dataset, name)
    return max(stored | set(claims), default=0)


def release(engine: Engine, name: str, *, after: int | None = None) -> Built:
    """A release of synopsis ``name`` of the current declaration newer than generation ``after`` (None:
    any), made and charged exactly once (issue #41 item 5).

    A generation is claimed by a row of the ledger written in its charge's transaction
    (:meth:`Ledger.reserve` with ``claim``): of builds racing for one generation one charges, the others
    are refused the claim and charge nothing. Its release is stored under the generation's own key, first
    writer wins, so at most one release is ever stored per charge. A build or refresh that finds what it
    asks for already claimed by another uses that one: its stored release, or, when none was stored (a
    build killed between its charge and its store, or still measuring), its own measurement stored in its
    place — paid by that claim's charge, so nothing is charged again. Only releases of the declaration
    that was paid for are reused. Nothing measured leaves but through the stored row."""
    policy = engine.policy
    declared(policy, name)
    declaration, identity = declaration_hash(policy, name), database_identity(engine.backend)
    stored, claims = _generations(engine.ledger, policy.dataset, name)
    paid = {"declaration": declaration, "identity": identity}
    ours = sorted(g for g, c in claims.items() if paid.items() <= c.items() and g > (after or 0))
    if ours and (existing := _stored(engine.ledger, policy.dataset, name, ours[-1])) is not None:
        return Built(existing, False)  # asked for already, and stored
    since = _new_periods(engine, name, declaration, identity)
    parts, full = prepare(engine, name, since)  # validated and priced: refusals come before any charge
    if cube_cells(full.plan) == 0:  # a continual synopsis with no new period to release
        raise InvalidParameterValue(
            f'synopsis "{name}": no new period to release', hint=_NOTHING_NEW, detail=f"released until {since}"
        )
    cost = Cost.total([p.budgeting.cost for p in parts])
    charged = False
    if ours:  # paid for by another build, not stored (yet): stored now, no new charge
        generation = ours[-1]
    else:
        generation = max(stored | set(claims), default=0) + 1
        value = {"name": name, "generation": generation, **paid, "epsilon": cost.epsilon}
        try:
            reserve_charge(  # durably, before anything runs; never refunded
                engine.ledger,
                policy,
                cost,
                who=ledger_identity(name),
                fingerprint=_fingerprint(name, generation),
                analyst_budget=policy.budget.dataset,
                claim=(claim_key(policy.dataset, name, generation), json.dumps(value, sort_keys=True)),
            )
            charged = True
        except Claimed:  # a concurrent build charged this generation: its release, or ours in its place
            pass
    existing = _stored(engine.ledger, policy.dataset, name, generation)
    if existing is not None:
        return Built(existing, False)
    with charged_on_failure(cost.epsilon if charged else 0.0):
        result = _measure(engine, name, parts, full, cost, generation)
    store(engine.ledger, result)
    kept = _stored(engine.ledger, policy.dataset, name, generation)  # the first stored, if another raced us
    return Built(kept or result, charged)


_NOTHING_NEW = (
    "A continual synopsis releases the time buckets after the last one released: extend its time column's "
    "upper bound in the policy as periods are appended, then refresh."
)


def _new_periods(engine: Engine, name: str, declaration: str, identity: str) -> str | None:
    """A continual synopsis's periods to release now: after the last bucket released (all, the first
    time), up to its time column's upper bound — rows beyond it are later periods, released by a later
    refresh, not clamped into this one's last bucket (they would be counted twice). None otherwise."""
    policy = engine.policy
    synopsis = policy.synopses[name]
    table = policy.table(synopsis.table)
    columns = time_columns(synopsis.keys)
    if not synopsis.continual or table is None or len(columns) != 1 or columns[0] not in table.columns:
        return None
    column = columns[0]
    column_type, upper = table.columns[column].type, table.columns[column].upper
    until = f"{column} <= '{upper}'" if upper is not None else None
    ends: list[dt.datetime] = []
    for key in engine.ledger.synopsis_keys(prefix(policy.dataset, name) + "g"):
        released = _stored(engine.ledger, policy.dataset, name, int(key.rsplit(":g", 1)[1]))
        if released is None or released.declaration != declaration or released.identity != identity:
            continue
        for k in released.keys:
            if k.kind == "trunc" and k.domain and k.unit is not None and k.column == column:
                ends.append(normal(bucket_end(max(k.domain, key=normal), k.unit, column_type))[1])
    if not ends:
        return until
    start = max(ends) + (dt.timedelta(days=1) if column_type == "date" else dt.timedelta(microseconds=1))
    text = start.date().isoformat() if column_type == "date" else start.isoformat(sep=" ")
    since = f"{column} >= '{text}'"
    return since if until is None else f"{since} AND {until}"


def _fingerprint(name: str, generation: int) -> str:
    return f"synopsis {name} g{generation}"


def _stored(ledger: Ledger, dataset: str, name: str, generation: int) -> Released | None:
    text = ledger.synopsis_document(release_key(dataset, name, generation))
    return None if text is None else unseal(text, ledger.signing_key())


def _measure(engine: Engine, name: str, parts: list[Prepared], full: Prepared, cost: Cost, generation: int) -> Released:
    """Measure every marginal (only ever after the charge) into the release of ``generation``."""
    policy = engine.policy
    synopsis = policy.synopses[name]
    keys = []
    for key in full.plan.keys:
        kind, column, unit, text = key_signature(key)
        keys.append(SynopsisKey(text, kind, column, unit, key.type or "", tuple(key.domain or ())))
    nkeys = len(keys)
    measure_of = [full.plan.outputs[nkeys + j].measures[0] for j in range(len(synopsis.measures))]
    measures = tuple(SynopsisMeasure(full.plan.measures[i].kind, full.plan.measures[i].column) for i in measure_of)
    marginals: list[list[Marginal]] = [[] for _ in measures]
    for axes, prepared in zip(synopsis.measured, parts, strict=True):
        plan = prepared.plan
        assert [tuple(k.domain or ()) for k in plan.keys] == [keys[a].domain for a in axes]
        rows = engine.step.query(engine.step.clamped_sql(plan))  # every clamp in place
        released = apply(plan, prepared.budgeting, rows, 0.95)
        width = len(plan.keys)
        for j in range(len(measures)):
            i = plan.outputs[width + j].measures[0]
            spec = prepared.budgeting.specs[i]
            assert spec is not None
            values = [float(v) for v in released.columns[i]]
            marginals[j].append(Marginal(tuple(axes), values, noise_variance(spec)))
    return Released(
        name=name,
        dataset=policy.dataset,
        table=synopsis.table,
        declaration=declaration_hash(policy, name),
        identity=database_identity(engine.backend),
        built_at=time.time(),
        epsilon=cost.epsilon,
        delta=cost.delta,
        keys=tuple(keys),
        measures=measures,
        marginals=tuple(tuple(m) for m in marginals),
        mechanism=parts[0].budgeting.mechanism,
        generation=generation,
        charge=_fingerprint(name, generation),
    )


# -- the commands ------------------------------------------------------------------------------------


def cmd_synopsis_build(args: argparse.Namespace) -> int:
    if require_policy(args, f"synopsis {args.synopsis_command}") is None:
        return 1
    engine = open_engine(args)
    try:
        names = args.name or sorted(engine.policy.synopses)
        if not names:
            print(f'ERROR:  the policy of dataset "{engine.policy.dataset}" declares no synopses', file=sys.stderr)
            return 1
        for name in names:
            warning = noise_warning(engine.policy.synopses[name]) if name in engine.policy.synopses else None
            if warning is not None:
                print(f'WARNING:  synopsis "{name}": {warning}', file=sys.stderr)
        current = {r.name for r in Synopses(engine.policy, engine.ledger).current(database_identity(engine.backend))}
        # what a refresh releases a newer one than (read first: a refresh racing this one is not repeated)
        seen = {name: latest(engine.ledger, engine.policy.dataset, name) for name in names}
        for name in names:
            if args.synopsis_command == "build" and name in current:
                print(f'synopsis "{name}": already released (use "dpsql synopsis refresh" to release it again)')
                continue
            built = release(engine, name, after=seen[name] if args.synopsis_command == "refresh" else None)
            released = built.released
            cells = " × ".join(str(len(k.domain)) for k in released.keys)
            charge = f"ε={fmt(released.epsilon)}" + (f", δ={fmt(released.delta)}" if released.delta else "")
            paid = (
                f"charged {charge} once to the dataset as {ledger_identity(name)}"
                if built.charged
                else f"nothing charged now ({charge} was charged once, as {released.charge})"
            )
            print(
                f'synopsis "{name}" of dataset "{released.dataset}": release {released.generation} at '
                f"{released.released_at}, {cells} cells, {len(released.axes)} marginals; {paid}"
            )
            parts, full = prepare(engine, name)
            for chart in chart_widths(engine.policy, name, [p.plan for p in parts], full.plan):
                wider = f" (more than {WARN_RATIO:g}× a fresh answer)" if chart.ratio > WARN_RATIO else ""
                print("  " + chart.line(name, engine.policy.defaults.epsilon) + wider)
    finally:
        engine.close()
    return 0


def noise_warning(synopsis: Synopsis) -> str | None:
    """Many marginals × measures share the synopsis's ε: each is that many times noisier than one query at
    that ε. Said by ``policy check`` and by ``dpsql synopsis build`` itself, where the curator types it."""
    shares = len(synopsis.measured) * len(synopsis.measures)
    if shares <= 2:
        return None
    return (
        f"{len(synopsis.measured)} marginals × {len(synopsis.measures)} measures: each is measured at "
        f"1/{shares} of ε={fmt(synopsis.epsilon)}, about {shares}× the noise of one query at that ε; "
        "declare only the marginals the dashboard needs"
    )


def cmd_synopsis_list(args: argparse.Namespace) -> int:
    if require_policy(args, "synopsis list") is None:
        return 1
    engine = open_engine(args)
    try:
        current = {r.name: r for r in Synopses(engine.policy, engine.ledger).current(database_identity(engine.backend))}
        releases = engine.ledger.synopsis_keys(prefix(engine.policy.dataset))
        for name, synopsis in sorted(engine.policy.synopses.items()):
            count = sum(1 for key in releases if key.startswith(prefix(engine.policy.dataset, name)))
            released = current.get(name)
            state = "not released" if released is None else f"released {released.released_at}"
            print(
                f"{name}\ttable {synopsis.table}\tkeys {', '.join(synopsis.keys)}"
                + (f"\tfilters {', '.join(synopsis.filters)}" if synopsis.filters else "")
                + f"\tmeasures {', '.join(synopsis.measures)}"
                f"\tε={fmt(synopsis.epsilon)}\t{state}\t{count} release{'s' if count != 1 else ''} in the ledger"
            )
    finally:
        engine.close()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    synopsis = sub.add_parser("synopsis", help="release the policy's synopses: noisy views charged once")
    ssub = synopsis.add_subparsers(dest="synopsis_command", required=True)
    for command, text in (
        ("build", "release the named (default: every) synopsis not yet released"),
        ("refresh", "release the named (default: every) synopsis again (charged again)"),
        ("list", "the declared synopses and their releases"),
    ):
        parser = ssub.add_parser(command, help=text)
        if command != "list":
            parser.add_argument("name", nargs="*", help="synopsis names (default: all declared)")
        parser.add_argument("--policy", help="policy YAML (required)")
        parser.add_argument("--database", help="duckdb:///path, postgresql://… (default: the demo data)")
        parser.add_argument("--ledger", help="sqlite:///abs/path or postgresql://… (default: under $DPSQL_HOME)")
        parser.add_argument("--statement-timeout", type=float, default=300.0, help="seconds per statement")
        parser.set_defaults(func=cmd_synopsis_list if command == "list" else cmd_synopsis_build)
