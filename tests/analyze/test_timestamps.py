"""Timestamp columns: literals compared with them, EXTRACT over them, and casts in released expressions."""

from __future__ import annotations

import datetime as dt

import pytest

from dpsql.analyze import analyze
from dpsql.backends import open_backend
from dpsql.errors import Error
from dpsql.policy import parse_policy
from dpsql.rewrite import to_sql
from tests.policies import policy_yaml, table_yaml

LOGINS = """
at: {type: timestamp, nullable: false}
hits: {type: int, lower: 0, upper: 10, nullable: false}
"""
POLICY = parse_policy(policy_yaml("ts", table_yaml("logins", LOGINS)))


def test_text_literal_compared_with_a_timestamp_is_a_timestamp() -> None:
    plan = analyze("SELECT COUNT(*) FROM logins WHERE at >= '2024-01-02T08:30:00'", POLICY)
    sql = to_sql(plan, "duckdb")
    assert "CAST('2024-01-02 08:30:00' AS TIMESTAMP)" in sql
    backend = open_backend("duckdb://")
    rows = [(dt.datetime(2024, 1, day, 9), 1) for day in (1, 2, 3)]
    backend.load_rows("logins", [("at", "TIMESTAMP"), ("hits", "INTEGER")], rows)
    assert backend.execute(sql)[1] == [(2,)]
    backend.close()


def test_extract_from_a_timestamp_and_bad_timestamp_literals() -> None:
    analyze("SELECT SUM(EXTRACT(HOUR FROM at)) FROM logins", POLICY)
    with pytest.raises(Error) as info:
        analyze("SELECT COUNT(*) FROM logins WHERE at > 'yesterday-ish'", POLICY)
    assert (info.value.sqlstate, info.value.message) == (
        "42804",
        'invalid input syntax for type timestamp: "yesterday-ish"',
    )
    with pytest.raises(Error) as info:
        analyze("SELECT COUNT(*) + CAST('not a time' AS TIMESTAMP) FROM logins", POLICY)
    assert info.value.message == 'invalid input syntax for type timestamp: "not a time"'
