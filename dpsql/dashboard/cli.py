"""``dpsql dashboard``: start the curator's web view of the privacy ledger (:mod:`dpsql.dashboard`).

The password is loaded before anything listens (never an open dashboard), and the command refuses
to start without ``--policy`` (never the demo's dataset by default).
"""

from __future__ import annotations

import argparse
import logging
import ssl
import sys

from dpsql.backends import redact_url
from dpsql.console import os_user, require_policy
from dpsql.errors import PolicyError
from dpsql.ledger import Ledger, default_ledger
from dpsql.policy import load_policy

from .auth import Curator, load_verifier
from .server import Dashboard, insecure_listen_warning, make_server

#: The dashboard's port unless ``--port`` says otherwise.
DEFAULT_PORT = 8080


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql dashboard`` to the command parsers."""
    p = sub.add_parser("dashboard", help="the curator's web dashboard: budgets, spend, audit trail, policy, levers")
    p.add_argument("--policy", help="policy YAML (required)")
    p.add_argument("--ledger", help="sqlite:///abs/path or postgresql://… (default: the dataset's ledger)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s; 0: any free port)")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the browser may use for the dashboard besides IP addresses, localhost and --host "
        "(repeatable); other Host headers get 421 (DNS rebinding)",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve HTTPS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--password-file",
        help="file holding the curator's SCRAM-SHA-256 verifier (from `dpsql passwd`); "
        "else $DPSQL_CURATOR_VERIFIER or $DPSQL_CURATOR_PASSWORD",
    )
    p.add_argument("--by", help="who the levers applied from the dashboard are recorded as (default: the OS user)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    verifier = load_verifier(args.password_file)  # before anything listens: never an open dashboard
    if bool(args.tls_cert) != bool(args.tls_key):
        raise PolicyError("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    path = require_policy(args, "dashboard")  # never the demo's dataset by default
    if path is None:
        return 1
    policy = load_policy(path)
    ledger_url = args.ledger or default_ledger(policy.dataset)
    ledger = Ledger.open(ledger_url)
    try:
        by = args.by or os_user()
        app = Dashboard(
            policy,
            ledger,
            Curator(verifier),
            by=f"{by} (dashboard)",
            tls=tls is not None,
            allowed_hosts=tuple(args.allowed_host),
        )
        try:
            server = make_server(app, args.host, args.port, tls)
        except OSError as exc:  # the port is taken, the address is not ours: one line, as `dpsql serve` says it
            print(f"ERROR:  could not listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
            print("HINT:  Is another dashboard running there? Choose another with --port.", file=sys.stderr)
            return 1
        warning = insecure_listen_warning(args.host, tls is not None)
        if warning is not None:
            print(f"WARNING:  {warning}", file=sys.stderr, flush=True)
        host, port = str(server.server_address[0]), int(server.server_address[1])
        scheme = "https" if tls else "http"
        shown = f"[{host}]" if ":" in str(host) else host
        print(
            f'dpsql dashboard for dataset "{policy.dataset}" at {scheme}://{shown}:{port}/ '
            f"(curator login; ledger {redact_url(ledger_url)}; reads the ledger only, never the data)",
            file=sys.stderr,
            flush=True,
        )
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    finally:
        ledger.close()
    return 0
