"""The ``dpsql`` command: the parser assembled from the command families, and the dispatch.

Each family defines its subcommands and their handlers in its own module and registers them here
(``register(sub)``); nothing imports this module, so a command never depends on another through it.
With no options every command works on the embedded demo (:mod:`dpsql.commands`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from dpsql import commands
from dpsql.curator import cli as curator_cli
from dpsql.curator import ledger_cli
from dpsql.curator import synopsis as synopsis_cli
from dpsql.dashboard import cli as dashboard_cli
from dpsql.dev import cli as dev_cli
from dpsql.errors import Error
from dpsql.server import cli as server_cli
from dpsql.version import __version__

#: The families' registrations, in the order ``dpsql --help`` lists their subcommands.
FAMILIES: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    server_cli.register,  # serve
    commands.register,  # query, explain
    ledger_cli.register,  # budget [grant|revoke|freeze|unfreeze], audit [prune], ledger verify
    dashboard_cli.register,  # dashboard: the curator's web view of the ledger
    dev_cli.register,  # demo, demo-data
    server_cli.register_passwd,  # passwd
    curator_cli.register,  # policy draft|check|report, cache clear, reload
    synopsis_cli.register,  # synopsis build|refresh|list
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpsql", description="Differential-privacy SQL gateway.")
    parser.add_argument("--version", action="version", version=f"dpsql {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in FAMILIES:
        register(sub)
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
