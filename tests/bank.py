"""A retail bank whose person is two and three foreign-key hops away: a schema unlike the demos.

``customers`` are the people; ``accounts`` (1–4 per customer) point at them; ``transactions`` point
at accounts (the customer two hops away); ``disputes`` point at transactions (three hops); ``loans``
have two keys to customers (borrower and an optional co-signer); ``branches`` is a small public
lookup table. Ids of different tables overlap on purpose (branch ids 1–12 are also transaction and
account ids), so containment of small id ranges is no evidence of a foreign key. A few customers
have hundreds of transactions (heavy users: what contribution bounding is for).

:func:`bank_script` writes it with or without PRIMARY KEY / FOREIGN KEY / NOT NULL constraints
(PostgreSQL with keys; a DuckDB file without, as CSV loads arrive). :data:`POLICY` is the natural
declaration a curator writes: ``references`` along each foreign key, the unit on customers only.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field

REGIONS = ["North", "South", "East", "West"]
KINDS = ["checking", "savings", "credit"]
CATEGORIES = ["groceries", "rent", "travel", "fuel", "dining", "salary"]
LOAN_KINDS = ["mortgage", "car", "personal"]
STATUSES = ["open", "closed"]
BRANCHES = [(i, f"Branch {i}", ["Oslo", "Bergen", "Trondheim"][i % 3]) for i in range(1, 13)]


@dataclass
class Bank:
    customers: list[tuple[object, ...]] = field(default_factory=list)
    accounts: list[tuple[object, ...]] = field(default_factory=list)
    transactions: list[tuple[object, ...]] = field(default_factory=list)
    loans: list[tuple[object, ...]] = field(default_factory=list)
    disputes: list[tuple[object, ...]] = field(default_factory=list)


def generate(n_customers: int = 300, seed: int = 11, heavy: int = 3) -> Bank:
    """Deterministic data: ``heavy`` customers have one account with hundreds of transactions."""
    rng = random.Random(seed)
    bank = Bank()
    account_id, txn_id, loan_id, dispute_id = 1, 1, 1, 1
    start = dt.datetime(2025, 1, 1)
    for customer in range(1, n_customers + 1):
        region = REGIONS[rng.randrange(4)]
        bank.customers.append(
            (
                customer,
                f"Customer {customer}",
                region,
                round(rng.uniform(10_000, 150_000), 2),
                dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(20_000)),
            )
        )
        for _ in range(rng.randint(1, 4)):
            opened = dt.date(2015, 1, 1) + dt.timedelta(days=rng.randrange(3_000))
            bank.accounts.append(
                (
                    account_id,
                    customer,
                    rng.randint(1, 12),
                    KINDS[rng.randrange(3)],
                    opened,
                    round(rng.uniform(0, 9e4), 2),
                )
            )
            count = rng.randint(0, 12) if customer > heavy else 400
            for _ in range(count):
                when = start + dt.timedelta(minutes=rng.randrange(525_600))
                amount = round(rng.uniform(1, 500), 2)
                bank.transactions.append((txn_id, account_id, when, amount, CATEGORIES[rng.randrange(6)]))
                if rng.random() < 0.05:
                    status = STATUSES[rng.randrange(2)]
                    bank.disputes.append((dispute_id, txn_id, when.date(), status))
                    dispute_id += 1
                txn_id += 1
            account_id += 1
        if rng.random() < 0.4:
            co_signer = rng.randint(1, n_customers) if rng.random() < 0.3 else None
            kind = LOAN_KINDS[rng.randrange(3)]
            bank.loans.append((loan_id, customer, co_signer, kind, round(rng.uniform(1_000, 400_000), 2)))
            loan_id += 1
    return bank


def _literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, dt.datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, dt.date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def _insert(table: str, rows: list[tuple[object, ...]], batch: int = 500) -> str:
    out = []
    for i in range(0, len(rows), batch):
        values = ",\n".join("(" + ", ".join(_literal(v) for v in row) + ")" for row in rows[i : i + batch])
        out.append(f"INSERT INTO {table} VALUES\n{values};\n")
    return "".join(out)


def bank_script(bank: Bank, *, keys: bool) -> str:
    """DDL and rows; ``keys`` adds PRIMARY KEY, FOREIGN KEY and NOT NULL constraints."""
    pk = " PRIMARY KEY" if keys else ""
    nn = " NOT NULL" if keys else ""

    def fk(table: str, column: str) -> str:
        return f" REFERENCES {table} ({column})" if keys else ""

    ddl = f"""
