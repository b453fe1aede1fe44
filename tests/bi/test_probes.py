"""Schema probes of BI tools: LIMIT 0 and a false WHERE return the columns and no rows, charging nothing.

Whether a probe returns rows is decided from the SQL alone, so answering it for free reveals nothing.
"""

from __future__ import annotations

import psycopg
import pytest

from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.session import Session

PROBES = [
    ("SELECT problem, COUNT(*) FROM patients GROUP BY problem LIMIT 0", [("problem", "text"), ("count", "bigint")]),
    ("SELECT COUNT(*) FROM patients WHERE 1 = 0", [("count", "bigint")]),
    ("SELECT sex, AVG(age) AS a FROM patients WHERE false GROUP BY sex", [("sex", "text"), ("a", "double precision")]),
    (
        "SELECT * FROM (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) AS t LIMIT 0",
        [("sex", "text"), ("n", "bigint")],
    ),
]


@pytest.mark.parametrize(("sql", "expected"), PROBES, ids=[p[0][:50] for p in PROBES])
def test_probe_returns_columns_and_charges_nothing(health: Engine, sql: str, expected: list[tuple[str, str]]) -> None:
    result = health.execute(sql, Session("alice"))
    assert [(c.name, c.type) for c in result.columns] == expected
    assert result.rows == [] and result.epsilon_spent == 0
    assert health.ledger.charges("health", "alice") == []
    assert [(c.name, c.type) for c in health.describe(sql, Session("alice")).columns] == expected


@pytest.mark.parametrize(
    ("sql", "state", "message"),
    [
        ("SELECT name, COUNT(*) FROM patients GROUP BY name LIMIT 0", "42501", 'permission denied for column "name"'),
        ("SELECT COUNT(*) FROM patients WHERE 1 = 0 AND age > 'x'", "0A000", None),
        ("SELECT * FROM patients LIMIT 0", "42803", "SELECT * would release individual rows"),
        ("SELECT * FROM no_such_table", "42P01", 'relation "no_such_table" does not exist'),
        ("SELECT * FROM no_such_table LIMIT 0", "42P01", 'relation "no_such_table" does not exist'),
    ],
)
def test_unanswerable_probe_is_refused_as_the_query(health: Engine, sql: str, state: str, message: str | None) -> None:
    with pytest.raises(Error) as info:
        health.execute(sql, Session("alice"))
    assert info.value.sqlstate == state
    if message is not None:
        assert str(info.value).split("\n")[0] == message
    assert health.ledger.charges("health", "alice") == []


def test_probe_through_the_wire(clinic_server: tuple[str, object]) -> None:
    dsn, _ = clinic_server
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("SELECT department, COUNT(*) AS n FROM visits WHERE 1 = 0 GROUP BY department")
        assert [(d.name, d.type_code) for d in cur.description] == [("department", 25), ("n", 20)]
        assert cur.fetchall() == []


def test_unknown_table_through_the_wire(clinic_server: tuple[str, object]) -> None:
    dsn, _ = clinic_server
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(psycopg.errors.UndefinedTable) as info:
        conn.execute("SELECT * FROM no_such_table")
    assert info.value.diag.message_primary == 'relation "no_such_table" does not exist'


def test_explain_format_json(health: Engine) -> None:
    import json

    result = health.execute("EXPLAIN (FORMAT JSON) SELECT sex, AVG(age) FROM patients GROUP BY sex", Session("alice"))
    assert [(c.name, c.type) for c in result.columns] == [("QUERY PLAN", "text")]
    (plan,) = json.loads(result.rows[0][0])
    assert plan["Plan"]["Node Type"] == "DP Aggregate"
    assert [o["name"] for o in plan["Plan"]["Outputs"]] == ["sex", "avg"]
    assert result.epsilon_spent == 0 and health.ledger.charges("health", "alice") == []
    with pytest.raises(Error) as info:
        health.execute("EXPLAIN (ANALYZE, FORMAT JSON) SELECT COUNT(*) FROM patients", Session("alice"))
    assert info.value.sqlstate == "0A000" and str(info.value).startswith("EXPLAIN options are not supported")


def test_explain_format_json_through_the_wire(clinic_server: tuple[str, object]) -> None:
    import json

    dsn, _ = clinic_server
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("EXPLAIN (FORMAT JSON) SELECT department, COUNT(*) FROM visits GROUP BY department")
        assert [d.name for d in cur.description] == ["QUERY PLAN"]
        rows = cur.fetchall()
        assert len(rows) == 1 and json.loads(rows[0][0])[0]["Plan"]["Node Type"] == "DP Aggregate"
