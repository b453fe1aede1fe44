"""Kept post-processing databases (issue #37 item 2): a statement never sees another's released rows.

Post-processing no longer starts a DuckDB per statement: each admitted statement takes a kept database
(:class:`dpsql.outer.admission.Databases`) and works in a connection of its own whose released rows are
temporary tables, dropped when it closes; public tables are kept between statements. These tests attack
that reuse: the next statement, another analyst's, looks for the previous statement's rows by name, by
schema, through table functions and the catalog, at the same time on another thread, and after a slip
that left a table behind; public copies follow writes to the data. Listed in tests/adversarial/README.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.outer import admission
from dpsql.outer.admission import RESERVED_BYTES, Admission, Table, post_process
from dpsql.outer.sandbox import Database, Sandbox
from dpsql.policy import load_policy
from dpsql.session import Session

SECRET = "alice's released row"
RELEASED = "__dpsql_released_0"
#: What another analyst's statement tries, in a database that just held alice's released rows.
PROBES = [
    f'SELECT * FROM "{RELEASED}"',
    f'SELECT * FROM temp."{RELEASED}"',
    f'SELECT * FROM main."{RELEASED}"',
    f"SELECT * FROM query_table('{RELEASED}')",
    f"SELECT * FROM query('SELECT * FROM \"{RELEASED}\"')",
]


@pytest.fixture
def one_place() -> Iterator[Admission]:
    """Admission with one place, so consecutive statements get the same kept database."""
    admission.DATABASES.clear()
    yield Admission(memory=RESERVED_BYTES, cpu_rate=0.0)
    admission.DATABASES.clear()


def _alice(gate: Admission) -> list[tuple[Any, ...]]:
    tables: list[Table] = [(RELEASED, [("k", "text"), ("n", "bigint")], [(SECRET, 42), ("other", 7)])]
    return post_process("alice", None, tables, f'SELECT k, n FROM "{RELEASED}" ORDER BY n', admission=gate)


def _kept(pool: admission.Databases) -> list[Database]:
    return list(pool._idle)


def test_next_statement_cannot_reach_released_rows(one_place: Admission) -> None:
    assert _alice(one_place) == [("other", 7), (SECRET, 42)]
    (database,) = _kept(admission.DATABASES)
    for probe in PROBES:
        with pytest.raises(Error):
            post_process("bob", None, [], probe, admission=one_place)
        assert _kept(admission.DATABASES) == [database], "the same database answered every probe"
    catalog = post_process(
        "bob",
        None,
        [],
        "SELECT table_name FROM duckdb_tables() UNION ALL SELECT view_name FROM duckdb_views() WHERE NOT internal",
        admission=one_place,
    )
    assert catalog == []
    # the same statement of bob's, with his own released table of the same name, sees his rows only
    mine: list[Table] = [(RELEASED, [("k", "text"), ("n", "bigint")], [("bob's", 1)])]
    assert post_process("bob", None, mine, f'SELECT * FROM "{RELEASED}"', admission=one_place) == [("bob's", 1)]


def test_refused_and_interrupted_statements_leave_nothing(one_place: Admission) -> None:
    """A statement that fails after its rows were loaded (an error of the outer SQL, a deadline) drops
    them all the same."""
    tables: list[Table] = [(RELEASED, [("k", "text"), ("n", "bigint")], [(SECRET, 42)])]
    with pytest.raises(Error):
        post_process("alice", None, tables, f'SELECT CAST(k AS INTEGER) FROM "{RELEASED}"', admission=one_place)
    with pytest.raises(Error) as caught:  # 57014 at the deadline, during a cross join of her rows
        big: list[Table] = [(RELEASED, [("n", "bigint")], [(i,) for i in range(3000)])]
        slow = f'SELECT COUNT(*) FROM "{RELEASED}" a, "{RELEASED}" b, "{RELEASED}" c'
        post_process("alice", time.monotonic() + 0.5, big, slow, admission=one_place)
    assert caught.value.sqlstate == "57014"
    for probe in PROBES[:2]:
        with pytest.raises(Error):
            post_process("bob", None, [], probe, admission=one_place)


def test_a_database_left_holding_a_table_is_not_reused(one_place: Admission, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slip of dpsql's own (a released table created in ``main``, which outlives the connection) is
    caught by the reset check: that database is closed, the next statement gets a fresh one."""
    original = Sandbox.load

    def slip(self: Sandbox, table: str, columns: Any, rows: Any, *, temporary: bool = True) -> None:
        original(self, table, columns, rows, temporary=False)  # the bug: a lasting table

    monkeypatch.setattr(Sandbox, "load", slip)
    _alice(one_place)
    assert _kept(admission.DATABASES) == [], "the database that kept a table was reused"
    monkeypatch.undo()
    for probe in PROBES[:3]:
        with pytest.raises(Error):
            post_process("bob", None, [], probe, admission=one_place)


