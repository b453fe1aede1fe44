"""Who a row belongs to on a schema unlike the demos (issue #35): a bank, the customer two and three hops away.

``policy draft`` then ``policy check`` with no edits passes, and every table that reaches the customer
gets the customer as its unit, on PostgreSQL with keys and on DuckDB without; a row id as a unit, a wrong
``references`` (to a repeating key, or to values that name no row) and a false ``nullable: false`` each
make ``check`` fail, and every fix it names is a column that reaches the person table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy
from dpsql.engine import Engine
from dpsql.errors import PolicyError
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.bank import POLICY, bank_script, generate
from tests.kinds import loaded

TABLES = ["branches", "customers", "accounts", "transactions", "loans", "disputes"]
PERSON = "customers.customer_id"


@pytest.fixture(params=["duckdb-no-keys", "postgres-keys"], scope="module")
def bank(request: pytest.FixtureRequest) -> Iterator[Backend]:
    script = bank_script(generate(200), keys=not request.param.endswith("no-keys"))
    with loaded(request.param, request, script) as backend:
        yield backend


def test_draft_then_check_with_no_edits_protects_the_customer(bank: Backend) -> None:
    text = draft_policy(bank, TABLES, "bank")
    report = check_text(text, "bank.yaml", bank)
    assert report.ok and report.errors == [], report.errors
    policy = parse_policy(text, "bank.yaml")
    assert policy.tables["branches"].public
    for table in ("customers", "accounts", "transactions", "loans", "disputes"):
        path = policy.unit_path(table)
        assert path is not None and path.person == PERSON, (table, path)
    assert policy.unit_path("disputes").chain == ("disputes", "transactions", "accounts", "customers")
    assert policy.tables["customers"].columns["region"].nullable is False  # NOT NULL, or no NULL stored
    assert not policy.tables["accounts"].columns["branch_id"].identifier  # a key into a public lookup
    engine = Engine(policy, bank, Ledger.open("memory"))
    explained = engine.execute("EXPLAIN SELECT COUNT(*) FROM disputes", Session("analyst"))
    unit_line = next(str(r[0]) for r in explained.rows if "Privacy unit" in str(r[0]))
    assert "customers.customer_id (disputes → transactions → accounts → customers)" in unit_line


def test_the_natural_declaration_checks_clean(bank: Backend) -> None:
    report = check_text(POLICY, "bank.yaml", bank)
    assert report.errors == [], report.errors


def _errors(bank: Backend, text: str) -> list[str]:
    report = check_text(text, "bank.yaml", bank)
    assert not report.ok
    return report.errors


def test_a_row_id_as_unit_is_an_error_whatever_its_cap(bank: Backend) -> None:
    for cap in (1, 200):
        text = POLICY.replace(
            "    references: {column: account_id, table: accounts, to: account_id}\n    max_rows_per_unit: 200",
            f"    privacy_unit: txn_id\n    max_rows_per_unit: {cap}",
        )
        errors = _errors(bank, text)
        assert any(
            "tables.transactions.privacy_unit: 'txn_id' is unique per row (a row id, not a person) while "
            "'account_id' repeats"
            in e
            and "declare references: {column: account_id, table: accounts, to: account_id}; the person is "
            "customers.customer_id"
            in e
            for e in errors
        ), errors


def test_one_row_per_person_on_a_table_of_someone_elses_rows_names_the_chain(bank: Backend) -> None:
    """accounts left "each row one person" while customer_id repeats: the fix references customers
    (the old hint, ``privacy_unit: account_id``, gave a customer with 4 accounts 4× the influence)."""
    text = POLICY.replace(
        "    references: {column: customer_id, table: customers, to: customer_id}\n    max_rows_per_unit: 4\n", "", 1
    )
    errors = _errors(bank, text)
    assert any(
        "tables.accounts: no 'privacy_unit' (each row is one person), but identifier 'customer_id' repeats; the "
        "tables referencing it would count one customer_id as many people: did you mean 'customer_id' (declare "
        "references: {column: customer_id, table: customers, to: customer_id}" in e
        for e in errors
    ), errors


def test_a_reference_to_a_repeating_key_is_an_error(bank: Backend) -> None:
    text = POLICY.replace("references: {column: account_id, table: accounts, to: account_id}",
                          "references: {column: account_id, table: accounts, to: customer_id}")  # fmt: skip
    errors = _errors(bank, text)
    assert any("tables.transactions.references.to: accounts.customer_id repeats" in e for e in errors), errors


def test_a_reference_to_values_that_name_no_row_is_an_error(bank: Backend) -> None:
    """txn ids are not account ids (ids overlap only by accident: containment is no evidence)."""
    text = POLICY.replace("references: {column: account_id, table: accounts, to: account_id}",
                          "references: {column: txn_id, table: accounts, to: account_id}")  # fmt: skip
    errors = _errors(bank, text)
    assert any(
        "tables.transactions.references.column:" in e
        and "distinct values of 'txn_id' are not in accounts.account_id" in e
        and "did you mean 'account_id'" in e
        for e in errors
    ), errors


def test_a_false_not_null_is_an_error(bank: Backend) -> None:
    text = POLICY.replace("      kind: {type: text, domain: [mortgage, car, personal], nullable: false}",
                        "      kind: {type: text, domain: [mortgage, car, personal], nullable: false}\n"
                        "      note: {type: text, nullable: false}")  # fmt: skip
    bank.execute_script("ALTER TABLE loans ADD COLUMN note VARCHAR(10)")
    try:
        errors = _errors(bank, text)
    finally:
        bank.execute_script("ALTER TABLE loans DROP COLUMN note")
    assert any("'note' is declared 'nullable: false' but holds NULLs" in e for e in errors), errors


def test_a_reference_into_a_public_table_or_a_circle_fails_at_load() -> None:
    public = POLICY.replace(
        "references: {column: customer_id, table: customers, to: customer_id}\n    max_rows_per_unit: 4",
        "references: {column: branch_id, table: branches, to: branch_id}\n    max_rows_per_unit: 4",
    )
    with pytest.raises(PolicyError, match="'branches' is public"):
        parse_policy(public, "bank.yaml")
    circle = POLICY.replace("    privacy_unit: customer_id\n    max_rows_per_unit: 1",
                            "    references: {column: customer_id, table: loans, to: customer_id}")  # fmt: skip
    with pytest.raises(PolicyError, match="circle"):
        parse_policy(circle, "bank.yaml")


def test_a_lookup_key_is_never_proposed_as_the_person(bank: Backend) -> None:
    """A branch id on the person table (ids 1–12, also transaction and account ids) is a branch, not a
    person: nothing suggests it as a unit, or that customers reference transactions."""
    bank.execute_script("ALTER TABLE customers ADD COLUMN home_branch_id INTEGER")
    bank.execute_script("UPDATE customers SET home_branch_id = 1 + customer_id % 12")
    try:
        text = POLICY.replace(
            "      full_name: {type: text, identifier: true}",
            "      full_name: {type: text, identifier: true}\n      home_branch_id: {type: int, identifier: true}",
        ).replace("branch_id: {type: int, domain: [1, 2,", "home_branch_id: {type: int, domain: [1, 2,")
        report = check_text(text, "bank.yaml", bank)
        assert not any("home_branch_id" in e for e in report.errors), report.errors
        assert not any("table: transactions" in e for e in report.errors), report.errors
    finally:
        bank.execute_script("ALTER TABLE customers DROP COLUMN home_branch_id")
