"""The result cache: an exact repeat costs nothing and returns the same answer, across restarts."""

from __future__ import annotations

from pathlib import Path

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.session import Session


def _engine(policy: Policy, backend: Backend, directory: Path) -> Engine:
    url = f"sqlite:///{directory / 'ledger.sqlite'}"
    return Engine(policy, backend, Ledger.open(url), ResultCache.open(url))


def test_repeat_costs_once_and_survives_restart(health_policy: Policy, health_duckdb: Backend, tmp_path: Path) -> None:
    sql = "SELECT sex, COUNT(*), AVG(age) FROM patients WHERE problem = 'Obesity' GROUP BY sex"
    engine = _engine(health_policy, health_duckdb, tmp_path)
    first = engine.execute(sql, Session("alice"))
    again = engine.execute("select SEX, count(*), avg(AGE)\n from PATIENTS where problem='Obesity' group by sex",
                           Session("bob"))  # fmt: skip
    assert again.rows == first.rows and again.epsilon_spent == 0 and "result cache" in again.notices[0]
    engine.ledger.close()
    engine.cache.close()
    restarted = _engine(health_policy, health_duckdb, tmp_path)
    assert restarted.execute(sql, Session("alice")).rows == first.rows
    assert restarted.ledger.spent("health").epsilon == 1.0


def test_rephrasing_and_other_settings_are_charged(
    health_policy: Policy, health_duckdb: Backend, tmp_path: Path
) -> None:
    engine = _engine(health_policy, health_duckdb, tmp_path)
    engine.execute("SELECT COUNT(*) FROM patients WHERE age > 30", Session("alice"))
    engine.execute("SELECT COUNT(*) FROM patients WHERE age >= 31", Session("alice"))  # same set, other text
    engine.execute("SELECT COUNT(*) FROM patients WHERE age > 30", Session("alice", epsilon=0.5))
    engine.execute("SELECT COUNT(*) FROM patients WHERE age > %s", Session("alice"), (40,))
    engine.execute("SELECT COUNT(*) FROM patients WHERE age > %s", Session("alice"), (40,))  # cached
    assert engine.ledger.spent("health", "alice").epsilon == 3.5
