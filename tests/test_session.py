"""One dpsql.* settings grammar for the wire server, the DB-API and the CLI; noisy flags from the plan."""

from __future__ import annotations

import pytest

import dpsql
from dpsql.dev.demo import demo_policy_path
from dpsql.errors import InvalidParameterValue, UndefinedObject
from dpsql.server.results import noisy_flags
from dpsql.session import OutputColumn, Session, parse_setting


@pytest.mark.parametrize(
    ("name", "value", "parsed"),
    [
        ("dpsql.epsilon", "0.5", 0.5),
        ("DPSQL.Delta", "0", 0.0),
        ("dpsql.mechanism", " Gaussian ", "gaussian"),
        ("dpsql.confidence", "0.9", 0.9),
        ("dpsql.show_intervals", "on", True),
    ],
)
def test_parse_setting(name: str, value: str, parsed: object) -> None:
    assert parse_setting(name, value) == parsed


@pytest.mark.parametrize(
    ("name", "value"),
    [("dpsql.epsilon", "0"), ("dpsql.epsilon", "nan"), ("dpsql.delta", "1"), ("dpsql.mechanism", "exponential")],
)
def test_invalid_settings_are_22023_with_a_hint(name: str, value: str) -> None:
    with pytest.raises(InvalidParameterValue) as info:
        parse_setting(name, value)
    assert info.value.sqlstate == "22023" and info.value.hint and name in info.value.hint


def test_unknown_setting_is_42704() -> None:
    with pytest.raises(UndefinedObject):
        parse_setting("dpsql.epsilom", "1")


def test_configure_mirrors_set() -> None:
    session = Session.configure("alice", epsilon=0.25, mechanism="GAUSSIAN")
    assert (session.epsilon, session.mechanism, session.delta) == (0.25, "gaussian", None)
    assert session.settings == {"dpsql.epsilon": "0.25", "dpsql.mechanism": "GAUSSIAN"}


def test_dbapi_refuses_what_set_refuses() -> None:
    with pytest.raises(dpsql.DataError) as info:
        dpsql.connect(demo_policy_path("health"), ledger="memory", epsilon=0.0)
    assert info.value.sqlstate == "22023"


def test_noisy_flags_come_from_the_plan() -> None:
    columns = [OutputColumn("sex", "text", noisy=False), OutputColumn("n", "bigint", noisy=True)]
    assert noisy_flags(columns) == [False, True]  # from the plan, never a re-parse of the SQL
    engine = dpsql.Engine.open(demo_policy_path("health"), "duckdb://", "memory")
    try:
        described = engine.describe("SELECT sex, COUNT(*) AS n, AVG(age) FROM patients GROUP BY sex", Session("alice"))
        assert noisy_flags(described.columns) == [False, True, True]
    finally:
        engine.close()
    assert OutputColumn("n", "bigint", noisy=True) == OutputColumn("n", "bigint")