def test_concurrent_analysts_see_only_their_rows() -> None:
    """Two analysts post-process at once, many times, each over rows of their own under the same table
    name; every answer is computed from the analyst's own rows."""
    admission.DATABASES.clear()
    gate = Admission(memory=2 * RESERVED_BYTES, cpu_rate=0.0)
    wrong: list[str] = []

    def analyst(name: str, value: int) -> None:
        rows = [(value,)] * 50
        for _ in range(40):
            tables: list[Table] = [(RELEASED, [("n", "bigint")], rows)]
            cross = f'"{RELEASED}" a, "{RELEASED}" b, "{RELEASED}" c'
            sql = f"SELECT MIN(a.n), MAX(b.n), COUNT(DISTINCT a.n) * 50 FROM {cross}"
            got = post_process(name, None, tables, sql, admission=gate)
            if got != [(value, value, 50)]:
                wrong.append(f"{name}: {got}")

    threads = [threading.Thread(target=analyst, args=(n, v)) for n, v in (("alice", 1), ("bob", 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not wrong, wrong[:3]
    assert gate.peak == 2, "the two analysts never overlapped"
    admission.DATABASES.clear()


# -- public tables kept between statements ----------------------------------------------------------------

JOINED = (
    "SELECT d.name, d.floor, t.n FROM (SELECT department, COUNT(*) AS n FROM visits GROUP BY department) t "
    "JOIN departments d ON d.name = t.department ORDER BY d.name"
)


@pytest.fixture
def clinic_backend() -> Iterator[Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    yield backend
    backend.close()


def _clinic(backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))


def test_public_copy_follows_writes(clinic_backend: Backend) -> None:
    """A kept public copy is keyed by the data stamp: a write to the public table is seen at once."""
    engine = _clinic(clinic_backend)
    before = {r[0]: r[1] for r in engine.execute(JOINED, Session("alice")).rows}
    assert before["Cardiology"] == 3
    clinic_backend.execute_script("UPDATE departments SET floor = 9 WHERE name = 'Cardiology'")
    after = {r[0]: r[1] for r in engine.execute(JOINED, Session("alice")).rows}
    assert after["Cardiology"] == 9


def test_public_copies_are_not_shared_between_backends(clinic_backend: Backend) -> None:
    """Two in-memory databases pinned to one name (the demo's) hold different public rows: each engine
    sees its own, whichever kept database it is given."""
    other = open_backend("duckdb://")
    try:
        load_demo(other, ["clinic"])
        other.execute_script("UPDATE departments SET floor = 7")
        clinic_backend.pin_identity("demo:clinic")
        other.pin_identity("demo:clinic")
        for _ in range(3):
            mine = {r[1] for r in _clinic(clinic_backend).execute(JOINED, Session("alice")).rows}
            theirs = {r[1] for r in _clinic(other).execute(JOINED, Session("alice")).rows}
            assert mine == {0, 1, 2, 3, 4, 5} and theirs == {7}
    finally:
        other.close()
