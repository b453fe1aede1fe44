"""SQL as people write it (issue #36 items 1, 2, 5): comma joins, subqueries by what they read, a public
table joined twice, predicates in JOIN … ON, computed columns of FROM-subqueries over joins; each answered
like the query written with explicit joins, or refused with its own message. The bank of tests/bank.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Result, Session
from tests.bank import POLICY, bank_script, generate


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    duck = open_backend("duckdb://")
    duck.execute_script(bank_script(generate(400), keys=False))
    yield duck
    duck.close()


@pytest.fixture
def engine(backend: Backend) -> Engine:
    return Engine(parse_policy(POLICY, "bank.yaml"), backend, Ledger.open("memory"))


def _run(engine: Engine, sql: str) -> Result:
    return engine.execute(sql, Session("analyst"))


def _measurement(engine: Engine, sql: str) -> str:
    return engine.prepare(sql, Session("analyst")).sql


@pytest.mark.parametrize(
    ("comma", "explicit"),
    [
        (
            "SELECT category, COUNT(*) FROM transactions, accounts WHERE transactions.account_id = "
            "accounts.account_id AND kind = 'credit' GROUP BY category",
            "SELECT category, COUNT(*) FROM transactions JOIN accounts ON transactions.account_id = "
            "accounts.account_id WHERE kind = 'credit' GROUP BY category",
        ),
        (  # a public table, and an OR whose branches share the join equality (TPC-H Q19's shape)
            "SELECT COUNT(*) FROM accounts a, branches b WHERE (a.branch_id = b.branch_id AND b.city = 'Oslo') "
            "OR (a.branch_id = b.branch_id AND a.kind = 'credit')",
            "SELECT COUNT(*) FROM accounts a JOIN branches b ON a.branch_id = b.branch_id "
            "WHERE ((b.city = 'Oslo') OR (a.kind = 'credit'))",
        ),
    ],
)
def test_comma_joins_plan_as_joins(engine: Engine, comma: str, explicit: str) -> None:
    assert _measurement(engine, comma) == _measurement(engine, explicit)


def test_a_cross_product_is_refused_naming_join_on(engine: Engine) -> None:
    with pytest.raises(Error) as info:
        _run(engine, "SELECT COUNT(*) FROM accounts, branches")
    assert (info.value.sqlstate, info.value.message) == ("0A000", "cross joins are not supported")
    assert "JOIN t ON a.k = t.k" in (info.value.hint or "")


def test_public_table_twice_and_a_predicate_in_left_join_on(engine: Engine) -> None:
    result = _run(
        engine,
        "SELECT b1.city, COUNT(*) FROM accounts a JOIN branches b1 ON a.branch_id = b1.branch_id "
        "JOIN branches b2 ON b1.branch_id = b2.branch_id GROUP BY b1.city",
    )
    assert sorted(r[0] for r in result.rows) == ["Bergen", "Oslo", "Trondheim"]
    result = _run(
        engine,
        "SELECT COUNT(*) FROM customers c LEFT JOIN loans l ON c.customer_id = l.customer_id AND l.kind = 'mortgage'",
    )
    assert result.rows[0][0] > 0


def test_computed_columns_of_a_subquery_over_a_join(engine: Engine) -> None:
    """TPC-H Q7–Q9's shape: ``SELECT x, SUM(v) FROM (SELECT …, expr AS v FROM a, b WHERE …) t GROUP BY x``."""
    nested = (
        "SELECT region, SUM(volume) AS total FROM (SELECT c.region AS region, t.amount * 2 AS volume "
        "FROM transactions t, accounts a, customers c WHERE t.account_id = a.account_id "
        "AND a.customer_id = c.customer_id) AS spend GROUP BY region"
    )
    flat = (
        "SELECT c.region AS region, SUM((t.amount * 2)) AS total FROM transactions t JOIN accounts a ON "
        "t.account_id = a.account_id JOIN customers c ON a.customer_id = c.customer_id GROUP BY c.region"
    )
    assert _measurement(engine, nested) == _measurement(engine, flat)
    assert [c.name for c in _run(engine, nested).columns] == ["region", "total"]


