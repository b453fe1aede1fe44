"""Statements are routed on their parsed form: a leading comment (ORMs, sqlcommenter) changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.policy import load_policy

from .conftest import Running, serving

ROW = "(region, age, smoker, drug_use) VALUES ('West', 50, true, 'current')"


@pytest.fixture(scope="module")
def survey_server() -> Iterator[Running]:
    engine = Engine.open(load_policy(demo_policy_path("survey")), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["survey"])
    with serving(engine, catalog_dsn="") as (running, _):
        yield running


PREFIXES = ["", "/* app */ ", "-- app\n", "/* a /* nested */ b */ -- c\n  "]


def _outcome(server: Running, sql: str, prepare: bool) -> str:
    with psycopg.connect(server.dsn("alice"), autocommit=True) as conn:
        try:
            return conn.execute(sql, prepare=prepare).statusmessage or ""
        except psycopg.Error as exc:
            return exc.sqlstate or ""


@pytest.mark.parametrize("prefix", PREFIXES)
def test_commented_insert_is_accepted(survey_server: Running, prefix: str) -> None:
    assert _outcome(survey_server, f"{prefix}INSERT INTO survey {ROW}", False) == "INSERT 0 1"
    assert _outcome(survey_server, f"{prefix}UPDATE survey SET smoker = false", False) == "25006"


@pytest.mark.parametrize("prefix", PREFIXES[1:])
def test_commented_write_is_routed_like_uncommented(survey_server: Running, prefix: str) -> None:
    for sql in (f"INSERT INTO survey {ROW}", "UPDATE survey SET smoker = false", "SELECT COUNT(*) FROM survey"):
        for prepare in (False, True):
            assert _outcome(survey_server, prefix + sql, prepare) == _outcome(survey_server, sql, prepare)


@pytest.mark.parametrize("prefix", ["", "/* app */ ", "-- app\n"])
def test_commented_explain_answers_like_uncommented(dp_server: Running, prefix: str) -> None:
    with psycopg.connect(dp_server.dsn(), autocommit=True) as conn:
        plan = [r[0] for r in conn.execute(f"{prefix}EXPLAIN SELECT COUNT(*) FROM patients")]
        assert plan and "epsilon" in plan[0]
        cur = conn.execute(f"{prefix}EXPLAIN SELECT COUNT(*) FROM patients WHERE age > %s", (3,))
        assert [d.name for d in cur.description or []] == ["QUERY PLAN"]
        assert "epsilon" in cur.fetchall()[0][0]
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute(f"{prefix}EXPLAIN ANALYZE SELECT COUNT(*) FROM patients")


def test_commented_dp_query_gets_interval_columns(dp_server: Running) -> None:
    with psycopg.connect(dp_server.dsn(), autocommit=True) as conn:
        conn.execute("SET dpsql.show_intervals = on")
        for prefix in ("", "/* app */ "):
            cur = conn.execute(f"{prefix}SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex", prepare=True)
            assert [d.name for d in cur.description or []] == ["sex", "n", "n_ci95"]


def test_prepared_insert_is_accepted(survey_server: Running) -> None:
    """An INSERT through Parse/Bind/Execute (psycopg with parameters, ORMs) stores like the simple one."""
    with psycopg.connect(survey_server.dsn("alice"), autocommit=True) as conn:
        cur = conn.execute(
            "INSERT INTO survey (region, age, smoker, drug_use) VALUES (%s, %s, %s, %s)",
            ("West", 50, True, "current"),
            prepare=True,
        )
        assert cur.statusmessage == "INSERT 0 1"
        cur = conn.execute("/* app */ INSERT INTO survey " + ROW, prepare=True)
        assert cur.statusmessage == "INSERT 0 1"
