"""The ``dpsql`` command: the parser assembled from the command families, and the dispatch.

Each family defines its subcommands and their handlers in its own module and registers them here
(``register(sub)``); nothing imports this module, so a command never depends on another through it.
With no options every command works on the embedded demo (:mod:`dpsql.commands`).

Only the family the command line names is imported (issue #37): ``dpsql --version`` loads nothing
else, and ``dpsql budget`` the ledger and the policy, not the engine, the server and every stage of
the pipeline, which took 2.5-5 s. ``dpsql --help``, no command or an unknown one load every family,
so the usage lists them all. This module is the one besides the package root whose functions may
import (``scripts/check_layers.py``: ``LAZY_MODULES``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from dpsql.errors import Error
from dpsql.version import __version__

#: A family's registration: adds its subcommands to ``dpsql``'s parser.
Register: TypeAlias = "Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]"


def _server() -> Register:
    from dpsql.server import cli

    return cli.register  # serve


def _analyst() -> Register:
    from dpsql import commands

    return commands.register  # query, explain


def _ledger() -> Register:
    from dpsql.curator import ledger_cli

    return ledger_cli.register  # budget [grant|revoke|freeze|unfreeze], audit [prune], ledger verify


def _dashboard() -> Register:
    from dpsql.dashboard import cli

    return cli.register  # dashboard: the curator's web view of the ledger


def _dev() -> Register:
    from dpsql.dev import cli

    return cli.register  # demo, demo-data


def _passwd() -> Register:
    from dpsql.server import cli

    return cli.register_passwd  # passwd


def _curator() -> Register:
    from dpsql.curator import cli

    return cli.register  # policy draft|check|report, cache clear, reload


def _synopsis() -> Register:
    from dpsql.curator import synopsis_cli as synopsis

    return synopsis.register  # synopsis build|refresh|list


#: The families, in the order ``dpsql --help`` lists their subcommands, with the commands each registers.
FAMILIES: tuple[tuple[tuple[str, ...], Callable[[], Register]], ...] = (
    (("serve",), _server),
    (("query", "explain"), _analyst),
    (("budget", "audit", "ledger"), _ledger),
    (("dashboard",), _dashboard),
    (("demo", "demo-data"), _dev),
    (("passwd",), _passwd),
    (("policy", "cache", "reload"), _curator),
    (("synopsis",), _synopsis),
)


def _families(argv: Sequence[str] | None) -> list[Callable[[], Register]]:
    """The families a command line needs: its command's, none for ``--version``, all otherwise."""
    everything = [load for _, load in FAMILIES]
    if argv is None:
        return everything
    for arg in argv:
        if arg == "--version":
            return []
        if arg.startswith("-"):  # --help, or an option before the command (an error): list them all
            return everything
        return [load for names, load in FAMILIES if arg in names] or everything
    return everything


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or (``argv`` given) of the ones that command line needs."""
    parser = argparse.ArgumentParser(prog="dpsql", description="Differential-privacy SQL gateway.")
    parser.add_argument("--version", action="version", version=f"dpsql {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for load in _families(argv):
        load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # dpsql validates its policy with pydantic and uses no pydantic plugin: not discovering them skips a scan
    # of every installed distribution's entry points (~0.05-0.1 s of each command's start; issue #37)
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
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
