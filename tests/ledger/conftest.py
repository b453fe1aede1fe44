"""Ledgers of every kind for the ledger tests, and the ``dpsql`` command run as a curator would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsql.ledger import Ledger, PostgresLedger

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path / 'ledger.sqlite'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_url(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    return sqlite_url if request.param == "sqlite" else str(request.getfixturevalue("pg_new_database")())


@pytest.fixture
def sqlite_ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A ledger in a fresh SQLite file."""
    with Ledger.open(f"sqlite://{tmp_path / 'ledger.sqlite'}") as opened:
        yield opened


@pytest.fixture
def postgres_ledger(pg_dsn: str) -> Iterator[Ledger]:
    """A ledger in the test PostgreSQL server's default database."""
    with PostgresLedger(pg_dsn) as opened:
        yield opened


@pytest.fixture
def any_ledger(any_url: str) -> Iterator[Ledger]:
    with Ledger.open(any_url) as opened:
        yield opened


def _policy(args: tuple[str, ...]) -> list[str]:
    """Curator commands need --policy (they never fall back to the demo): the demo's, unless given."""
    return [] if "--policy" in args else ["--policy", str(ROOT / "schemas" / "health.yaml")]


def dpsql_cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``python -m dpsql.cli ARGS`` from the checkout with ``DPSQL_HOME=home`` (and the demo policy)."""
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, *_policy(args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
