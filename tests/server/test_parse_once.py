"""One parse per wire statement (issue #39, "route once"): the server routes on the statement the engine
parses and classifies (its cache, by text), and the engine, the log line's fingerprint, the audit row and
a table-free answer read that same tree. So do a read of ``dpsql_budget`` and a statement the parse refuses
(its error is kept with the text); a statement over 4 kB is parsed once in the routing helper process, which
hands the engine its tree.

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

from dpsql.analyze.statement import classify
from dpsql.server import offload
from dpsql.server.offload import Offload
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
    "SELECT epsilon_spent, {n} AS n FROM dpsql_budget",  # the analyst's own budget row
    "/* bi */ SELECT COUNT(*) FROM dpsql_budget WHERE queries > {n} AND analyst IN ('a', 'b', 'a')",
]

#: Statements the parse refuses (42601): their error is kept with the text, so the route, the log line's
#: fingerprint, the engine's refusal and its audit row parse them once in all.
REFUSED = [
    "SELECT COUNT(* FROM patients WHERE age > {n}",
    "/* x */ SELECT COUNT(*) FROM patients WHERE age > {n} AND",
]

#: Over 4 kB: routed (and parsed) in the helper process (one per server process).
_LIST = ", ".join(str(i) for i in range(1000, 2000))
LONG = [
    "SELECT COUNT(*) FROM patients WHERE age > {n} AND age NOT IN (" + _LIST + ")",
    "SELECT COUNT(*) FROM patients WHERE age > {n} AND problem NOT IN ("
    + ", ".join(f"'p{i}'" for i in range(800))
    + ")",
    "SELECT relname FROM pg_catalog.pg_class WHERE relpages > {n} AND relpages NOT IN (" + _LIST + ")",
    "SELECT {n} AS one, 2 NOT IN (" + _LIST + ") AS two",
    "SELECT COUNT(* FROM patients WHERE age > {n} AND age NOT IN (" + _LIST + ")",  # 42601
    "SELECT COUNT(*) FROM patients WHERE age > {n} AND age < CASE "  # 54000: over 1,000 branches
    + " ".join(f"WHEN age = {i} THEN {i}" for i in range(1001))
    + " END",
]


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
@pytest.mark.parametrize("template", STATEMENTS)
def test_a_wire_statement_is_parsed_once(dp_server: Running, parses: list[str], template: str, prepare: bool) -> None:
    sql = template.format(n=next(_NEXT))
    _run(dp_server, sql, prepare)
    assert parses.count(sql) == 1, parses


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
@pytest.mark.parametrize("template", REFUSED)
def test_a_refused_statement_is_parsed_once(
    dp_server: Running, parses: list[str], template: str, prepare: bool
) -> None:
    sql = template.format(n=next(_NEXT))
    for _ in range(2):
        with pytest.raises(psycopg.errors.SyntaxError):
            _run(dp_server, sql, prepare)
    assert parses.count(sql) == 1, parses


@pytest.mark.parametrize("template", LONG)
def test_the_helper_parses_a_long_statement_once(parses: list[str], template: str) -> None:
    """What the routing helper process runs (here in this process, so its parses are counted)."""
    sql = template.format(n=next(_NEXT))
    assert len(sql) > 4096
    status, _ = offload._route_of(sql, frozenset({"patients"}))
    assert status == "ok" and parses.count(sql) == 1, parses


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
@pytest.mark.parametrize("template", LONG)
def test_a_long_statement_is_parsed_once(
    dp_server: Running, parses: list[str], monkeypatch: pytest.MonkeyPatch, template: str, prepare: bool
) -> None:
    """With the helper running, the server's process parses a long statement no more: the engine runs the
    tree the helper parsed (the same tree, IN lists included), and a repeat is routed on it."""
    assert Offload.shared().start(timeout=120)
    sql = template.format(n=next(_NEXT))
    routed: list[str] = []
    real = Offload.route_of

    def counting(self: Offload, analyst: str, text: str, tables: frozenset[str]) -> offload.Routed:
        routed.append(text)
        return real(self, analyst, text, tables)

    monkeypatch.setattr(Offload, "route_of", counting)
    refused = "COUNT(* FROM" in sql or "CASE" in sql
    for _ in range(2):  # the repeat too
        try:
            _run(dp_server, sql, prepare)
        except (psycopg.errors.SyntaxError, psycopg.errors.ProgramLimitExceeded):
            assert refused
    assert parses.count(sql) == 0, parses
    if "patients" in sql and not refused:  # the repeat routed on the engine's copy of the helper's tree
        statement = dp_server.engine.statements.cached(sql)
        assert statement is not None
        here = classify(sql).tree
        dp_server.engine._shrink(here)  # what the engine's cache does to a new query's tree
        assert statement.tree == here and routed.count(sql) == 1


def test_a_packed_tree_is_the_parsed_tree() -> None:
    """The helper's tree as data (long IN lists as text pairs) loads as the tree the parser makes."""
    for template in LONG[:2]:
        sql = template.format(n=7)
        packed = offload._pack(classify(sql).tree)
        tree = offload._unpack(*packed)
        assert tree == classify(sql).tree and tree.sql() == classify(sql).tree.sql()
        assert sum(len(values) for values in packed[1]) >= 800


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
