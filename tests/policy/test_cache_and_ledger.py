"""Result cache keyed on the policy across restarts, ``dpsql cache clear``, and the empty-ledger warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpsql.backends import open_backend
from dpsql.cache import ResultCache
from dpsql.cli import main
from dpsql.curator.serve import note_ledger
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session

HEALTH = demo_policy_path("health").read_text()
SQL = "SELECT SUM(zip) FROM patients"
WIDER = HEALTH.replace("zip: {type: int, lower: 2100, upper: 2199", "zip: {type: int, lower: 0, upper: 9999")


def _database(tmp_path: Path) -> str:
    url = f"duckdb://{tmp_path / 'health.duckdb'}"
    backend = open_backend(url)
    load_demo(backend, ["health"])
    backend.close()
    return url


def _engine(policy_text: str, database: str, ledger: str) -> Engine:
    return Engine(parse_policy(policy_text), open_backend(database), Ledger.open(ledger), ResultCache.open(ledger))


@pytest.mark.parametrize("order", ["narrow-then-wide", "wide-then-narrow"])
def test_changed_policy_never_served_old_answer_across_restarts(tmp_path: Path, order: str) -> None:
    """An answer computed under one policy (here: other bounds) is never served under another, even by a
    new process on the same database, ledger and cache file; under the first policy again it is."""
    database, ledger = _database(tmp_path), f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    first, second = (HEALTH, WIDER) if order == "narrow-then-wide" else (WIDER, HEALTH)
    engine = _engine(first, database, ledger)
    answer = engine.execute(SQL, Session("alice"))
    assert answer.epsilon_spent == 1.0
    engine.close()
    engine = _engine(second, database, ledger)  # "restart" with the edited policy
    other = engine.execute(SQL, Session("alice"))
    assert other.epsilon_spent == 1.0 and other.accuracy != answer.accuracy  # computed afresh, other noise scale
    engine.close()
    engine = _engine(first, database, ledger)
    again = engine.execute(SQL, Session("alice"))
    assert again.epsilon_spent == 0 and again.rows == answer.rows  # the first policy's own answer
    engine.close()


def test_cache_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    database, ledger = _database(tmp_path), f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    engine = _engine(HEALTH, database, ledger)
    engine.execute(SQL, Session("alice"))
    engine.execute("SELECT COUNT(*) FROM patients", Session("alice"))
    engine.close()
    policy = tmp_path / "health.yaml"
    policy.write_text(HEALTH)
    assert main(["cache", "clear", "--policy", str(policy), "--ledger", ledger]) == 0
    # two answers, the two released measurements stored beside them (measurement reuse) and the first's
    # released bias estimate (its SUM clamps a value)
    assert capsys.readouterr().out == f'removed 5 cached results from {ledger} (the ledger of dataset "health")\n'
    engine = _engine(HEALTH, database, ledger)
    assert engine.execute(SQL, Session("alice")).epsilon_spent == 1.0  # charged again, never free
    engine.close()


def test_empty_ledger_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving a database whose last ledger here held charges, with an empty ledger, is warned about."""
    monkeypatch.setenv("DPSQL_HOME", str(tmp_path / "home"))
    database = _database(tmp_path)
    first, second = f"sqlite:///{tmp_path / 'a.sqlite'}", f"sqlite:///{tmp_path / 'b.sqlite'}"
    engine = _engine(HEALTH, database, first)
    assert note_ledger(engine, first, at_start=True) is None  # nothing known yet
    engine.execute("SELECT COUNT(*) FROM patients", Session("alice"))
    assert note_ledger(engine, first, at_start=False) is None
    engine.close()
    engine = _engine(HEALTH, database, second)  # a fresh ledger for the same data
    warning = note_ledger(engine, second, at_start=True)
    assert warning == (
        f'the ledger {second} holds no charges for dataset "health", but this database was last served with '
        f"the ledger {first}, which held 1 charged queries: budget spent there is not counted here. Serve with "
        "that --ledger, or ignore this if the budget was reset on purpose."
    )
    engine.close()
    engine = _engine(HEALTH, database, first)  # back on the right ledger: no warning
    assert note_ledger(engine, first, at_start=True) is None
    engine.close()
    memory = open_backend("duckdb://")
    load_demo(memory, ["health"])
    engine = Engine(parse_policy(HEALTH), memory, Ledger.open("memory"))
    assert note_ledger(engine, "memory", at_start=True) is None  # in-memory data: nothing to compare
    engine.close()
