"""The curator's subcommands, registered on ``dpsql``'s parser: ``policy draft``, ``policy check``,
``policy report``, ``cache clear`` and ``reload`` (the ledger's are :mod:`dpsql.curator.ledger_cli`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dpsql.accountant import fmt
from dpsql.backends import Backend, open_backend, redact_url
from dpsql.cache import ResultCache, default_cache_url
from dpsql.console import require_policy
from dpsql.dev.demo import DEMO_TABLES, load_demo
from dpsql.errors import BackendError, InvalidParameterValue, UndefinedTable, charged_on_failure
from dpsql.ledger import Ledger, default_ledger, resolve_ledger_url
from dpsql.policy import load_policy
from dpsql.version import DEFAULT_PORT

from . import introspect
from .check import check_file
from .dp_bounds import DP_COVERAGE, charge_dp_bounds, curator_name, dp_bounds, dp_targets
from .draft import dataset_name, draft_policy
from .reload import await_verdicts, default_pid_file, signal_reload
from .report import build_report, render
from .serve import missing_database_file


def _open_database(url: str | None, dataset: str | None) -> Backend:
    """The database to check against: a URL, or the demo (in-memory DuckDB with the demo tables)."""
    if url is None or url == "demo":
        backend = open_backend("duckdb://")
        load_demo(backend, [dataset] if dataset in DEMO_TABLES else [])
        return backend
    path = missing_database_file(url)
    if path is not None:
        raise BackendError(f'database file "{path}" does not exist')
    return open_backend(url, read_only=True)  # curator tools only read: the file stays shared


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Exit 0 when the policy loads and fits the database (warnings printed), 1 on any error."""
    path = require_policy(args, "policy check")
    if path is None:
        return 1
    first = check_file(path)  # loads it first: the dataset decides which demo tables to load
    if first.policy is None:
        for error in first.errors:
            print(error, file=sys.stderr)
        return 1
    if args.database is None and first.policy.dataset not in _demo_datasets():
        print(f'ERROR:  dpsql policy check needs --database for dataset "{first.policy.dataset}"', file=sys.stderr)
        print("HINT:  Only the demo's datasets are checked against the demo data by default.", file=sys.stderr)
        return 1
    backend = _open_database(args.database, first.policy.dataset)
    try:
        report = check_file(path, backend, bias=True)
    finally:
        backend.close()
    for note in report.notes:  # the bias summary: with the warnings, stdout keeps the verdict alone
        print(note, file=sys.stderr)
    for warning in report.warnings:
        print(warning, file=sys.stderr)
    for error in report.errors:
        print(error, file=sys.stderr)
    if report.ok:
        count = len(report.warnings)
        print(f'{path}: dataset "{first.policy.dataset}": ok ({count} warning{"s" if count != 1 else ""})')
        return 0
    return 1


