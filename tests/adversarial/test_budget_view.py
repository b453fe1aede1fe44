"""The analyst's own budget view, ``SELECT … FROM dpsql_budget``: answered by plain Python, never by code
built from the statement (issue #26, item 1).

sqlglot's executor, which used to answer it, turns the tree into Python source and evals it, pasting an
EXTRACT unit or a JSON path key in unescaped: a statement over the budget view ran code in the server
(raw rows, ε = 0, even for a frozen analyst). The payloads below wrote their marker files on that
version; now each is refused with 0A000 before anything is evaluated, runs nothing and charges nothing — through
the engine, the DB-API and the wire. The shapes BI tools send still answer the analyst's own row.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import dpsql
from dpsql.budget_view import BUDGET_COLUMNS
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import (
    Error,
    FeatureNotSupported,
    GroupingError,
    InsufficientPrivilege,
    InvalidColumnReference,
    InvalidTextRepresentation,
    UndefinedColumn,
    UndefinedFunction,
    UndefinedTable,
)
from dpsql.server import ThreadedServer
from dpsql.session import Session

SELECT_LIST = "this expression in the select list is not supported over dpsql_budget"
IN_WHERE = "this expression in WHERE is not supported over dpsql_budget"
IN_ORDER = "ORDER BY an expression is not supported over dpsql_budget"
HINT_START = "Over dpsql_budget: SELECT *, columns, constants, COUNT, or SUM/AVG/MIN/MAX of a column [AS name] FROM"


def _code(marker: Path) -> str:
    """Python that creates ``marker``, in lower case only (the executor lower-cased EXTRACT units)."""
    return f"open(bytes.fromhex('{str(marker).encode().hex()}').decode(), 'w').write('pwned')"


def _quoted(code: str) -> str:
    """``code`` inside a SQL string constant."""
    return code.replace("'", "''")


#: case id -> (statement around the payload's Python code, the refusal's message). Each one but
#: json-path-identifier (a quoted identifier as the key) wrote its marker on the executor version.
PAYLOADS: dict[str, tuple[Callable[[str], str], str]] = {
    "extract-unit": (
        lambda c: f'SELECT EXTRACT("x\', 0) if 0 else {c} #" FROM epsilon_spent) FROM dpsql_budget',
        SELECT_LIST,
    ),
    "extract-unit-aliased": (
        lambda c: (
            f'SELECT EXTRACT("x\', 0) if 0 else {c} #" FROM epsilon_spent) AS e, analyst '
            "FROM public.dpsql_budget AS b WHERE frozen = false"
        ),
        SELECT_LIST,
    ),
    "extract-unit-where": (
        lambda c: (
            f'SELECT analyst FROM dpsql_budget WHERE EXTRACT("x\', 0) if {c} else 0, 0) #" FROM epsilon_spent) > 0'
        ),
        IN_WHERE,
    ),
    "extract-unit-nested": (
        lambda c: f'SELECT UPPER(EXTRACT("x\', 0) if 0 else {c}) #" FROM epsilon_spent)) FROM dpsql_budget',
        SELECT_LIST,
    ),
    "extract-unit-of-extract": (
        lambda c: f'SELECT EXTRACT("x\', 0) if 0 else {c} #" FROM EXTRACT("y" FROM epsilon_spent)) FROM dpsql_budget',
        SELECT_LIST,
    ),
    "extract-unit-order-by": (
        lambda c: (
            f'SELECT analyst FROM dpsql_budget ORDER BY EXTRACT("x\', 0) if 0 else {c}, False, False) #" '
            "FROM epsilon_spent)"
        ),
        IN_ORDER,
    ),
    "json-path-key": (lambda c: f"SELECT analyst -> 'x'', {_quoted(c)}]) #' FROM dpsql_budget", SELECT_LIST),
    "json-path-key-text": (
        lambda c: f"SELECT analyst ->> 'x'', 0]) if 0 else {_quoted(c)} #' FROM dpsql_budget",
        SELECT_LIST,
    ),
    "json-path-identifier": (lambda c: f'SELECT analyst ->> "x\', {c}]) #" FROM dpsql_budget', SELECT_LIST),
    "json-extract-path": (
        lambda c: f"SELECT JSON_EXTRACT_PATH(analyst, 'x'', {_quoted(c)}]) #') FROM dpsql_budget",
        SELECT_LIST,
    ),
    "json-path-where": (
        lambda c: f"SELECT analyst FROM dpsql_budget WHERE analyst ->> 'x'', 0]) if 0 else {_quoted(c)} #' IS NULL",
        IN_WHERE,
    ),
}
#: The statement of issue #26, verbatim: it answered the server's process id.
ISSUE_26 = "SELECT EXTRACT(\"x', 0) if 0 else str(__import__('os').getpid()) #\" FROM epsilon_spent) FROM dpsql_budget"


def _own(engine: Engine, analyst: str) -> dict[str, object]:
    result = engine.execute("SELECT * FROM dpsql_budget", Session(analyst))
    assert len(result.rows) == 1
    return dict(zip((c.name for c in result.columns), result.rows[0], strict=True))


def _assert_refused(exc: BaseException, message: str) -> None:
    assert type(exc) is FeatureNotSupported, repr(exc)
    assert exc.sqlstate == "0A000" and exc.message == message
    assert exc.hint is not None and exc.hint.startswith(HINT_START)
    assert str(os.getpid()) not in str(exc)


def _assert_nothing_charged(engine: Engine, analyst: str = "alice") -> None:
    own = _own(engine, analyst)
    assert own["epsilon_spent"] == 0.0 and own["delta_spent"] == 0.0 and own["queries"] == 0


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_budget_view_code_injection_engine(health: Engine, tmp_path: Path, case: str) -> None:
    """budget-view-codegen: a payload in an EXTRACT unit or JSON path key -> 0A000, no code run, free."""
    statement, message = PAYLOADS[case]
    marker = tmp_path / "pwned"
    with pytest.raises(Error) as refused:
        health.execute(statement(_code(marker)), Session("alice"))
    _assert_refused(refused.value, message)
    assert not marker.exists()
    _assert_nothing_charged(health)


def test_budget_view_issue_26_statement(health: Engine) -> None:
    with pytest.raises(Error) as refused:
        health.execute(ISSUE_26, Session("alice"))
    _assert_refused(refused.value, SELECT_LIST)
    _assert_nothing_charged(health)


@pytest.mark.parametrize("case", ["extract-unit", "json-path-key", "extract-unit-where"])
def test_budget_view_code_injection_dbapi(health: Engine, tmp_path: Path, case: str) -> None:
    statement, message = PAYLOADS[case]
    marker = tmp_path / "pwned"
    with dpsql.connect(engine=health, analyst="alice") as conn:
        cur = conn.cursor()
        with pytest.raises(dpsql.NotSupportedError) as refused:
            cur.execute(statement(_code(marker)))
        _assert_refused(refused.value, message)
        with pytest.raises(dpsql.NotSupportedError) as refused:
            cur.execute(ISSUE_26)
        _assert_refused(refused.value, SELECT_LIST)
        cur.execute("SELECT analyst AS who, epsilon_spent FROM dpsql_budget WHERE NOT frozen")
        assert [d[0] for d in cur.description or ()] == ["who", "epsilon_spent"]
        assert cur.fetchall() == [("alice", 0.0)] and cur.epsilon_spent == 0.0
    assert not marker.exists()
    _assert_nothing_charged(health)


def test_budget_view_frozen_analyst(health: Engine, tmp_path: Path) -> None:
    """budget-view-frozen: a frozen analyst still reads their own row (as before), and a payload is
    refused with 0A000 like anyone's; every other statement stays 42501."""
    health.ledger.freeze(dataset=health.policy.dataset, analyst="alice", by="carol", reason="probing")
    alice = Session("alice")
    assert health.execute("SELECT analyst, frozen FROM dpsql_budget", alice).rows == [("alice", True)]
    marker = tmp_path / "pwned"
    for case in ("extract-unit", "json-path-key"):
        statement, message = PAYLOADS[case]
        with pytest.raises(Error) as refused:
            health.execute(statement(_code(marker)), alice)
        _assert_refused(refused.value, message)
    assert not marker.exists()
    with pytest.raises(InsufficientPrivilege):
        health.execute("SELECT COUNT(*) FROM patients", alice)
    _assert_nothing_charged(health)


