"""The ``dpsql`` command: serve, query, explain, budget, demo, demo-data, passwd.

With no options every command works on the embedded demo: the hospital policy
(schemas/health.yaml) over an in-memory DuckDB filled with the demo data, and a
persistent SQLite ledger under ``$DPSQL_HOME`` (default ``~/.local/share/dpsql``).
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpsql.version import __version__
from dpsql.backends import DEFAULT_STATEMENT_TIMEOUT_MS
from dpsql.errors import Error
from dpsql.ledger import default_ledger
from dpsql.server.protocol import DEFAULT_PORT
from dpsql.session import MECHANISMS, Result, Session, ci_label

DEMO_DATABASE = "demo"


def default_policy() -> Path:
    """schemas/health.yaml from the working directory, else from the source tree."""
    local = Path("schemas/health.yaml")
    if local.exists():
        return local
    from dpsql.demo import demo_policy_path

    return demo_policy_path("health")


def open_engine(args: argparse.Namespace) -> Any:
    """An Engine for the command's --policy/--database/--ledger; ``demo`` loads the demo data."""
    from dpsql.backends import open_backend
    from dpsql.cache import ResultCache
    from dpsql.engine import Engine
    from dpsql.ledger import Ledger
    from dpsql.policy import load_policy

    policy = load_policy(args.policy or default_policy())
    database = args.database or DEMO_DATABASE
    timeout_ms = round(args.statement_timeout * 1000)
    if database == DEMO_DATABASE:
        from dpsql.demo import DEMO_TABLES, load_demo

        backend = open_backend("duckdb://", statement_timeout_ms=timeout_ms)
        load_demo(backend, [policy.dataset] if policy.dataset in DEMO_TABLES else [])
    else:
        writes = policy.writes.randomized_response  # else the file is shared read-only with other processes
        backend = open_backend(database, statement_timeout_ms=timeout_ms, read_only=not writes)
    ledger_url = args.ledger or default_ledger(policy.dataset)
    from dpsql.cache import default_cache_url

    return Engine(policy, backend, Ledger.open(ledger_url), ResultCache.open(default_cache_url(ledger_url)))


