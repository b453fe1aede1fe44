"""The curator's commands: ``dpsql audit [prune]``, ``dpsql budget grant|revoke|freeze|unfreeze`` and
``dpsql ledger verify``.

They read and append to the ledger only, never the data. Every lever is a new ledger row (who,
when, why): nothing is ever changed, so the history of an analyst's limit is the audit; a revoke is
its own row taking grants back (never budget already spent), and the only deletion, ``audit prune``,
removes free refusals and cache hits only, after recording itself. A running ``dpsql serve`` needs no
restart: it reads the levers inside every reservation and checks the freeze before analysing each
statement.

Privacy meaning: a grant of (ε, δ) lets the analyst release that much more about the data; it is
the curator's decision and is recorded as such. The dataset's total (the policy's
``budget.dataset``) is not raised by a grant — it bounds what all analysts together may learn.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import math
import sys
from typing import Any

from dpsql.errors import InvalidParameterValue, UndefinedObject


def register(sub: Any, budget: argparse.ArgumentParser) -> None:
    """Add ``dpsql audit`` to the command parsers and the lever subcommands to ``dpsql budget``
    (``dpsql budget`` and ``dpsql budget --json`` keep working without a subcommand)."""
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


def _ledger_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    # Under ``dpsql budget`` the parent already has them: SUPPRESS keeps a value given before the subcommand.
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument("--policy", default=default, help="policy YAML (required for the curator's commands)")
    parser.add_argument("--ledger", default=default, help="sqlite:///abs/path or postgresql://…")


def _since(text: str) -> dt.datetime:
    from dpsql.audit import parse_since
    from dpsql.errors import DatetimeFieldOverflow, InvalidDatetimeFormat

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


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    """The policy and ledger a curator command acts on. ``--policy`` is required: a lever or an audit
    silently applied to the demo's dataset instead of the curator's own would mislead (exit 1)."""
    from dpsql.curator.cli import require_policy
    from dpsql.ledger import Ledger, default_ledger
    from dpsql.policy import load_policy

    func: Any = getattr(args, "func", None)
    command = {cmd_audit: "audit", cmd_prune: "audit prune", cmd_verify: "ledger verify"}.get(
        func, f"budget {getattr(args, 'lever', None) or ''}".strip()
    )
    path = require_policy(args, command)
    if path is None:
        raise SystemExit(1)
    policy = load_policy(path)
    return policy, Ledger.open(getattr(args, "ledger", None) or default_ledger(policy.dataset))


def cmd_audit(args: argparse.Namespace) -> int:
    from dpsql.audit import TABLE_COLUMNS, as_csv, as_json, as_table_rows, audit_rows
    from dpsql.cli import format_table

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
    from dpsql.accountant import Allowance

    policy, ledger = _open(args)
    try:
        by = args.by or _os_user()
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
            f"now has ε={limit.epsilon:g} in total, "
            f"ε={remaining.epsilon:g} remaining{' (frozen)' if levers.frozen else ''}"
        )
    return 0


def apply_lever(
    ledger: Any,
    policy: Any,
    lever: str,
    analyst: str,
    *,
    by: str,
    reason: str,
    epsilon: float = 0.0,
    delta: float = 0.0,
) -> list[str]:
    """Validate and append one curator lever (``grant``, ``revoke``, ``freeze``, ``unfreeze``) to the
    ledger; returns warnings for the curator (applied anyway).

    The one home of the levers' checks, shared by ``dpsql budget`` and ``dpsql dashboard``: an
    unknown analyst is 42704; a non-finite or negative grant, one taking δ to 1, or one taking the
    analyst's grants beyond the dataset's budget (which bounds every analyst's spending anyway) is 22023,
    and so is a revoke of more than the analyst's grants or below what they already spent. A grant
    larger than what the dataset has left warns: the analyst can never spend more than that."""
    if policy.analyst(analyst) is None:
        raise UndefinedObject(
            f'analyst "{analyst}" is not in the policy',
            hint="Name one of the policy's analysts (see dpsql budget).",
        )
    base = policy.analyst_budget(analyst)
    warnings: list[str] = []
    if lever in ("grant", "revoke") and (
        not (math.isfinite(epsilon) and math.isfinite(delta)) or epsilon < 0 or delta < 0
    ):
        raise InvalidParameterValue(
            f"invalid {lever}: ε={epsilon:g}, δ={delta:g}", hint=f"{lever.capitalize()} a finite ε ≥ 0 and δ ≥ 0."
        )
    if lever == "grant":
        limit = ledger.levers(policy.dataset, analyst).limit(base)
        if limit.delta + delta >= 1:
            raise InvalidParameterValue(
                f"invalid grant: δ would reach {limit.delta + delta:g}", hint="An analyst's δ stays below 1."
            )
        ledger.grant(
            dataset=policy.dataset,
            analyst=analyst,
            epsilon=epsilon,
            delta=delta,
            by=by,
            reason=reason,
            dataset_budget=policy.budget.dataset,
        )
        left = ledger.remaining(policy.dataset, budget=policy.budget.dataset, accounting=policy.budget.accounting)
        if epsilon > left.epsilon or delta > left.delta:
            warnings.append(
                f"the grant of ε={epsilon:g}, δ={delta:g} is more than the dataset has left "
                f"(ε={left.epsilon:g}, δ={left.delta:g}, shared by all analysts): "
                f'analyst "{analyst}" can spend at most that'
            )
    elif lever == "revoke":
        ledger.revoke(
            dataset=policy.dataset,
            analyst=analyst,
            epsilon=epsilon,
            delta=delta,
            by=by,
            reason=reason,
            analyst_budget=base,
            accounting=policy.budget.accounting,
        )
    elif lever == "freeze":
        ledger.freeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    elif lever == "unfreeze":
        ledger.unfreeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    else:
        raise InvalidParameterValue(f"unknown lever {lever!r}", hint="Use grant, revoke, freeze or unfreeze.")
    return warnings


def cmd_prune(args: argparse.Namespace) -> int:
    """``dpsql audit prune``: one audited deletion of old free rows (see :meth:`dpsql.ledger.Ledger.prune_audit`)."""
    policy, ledger = _open(args)
    try:
        event, count = ledger.prune_audit(
            dataset=policy.dataset, before=args.before, by=args.by or _os_user(), reason=args.reason
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


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (containers): still record something
        return "unknown"