# --- the shapes that are answered -----------------------------------------------------------------


def test_budget_view_star_is_the_own_row(health: Engine) -> None:
    health.execute("SELECT COUNT(*) FROM patients", Session("alice", epsilon=1.0))
    health.execute("SELECT COUNT(*) FROM patients", Session("bob", epsilon=0.5))
    result = health.execute("SELECT * FROM dpsql_budget", Session("alice"))
    assert [(c.name, c.type) for c in result.columns] == list(BUDGET_COLUMNS)
    (row,) = result.rows
    own = dict(zip((name for name, _ in BUDGET_COLUMNS), row, strict=True))
    assert own["analyst"] == "alice" and own["epsilon_spent"] == 1.0 and own["queries"] == 1
    assert own["epsilon_total"] == 10.0 and own["epsilon_remaining"] == 9.0 and own["frozen"] is False
    assert result.epsilon_spent == 0.0 and result.delta_spent == 0.0
    assert _own(health, "bob")["epsilon_spent"] == 0.5  # each analyst sees their own figures
    assert _own(health, "alice")["queries"] == 1  # reading the view charged nothing


@pytest.mark.parametrize(
    ("sql", "columns", "rows"),
    [
        (
            "SELECT analyst AS who, b.epsilon_total AS \"Total\", 1, 2.5, -3, 'x', true, NULL "
            "FROM public.dpsql_budget AS b",
            [
                ("who", "text"),
                ("Total", "double precision"),
                ("?column?", "integer"),
                ("?column?", "numeric"),
                ("?column?", "integer"),
                ("?column?", "text"),
                ("bool", "boolean"),
                ("?column?", "text"),
            ],
            [("alice", 10.0, 1, pytest.approx(2.5), -3, "x", True, None)],
        ),
        (  # Metabase / Superset style: quoted, fully qualified, LIMIT
            'SELECT "public"."dpsql_budget"."analyst" AS "analyst", dpsql_budget.queries '
            'FROM "public"."dpsql_budget" ORDER BY analyst ASC LIMIT 2000',
            [("analyst", "text"), ("queries", "bigint")],
            [("alice", 0)],
        ),
        ("SELECT analyst FROM dpsql_budget WHERE frozen", [("analyst", "text")], []),
        ("SELECT analyst FROM dpsql_budget WHERE analyst = 'bob'", [("analyst", "text")], []),
        ("SELECT analyst FROM dpsql_budget WHERE 1 = 0", [("analyst", "text")], []),
        ("SELECT analyst FROM dpsql_budget WHERE analyst = NULL", [("analyst", "text")], []),
        (
            "SELECT analyst FROM dpsql_budget WHERE analyst = 'alice' AND (epsilon_remaining >= 10 OR frozen) "
            "AND NOT frozen AND queries IN (0, 1) AND delta_spent IS NOT NULL AND frozen IS NOT TRUE "
            "AND epsilon_total BETWEEN 1 AND '10' AND queries <> 5",
            [("analyst", "text")],
            [("alice",)],
        ),
        ("SELECT COUNT(*) FROM dpsql_budget WHERE frozen", [("count", "bigint")], [(0,)]),
        (
            "SELECT COUNT(*) AS n, count(analyst), 7 FROM dpsql_budget ORDER BY n DESC, COUNT(*)",
            [("n", "bigint"), ("count", "bigint"), ("?column?", "integer")],
            [(1, 1, 7)],
        ),
        ("SELECT DISTINCT frozen FROM dpsql_budget ORDER BY 1 LIMIT 1", [("frozen", "boolean")], [(False,)]),
        ("SELECT frozen FROM dpsql_budget LIMIT ALL OFFSET 1", [("frozen", "boolean")], []),
        ("SELECT frozen FROM dpsql_budget LIMIT 0", [("frozen", "boolean")], []),
        # what a BI chart over the relation sends (issue #38): aggregates, GROUP BY
        (
            "SELECT SUM(epsilon_remaining) AS rem FROM public.dpsql_budget LIMIT 100",
            [("rem", "double precision")],
            [(10.0,)],
        ),
        (
            "SELECT analyst AS analyst, SUM(epsilon_remaining) AS rem FROM public.dpsql_budget GROUP BY analyst "
            "ORDER BY rem DESC LIMIT 100",
            [("analyst", "text"), ("rem", "double precision")],
            [("alice", 10.0)],
        ),
        (
            "SELECT frozen, MAX(queries), AVG(queries), MIN(analyst) FROM dpsql_budget GROUP BY 1 "
            "ORDER BY SUM(queries)",
            [("frozen", "boolean"), ("max", "bigint"), ("avg", "numeric"), ("min", "text")],
            [(False, 0, 0, "alice")],
        ),
        (
            "SELECT analyst, COUNT(*) FROM dpsql_budget WHERE frozen GROUP BY analyst",
            [("analyst", "text"), ("count", "bigint")],
            [],
        ),
        (
            "SELECT SUM(epsilon_spent), COUNT(*) FROM dpsql_budget WHERE frozen",
            [("sum", "double precision"), ("count", "bigint")],
            [(None, 0)],
        ),
    ],
)
def test_budget_view_supported_shapes(
    health: Engine, sql: str, columns: list[tuple[str, str]], rows: list[tuple[object, ...]]
) -> None:
    result = health.execute(sql, Session("alice"))
    assert [(c.name, c.type) for c in result.columns] == columns
    assert result.rows == rows
    assert result.epsilon_spent == 0.0