def _session(args: argparse.Namespace) -> Session:
    """The flags go through the SET dpsql.* grammar (the same checks and 22023 as the wire server)."""
    return Session.configure(
        args.analyst,
        epsilon=args.epsilon,
        delta=args.delta,
        mechanism=args.mechanism,
        confidence=getattr(args, "confidence", None),
    )


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """psql-style aligned table."""
    cells = [[("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [" " + " | ".join(c.center(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("-" + "-+-".join("-" * w for w in widths) + "-")
    lines += [" " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def _json_default(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _print_result(result: Result, as_json: bool, show_ci: bool = True, confidence: float = 0.95) -> None:
    names = [c.name for c in result.columns]
    if as_json:
        payload = {
            "columns": [{"name": c.name, "type": c.type} for c in result.columns],
            "rows": [list(r) for r in result.rows],
            "ci_half_width": [list(a) for a in result.accuracy],
            "epsilon_spent": result.epsilon_spent,
            "delta_spent": result.delta_spent,
            "remaining_epsilon": result.remaining_epsilon,
        }
        print(json.dumps(payload, default=_json_default))
        return
    rows: Sequence[Sequence[Any]] = result.rows
    if show_ci and any(a is not None for acc in result.accuracy for a in acc):
        noisy = [i for i in range(len(names)) if any(acc[i] is not None for acc in result.accuracy)]
        names = names + [f"{names[i]} ±{ci_label(confidence)}%" for i in noisy]
        rows = [(*r, *(acc[i] for i in noisy)) for r, acc in zip(result.rows, result.accuracy, strict=True)]
    print(format_table(names, rows))
    for notice in result.notices:
        print(f"NOTICE:  {notice}", file=sys.stderr)


def cmd_query(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    try:
        session = _session(args)
        confidence = session.confidence or engine.policy.defaults.confidence
        _print_result(engine.execute(args.sql, session), args.json, confidence=confidence)
    finally:
        engine.close()
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    try:
        explanation = engine.explain(args.sql, _session(args))
        if args.json:  # asdict: a composite's sub-plans are explanations too, not their repr
            print(json.dumps(dataclasses.asdict(explanation), default=_json_default))
        else:
            for (line,) in explanation.as_result().rows:
                print(line)
    finally:
        engine.close()
    return 0


def cmd_budget(args: argparse.Namespace) -> int:
    from dpsql.accountant import BudgetLike, Spent, remaining_budget
    from dpsql.audit import printable
    from dpsql.ledger import Ledger
    from dpsql.policy import load_policy

    policy = load_policy(args.policy or default_policy())
    accounting = policy.budget.accounting

    def spent_and_left(used: Spent, total: BudgetLike) -> tuple[float, float]:
        # the ledger's accountant: Σε under pure, ε(Σρ, δ − Σδ_selection) under zcdp
        left = remaining_budget(used, total, accounting).epsilon
        return used.privacy_loss(accounting, total.delta)[0], left

    ledger = Ledger.open(args.ledger or default_ledger(policy.dataset))
    try:
        spent = {row.analyst: row.spent for row in ledger.summary(policy.dataset)}
        names = sorted({a.name for a in policy.analysts} | set(spent))
        if args.analyst:
            names = [args.analyst]
        rows = []
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
        columns = ["analyst", "epsilon_spent", "epsilon_total", "epsilon_remaining", "queries"]
        if args.json:  # a corrupt total reads as inf: null in JSON (Infinity is not JSON)
            print(json.dumps([dict(zip(columns, map(_json_number, r), strict=True)) for r in rows]))
        else:
            print(f'privacy budget of dataset "{policy.dataset}"')
            print(format_table(columns, [(printable(r[0]), *r[1:]) for r in rows]))
    finally:
        ledger.close()
    return 0


def _json_number(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def cmd_demo(args: argparse.Namespace) -> int:
    """Replay the seeds' differencing attack on Igor, first on raw SQL, then through dpsql."""
    from dpsql.attack import differencing_attack

    report = differencing_attack(runs=args.runs, epsilon=args.epsilon or 1.0)
    if args.json:
        print(json.dumps(report))
        return 0
    print("The seeds' differencing attack: Igor is the only single white male in zip 2138.")
    print("  Q1: SELECT COUNT(*) FROM patients WHERE problem = 'Obesity'")
    print("  Q2: SELECT COUNT(*) FROM patients WHERE problem = 'Obesity' AND (ethnicity <> 'White'")
    print("      OR marital_status <> 'Single' OR sex <> 'Male' OR zip <> 2138)   -- everyone but Igor")
    print(f"Raw SQL: Q1 - Q2 = {report['raw_difference']} -> the attacker learns Igor has obesity, every time.")
    print(
        f"dpsql (ε={report['epsilon']:g} per query, {report['runs']} fresh attacks): the attacker guessed right "
        f"{report['success_rate']:.1%} of the time; DP caps it at e^ε/(1+e^ε) = {report['bound']:.1%}."
    )
    print(f"Sample noisy differences: {report['sample_differences']}")
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from dpsql.backends import open_backend
    from dpsql.demo import load_demo

    backend = open_backend(args.database)
    try:
        load_demo(backend, args.dataset or ["health", "adult"])
    finally:
        backend.close()
    print(f"loaded demo data ({', '.join(args.dataset or ['health', 'adult'])})")
    return 0


def cmd_passwd(args: argparse.Namespace) -> int:
    from dpsql.server.auth import make_verifier

    password = args.password if args.password is not None else getpass.getpass("Password: ")
    print(make_verifier(password))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dpsql import server

    if getattr(args, "processes", 1) > 1:
        from dpsql.server.workers import supervise

        return supervise(args)

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    from dpsql.backends import database_log

    database_log.propagate = True  # the operator's log is the one sink for the database's own text
    from dpsql.curator import serve as curator

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the server handles it: a reload must not kill a start

    if curator.refuse_missing_database(args.database):
        return 1
    engine = open_engine(args)
    policy_path = args.policy or default_policy()
    ledger_url = args.ledger or default_ledger(engine.policy.dataset)
    if not curator.check_at_start(policy_path, engine):
        engine.close()
        return 1
    if warning := curator.note_ledger(engine, ledger_url, at_start=True):
        print(f"WARNING:  {warning}", file=sys.stderr)
    from dpsql.backends import redact_url
    from dpsql.curator.reload import default_pid_file, make_reloader, remove_pid_file, remove_verdict, write_pid_file

    ledger = redact_url(ledger_url)
    pid_files: list[Path] = []
    # a --processes worker writes its reload verdict next to its supervisor's pid file
    supervisor_pid_file = Path(args.reload_status) if getattr(args, "reload_status", None) else None

    def status() -> Path | None:
        return supervisor_pid_file or (pid_files[-1] if pid_files else None)

    def announce(port: int) -> None:  # called once the socket listens, not before
        pid_file = getattr(args, "pid_file", None)
        if pid_file != "":
            pid_files.append(Path(pid_file) if pid_file else default_pid_file(port))
            write_pid_file(pid_files[-1])
        print(
            f'dpsql serving dataset "{engine.policy.dataset}" on {args.host}:{port} '
            f"(try: psql -h {args.host} -p {port} -U analyst {engine.policy.dataset}); "
            f"policy {policy_path}; ledger {ledger}; log on stderr; curator dashboard: "
            f"dpsql dashboard --policy {policy_path} --ledger {ledger} (http://127.0.0.1:8080/)"
            + (
                f"; pid file {pid_files[-1]} (reload the policy: kill -HUP {os.getpid()} or dpsql reload)"
                if pid_files
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )

    try:
        server.run(
            engine,
            host=args.host,
            port=args.port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            catalog_dsn=args.catalog_dsn,
            statement_timeout=args.statement_timeout or None,
            default_statement_timeout=args.default_statement_timeout,
            idle_in_transaction_timeout=args.idle_in_transaction_timeout or None,
            startup_timeout=args.authentication_timeout,
            max_connections=args.max_connections,
            max_connections_per_analyst=args.max_connections_per_analyst,
            workers=args.workers,
            analyst_workers=args.analyst_workers,
            sandbox_memory=getattr(args, "sandbox_memory", 512),
            catalog_pool=args.catalog_pool,
            reuse_port=getattr(args, "reuse_port", False),
            on_listening=announce,
            reloader=make_reloader(policy_path, status),
        )
    except OSError as exc:
        print(f"ERROR:  could not listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        print("HINT:  Is another server running there? Choose another with --port.", file=sys.stderr)
        return 1
    finally:
        if (verdicts := status()) is not None:
            remove_verdict(verdicts)
        for pid_file in pid_files:
            remove_pid_file(pid_file)
        curator.note_ledger(engine, ledger_url, at_start=False)
        engine.close()
    return 0


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: seconds ≥ 0 expected")
    return value


def _common(parser: argparse.ArgumentParser, *, analyst: bool = True) -> None:
    parser.add_argument("--policy", help="policy YAML (default: schemas/health.yaml)")
    parser.add_argument(
        "--database",
        help="duckdb:///path, duckdb://, postgresql://…, spark://local[N] or sc://host:15002 (default: demo)",
    )
    parser.add_argument("--ledger", help="sqlite:///abs/path or postgresql://… (default: under $DPSQL_HOME)")
    parser.add_argument(
        "--statement-timeout",
        type=_seconds,
        default=DEFAULT_STATEMENT_TIMEOUT_MS / 1000,
        metavar="SECONDS",
        help="cancel any database statement after this long (default: %(default)g; 0: never)",
    )
    if analyst:
        parser.add_argument("--analyst", "-U", default=os.environ.get("DPSQL_ANALYST", "analyst"))
        parser.add_argument("--epsilon", type=float, help="ε for this query (default: the policy's)")
        parser.add_argument("--delta", type=float)
        parser.add_argument("--mechanism", choices=MECHANISMS)
        parser.add_argument(
            "--confidence", type=float, help="confidence of the reported intervals (default: the policy's)"
        )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpsql", description="Differential-privacy SQL gateway.")
    parser.add_argument("--version", action="version", version=f"dpsql {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="PostgreSQL wire-protocol server (psql, BI tools, drivers)")
    _common(serve, analyst=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--tls-cert")
    serve.add_argument("--tls-key")
    serve.add_argument("--catalog-dsn", help="PostgreSQL holding the schema-only catalog (default: start one)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--default-statement-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a session's statement timeout until it SETs statement_timeout; never above --statement-timeout "
        "(default: %(default)g)",
    )
    serve.add_argument(
        "--idle-in-transaction-timeout",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="close sessions idle inside a transaction block this long (default: %(default)g; 0: never)",
    )
    serve.add_argument(
        "--authentication-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="the whole startup and authentication must finish within this (default: %(default)g)",
    )
    serve.add_argument("--max-connections", type=int, default=100, help="sessions in all (default: %(default)s)")
    serve.add_argument(
        "--max-connections-per-analyst", type=int, default=32, help="sessions per analyst (default: %(default)s)"
    )
    serve.add_argument("--workers", type=int, default=8, help="threads running statements (default: %(default)s)")
    serve.add_argument(
        "--analyst-workers", type=int, default=None, help="worker threads one analyst may hold (default: half)"
    )
    serve.add_argument(
        "--sandbox-memory",
        type=int,
        default=512,
        metavar="MB",
        help="memory of the post-processing sandboxes in all, 256 MB each (default: %(default)s)",
    )
    serve.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="worker processes sharing the port (SO_REUSEPORT), each with its own event loop and engine; "
        "share a PostgreSQL ledger (default: %(default)s)",
    )
    serve.add_argument(
        "--catalog-pool", type=int, default=10, help="shadow-catalog connections shared by all (default: %(default)s)"
    )
    from dpsql.curator.serve import add_serve_options

    add_serve_options(serve)
    serve.set_defaults(func=cmd_serve)

    query = sub.add_parser("query", help="run one DP query and print the noisy answer")
    query.add_argument("sql")
    _common(query)
    query.set_defaults(func=cmd_query)

    explain = sub.add_parser("explain", help="cost, sensitivity and expected error; spends nothing")
    explain.add_argument("sql")
    _common(explain)
    explain.set_defaults(func=cmd_explain)

    budget = sub.add_parser("budget", help="privacy budget spent and remaining")
    budget.add_argument("--policy")
    budget.add_argument("--ledger")
    budget.add_argument("--analyst")
    budget.add_argument("--json", action="store_true")
    budget.set_defaults(func=cmd_budget)
    from dpsql import curator_cli

    curator_cli.register(sub, budget)  # dpsql audit; dpsql budget grant|freeze|unfreeze
    from dpsql import dashboard

    dashboard.register(sub)  # dpsql dashboard: the curator's web view of the ledger

    demo = sub.add_parser("demo", help="replay the seeds' differencing attack on Igor")
    demo.add_argument("--runs", type=int, default=1000)
    demo.add_argument("--epsilon", type=float)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=cmd_demo)

    data = sub.add_parser("demo-data", help="load the demo tables into a database")
    data.add_argument("--database", required=True)
    data.add_argument("--dataset", action="append", choices=["health", "adult", "clinic", "survey"])
    data.set_defaults(func=cmd_demo_data)

    passwd = sub.add_parser("passwd", help="print a SCRAM-SHA-256 verifier for a policy's analysts list")
    passwd.add_argument("--password", help="(default: prompt)")
    passwd.set_defaults(func=cmd_passwd)

    from dpsql.curator.cli import register

    register(sub)  # policy draft/check, cache clear, reload
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Error as exc:
        print(f"ERROR:  {exc.message}", file=sys.stderr)
        if exc.detail:
            print(f"DETAIL:  {exc.detail}", file=sys.stderr)
        if exc.hint:
            print(f"HINT:  {exc.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
