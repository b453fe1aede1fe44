"""The ledger's commands: ``dpsql budget [grant|revoke|freeze|unfreeze]``, ``dpsql audit [prune]``
and ``dpsql ledger verify``.

They read and append to the ledger only, never the data. The levers' checks are
:func:`dpsql.curator.lever_checks.apply_lever` (shared with the dashboard); the only deletion, ``audit
prune``, removes free refusals and cache hits only, after recording itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from dpsql.accountant import Allowance, BudgetLike, Spent, fmt, remaining_budget
from dpsql.console import format_table, json_number, os_user, require_policy
from dpsql.errors import DatetimeFieldOverflow, InvalidDatetimeFormat
from dpsql.ledger import Ledger, dataset_charge, default_ledger
from dpsql.ledger.audit_report import TABLE_COLUMNS, as_csv, as_json, as_table_rows, audit_rows, parse_since, printable
from dpsql.policy import Policy, load_policy

from .lever_checks import apply_lever


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql budget`` with its lever subcommands (``dpsql budget`` and ``dpsql budget --json``
    keep working without one), ``dpsql audit`` and ``dpsql ledger`` to the command parsers."""
    budget = sub.add_parser("budget", help="privacy budget spent and remaining")
    _ledger_options(budget)
    budget.add_argument("--analyst")
    budget.add_argument("--json", action="store_true")
    budget.set_defaults(func=cmd_budget)

    audit = sub.add_parser("audit", help="the audit trail: statements, charges, refusals and curator actions")
    _ledger_options(audit)
    audit.add_argument("--analyst", help="only this analyst's rows")
    audit.add_argument("--since", type=_since, help="only rows at or after this date or time (ISO 8601, UTC)")
    audit.add_argument("--limit", type=_positive_int, default=100, help="newest N rows (default: %(default)s)")
    fmt = audit.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="a JSON array")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header line")
    audit.set_defaults(func=cmd_audit)
    actions = audit.add_subparsers(dest="audit_action", metavar="{prune}")
    prune = actions.add_parser(
        "prune", help="delete audit rows of free refusals and cache hits before a date (answered ones never)"
    )
    prune.add_argument("--before", type=_since, required=True, help="ISO 8601 date or time (UTC), in the past")
    prune.add_argument("--reason", required=True)
    prune.add_argument("--by", help="who acts (default: the OS user)")
    _ledger_options(prune, suppress=True)
    prune.set_defaults(func=cmd_prune)

    ledger = sub.add_parser("ledger", help="check the privacy ledger's integrity")
    checks = ledger.add_subparsers(dest="ledger_action", metavar="{verify}", required=True)
    verify = checks.add_parser("verify", help="check every charge and total against the append-only rows")
    _ledger_options(verify)
    verify.add_argument("--all-datasets", action="store_true", help="every dataset in the ledger, not the policy's")
    verify.set_defaults(func=cmd_verify)

    levers = budget.add_subparsers(dest="lever", metavar="{grant,revoke,freeze,unfreeze}")
    grant = levers.add_parser("grant", help="add ε (and δ) to an analyst's budget, with a reason")
    grant.add_argument("--analyst", required=True)
    grant.add_argument("--epsilon", type=float, required=True)
    grant.add_argument("--delta", type=float, default=0.0)
    grant.add_argument("--reason", required=True)
    revoke = levers.add_parser("revoke", help="take back ε (and δ) granted to an analyst, never what was spent")
    revoke.add_argument("--analyst", required=True)
    revoke.add_argument("--epsilon", type=float, required=True)
    revoke.add_argument("--delta", type=float, default=0.0)
    revoke.add_argument("--reason", required=True)
    for name, verb in (("freeze", "refuse every query of"), ("unfreeze", "answer again the queries of")):
        parser = levers.add_parser(name, help=f"{verb} an analyst")
        parser.add_argument("--analyst", required=True)
        parser.add_argument("--reason", default="")
    for parser in levers.choices.values():
        parser.add_argument("--by", help="who acts (default: the OS user)")
        _ledger_options(parser, suppress=True)
        parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        parser.set_defaults(func=cmd_lever)


