"""Shared pytest configuration; PostgreSQL fixtures live in tests/pg.py."""

import os
import tempfile

import pytest

pytest_plugins = ["tests.pg"]

# Default ledgers (dpsql.connect / Engine.open / the CLI without a ledger) live under $DPSQL_HOME:
# point it at a throwaway directory so no test ever charges the real ~/.local/share/dpsql.
os.environ["DPSQL_HOME"] = tempfile.mkdtemp(prefix="dpsql-test-home-")

#: The fast tier (``pytest -m unit``, well under 30 s): pure analysis, rewrite golden files, release
#: arithmetic, errors and settings — no database server, no subprocess, no statistical sampling.
UNIT_PATHS = (
    "tests/rewrite/",
    "tests/test_errors.py",
    "tests/test_session.py",
    "tests/engine/test_analyze.py",
    "tests/engine/test_expressions.py",
    "tests/engine/test_rewrite.py",
    "tests/noise/test_mechanisms.py",
    "tests/release/test_accuracy.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow = item.get_closest_marker("postgres") or item.get_closest_marker("heavy") or "heavy" in item.name
        if path.startswith(UNIT_PATHS) and not slow:
            item.add_marker(pytest.mark.unit)