@pytest.mark.parametrize(
    ("sql", "error", "message"),
    [
        ("SELECT nope FROM dpsql_budget", UndefinedColumn, 'column "nope" does not exist'),
        ('SELECT "Analyst" FROM dpsql_budget', UndefinedColumn, 'column "Analyst" does not exist'),
        ("SELECT analyst FROM dpsql_budget WHERE nope = 1", UndefinedColumn, 'column "nope" does not exist'),
        ("SELECT x.analyst FROM dpsql_budget", UndefinedTable, 'missing FROM-clause entry for table "x"'),
        (
            "SELECT analyst FROM dpsql_budget GROUP BY ROLLUP (analyst)",
            FeatureNotSupported,
            "GROUP BY an expression is not supported over dpsql_budget",
        ),
        ("SELECT SUM(analyst) FROM dpsql_budget", UndefinedFunction, "function sum(text) does not exist"),
        (
            "SELECT SUM(queries + 1) FROM dpsql_budget",
            FeatureNotSupported,
            "SUM of anything but a column is not supported over dpsql_budget",
        ),
        (
            "SELECT frozen, SUM(queries) FROM dpsql_budget GROUP BY analyst",
            GroupingError,
            'column "dpsql_budget.frozen" must appear in the GROUP BY clause or be used in an aggregate function',
        ),
        ("SELECT upper(analyst) FROM dpsql_budget", FeatureNotSupported, SELECT_LIST),
        ("SELECT analyst FROM dpsql_budget WHERE analyst LIKE 'a%'", FeatureNotSupported, IN_WHERE),
        (
            "SELECT a.analyst FROM dpsql_budget a, dpsql_budget b",
            FeatureNotSupported,
            "JOIN is not supported over dpsql_budget",
        ),
        (
            "SELECT analyst FROM dpsql_budget WHERE analyst IN (SELECT analyst FROM dpsql_budget)",
            FeatureNotSupported,
            "IN (subquery) is not supported over dpsql_budget",
        ),
        (
            "SELECT analyst FROM dpsql_budget LIMIT -1",
            FeatureNotSupported,
            "LIMIT other than a non-negative integer is not supported over dpsql_budget",
        ),
        (
            "SELECT analyst, COUNT(*) FROM dpsql_budget",
            GroupingError,
            'column "dpsql_budget.analyst" must appear in the GROUP BY clause or be used in an aggregate function',
        ),
        (
            "SELECT analyst FROM dpsql_budget ORDER BY 2",
            InvalidColumnReference,
            "ORDER BY position 2 is not in select list",
        ),
        (
            "SELECT analyst FROM dpsql_budget WHERE analyst = 1",
            UndefinedFunction,
            "operator does not exist: text = integer",
        ),
        (
            "SELECT analyst FROM dpsql_budget WHERE queries = 'many'",
            InvalidTextRepresentation,
            'invalid input syntax for type bigint: "many"',
        ),
    ],
)
def test_budget_view_refusals(health: Engine, sql: str, error: type[Error], message: str) -> None:
    with pytest.raises(Error) as refused:
        health.execute(sql, Session("alice"))
    assert type(refused.value) is error and refused.value.message == message
    _assert_nothing_charged(health)