def cmd_budget(args: argparse.Namespace) -> int:
    """``dpsql budget``: every analyst's ε spent, total (policy + grants) and remaining, and the dataset's.
    ``--policy`` is required (:func:`_open`): totals of the demo's dataset printed for a curator who forgot
    it would read as their own."""
    policy, ledger = _open(args)
    accounting = policy.budget.accounting

    def spent_and_left(used: Spent, total: BudgetLike) -> tuple[float, float]:
        # the ledger's accountant: Σε under pure, ε(Σρ, δ − Σδ_selection) under zcdp
        left = remaining_budget(used, total, accounting).epsilon
        return used.privacy_loss(accounting, total.delta)[0], left

    try:
        spent = {row.analyst: row.spent for row in ledger.summary(policy.dataset)}
        declared = {a.name for a in policy.analysts}
        # synopses and DP bounds are the dataset's own charges: listed under it, never as analysts
        charges = sorted(name for name in spent if dataset_charge(name, declared))
        names = sorted((declared | set(spent)) - set(charges))
        if args.analyst:
            names, charges = [args.analyst], []
        rows: list[tuple[str, float, float | None, float | None, int]] = []
        # an analyst can spend no more than the dataset has left: their remaining is the smaller of the two
        dataset_left = spent_and_left(ledger.spent(policy.dataset), policy.budget.dataset)[1]
        for name in names:
            total = ledger.levers(policy.dataset, name).limit(policy.analyst_budget(name))  # policy + grants
            used = spent.get(name, Spent())
            eps, left = spent_and_left(used, total)
            rows.append((name, eps, total.epsilon, min(left, dataset_left), used.queries))
        all_spent = ledger.spent(policy.dataset)
        dataset_total = policy.budget.dataset
        eps, left = spent_and_left(all_spent, dataset_total)
        rows.append(("(dataset)", eps, dataset_total.epsilon, left, all_spent.queries))
        for name in charges:
            used = spent[name]
            rows.append(
                (f"(dataset) {name}", used.privacy_loss(accounting, dataset_total.delta)[0], None, None, used.queries)
            )
        columns = ["analyst", "epsilon_spent", "epsilon_total", "epsilon_remaining", "queries"]
        if args.json:  # full precision; a corrupt total reads as inf: null in JSON (Infinity is not JSON)
            print(json.dumps([dict(zip(columns, map(json_number, r), strict=True)) for r in rows]))
        else:  # 4 significant digits: spent rounded up, what is left down
            shown_rows = [(printable(r[0]), _eps(r[1], up=True), _eps(r[2]), _eps(r[3], down=True), r[4]) for r in rows]
            print(f'privacy budget of dataset "{policy.dataset}"')
            print(format_table(columns, shown_rows))
    finally:
        ledger.close()
    return 0


def _eps(value: float | None, *, up: bool = False, down: bool = False) -> str | None:
    """An ε cell of ``dpsql budget``'s table (None: not applicable, a dataset charge's own total)."""
    return None if value is None else fmt(value, up=up, down=down)


def _ledger_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    # Under ``dpsql budget`` the parent already has them: SUPPRESS keeps a value given before the subcommand.
    default: str | None = argparse.SUPPRESS if suppress else None
    parser.add_argument("--policy", default=default, help="policy YAML (required for the curator's commands)")
    parser.add_argument("--ledger", default=default, help="sqlite:///abs/path or postgresql://…")


