"""Statements over public tables only are exact and free on every front door (#36 item 6); a statement
mixing public and private tables is the DP query it always was. And an answer that partition selection
left empty says why and what would release groups (#36 item 7)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

import dpsql
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.outer.sandbox import _TO_DUCKDB, Sandbox, _bulk_insert, _columns, _flat
from dpsql.policy import load_policy
from dpsql.server import ThreadedServer
from dpsql.session import Session
from tests.policies import without_domain

FREE = "dpsql: reads public tables only (departments): answered exactly, without noise; no budget charged"


@pytest.fixture(scope="module")
def clinic() -> Iterator[Engine]:
    engine = Engine(
        load_policy(demo_policy_path("clinic")), dpsql.backends.open_backend("duckdb://"), Ledger.open("memory")
    )
    load_demo(engine.backend, ["clinic"])
    yield engine
    engine.close()


def _truth(engine: Engine, sql: str) -> list[tuple[object, ...]]:
    return engine.backend.execute(sql)[1]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT COUNT(*) FROM departments WHERE floor = 3",
        "SELECT building, COUNT(*), SUM(floor) FROM departments GROUP BY building ORDER BY building",
        "SELECT name, floor FROM departments WHERE floor > (SELECT AVG(floor) FROM departments) ORDER BY name",
        "SELECT d.name FROM departments d JOIN departments e ON d.building = e.building AND d.name < e.name ORDER BY 1",
        "WITH f AS (SELECT floor FROM departments WHERE building = 'North') SELECT MAX(floor) - MIN(floor) FROM f",
    ],
)
def test_exact_and_free_through_the_engine(clinic: Engine, sql: str) -> None:
    session = Session("alice")
    before = len(clinic.ledger.charges("clinic", "alice"))
    result = clinic.execute(sql, session)
    assert [tuple(r) for r in result.rows] == _truth(clinic, sql)
    assert result.epsilon_spent == 0 and result.delta_spent == 0
    assert FREE in result.notices
    assert all(c.noisy is False for c in result.columns)
    assert len(clinic.ledger.charges("clinic", "alice")) == before


def test_private_tables_keep_the_dp_path(clinic: Engine) -> None:
    session = Session("alice")
    mixed = clinic.execute("SELECT COUNT(*) FROM visits JOIN departments ON department = name", session)
    assert mixed.epsilon_spent == 1 and FREE not in mixed.notices  # the DP query it always was
    with pytest.raises(dpsql.Error) as info:  # a sub-query over a private table: not public-only
        clinic.execute("SELECT COUNT(*) FROM departments WHERE floor IN (SELECT age FROM patients)", session)
    assert info.value.sqlstate != "00000"


def test_explain_says_exact_and_free(clinic: Engine) -> None:
    result = clinic.execute("EXPLAIN SELECT COUNT(*) FROM departments WHERE floor = 3", Session("alice"))
    text = "\n".join(str(r[0]) for r in result.rows)
    assert text.startswith("Public tables only: departments  (epsilon=0 delta=0; exact, no noise, no budget charged)")
    assert result.epsilon_spent == 0


def test_db_api_and_wire(clinic: Engine) -> None:
    sql = "SELECT building, COUNT(*) FROM departments GROUP BY building ORDER BY building"
    truth = _truth(clinic, sql)
    with dpsql.connect(engine=clinic, analyst="alice") as conn:
        cursor = conn.cursor()
        cursor.execute(sql)
        assert cursor.fetchall() == truth
        assert FREE in cursor.notices
    server = ThreadedServer(clinic, statement_timeout=None)
    try:
        dsn = f"host={server.host} port={server.port} user=alice dbname=clinic"
        with psycopg.connect(dsn, autocommit=True) as wire:
            notices: list[str] = []
            wire.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            assert wire.execute(sql).fetchall() == truth
            assert wire.execute("SELECT COUNT(*) FROM departments WHERE floor = %s", (3,), prepare=True).fetchall() == [
                (1,)
            ]
        assert FREE in notices
    finally:
        server.stop()


def test_empty_selection_says_why(clinic: Engine) -> None:
    engine = Engine(without_domain(clinic.policy, "visits", "department"), clinic.backend, Ledger.open("memory"))
    session = Session("alice")
    empty = engine.execute("SELECT department, COUNT(*) FROM visits WHERE cost > 5000 GROUP BY department", session)
    assert empty.rows == []
    (note,) = [n for n in empty.notices if "no group was released" in n]
    prepared = engine.prepare("SELECT department, COUNT(*) FROM visits WHERE cost > 5000 GROUP BY department", session)
    assert f"reaches τ={prepared.budgeting.threshold} at ε=1" in note
    assert "declare a domain for visits.department in the policy" in note and "group by a coarser key" in note
    assert "at ε=10)" in note
    full = engine.execute("SELECT department, COUNT(*) FROM visits GROUP BY department", session)
    assert full.rows and not any("no group was released" in n for n in full.notices)


def test_a_write_is_never_answered_stale() -> None:
    """Public tables are read once per data version: a write moves the stamp, so the next answer reads again."""
    backend = dpsql.backends.open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("memory"))
    sql = "SELECT COUNT(*) FROM departments WHERE building = 'East'"
    before = engine.execute(sql, Session("alice")).rows[0][0]
    backend.execute_script("INSERT INTO departments VALUES ('Radiology', 9, 'East')")
    assert engine.execute(sql, Session("alice")).rows[0][0] == before + 1
    engine.close()


def test_a_double_column_of_floats_and_whole_numbers_loads_in_bulk_and_exactly() -> None:
    """A backend hands ``12.0`` back as ``12``: such a column still loads in one bulk insert (TPC-H's
    partsupp, 80,000 rows: row by row it took past the statement timeout), each value exact."""
    mixed = [(1, 2.5), (2, 12), (3, None), (4, -(2**53))]
    assert _columns(mixed, 2) == [[[1, 2, 3, 4]], [[2.5, None, None, None], [None, 12, None, -(2**53)]]]
    with Sandbox(None) as box:
        box.load("t", [("k", "integer"), ("x", "double precision")], mixed)
        assert box.run("SELECT k, x FROM t ORDER BY k") == [(1, 2.5), (2, 12.0), (3, None), (4, float(-(2**53)))]


MIXED_COLUMNS = [
    ("double precision", [2.5, 12, 2**53 + 1, None, True]),
    ("text", [2.5, 2**53 + 1, "x", None, Decimal("0.10")]),
    ("numeric", [Decimal("1.25"), 3, 0.1, None, 2**60]),
    ("bigint", [2**53 + 1, 7.0, True, None, Decimal("12")]),
    (
        "timestamp with time zone",
        [dt.datetime(2026, 1, 1, 12), dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC), None, dt.datetime(2025, 6, 1)],
    ),
]


@pytest.mark.parametrize(("kind", "values"), MIXED_COLUMNS, ids=[k for k, _ in MIXED_COLUMNS])
def test_a_column_of_mixed_python_types_loads_in_bulk_as_row_by_row_would(kind: str, values: list[Any]) -> None:
    """Every mix of Python types loads column-wise (one list per kind, :func:`_columns`), each value cast
    from its own type exactly as a row-by-row insert casts it (an integer beyond 2^53 in a text column is
    not first made a double)."""
    rows = [(i, v) for i, v in enumerate(values)]
    parts = _columns(rows, 2)
    assert parts is not None and len(parts[1]) > 1
    columns: list[tuple[str, Any]] = [("k", "integer"), ("x", kind)]
    with Sandbox(None) as box:
        box.load("bulk", columns, rows)
        for table in ("direct", "one"):
            box.load(table, columns, [])
        # the bulk statement itself takes every kind (no silent fall back to rows)
        box.con.execute(_bulk_insert('"direct"', ["INTEGER", _TO_DUCKDB[kind]], [len(p) for p in parts]), _flat(parts))
        box.con.executemany('INSERT INTO "one" VALUES (?, ?)', [list(r) for r in rows])
        one = box.run("SELECT k, x FROM one ORDER BY k")
        assert box.run("SELECT k, x FROM bulk ORDER BY k") == one == box.run("SELECT k, x FROM direct ORDER BY k")
