"""Answers on a schema whose person is two hops away (issue #35): the bank of tests/bank.py on DuckDB.

A two-hop count is bounded like a one-hop one (the same ± at the same ε and cap), a join along a foreign
key multiplies no cap, the cap can be set per query or chosen under DP (and the answer says which),
and the per-person questions ("customers with more than one account", "loans with a co-signer",
"transactions per customer") are answered within their ±.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.session import Session
from tests.bank import POLICY, Bank, bank_script, generate


@pytest.fixture(scope="module")
def bank_data() -> Bank:
    return generate(2000)


@pytest.fixture(scope="module")
def backend(bank_data: Bank) -> Iterator[Backend]:
    duck = open_backend("duckdb://")
    duck.execute_script(bank_script(bank_data, keys=False))
    yield duck
    duck.close()


@pytest.fixture
def engine(backend: Backend) -> Engine:
    return Engine(parse_policy(POLICY, "bank.yaml"), backend, Ledger.open("memory"))


def _one_hop_policy() -> Policy:
    """The same bank with a customer_id copied onto each transaction: the customer one hop away."""
    text = POLICY.replace(
        "    references: {column: account_id, table: accounts, to: account_id}\n",
        "    references: {column: customer_id, table: customers, to: customer_id}\n",
    ).replace("      account_id: {type: int, identifier: true}\n      ts:",
              "      account_id: {type: int, identifier: true}\n      customer_id: {type: int, identifier: true}\n"
              "      ts:")  # fmt: skip
    return parse_policy(text, "bank1.yaml")


def _width(result: object) -> float:
    acc = result.accuracy[0][-1]  # type: ignore[attr-defined]
    assert acc is not None
    return float(acc)


def test_two_hop_count_is_bounded_like_one_hop(backend: Backend, engine: Engine) -> None:
    backend.execute_script(
        "CREATE TABLE IF NOT EXISTS transactions1 AS SELECT t.*, a.customer_id FROM transactions t "
        "JOIN accounts a ON t.account_id = a.account_id"
    )
    policy = _one_hop_policy()
    one_hop = policy.model_copy(
        update={
            "tables": {
                **policy.tables,
                "transactions": policy.tables["transactions"].model_copy(update={"source": "transactions1"}),
            }
        }
    )
    session = Session("analyst", bias=False)  # the noise-only ± (the bias estimate is random: compared below)
    two = engine.execute("SELECT COUNT(*) FROM transactions", session)
    one = Engine(one_hop, backend, Ledger.open("memory")).execute("SELECT COUNT(*) FROM transactions", session)
    assert _width(two) <= 1.5 * _width(one)  # the bar; the caps are equal, so are the widths
    assert _width(two) == _width(one)
    joined = engine.execute(
        "SELECT COUNT(*) FROM transactions t JOIN accounts a ON t.account_id = a.account_id", session
    )
    assert _width(joined) == _width(two)  # a join by foreign key multiplies no cap (it was 200 × 4)


def test_explain_names_the_person_of_every_table(engine: Engine) -> None:
    for table, chain in [
        ("customers", "customers.customer_id"),
        ("accounts", "customers.customer_id"),
        ("loans", "customers.customer_id"),
        ("transactions", "customers.customer_id (transactions → accounts → customers)"),
        ("disputes", "customers.customer_id (disputes → transactions → accounts → customers)"),
    ]:
        rows = engine.execute(f"EXPLAIN SELECT COUNT(*) FROM {table}", Session("analyst")).rows
        line = next(str(r[0]) for r in rows if "Privacy unit" in str(r[0]))
        assert line.startswith(f"  Privacy unit: {chain} (at most"), line


def test_cap_set_per_query_and_chosen_under_dp(engine: Engine) -> None:
    session = Session.configure("analyst", max_rows_per_unit=8, bias=False)  # (the noise-only ±)
    result = engine.execute("SELECT COUNT(*) FROM transactions", session)
    assert _width(result) == pytest.approx(8 * 2.9957, rel=0.01)  # Laplace(8/ε) at 95 %: 8 · ln 20
    assert any("at most 8 rows per customers.customer_id" in n and "(SET dpsql.max_rows_per_unit)" in n
               for n in result.notices)  # fmt: skip
    auto = Session.configure("analyst", max_rows_per_unit="auto")
    result = engine.execute("SELECT COUNT(*) FROM transactions WHERE amount > 100", auto)
    chosen = [n for n in result.notices if "a cap chosen under DP among 1, 2, 4," in n]
    assert len(chosen) == 1 and "(ε=0.1 of this query's ε=1)" in chosen[0], result.notices
    assert result.epsilon_spent == 1.0
    with pytest.raises(Error) as info:
        engine.execute("SELECT COUNT(*) FROM transactions", Session.configure("analyst", max_rows_per_unit=0))
    assert info.value.sqlstate == "22023"
    both = Session.configure("analyst", max_rows_per_unit="auto", accuracy=100)
    with pytest.raises(Error) as info:
        engine.execute("SELECT COUNT(*) FROM transactions", both)
    assert info.value.sqlstate == "0A000"
    assert info.value.message == "dpsql.max_rows_per_unit = auto cannot be combined with dpsql.accuracy"


def _truth(backend: Backend, sql: str) -> float:
    _, rows = backend.execute(sql)
    return float(rows[0][0])


@pytest.mark.parametrize(
    ("question", "exact"),
    [
        (
            "SELECT COUNT(*) FROM (SELECT customer_id FROM accounts GROUP BY customer_id HAVING COUNT(*) > 1) t",
            "SELECT COUNT(*) FROM (SELECT customer_id FROM accounts GROUP BY customer_id HAVING COUNT(*) > 1) t",
        ),
        (
            "SELECT COUNT(*) FROM loans WHERE co_signer_id IS NOT NULL",
            "SELECT COUNT(*) FROM loans WHERE co_signer_id IS NOT NULL",
        ),
        (
            "SELECT AVG(n) FROM (SELECT a.customer_id, COUNT(*) AS n FROM transactions t "
            "JOIN accounts a ON t.account_id = a.account_id GROUP BY a.customer_id) p",
            "SELECT AVG(LEAST(n, 200)) FROM (SELECT a.customer_id, COUNT(*) AS n FROM transactions t "
            "JOIN accounts a ON t.account_id = a.account_id GROUP BY a.customer_id) p",
        ),
    ],
)
def test_per_person_questions_are_answered_within_their_interval(
    backend: Backend, engine: Engine, question: str, exact: str
) -> None:
    """Each answer's exact value (at the declared caps: what the ± can speak for) is inside its 95 %
    interval in at least 16 of 20 fresh releases (a 95 % interval misses 5 of 20 with probability 0.3 %;
    18 of 20 would fail one run in 13)."""
    truth = _truth(backend, exact)
    inside = 0
    for i in range(20):
        result = engine.execute(question, Session.configure("analyst", epsilon=1 + i / 1000))  # a fresh release
        value, width = float(result.rows[0][0]), _width(result)
        inside += abs(value - truth) <= width
    assert inside >= 16, inside


def test_per_person_refusals(engine: Engine) -> None:
    cases = [
        ("SELECT COUNT(*) FROM (SELECT customer_id, balance FROM accounts GROUP BY customer_id) t", "42803"),
        (
            "SELECT COUNT(*) FROM (SELECT customer_id, COUNT(*) n FROM accounts GROUP BY customer_id "
            "HAVING COUNT(*) * 2 > 1) t",
            "0A000",
        ),
        ("SELECT COUNT(*) FROM loans WHERE co_signer_id = 7", "42501"),
    ]
    for sql, sqlstate in cases:
        with pytest.raises(Error) as info:
            engine.execute(sql, Session("analyst"))
        assert info.value.sqlstate == sqlstate, (sql, info.value.sqlstate, info.value.message)
