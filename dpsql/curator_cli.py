"""The curator's commands: ``dpsql audit`` and ``dpsql budget grant|freeze|unfreeze``.

They read and append to the ledger only, never the data. Every lever is a new ledger row (who,
when, why): nothing is ever changed or deleted, so the history of an analyst's limit is the
audit. A running ``dpsql serve`` needs no restart: it reads the levers inside every reservation
and checks the freeze before analysing each statement.

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

    levers = budget.add_subparsers(dest="lever", metavar="{grant,freeze,unfreeze}")
    grant = levers.add_parser("grant", help="add ε (and δ) to an analyst's budget, with a reason")
    grant.add_argument("--analyst", required=True)
    grant.add_argument("--epsilon", type=float, required=True)
    grant.add_argument("--delta", type=float, default=0.0)
    grant.add_argument("--reason", required=True)
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
    parser.add_argument("--policy", default=default, help="policy YAML (default: schemas/health.yaml)")
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
    from dpsql.cli import default_policy
    from dpsql.ledger import Ledger, default_ledger
    from dpsql.policy import load_policy

    policy = load_policy(getattr(args, "policy", None) or default_policy())
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
        print(format_table(TABLE_COLUMNS, as_table_rows(rows)))
    return 0


def cmd_lever(args: argparse.Namespace) -> int:
    from dpsql.accountant import Allowance

    policy, ledger = _open(args)
    try:
        by = args.by or _os_user()
        apply_lever(
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
        remaining = ledger.remaining(policy.dataset, args.analyst, budget=base, accounting=policy.budget.accounting)
    finally:
        ledger.close()
    state: dict[str, Any] = {
        "analyst": args.analyst,
        "action": args.lever,
        "by": by,
        "epsilon_total": limit.epsilon,
        "delta_total": limit.delta,
        "epsilon_remaining": remaining.epsilon,
        "frozen": levers.frozen,
    }
    assert isinstance(limit, Allowance)
    if getattr(args, "json", False):
        print(json.dumps(state))
    else:
        print(
            f'{args.lever}: analyst "{args.analyst}" now has ε={limit.epsilon:g} in total, '
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
) -> None:
    """Validate and append one curator lever (``grant``, ``freeze``, ``unfreeze``) to the ledger.

    The one home of the levers' checks, shared by ``dpsql budget`` and ``dpsql dashboard``: an
    unknown analyst is 42704; a non-finite or negative grant, one taking δ to 1, or one taking the
    analyst's grants beyond the dataset's budget (which bounds every analyst's spending anyway) is 22023."""
    if policy.analyst(analyst) is None:
        raise UndefinedObject(
            f'analyst "{analyst}" is not in the policy',
            hint="Name one of the policy's analysts (see dpsql budget).",
        )
    base = policy.analyst_budget(analyst)
    if lever == "grant":
        if not (math.isfinite(epsilon) and math.isfinite(delta)) or epsilon < 0 or delta < 0:
            raise InvalidParameterValue(
                f"invalid grant: ε={epsilon:g}, δ={delta:g}", hint="Grant a finite ε ≥ 0 and δ ≥ 0."
            )
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
    elif lever == "freeze":
        ledger.freeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    elif lever == "unfreeze":
        ledger.unfreeze(dataset=policy.dataset, analyst=analyst, by=by, reason=reason)
    else:
        raise InvalidParameterValue(f"unknown lever {lever!r}", hint="Use grant, freeze or unfreeze.")


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (containers): still record something
        return "unknown"
