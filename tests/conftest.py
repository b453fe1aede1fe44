"""Shared pytest configuration; PostgreSQL fixtures live in tests/pg.py."""

import os
import tempfile

pytest_plugins = ["tests.pg"]

# Default ledgers (dpsql.connect / Engine.open / the CLI without a ledger) live under $DPSQL_HOME:
# point it at a throwaway directory so no test ever charges the real ~/.local/share/dpsql.
os.environ["DPSQL_HOME"] = tempfile.mkdtemp(prefix="dpsql-test-home-")
