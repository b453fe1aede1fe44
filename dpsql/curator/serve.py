"""What ``dpsql serve`` checks before it accepts a connection, and what it leaves for the operator.

- ``duckdb:///path`` must name an existing file: DuckDB would create an empty database, and a typo
  would then serve nothing (or, worse, a later query would be answered on the wrong data).
  ``duckdb://`` (in memory) and the demo stay allowed.
- The policy passes :mod:`dpsql.curator.check` against the database (missing table or column,
  incompatible type, unit not an identifier, …): errors refuse the start, warnings are printed.
- An empty ledger where this machine last saw charges for the same database and dataset is
  warned about (a ledger marker under ``$DPSQL_HOME/markers``): budget spent there is not counted
  here, so the whole budget would be spendable again. The marker holds the redacted ledger URL and a
  query count, for the operator only; it only knows what this ``$DPSQL_HOME`` recorded.
- A pid file (``--pid-file``, default ``$DPSQL_HOME/serve-<port>.pid``) for ``dpsql reload``: the pid
  alone, so ``kill -HUP $(cat FILE)`` works (:func:`dpsql.curator.reload.write_pid_file`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from dpsql.backends import redact_url
from dpsql.backends.duckdb import _database_path
from dpsql.cache import database_identity
from dpsql.engine import Engine
from dpsql.ledger import dpsql_home, warn_about_roles

from .check import check_file

log = logging.getLogger("dpsql.curator")


def missing_database_file(database: str | None) -> str | None:
    """The path of a ``duckdb:///path`` that does not exist (None when the URL is fine)."""
    if not database or not database.lower().startswith("duckdb:"):
        return None
    path = _database_path(database)
    if path == ":memory:" or Path(path).exists():
        return None
    return path


def refuse_missing_database(database: str | None) -> bool:
    """Print why and return True when ``database`` names a DuckDB file that does not exist."""
    path = missing_database_file(database)
    if path is None:
        return False
    print(f'ERROR:  database file "{path}" does not exist', file=sys.stderr)
    print(
        "HINT:  dpsql serve never creates an empty database. Check the path, or load data first "
        "(dpsql demo-data --database duckdb:///…); duckdb:// serves an in-memory database.",
        file=sys.stderr,
    )
    return True


def check_at_start(policy_path: str | Path, engine: Engine) -> bool:
    """Run the policy check against the engine's database; print findings; False refuses the start."""
    report = check_file(policy_path, engine.backend)
    for warning in report.warnings:
        print(f"WARNING:  {warning}", file=sys.stderr)
    for error in report.errors:
        print(f"ERROR:  {error}", file=sys.stderr)
    if not report.ok:
        print(
            "HINT:  dpsql serve refuses to start on a policy with errors; `dpsql policy check` shows them all.",
            file=sys.stderr,
        )
        return False
    warn_about_roles(engine)  # a superuser or table-owner role for the ledger or the data: one WARNING line each
    return True


# --- the ledger marker ---------------------------------------------------------------------------


def _marker_path(engine: Engine) -> Path | None:
    backend = engine.backend
    if backend.in_memory:  # DuckDB's in-memory database (the demo)
        return None  # nothing outlives the process
    identity = database_identity(backend)
    digest = hashlib.sha256(f"{identity}\x1f{engine.policy.dataset}".encode()).hexdigest()[:32]
    return dpsql_home() / "markers" / f"{digest}.json"


def _queries(engine: Engine) -> int:
    return int(engine.ledger.spent(engine.policy.dataset).queries)


def note_ledger(engine: Engine, ledger_url: str, *, at_start: bool) -> str | None:
    """Record which ledger serves this database and how many charges it holds; at start, return a
    warning when the ledger is empty but the last one recorded here for this database was not."""
    try:
        path = _marker_path(engine)
        if path is None:
            return None
        queries = _queries(engine)
        warning = None
        if at_start and queries == 0:
            with contextlib.suppress(OSError, ValueError):
                seen = json.loads(path.read_text(encoding="utf-8"))
                if int(seen.get("queries", 0)) > 0:
                    warning = (
                        f"the ledger {redact_url(ledger_url)} holds no charges for dataset "
                        f'"{engine.policy.dataset}", but this database was last served with the ledger '
                        f"{seen.get('ledger')}, which held {int(seen['queries'])} charged queries: budget spent "
                        "there is not counted here. Serve with that --ledger, or ignore this if the budget "
                        "was reset on purpose."
                    )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"dataset": engine.policy.dataset, "ledger": redact_url(ledger_url), "queries": queries}, out)
        tmp.replace(path)
        return warning
    except Exception as exc:  # the marker is advice: it never stops a server
        log.debug("ledger marker not written: %s", exc)
        return None


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pid-file",
        help="where to write the server's pid, alone, for `dpsql reload` or `kill -HUP $(cat FILE)` "
        "(default: $DPSQL_HOME/serve-<port>.pid; '' none)",
    )
