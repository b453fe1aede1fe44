"""What the ``dpsql`` command's families share, and the analyst's own commands ``query`` and ``explain``.

Each family registers its subcommands on the parser :mod:`dpsql.cli` assembles (:func:`register`
here; :mod:`dpsql.server.cli`, :mod:`dpsql.curator.cli`, :mod:`dpsql.curator.ledger_cli`,
:mod:`dpsql.dashboard.cli`, :mod:`dpsql.dev.cli`), so no module imports the top of the CLI.

With no options every command works on the embedded demo: the hospital policy
(schemas/health.yaml) over an in-memory DuckDB filled with the demo data, and a
persistent SQLite ledger under ``$DPSQL_HOME`` (default ``~/.local/share/dpsql``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpsql.backends import DEFAULT_STATEMENT_TIMEOUT_MS, open_backend
from dpsql.cache import ResultCache, default_cache_url
from dpsql.console import format_table, json_default
from dpsql.dev.demo import DEMO_TABLES, demo_identity, demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger, default_ledger
from dpsql.policy import load_policy
from dpsql.session import MECHANISM_NAMES, Result, Session, ci_label

DEMO_DATABASE = "demo"


def default_policy() -> Path:
    """schemas/health.yaml from the working directory, else from the source tree."""
    local = Path("schemas/health.yaml")
    if local.exists():
        return local
    return demo_policy_path("health")


def open_engine(args: argparse.Namespace) -> Engine:
    """An Engine for the command's --policy/--database/--ledger; ``demo`` loads the demo data."""
    policy = load_policy(args.policy or default_policy())
    database = args.database or DEMO_DATABASE
    timeout_ms = round(args.statement_timeout * 1000)
    if database == DEMO_DATABASE:
        backend = open_backend("duckdb://", statement_timeout_ms=timeout_ms)
        datasets = [policy.dataset] if policy.dataset in DEMO_TABLES else []
        load_demo(backend, datasets)
        if not policy.writes.randomized_response:  # seeded and never written: every process's rows are the same
            backend.pin_identity(demo_identity(datasets))
    else:
        writes = policy.writes.randomized_response  # else the file is shared read-only with other processes
        backend = open_backend(database, statement_timeout_ms=timeout_ms, read_only=not writes)
    ledger_url = args.ledger or default_ledger(policy.dataset)
    return Engine(policy, backend, Ledger.open(ledger_url), ResultCache.open(default_cache_url(ledger_url)))


# --- output --------------------------------------------------------------------------------------


def print_result(result: Result, as_json: bool, show_ci: bool = True, confidence: float = 0.95) -> None:
    names = [c.name for c in result.columns]
    if as_json:
        payload = {
            "columns": [{"name": c.name, "type": c.type} for c in result.columns],
            "rows": [list(r) for r in result.rows],
            "ci_half_width": [list(a) for a in result.accuracy],
            # quantiles' value intervals (low, high) per cell, at the confidence their note states
            "value_interval": [[list(i) if i else None for i in row] for row in result.intervals] or None,
            "epsilon_spent": result.epsilon_spent,
            "delta_spent": result.delta_spent,
            "remaining_epsilon": result.remaining_epsilon,
        }
        print(json.dumps(payload, default=json_default))
        return
    rows: Sequence[Sequence[Any]] = result.rows
    if show_ci and any(a is not None for acc in result.accuracy for a in acc):
        noisy = [i for i in range(len(names)) if any(acc[i] is not None for acc in result.accuracy)]
        names = names + [f"{names[i]} ±{ci_label(confidence)}%" for i in noisy]
        rows = [(*r, *(acc[i] for i in noisy)) for r, acc in zip(result.rows, result.accuracy, strict=True)]
    print(format_table(names, rows))
    for notice in result.notices:
        print(f"NOTICE:  {notice}", file=sys.stderr)


# --- options -------------------------------------------------------------------------------------


def seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: seconds ≥ 0 expected")
    return value


# argparse shows a type's __name__ in its errors ("invalid _seconds value: 'x'"): keep the old one
seconds.__name__ = "_seconds"


def add_common(parser: argparse.ArgumentParser, *, analyst: bool = True) -> None:
    """The options of every command that opens an engine (``serve`` without the analyst's)."""
    parser.add_argument("--policy", help="policy YAML (default: schemas/health.yaml)")
    parser.add_argument(
        "--database",
        help="duckdb:///path, duckdb://, postgresql://…, spark://local[N] or sc://host:15002 (default: demo)",
    )
    parser.add_argument("--ledger", help="sqlite:///abs/path or postgresql://… (default: under $DPSQL_HOME)")
    parser.add_argument(
        "--statement-timeout",
        type=seconds,
        default=DEFAULT_STATEMENT_TIMEOUT_MS / 1000,
        metavar="SECONDS",
        help="cancel any database statement after this long (default: %(default)g; 0: never)",
    )
    if analyst:
        parser.add_argument("--analyst", "-U", default=os.environ.get("DPSQL_ANALYST", "analyst"))
        parser.add_argument("--epsilon", type=float, help="ε for this query (default: the policy's)")
        parser.add_argument("--delta", type=float)
        parser.add_argument("--mechanism", choices=MECHANISM_NAMES)
        parser.add_argument(
            "--confidence", type=float, help="confidence of the reported intervals (default: the policy's)"
        )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# --- dpsql query, dpsql explain ------------------------------------------------------------------


def _session(args: argparse.Namespace) -> Session:
    """The flags go through the SET dpsql.* grammar (the same checks and 22023 as the wire server)."""
    return Session.configure(
        args.analyst,
        epsilon=args.epsilon,
        delta=args.delta,
        mechanism=args.mechanism,
        confidence=getattr(args, "confidence", None),
        accuracy=getattr(args, "accuracy", None),
    )


def cmd_query(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    try:
        session = _session(args)
        confidence = session.confidence or engine.policy.defaults.confidence
        print_result(engine.execute(args.sql, session), args.json, confidence=confidence)
    finally:
        engine.close()
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    try:
        explanation = engine.explain(args.sql, _session(args))
        if args.json:  # asdict: a composite's sub-plans are explanations too, not their repr
            print(json.dumps(dataclasses.asdict(explanation), default=json_default))
        else:
            for (line,) in explanation.as_result().rows:
                print(line)
    finally:
        engine.close()
    return 0


def _add_accuracy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accuracy",
        metavar="HALF_WIDTH",
        help="wanted ± of each noisy measure at the confidence level, e.g. 10 or ±10: "
        "the least ε meeting it is used instead of --epsilon",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql query`` and ``dpsql explain`` to the command parsers."""
    query = sub.add_parser("query", help="run one DP query and print the noisy answer")
    query.add_argument("sql")
    add_common(query)
    _add_accuracy(query)
    query.set_defaults(func=cmd_query)

    explain = sub.add_parser("explain", help="cost, sensitivity and expected error; spends nothing")
    explain.add_argument("sql")
    add_common(explain)
    _add_accuracy(explain)
    explain.set_defaults(func=cmd_explain)