def test_subqueries_over_the_same_persons_rows(engine: Engine) -> None:
    """EXISTS / NOT EXISTS / IN tied along the foreign key: a semi- or anti-join inside each person."""
    for sql in [
        "SELECT COUNT(*) FROM accounts a WHERE EXISTS (SELECT * FROM transactions t "
        "WHERE t.account_id = a.account_id AND t.amount > 400)",
        "SELECT COUNT(*) FROM customers c WHERE NOT EXISTS (SELECT * FROM loans l WHERE l.customer_id = c.customer_id)",
        "SELECT COUNT(*) FROM accounts a WHERE a.account_id IN (SELECT t.account_id FROM transactions t "
        "GROUP BY t.account_id HAVING SUM(t.amount) > 1000)",
    ]:
        sql_text = _measurement(engine, sql)
        assert "EXISTS" in sql_text and "IS NOT DISTINCT FROM" in sql_text  # tied by the unit too
        assert _run(engine, sql).epsilon_spent == 1.0


def test_a_public_subquery_is_kept_as_a_semi_join(engine: Engine) -> None:
    sql = "SELECT COUNT(*) FROM accounts WHERE branch_id IN (SELECT branch_id FROM branches WHERE city = 'Oslo')"
    assert '"branches"' in _measurement(engine, sql)
    assert _run(engine, sql).rows[0][0] > 0


def test_a_filter_on_a_released_aggregate_is_two_dp_queries(engine: Engine) -> None:
    result = _run(engine, "SELECT COUNT(*) FROM customers WHERE income > (SELECT AVG(income) FROM customers)")
    assert result.epsilon_spent == 2.0
    assert any("was released first (a DP query of its own)" in n for n in result.notices), result.notices


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        (  # an aggregate of other people's rows for each row (TPC-H Q17)
            "SELECT COUNT(*) FROM transactions t WHERE t.amount < (SELECT AVG(t2.amount) FROM transactions t2 "
            "WHERE t2.account_id = t.account_id)",
            "a subquery in WHERE that aggregates protected rows is not supported",
        ),
        (  # not tied to the row's person: SQL's meaning would be the whole table
            "SELECT COUNT(*) FROM accounts a WHERE EXISTS (SELECT * FROM transactions t WHERE t.amount > 499)",
            "a subquery over protected rows must be tied to the outer row along a foreign key or the privacy unit",
        ),
        (  # public rows selected by protected data
            "SELECT COUNT(*) FROM branches b WHERE EXISTS (SELECT * FROM accounts a WHERE a.branch_id = b.branch_id)",
            "a subquery over protected rows may only filter rows of the same person",
        ),
    ],
)
def test_subqueries_refused_with_what_works(engine: Engine, sql: str, message: str) -> None:
    with pytest.raises(Error) as info:
        _run(engine, sql)
    assert (info.value.sqlstate, info.value.message) == ("0A000", message)
    assert info.value.hint


@pytest.mark.parametrize(
    ("sql", "exact"),
    [
        (  # a comma join with two OR groups: A OR B AND C OR D would keep rows the WHERE filters out
            "SELECT COUNT(*) FROM transactions t, accounts a WHERE (t.category = 'rent' OR t.category = 'fuel') "
            "AND (a.kind = 'credit' OR a.kind = 'savings') AND t.account_id = a.account_id",
            "SELECT COUNT(*) FROM transactions t JOIN accounts a ON t.account_id = a.account_id "
            "WHERE t.category IN ('rent', 'fuel') AND a.kind IN ('credit', 'savings')",
        ),
        (  # the same groups as extra conditions in JOIN … ON
            "SELECT COUNT(*) FROM transactions t JOIN accounts a ON t.account_id = a.account_id "
            "AND (t.category = 'rent' OR t.category = 'fuel') AND (a.kind = 'credit' OR a.kind = 'savings')",
            "SELECT COUNT(*) FROM transactions t JOIN accounts a ON t.account_id = a.account_id "
            "WHERE t.category IN ('rent', 'fuel') AND a.kind IN ('credit', 'savings')",
        ),
    ],
)
def test_or_groups_keep_their_parentheses(engine: Engine, backend: Backend, sql: str, exact: str) -> None:
    """Conjuncts split apart and joined again keep an OR's parentheses: the measurement counts exactly the
    rows the query names (a fuzzer find: the WHERE had become ``A OR B AND C OR D``)."""
    rows = backend.execute(_measurement(engine, sql))[1]
    assert rows == backend.execute(_measurement(engine, exact))[1]
    assert "OR" in _measurement(engine, sql) and ") AND (" in _measurement(engine, sql)
