"""PEP 249 driver: dpsql.connect → cursor → noisy rows, accuracy, cost, errors with SQLSTATE."""

from __future__ import annotations

import pytest

import dpsql
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine


@pytest.fixture
def conn(engine: Engine) -> dpsql.dbapi.Connection:
    return dpsql.connect(engine=engine, analyst="alice")


def test_module_globals() -> None:
    assert dpsql.apilevel == "2.0" and dpsql.paramstyle == "pyformat" and dpsql.threadsafety == 1
    assert issubclass(dpsql.ProgrammingError, dpsql.DatabaseError) and issubclass(dpsql.DatabaseError, dpsql.Error)


def test_cursor_round_trip(conn) -> None:
    with conn, conn.cursor() as cur:
        cur.execute("SELECT sex, COUNT(*) AS n, AVG(age) FROM patients WHERE age > %s GROUP BY sex", (40,))
        assert [d[0] for d in cur.description] == ["sex", "n", "avg"]
        assert cur.description[1][1] == dpsql.dbapi.NUMBER and cur.description[0][1] == dpsql.dbapi.STRING
        assert cur.rowcount == 2
        first = cur.fetchone()
        rest = cur.fetchall()
        assert first[0] == "Female" and len(rest) == 1 and cur.fetchone() is None
        assert cur.accuracy[0][0] is None and cur.accuracy[0][1] > 0
        assert cur.epsilon_spent == 1.0 and cur.remaining_epsilon == 9.0
        assert any("charged" in n for n in cur.notices)


def test_named_parameters_and_fetchmany(conn) -> None:
    cur = conn.cursor()
    cur.execute("SELECT problem, COUNT(*) FROM patients WHERE sex = %(sex)s GROUP BY problem", {"sex": "Male"})
    assert len(cur.fetchmany(3)) == 3 and len(cur.fetchmany(10)) == 4
    assert [row[0] for row in cur.execute("SELECT sex, COUNT(*) FROM patients GROUP BY sex")] == [
        "Female",
        "Male",
    ]


def test_errors_carry_sqlstate(conn) -> None:
    cur = conn.cursor()
    with pytest.raises(dpsql.ProgrammingError) as info:
        cur.execute("SELECT name FROM patients")
    assert info.value.sqlstate == "42501" and info.value.pgcode == "42501"
    with pytest.raises(dpsql.NotSupportedError):
        cur.execute("SELECT COUNT(*) OVER () FROM patients")
    with pytest.raises(dpsql.ProgrammingError):
        cur.fetchall()


def test_closed_objects_raise_interface_error(conn) -> None:
    cur = conn.cursor()
    cur.close()
    with pytest.raises(dpsql.InterfaceError):
        cur.execute("SELECT COUNT(*) FROM patients")
    conn.close()
    with pytest.raises(dpsql.InterfaceError):
        conn.cursor()


def test_connect_from_policy_file_and_duckdb_file(tmp_path) -> None:
    from dpsql.backends import open_backend

    url = f"duckdb:///{tmp_path / 'demo.duckdb'}"
    backend = open_backend(url)
    load_demo(backend, ["health"])
    backend.close()
    with dpsql.connect(
        policy=demo_policy_path("health"),
        database=url,
        analyst="bob",
        ledger=f"sqlite:///{tmp_path / 'l.sqlite'}",
        epsilon=0.5,
    ) as conn:
        cur = conn.cursor()
        cur.execute("SELECT COUNT(*) FROM patients")
        row = cur.fetchone()
        assert row is not None and 9900 < row[0] < 10100 and cur.epsilon_spent == 0.5


def test_connections_without_ledger_share_the_persistent_budget(tmp_path, monkeypatch) -> None:
    """Defect 6: each connect() used to get a fresh in-memory budget (bob: 50 answers over 10 connections)."""
    from dpsql.backends import open_backend

    monkeypatch.setenv("DPSQL_HOME", str(tmp_path / "home"))
    url = f"duckdb:///{tmp_path / 'demo.duckdb'}"
    backend = open_backend(url)
    load_demo(backend, ["health"])
    backend.close()
    answers, refusals = 0, []
    for i in range(10):
        with dpsql.connect(policy=demo_policy_path("health"), database=url, analyst="bob", epsilon=1.0) as conn:
            cur = conn.cursor()
            for j in range(5):
                try:
                    cur.execute(f"SELECT COUNT(*) FROM patients WHERE age > {10 * i + j}")  # distinct: no cache hits
                    answers += 1
                except dpsql.OperationalError as exc:
                    refusals.append(exc.sqlstate)
    assert answers == 5 and refusals == ["53P01"] * 45  # bob's budget is ε=5
    assert (tmp_path / "home" / "ledger-health.sqlite").exists()


def test_memory_ledger_only_when_asked_for(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DPSQL_HOME", str(tmp_path / "home"))
    for ledger in ("memory", "sqlite:///:memory:"):
        with dpsql.connect(policy=demo_policy_path("health"), database="duckdb://", ledger=ledger) as conn:
            assert conn.engine.ledger.spent("health").epsilon == 0
    assert not (tmp_path / "home").exists()
