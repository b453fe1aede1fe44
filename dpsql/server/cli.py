"""``dpsql serve`` (the wire-protocol server, one process or a supervisor of ``--processes N``) and
``dpsql passwd`` (a SCRAM verifier for the policy's analysts list), registered on ``dpsql``'s parser.

Before anything listens, :mod:`dpsql.curator.serve` refuses a missing database file and a policy
with errors; the ledger marker warns when the budget spent elsewhere would not be counted here.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from dpsql.backends import database_log, redact_url
from dpsql.commands import add_common, default_policy, open_engine, seconds
from dpsql.curator import serve as curator
from dpsql.curator.reload import default_pid_file, make_reloader, remove_pid_file, remove_verdict, write_pid_file
from dpsql.ledger import default_ledger
from dpsql.policy import Policy
from dpsql.server.auth import make_verifier
from dpsql.server.protocol import DEFAULT_PORT
from dpsql.server.server import run
from dpsql.server.workers import supervise


def banner_login(policy: Policy, host: str, port: int) -> str:
    """The start banner's ``try: psql …``, naming an analyst the policy declares (``analyst`` when it is one)."""
    declared = [a.name for a in policy.analysts]
    who = "analyst" if "analyst" in declared else declared[0] if declared else None
    if who is None:
        return "no analyst declared: nobody can log in"
    return f"try: psql -h {host} -p {port} -U {shlex.quote(who)} {shlex.quote(policy.dataset)}"


def _server_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`dpsql.server.run` set by ``dpsql serve``'s options."""
    return dict(
        host=args.host,
        port=args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        catalog_dsn=args.catalog_dsn,
        catalog_background=True,  # listen at once; the local shadow catalog comes up meanwhile
        statement_timeout=args.statement_timeout or None,
        default_statement_timeout=args.default_statement_timeout,
        idle_in_transaction_timeout=args.idle_in_transaction_timeout or None,
        idle_holding_timeout=getattr(args, "idle_holding_timeout", 120.0) or None,
        analyst_cpu_share=getattr(args, "analyst_cpu_share", 0.1),
        require_tls=getattr(args, "require_tls", False),
        startup_timeout=args.authentication_timeout,
        max_connections=args.max_connections,
        max_connections_per_analyst=args.max_connections_per_analyst,
        workers=args.workers,
        analyst_workers=args.analyst_workers,
        sandbox_memory=getattr(args, "sandbox_memory", 512),
        catalog_pool=args.catalog_pool,
        reuse_port=getattr(args, "reuse_port", False),
        worker_index=getattr(args, "worker_index", None),
        cancel_dir=getattr(args, "cancel_dir", None),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    if getattr(args, "processes", 1) > 1:
        return supervise(args, cmd_serve)  # each worker runs this very command with --processes 1

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    database_log.propagate = True  # the operator's log is the one sink for the database's own text
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
            f"({banner_login(engine.policy, args.host, port)}); "
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
        run(
            engine,
            **_server_options(args),
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


def cmd_passwd(args: argparse.Namespace) -> int:
    password = args.password if args.password is not None else getpass.getpass("Password: ")
    print(make_verifier(password))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql serve`` to the command parsers."""
    serve = sub.add_parser("serve", help="PostgreSQL wire-protocol server (psql, BI tools, drivers)")
    add_common(serve, analyst=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--tls-cert")
    serve.add_argument("--tls-key")
    serve.add_argument("--catalog-dsn", help="PostgreSQL holding the schema-only catalog (default: start one)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--default-statement-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="a session's statement timeout until it SETs statement_timeout; never above --statement-timeout "
        "(default: %(default)g)",
    )
    serve.add_argument(
        "--idle-in-transaction-timeout",
        type=seconds,
        default=600.0,
        metavar="SECONDS",
        help="close sessions idle inside a transaction block this long (default: %(default)g; 0: never)",
    )
    serve.add_argument(
        "--idle-holding-timeout",
        type=seconds,
        default=120.0,
        metavar="SECONDS",
        help="close sessions idle outside a transaction while holding more than their reserved 1 MiB "
        "(WITH HOLD cursors, portals, prepared statements) this long (default: %(default)g; 0: never)",
    )
    serve.add_argument(
        "--analyst-cpu-share",
        type=float,
        default=0.1,
        metavar="CPU",
        help="CPU-seconds per second an analyst may use while others are active; the heaviest beyond it "
        "waits and runs one statement at a time (default: %(default)g; 0: no cap)",
    )
    serve.add_argument(
        "--require-tls", action="store_true", help="refuse sessions without TLS (needs --tls-cert), as hostssl"
    )
    serve.add_argument(
        "--authentication-timeout",
        type=seconds,
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
    curator.add_serve_options(serve)
    serve.set_defaults(func=cmd_serve)


def register_passwd(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql passwd`` to the command parsers (after the demo commands, as ``dpsql --help`` lists it)."""
    passwd = sub.add_parser("passwd", help="print a SCRAM-SHA-256 verifier for a policy's analysts list")
    passwd.add_argument("--password", help="(default: prompt)")
    passwd.set_defaults(func=cmd_passwd)
