"""A synopsis over a table whose person is two hops away (issue #35 item 5): transactions → accounts →
customers. Before #35 its charts were all charged again (the hidden join to the unit made every query a
join, which no synopsis answers); now the synopsis answers them free, on DuckDB and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.curator.check import check_text
from dpsql.curator.synopsis_cli import build
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.bank import POLICY, bank_script, generate
from tests.kinds import loaded

SYNOPSIS = """
synopses:
  spending:
    table: transactions
    keys: [category, "DATE_TRUNC('month', ts)"]
    measures: ["COUNT(*)", "SUM(amount)"]
    marginals: [[category], ["DATE_TRUNC('month', ts)"]]
    epsilon: 3.0
"""

CHARTS = [
    "SELECT category, COUNT(*) FROM transactions GROUP BY category",
    "SELECT category, SUM(amount) AS total FROM transactions GROUP BY category ORDER BY total DESC",
    "SELECT DATE_TRUNC('month', ts) AS m, COUNT(*) FROM transactions GROUP BY m",
    "SELECT category, AVG(amount) FROM transactions WHERE category IN ('rent', 'fuel') GROUP BY category",
    "SELECT COUNT(*) FROM transactions",
]


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    with loaded(request.param, request, bank_script(generate(300), keys=request.param == "postgres")) as opened:
        yield opened


def test_charts_over_two_hops_are_answered_from_the_synopsis(backend: Backend) -> None:
    text = POLICY + SYNOPSIS
    assert check_text(text, "bank.yaml", backend).errors == []
    engine = Engine(parse_policy(text, "bank.yaml"), backend, Ledger.open("sqlite:///:memory:"), ResultCache())
    build(engine, "spending")
    assert engine.ledger.spent("bank").epsilon == pytest.approx(3.0)  # once, to the dataset
    for sql in CHARTS:
        result = engine.execute(sql, Session("analyst"))
        assert result.epsilon_spent == 0, (sql, result.notices)
        assert any('answered from synopsis "spending"' in n for n in result.notices), (sql, result.notices)
    assert engine.ledger.spent("bank", "analyst").epsilon == 0