def cmd_policy_draft(args: argparse.Namespace) -> int:
    path = missing_database_file(args.database)
    if path is not None:
        print(f'ERROR:  database file "{path}" does not exist', file=sys.stderr)
        return 1
    backend = open_backend(args.database, read_only=True)
    try:
        tables = args.table or introspect.tables(backend)
        if not tables:
            print("ERROR:  the database has no tables to draft a policy for", file=sys.stderr)
            return 1
        dataset = args.dataset or dataset_name(args.database)
        text = draft_policy(backend, tables, dataset)
    finally:
        backend.close()
    if args.out:
        out = Path(args.out)
        if out.exists() and not args.force:
            print(f"ERROR:  {out} exists (use --force to overwrite)", file=sys.stderr)
            return 1
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}: review it, then `dpsql policy check --policy {out} --database …`", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """Delete every cached result next to the ledger (answers already released stay released: the
    next repeat is simply charged again)."""
    path = require_policy(args, "cache clear")
    if path is None:
        return 1
    dataset = load_policy(path).dataset
    ledger = args.ledger or default_ledger(dataset)
    url = default_cache_url(ledger)
    cache = ResultCache.open(url)
    try:
        removed = cache.clear()
    finally:
        cache.close()
    plural = "s" if removed != 1 else ""
    print(f'removed {removed} cached result{plural} from {redact_url(url)} (the ledger of dataset "{dataset}")')
    return 0


def cmd_policy_report(args: argparse.Namespace) -> int:
    """``dpsql policy report``: print the report (text or ``--json``); with ``--dp-bounds``, charge the
    curator's ε to the ledger first, then add DP-suggested bounds. Errors propagate to ``dpsql``'s
    handler (``ERROR:`` lines, exit 1)."""
    path = require_policy(args, "policy report")  # never the demo's policy by default (as policy check)
    if path is None:
        return 1
    policy = load_policy(path)
    if args.database is None and policy.dataset not in _demo_datasets():
        print(f'ERROR:  dpsql policy report needs --database for dataset "{policy.dataset}"', file=sys.stderr)
        return 1
    tables = args.table or list(policy.tables)
    unknown = [t for t in tables if t not in policy.tables]
    if unknown:
        raise UndefinedTable(
            f'table "{unknown[0]}" is not in the policy', hint=f"Tables: {', '.join(sorted(policy.tables))}."
        )
    if args.dp_bounds and not (args.epsilon is not None and math.isfinite(args.epsilon) and args.epsilon > 0):
        raise InvalidParameterValue("--dp-bounds needs --epsilon E > 0 (charged to the curator's budget)")
    if not 0.5 < args.coverage < 1:
        raise InvalidParameterValue("--coverage must be between 0.5 and 1 (exclusive), e.g. 0.99")
    backend = _open_database(args.database, policy.dataset)
    targets: list[tuple[str, str]] = []
    try:
        dp = None
        if args.dp_bounds:
            targets = dp_targets(policy, tables)
            if not targets:
                raise InvalidParameterValue("no bounded numeric column to suggest bounds for")
            ledger = Ledger.open(resolve_ledger_url(args.ledger, policy.dataset))
            try:
                charge = charge_dp_bounds(policy, ledger, args.epsilon, args.charge_as or curator_name(), targets)
            finally:
                ledger.close()
            print(
                f"charged ε={fmt(args.epsilon)} to {charge.analyst} (dataset {policy.dataset} now at "
                f"ε={fmt(charge.dataset_spent.epsilon, up=True)} spent)",
                file=sys.stderr,
            )
            with charged_on_failure(args.epsilon):  # charged above, never refunded
                dp = dp_bounds(policy, backend, targets, args.epsilon, args.coverage)
        report = build_report(policy, backend, tables, dp)
    finally:
        backend.close()
    if args.dp_bounds:
        report.dp_epsilon, report.dp_columns = args.epsilon, len(targets)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(render(report))
    return 0


def _demo_datasets() -> frozenset[str]:
    return frozenset(DEMO_TABLES)


def cmd_reload(args: argparse.Namespace) -> int:
    """Signal a running ``dpsql serve`` to re-read its policy and wait for its verdict (every worker's
    with ``--processes``): exit 0 when all accepted it, 1 when any refused it or none answered in
    time. With ``--policy``, check the file first and signal nothing if it has errors."""
    if args.policy:
        report = check_file(args.policy)
        if not report.ok:
            for error in report.errors:
                print(error, file=sys.stderr)
            print("HINT:  nothing was signalled; fix the policy first.", file=sys.stderr)
            return 1
    pid_file = Path(args.pid_file) if args.pid_file else default_pid_file(args.port)
    try:
        pid, token, processes = signal_reload(pid_file)
    except (OSError, ValueError, IndexError) as exc:
        print(f"ERROR:  no running dpsql serve found through {pid_file}: {exc}", file=sys.stderr)
        print("HINT:  give --pid-file (as passed to dpsql serve) or --port.", file=sys.stderr)
        return 1
    if args.no_wait:
        print(f"sent SIGHUP to dpsql serve (pid {pid}); the server's log says whether the policy was accepted")
        return 0
    verdicts = await_verdicts(pid_file, token, processes, args.timeout)
    refused = [v for v in verdicts if not v.ok]
    for verdict in refused:
        where = f" (worker pid {verdict.pid})" if processes > 1 else ""
        print(f"ERROR:  policy reload refused{where}; still serving the previous policy:", file=sys.stderr)
        print(verdict.message, file=sys.stderr)
    if refused:
        return 1
    if len(verdicts) < processes:
        print(
            f"ERROR:  {processes - len(verdicts)} of {processes} serving processes gave no verdict within "
            f"{args.timeout:g} s (pid {pid}); see the server's log",
            file=sys.stderr,
        )
        return 1
    workers = f" by {processes} processes" if processes > 1 else ""
    print(f"{verdicts[0].message}{workers} (pid {pid})")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the curator's subcommands to ``dpsql``'s subparsers."""
    policy = sub.add_parser("policy", help="draft a policy from a database, or check one against it")
    psub = policy.add_subparsers(dest="policy_command", required=True)

    draft = psub.add_parser("draft", help="write a starting policy from tables' schemas (review it!)")
    draft.add_argument("--database", required=True, help="duckdb:///path or postgresql://…")
    draft.add_argument("--table", action="append", help="a table to include (repeatable; default: all)")
    draft.add_argument("--dataset", help="the dataset name (default: from the database URL)")
    draft.add_argument("--out", help="write here instead of stdout")
    draft.add_argument("--force", action="store_true", help="overwrite --out")
    draft.set_defaults(func=cmd_policy_draft)

    check = psub.add_parser("check", help="check a policy against its database (exit 1 on errors)")
    check.add_argument("--policy", help="policy YAML (required)")
    check.add_argument(
        "--database", help="duckdb:///path, postgresql://… (default: the demo data, for the demo's datasets only)"
    )
    check.set_defaults(func=cmd_policy_check)

    # curator only: the exact figures of dpsql.curator.report, the noisy bounds of dpsql.curator.dp_bounds
    report = psub.add_parser(
        "report", help="curator only: bias of the caps and bounds (exact, from the data) and suggested values"
    )
    report.add_argument("--policy", help="policy YAML (required)")
    report.add_argument(
        "--database", help="duckdb:///path, postgresql://… (default: the demo data, demo datasets only)"
    )
    report.add_argument("--table", action="append", help="a table to report on (repeatable; default: all)")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument(
        "--dp-bounds", action="store_true", help="also suggest bounds through a DP mechanism (needs --epsilon)"
    )
    report.add_argument("--epsilon", type=float, help="ε for --dp-bounds, charged to the ledger")
    report.add_argument("--coverage", type=float, default=DP_COVERAGE, help="share the DP bounds keep inside")
    report.add_argument("--ledger", help="sqlite:///abs/path or postgresql://… (default: under $DPSQL_HOME)")
    report.add_argument("--charge-as", help="the ledger identity charged (default: curator:<OS user>)")
    report.set_defaults(func=cmd_policy_report)

    cache = sub.add_parser("cache", help="the result cache next to the ledger")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    clear = csub.add_parser("clear", help="delete every cached result (repeats are charged again)")
    clear.add_argument("--policy", help="policy YAML (required): its dataset names the ledger")
    clear.add_argument("--ledger")
    clear.set_defaults(func=cmd_cache_clear)

    reload = sub.add_parser("reload", help="make a running dpsql serve re-read its policy (SIGHUP)")
    reload.add_argument("--pid-file", help="as given to dpsql serve (default: $DPSQL_HOME/serve-<port>.pid)")
    reload.add_argument("--port", type=int, default=DEFAULT_PORT)
    reload.add_argument("--policy", help="check this policy file first; signal nothing if it has errors")
    reload.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the verdict (default: 30)")
    reload.add_argument("--no-wait", action="store_true", help="signal and exit 0 without waiting for the verdict")
    reload.set_defaults(func=cmd_reload)
