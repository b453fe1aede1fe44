"""``dpsql synopsis build|refresh|list``: release a policy's declared synopses, charged once to the dataset.

A build measures each marginal of the synopsis as an ordinary DP query of the engine (the same analysis,
contribution bounding, clamping and calibration every analyst query gets, at an equal share of the
synopsis's (ε, δ)), charges the composed cost *once*, durably, before anything runs, to the dataset under
the ledger identity ``synopsis:<name>`` (not to any analyst), then stores only the released noisy marginals
(:mod:`dpsql.synopsis.store`). A refresh is a new release, charged again; answers then come from the newest.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from dpsql.accountant import Cost, fmt
from dpsql.cache import database_identity
from dpsql.commands import open_engine, require_policy
from dpsql.engine import Engine
from dpsql.errors import FeatureNotSupported, InvalidParameterValue, charged_on_failure
from dpsql.plan import Plan
from dpsql.policy import Policy, Synopsis
from dpsql.prepared import Prepared
from dpsql.release.apply import apply
from dpsql.session import Session
from dpsql.synopsis import Released, Synopses, store
from dpsql.synopsis.answer import key_signature
from dpsql.synopsis.solve import MAX_CELLS, Marginal, noise_variance
from dpsql.synopsis.store import SynopsisKey, SynopsisMeasure, declaration_hash, prefix


def ledger_identity(name: str) -> str:
    """Who a synopsis's charge is recorded as: the dataset pays, no analyst does."""
    return f"synopsis:{name}"


def marginal_sql(policy: Policy, name: str, axes: tuple[int, ...]) -> str:
    """The DP query measuring one marginal: the keys on ``axes`` and every measure, grouped by those keys."""
    synopsis = policy.synopses[name]
    keys = ", ".join(synopsis.keys[a] for a in axes)
    select = ", ".join([*(synopsis.keys[a] for a in axes), *synopsis.measures])
    return f"SELECT {select} FROM {synopsis.table}" + (f" GROUP BY {keys}" if keys else "")


def check_plan(name: str, sql: str, plan: Plan) -> None:
    """A synopsis measures public cells only, of COUNT(*) and plain SUMs: refused before any charge."""
    if not plan.public_keys or plan.selection_measure is not None:
        raise FeatureNotSupported(
            f'synopsis "{name}": every key needs a public domain',
            detail=sql,
            hint="Use keys with a declared domain, or a time grain (DATE_TRUNC) of a bounded column.",
        )
    for measure in plan.measures:
        plain_sum = measure.kind == "sum" and measure.expr is None and not measure.square and not measure.centre
        if measure.kind != "count_star" and not plain_sum:
            raise FeatureNotSupported(
                f'synopsis "{name}": only COUNT(*) and SUM(column) can be measured',
                detail=sql,
                hint="AVG is answered from a synopsis that has SUM(column) and COUNT(*).",
            )


def cube_cells(plan: Plan) -> int:
    return math.prod(len(key.domain or ()) for key in plan.keys)


def prepare(engine: Engine, name: str) -> tuple[list[Prepared], Prepared]:
    """Each measured marginal's prepared query, and the query over all keys (its keys' domains); validated
    and priced, nothing charged."""
    synopsis = engine.policy.synopses.get(name)
    if synopsis is None:
        declared = ", ".join(sorted(engine.policy.synopses)) or "none"
        raise InvalidParameterValue(
            f'synopsis "{name}" is not declared in the policy', hint=f"Declared synopses: {declared}."
        )
    share = len(synopsis.measured)
    session = Session(
        ledger_identity(name),
        epsilon=synopsis.epsilon / share,
        delta=synopsis.delta / share,
        mechanism=synopsis.mechanism or engine.policy.defaults.mechanism,
    )
    every = tuple(range(len(synopsis.keys)))
    full = engine.prepare(marginal_sql(engine.policy, name, every), session)
    check_plan(name, marginal_sql(engine.policy, name, every), full.plan)
    cells = cube_cells(full.plan)
    if cells > MAX_CELLS:
        raise FeatureNotSupported(
            f'synopsis "{name}" has {cells} cells (more than {MAX_CELLS})', hint="Use fewer keys or a coarser grain."
        )
    parts = []
    for axes in synopsis.measured:
        sql = marginal_sql(engine.policy, name, axes)
        prepared = engine.prepare(sql, session)
        check_plan(name, sql, prepared.plan)
        parts.append(prepared)
    return parts, full


def build(engine: Engine, name: str) -> Released:
    """Release synopsis ``name``: charge once, measure every marginal, store the noisy marginals."""
    policy = engine.policy
    parts, full = prepare(engine, name)
    synopsis = policy.synopses[name]
    keys = []
    for key in full.plan.keys:
        kind, column, unit, text = key_signature(key)
        keys.append(SynopsisKey(text, kind, column, unit, key.type or "", tuple(key.domain or ())))
    nkeys = len(keys)
    measure_of = [full.plan.outputs[nkeys + j].measures[0] for j in range(len(synopsis.measures))]
    measures = tuple(SynopsisMeasure(full.plan.measures[i].kind, full.plan.measures[i].column) for i in measure_of)
    cost = Cost.total([p.budgeting.cost for p in parts])
    engine.ledger.reserve(  # durably, before anything runs; never refunded
        dataset=policy.dataset,
        analyst=ledger_identity(name),
        cost=cost,
        dataset_budget=policy.budget.dataset,
        analyst_budget=policy.budget.dataset,
        fingerprint=f"synopsis {name}",
        accounting=policy.budget.accounting,
    )
    marginals: list[list[Marginal]] = [[] for _ in measures]
    with charged_on_failure(cost.epsilon):
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
    result = Released(
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
        laplace=parts[0].budgeting.mechanism == "laplace",
    )
    store(engine.ledger, result)
    return result


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
        for name in names:
            if args.synopsis_command == "build" and name in current:
                print(f'synopsis "{name}": already released (use "dpsql synopsis refresh" to release it again)')
                continue
            released = build(engine, name)
            cells = " × ".join(str(len(k.domain)) for k in released.keys)
            print(
                f'synopsis "{name}" of dataset "{released.dataset}": released at {released.released_at}, '
                f"{cells} cells, {len(released.axes)} marginals; charged ε={fmt(released.epsilon)}"
                + (f", δ={fmt(released.delta)}" if released.delta else "")
                + f" once to the dataset as {ledger_identity(name)}"
            )
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
                f"\tmeasures {', '.join(synopsis.measures)}"
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