def _since(text: str) -> dt.datetime:
    try:
        return parse_since(text)
    except InvalidDatetimeFormat:
        raise argparse.ArgumentTypeError(f"invalid date {text!r}: use ISO 8601, e.g. 2026-11-01") from None
    except DatetimeFieldOverflow:
        raise argparse.ArgumentTypeError(
            f"date {text!r} out of range: use a date between 0001-01-01 and 9999-12-31 (UTC)"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: a positive integer expected")
    return value


def _open(args: argparse.Namespace) -> tuple[Policy, Ledger]:
    """The policy and ledger a curator command acts on. ``--policy`` is required: a lever or an audit
    silently applied to the demo's dataset instead of the curator's own would mislead (exit 1)."""
    names: dict[object, str] = {cmd_audit: "audit", cmd_prune: "audit prune", cmd_verify: "ledger verify"}
    command = names.get(getattr(args, "func", None), f"budget {getattr(args, 'lever', None) or ''}".strip())
    path = require_policy(args, command)
    if path is None:
        raise SystemExit(1)
    policy = load_policy(path)
    return policy, Ledger.open(getattr(args, "ledger", None) or default_ledger(policy.dataset))


def cmd_audit(args: argparse.Namespace) -> int:
    policy, ledger = _open(args)
    try:
        rows = audit_rows(ledger, policy.dataset, analyst=args.analyst, since=args.since, limit=args.limit)
    finally:
        ledger.close()
    if args.json:
        print(as_json(rows))
    elif args.csv:
        sys.stdout.write(as_csv(rows))
    else:
        print(f'audit trail of dataset "{policy.dataset}"')
        print(format_table(TABLE_COLUMNS, as_table_rows(rows)))
    return 0


def cmd_lever(args: argparse.Namespace) -> int:
    policy, ledger = _open(args)
    try:
        by = args.by or os_user()
        warnings = apply_lever(
            ledger,
            policy,
            args.lever,
            args.analyst,
            by=by,
            reason=args.reason,
            epsilon=getattr(args, "epsilon", 0.0),
            delta=getattr(args, "delta", 0.0),
        )
        base = policy.analyst_budget(args.analyst)
        levers = ledger.levers(policy.dataset, args.analyst)
        limit = levers.limit(base)
        remaining = ledger.remaining(
            policy.dataset,
            args.analyst,
            budget=base,
            accounting=policy.budget.accounting,
            dataset_budget=policy.budget.dataset,  # what the analyst can really spend: min(own, dataset's)
        )
    finally:
        ledger.close()
    for warning in warnings:
        print(f"WARNING:  {warning}", file=sys.stderr)
    state: dict[str, Any] = {
        "analyst": args.analyst,
        "action": args.lever,
        "by": by,
        "epsilon_total": limit.epsilon,
        "delta_total": limit.delta,
        "epsilon_remaining": remaining.epsilon,
        "frozen": levers.frozen,
        "warnings": warnings,
    }
    assert isinstance(limit, Allowance)
    if getattr(args, "json", False):
        print(json.dumps(state))
    else:
        print(
            f'{args.lever}: analyst "{args.analyst}" of dataset "{policy.dataset}" '
            f"now has ε={fmt(limit.epsilon)} in total, "
            f"ε={fmt(remaining.epsilon, down=True)} remaining{' (frozen)' if levers.frozen else ''}"
        )
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """``dpsql audit prune``: one audited deletion of old free rows (see :meth:`dpsql.ledger.Ledger.prune_audit`)."""
    policy, ledger = _open(args)
    try:
        event, count = ledger.prune_audit(
            dataset=policy.dataset, before=args.before, by=args.by or os_user(), reason=args.reason
        )
    finally:
        ledger.close()
    print(f"prune: {count} audit rows of free refusals and cache hits deleted; recorded as curator action #{event.id}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``dpsql ledger verify``: exit 0 when the ledger is consistent, 1 with one line per problem."""
    policy, ledger = _open(args)
    try:
        problems = ledger.verify(None if args.all_datasets else policy.dataset)
    finally:
        ledger.close()
    for problem in problems:
        print(f"ERROR:  {problem}", file=sys.stderr)
    if problems:
        print(
            "HINT:  Budgets are charged against the larger of the totals and the charge rows, so nothing is "
            "given back; find who could write the ledger (README: Least-privilege database roles).",
            file=sys.stderr,
        )
        return 1
    print("ledger verified: every total and charge row agrees")
    return 0