CREATE TABLE branches (branch_id INTEGER{pk}, name VARCHAR(40){nn}, city VARCHAR(40){nn});
CREATE TABLE customers (customer_id INTEGER{pk}, full_name VARCHAR(60){nn}, region VARCHAR(10){nn},
                        income DOUBLE PRECISION{nn}, birth_date DATE{nn});
CREATE TABLE accounts (account_id INTEGER{pk}, customer_id INTEGER{nn}{fk("customers", "customer_id")},
                       branch_id INTEGER{nn}{fk("branches", "branch_id")}, kind VARCHAR(10){nn},
                       opened DATE{nn}, balance DOUBLE PRECISION{nn});
CREATE TABLE transactions (txn_id INTEGER{pk}, account_id INTEGER{nn}{fk("accounts", "account_id")},
                           ts TIMESTAMP{nn}, amount DOUBLE PRECISION{nn}, category VARCHAR(12){nn});
CREATE TABLE loans (loan_id INTEGER{pk}, customer_id INTEGER{nn}{fk("customers", "customer_id")},
                    co_signer_id INTEGER{fk("customers", "customer_id")}, kind VARCHAR(10){nn},
                    principal DOUBLE PRECISION{nn});
CREATE TABLE disputes (dispute_id INTEGER{pk}, txn_id INTEGER{nn}{fk("transactions", "txn_id")},
                       opened DATE{nn}, status VARCHAR(10){nn});
"""
    return (
        ddl
        + _insert("branches", list(BRANCHES))
        + _insert("customers", bank.customers)
        + _insert("accounts", bank.accounts)
        + _insert("transactions", bank.transactions)
        + _insert("loans", bank.loans)
        + _insert("disputes", bank.disputes)
    )


#: The natural declaration: each table ``references`` the table its foreign key names; only customers
#: names the person. Transactions reach the customer two hops away, disputes three.
POLICY = """\
dataset: bank
defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}
budget:
  dataset: {epsilon: 1000.0, delta: 1.0e-3}
  analyst: {epsilon: 1000.0, delta: 1.0e-3}
auth: {trust: true}
analysts:
  - name: analyst
tables:
  customers:
    privacy_unit: customer_id
    max_rows_per_unit: 1
    columns:
      customer_id: {type: int, identifier: true}
      full_name: {type: text, identifier: true}
      region: {type: text, domain: [North, South, East, West], nullable: false}
      income: {type: float, lower: 0.0, upper: 200000.0, nullable: false}
      birth_date: {type: date, lower: 1900-01-01, upper: 2010-12-31, nullable: false}
  accounts:
    references: {column: customer_id, table: customers, to: customer_id}
    max_rows_per_unit: 4
    columns:
      account_id: {type: int, identifier: true}
      customer_id: {type: int, identifier: true}
      branch_id: {type: int, nullable: false, domain: {table: branches, column: branch_id}}
      kind: {type: text, domain: [checking, savings, credit], nullable: false}
      opened: {type: date, lower: 2010-01-01, upper: 2025-12-31, nullable: false}
      balance: {type: float, lower: 0.0, upper: 100000.0, nullable: false}
  transactions:
    references: {column: account_id, table: accounts, to: account_id}
    max_rows_per_unit: 200
    columns:
      txn_id: {type: int, identifier: true}
      account_id: {type: int, identifier: true}
      ts: {type: timestamp, lower: 2025-01-01 00:00:00, upper: 2025-12-31 23:59:59, nullable: false}
      amount: {type: float, lower: 0.0, upper: 500.0, nullable: false}
      category: {type: text, domain: [groceries, rent, travel, fuel, dining, salary], nullable: false}
  disputes:
    references: {column: txn_id, table: transactions, to: txn_id}
    max_rows_per_unit: 10
    columns:
      dispute_id: {type: int, identifier: true}
      txn_id: {type: int, identifier: true}
      opened: {type: date, lower: 2025-01-01, upper: 2025-12-31, nullable: false}
      status: {type: text, domain: [open, closed], nullable: false}
  loans:
    references: {column: customer_id, table: customers, to: customer_id}
    max_rows_per_unit: 3
    columns:
      loan_id: {type: int, identifier: true}
      customer_id: {type: int, identifier: true}
      co_signer_id: {type: int, identifier: true}
      kind: {type: text, domain: [mortgage, car, personal], nullable: false}
      principal: {type: float, lower: 0.0, upper: 500000.0, nullable: false}
  branches:
    public: true
    columns:
      branch_id: {type: int, domain: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], nullable: false}
      name: {type: text}
      city: {type: text, domain: [Oslo, Bergen, Trondheim], nullable: false}
"""
