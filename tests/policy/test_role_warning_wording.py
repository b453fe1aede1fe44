"""The superuser warning of ``dpsql serve`` for its data connection names what the ledger it really has
rests on: a SQLite ledger's file permissions (no triggers to disable), a PostgreSQL ledger's triggers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dpsql.backends import open_backend
from dpsql.dev.demo import demo_policy_path
from dpsql.ledger import Ledger, serve_role_warnings
from dpsql.policy import load_policy

pytestmark = pytest.mark.postgres

POLICY = load_policy(demo_policy_path("health"))


class _Engine:
    """What :func:`serve_role_warnings` reads of an engine."""

    def __init__(self, ledger: Ledger, backend: object) -> None:
        self.ledger, self.backend, self.policy = ledger, backend, POLICY


def _data_warning(ledger_url: str, data_url: str) -> list[str]:
    backend = open_backend(data_url)  # the test cluster's superuser
    try:
        with Ledger.open(ledger_url) as ledger:
            return serve_role_warnings(_Engine(ledger, backend))
    finally:
        backend.close()


def test_sqlite_ledger_wording(tmp_path: Path, pg_new_database: Callable[[], str]) -> None:
    (warning,) = _data_warning(f"sqlite:///{tmp_path / 'ledger.sqlite'}", pg_new_database())
    assert warning.startswith('the data database connects as role "')
    assert "a superuser: it can change any of the served rows and read and write files as the database " in warning
    assert "SQLite ledger on the same host is safe only while its file's permissions keep that user out" in warning
    assert "trigger" not in warning
    assert warning.endswith(
        'dpsql_data_reader (SELECT on the served tables only) (README "Least-privilege database roles")'
    )


def test_postgres_ledger_wording(pg_new_database: Callable[[], str]) -> None:
    ledger, data = _data_warning(pg_new_database(), pg_new_database())
    assert ledger.startswith('the privacy ledger connects as role "') and "disable the ledger's triggers" in ledger
    assert data.startswith('the data database connects as role "')
    assert "change any of the served rows and disable the ledger's triggers and rewrite any charge, total or " in data
    assert "when the ledger is on the same server" in data and "SQLite" not in data
