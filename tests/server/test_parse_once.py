"""One parse per wire statement (issue #39, "route once"): the server routes on the statement the engine
parses and classifies (its cache, by text), and the engine, the log line's fingerprint, the audit row and
a table-free answer read that same tree.

Parses are counted by wrapping sqlglot's one entry to its parser (``Dialect.parse``, which
``sqlglot.parse`` and ``sqlglot.parse_one`` both call) with a counter that delegates to the real parser;
each statement carries a constant of its own, so only its own parses are counted (and no cache of an
earlier test already holds it).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlglot.dialects.dialect import Dialect

from dpsql.session import Session

from .conftest import Running

_NEXT = itertools.count(secrets.randbelow(10**6) * 1000 + 10**9)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every text sqlglot parses while the test runs (the server's threads included)."""
    seen: list[str] = []
    real = Dialect.parse

    def counting(self: Dialect, sql: str, **opts: Any) -> Any:
        seen.append(sql)
        return real(self, sql, **opts)

    monkeypatch.setattr(Dialect, "parse", counting)
    yield seen


def _run(server: Running, sql: str, prepare: bool, params: tuple[Any, ...] | None = None) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(sql, params, prepare=prepare).fetchall()


STATEMENTS = [
    "SELECT COUNT(*) FROM patients WHERE age > {n}",
    "/* app */ SELECT problem, COUNT(*) FROM patients WHERE age < {n} GROUP BY problem",
    "SELECT AVG(age) AS a FROM patients WHERE age <> {n}",
    "SELECT {n} AS one",  # table-free: answered by the server on the routed tree
    "SELECT relname FROM pg_catalog.pg_class WHERE relpages > {n}",  # the shadow catalog's
]


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
@pytest.mark.parametrize("template", STATEMENTS)
def test_a_wire_statement_is_parsed_once(dp_server: Running, parses: list[str], template: str, prepare: bool) -> None:
    sql = template.format(n=next(_NEXT))
    _run(dp_server, sql, prepare)
    assert parses.count(sql) == 1, parses


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
def test_a_parameterised_statement_is_parsed_once(dp_server: Running, parses: list[str], prepare: bool) -> None:
    marker = next(_NEXT)
    sql = f"SELECT COUNT(*) FROM patients WHERE age > %s AND age <> {marker}"
    _run(dp_server, sql, prepare, (30,))
    assert [p for p in parses if str(marker) in p] == [sql.replace("%s", "$1")]


def test_explain_parses_only_the_query_it_explains(dp_server: Running, parses: list[str]) -> None:
    query = f"SELECT COUNT(*) FROM patients WHERE age > {next(_NEXT)}"
    _run(dp_server, f"EXPLAIN {query}", False)
    assert [p for p in parses if query in p] == [query]


def test_a_repeated_statement_is_not_parsed_again(dp_server: Running, parses: list[str]) -> None:
    sql = f"SELECT COUNT(*) FROM patients WHERE age > {next(_NEXT)}"
    for prepare in (False, True, False):
        _run(dp_server, sql, prepare)
    assert parses.count(sql) == 1


def test_the_engine_entry_parses_once(dp_server: Running, parses: list[str]) -> None:
    """DB-API and the CLI call :meth:`Engine.execute` directly: its fingerprint and audit row read the tree too."""
    sql = f"SELECT COUNT(*) FROM patients WHERE age > {next(_NEXT)}"
    dp_server.engine.execute(sql, Session("analyst"))
    assert parses.count(sql) == 1