def test_budget_view_deep_predicate_is_too_complex(health: Engine) -> None:
    sql = "SELECT analyst FROM dpsql_budget WHERE " + " AND ".join(["frozen = false"] * 20_000)
    with pytest.raises(Error) as refused:
        health.execute(sql, Session("alice"))
    assert refused.value.sqlstate == "54001"


# --- over the wire -----------------------------------------------------------------------------------


@pytest.fixture
def wire() -> Iterator[tuple[ThreadedServer, Engine]]:
    engine = Engine.open(demo_policy_path("health"), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["health"])
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        yield server, engine
    finally:
        server.stop()
        engine.close()


def test_budget_view_code_injection_wire(wire: tuple[ThreadedServer, Engine], tmp_path: Path) -> None:
    server, engine = wire
    marker = tmp_path / "pwned"
    dsn = f"postgresql://alice@{server.host}:{server.port}/health"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        for case in ("extract-unit", "json-path-key", "extract-unit-where"):
            statement, message = PAYLOADS[case]
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(statement(_code(marker)))
            assert type(refused.value) is psycopg.errors.FeatureNotSupported
            assert refused.value.sqlstate == "0A000" and refused.value.diag.message_primary == message
            assert (refused.value.diag.message_hint or "").startswith(HINT_START)
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute(ISSUE_26)
        cur = conn.execute("SELECT analyst AS who, frozen FROM dpsql_budget WHERE queries = 0")
        assert [d.name for d in cur.description or ()] == ["who", "frozen"]
        assert cur.fetchall() == [("alice", False)]
        # the extended protocol (psycopg prepare=True, JDBC): Describe answers the view's columns too
        prepared = conn.execute("SELECT epsilon_spent, frozen FROM dpsql_budget", prepare=True)
        assert [d.name for d in prepared.description or ()] == ["epsilon_spent", "frozen"]
        assert prepared.fetchall() == [(0.0, False)]
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute(PAYLOADS["extract-unit"][0](_code(marker)), prepare=True)
    assert not marker.exists()
    _assert_nothing_charged(engine)
