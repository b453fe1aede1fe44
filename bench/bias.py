"""Issue #40 item 1: do the printed intervals cover the exact answers once the cap/clamp bias is sized?

Run directly: ``.venv/bin/python bench/bias.py [--reps N] [--customers N] [--json]``. Builds a bank-like
DuckDB database (the person two hops from transactions, a long tail of transactions per customer beyond
the 200-row cap, incomes, amounts and loan principals beyond their declared bounds; seeded), asks
questions in the spirit of the issue's held-out ones with ``dpsql.bias`` on and off, and prints per
question the share of released cells whose exact (unbounded, unclamped) value lies inside ``value ± ci``
and the median half-width. Then the clinic demo's capped ``COUNT(*)`` of visits (20 releases each).

The exact values come from the same SQL run on the backend directly (what the analyst would get without
DP). Nothing here is a privacy test: it measures accuracy claims.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: tests/bank.py

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy, parse_policy
from dpsql.session import Session
from tests.bank import POLICY as BANK_POLICY

#: The columns of tests/bank.py's declaration that the bank built here (:func:`build_bank`) does not have.
_NOT_BUILT = {
    "customers": ("full_name", "birth_date"),
    "accounts": ("branch_id", "opened"),
    "loans": ("co_signer_id",),
}


def bank_policy() -> str:
    """tests/bank.py's declaration (its tables, units and caps) for the tables built here, with bounds a
    curator drafts from a sample (so the tails lie beyond them) and a budget that never runs out."""
    doc = yaml.safe_load(BANK_POLICY)
    doc["dataset"] = "bankbias"
    doc["budget"] = {"dataset": {"epsilon": 1.0e9, "delta": 0.5}, "analyst": {"epsilon": 1.0e9, "delta": 0.5}}
    tables = {name: doc["tables"][name] for name in ("customers", "accounts", "transactions", "loans")}
    for table, columns in _NOT_BUILT.items():
        for column in columns:
            del tables[table]["columns"][column]
    tables["customers"]["columns"]["income"]["upper"] = 300000.0
    tables["transactions"]["columns"]["ts"]["lower"] = dt.datetime(2024, 1, 1)
    doc["tables"] = tables
    return str(yaml.safe_dump(doc, sort_keys=False))


POLICY = bank_policy()

#: (name, SQL, whether the policy's caps and bounds leave the exact answer unchanged on this data: principals
#: stay below 500k and each customer has at most 4 accounts and 1 loan).
QUESTIONS: list[tuple[str, str, bool]] = [
    (
        "HAVING over categories",
        "SELECT category, COUNT(*) AS n FROM transactions GROUP BY category HAVING COUNT(*) > 1000",
        False,
    ),
    ("AVG income by region", "SELECT region, AVG(income) AS avg_income FROM customers GROUP BY region", False),
    (
        "2025 count and total",
        "SELECT COUNT(*) AS n, SUM(amount) AS total FROM transactions WHERE ts >= '2025-01-01'",
        False,
    ),
    (
        "amount by category",
        "SELECT category, SUM(amount) AS total FROM transactions GROUP BY category",
        False,
    ),
    ("principal by loan kind", "SELECT kind, SUM(principal) AS total FROM loans GROUP BY kind", True),
    ("accounts by kind", "SELECT kind, COUNT(*) AS n FROM accounts GROUP BY kind", True),
    ("balance by kind", "SELECT kind, SUM(balance) AS total FROM accounts GROUP BY kind", True),
    ("customers by region", "SELECT region, COUNT(*) AS n FROM customers GROUP BY region", True),
    ("accounts", "SELECT COUNT(*) AS n FROM accounts", True),
]


def build_bank(backend: Backend, customers: int, seed: float = 0.4) -> None:
    """Seeded bank data in SQL: transactions per account lognormal (a tail of customers beyond 200),
    incomes lognormal (a tail beyond 300k), amounts with a tail beyond 500, loan principals beyond 500k."""
    script = f"""
SELECT setseed({seed});
CREATE OR REPLACE TABLE customers AS
  SELECT i AS customer_id, ['North','South','East','West'][1 + (i % 4)] AS region,
         round(exp(11.0 + 0.2 * (i % 4) + 0.7 * sqrt(-2 * ln(random())) * cos(2 * pi() * random())), 2) AS income
  FROM range(1, {customers + 1}) t(i);
CREATE OR REPLACE TABLE accounts AS
  SELECT row_number() OVER () AS account_id, customer_id, ['checking','savings','credit'][1 + (k % 3)] AS kind,
         round(random() * 90000, 2) AS balance
  FROM (SELECT customer_id, unnest(range(1 + CAST(floor(random() * 4) AS INTEGER))) AS k FROM customers);
CREATE OR REPLACE TABLE transactions AS
  SELECT row_number() OVER () AS txn_id, account_id,
         TIMESTAMP '2024-01-01' + INTERVAL (CAST(floor(random() * 730 * 24) AS INTEGER)) HOUR AS ts,
         round(CASE WHEN random() < 0.03 THEN 500 + random() * 3000 ELSE 1 + random() * 400 END, 2) AS amount,
         ['groceries','rent','travel','fuel','dining','salary'][1 + CAST(floor(random() * 6) AS INTEGER)] AS category
  FROM (SELECT account_id,
               unnest(range(CAST(floor(exp(3.0 + 0.9 * sqrt(-2 * ln(random())) * cos(2 * pi() * random())))
                                 AS INTEGER))) AS k
        FROM accounts);
CREATE OR REPLACE TABLE loans AS
  SELECT row_number() OVER () AS loan_id, customer_id, ['mortgage','car','personal'][1 + (customer_id % 3)] AS kind,
         round(CASE WHEN customer_id % 3 = 0 THEN exp(12.4 + 0.6 * random()) ELSE 1000 + random() * 60000 END, 2)
           AS principal
  FROM customers WHERE random() < 0.4;
"""
    backend.execute_script(script)


def covered(
    engine: Engine, backend: Backend, sql: str, bias: bool, reps: int, analyst: str = "analyst"
) -> tuple[int, int, list[float]]:
    """(cells covered, cells released, half-widths) over ``reps`` releases of ``sql``."""
    exact = {row[: _keys(row)]: row for row in backend.execute(sql)[1]}
    inside = total = 0
    widths: list[float] = []
    session = Session(analyst)
    session.apply("dpsql.bias", bias, "on" if bias else "off")
    for _ in range(reps):
        result = engine.execute(sql, session)
        for row, acc in zip(result.rows, result.accuracy, strict=True):
            key = row[: _keys(row)]
            truth = exact.get(key)
            for c, (value, width) in enumerate(zip(row, acc, strict=True)):
                if width is None or not isinstance(value, int | float):
                    continue
                total += 1
                widths.append(float(width))
                exact_value = float(truth[c]) if truth is not None else 0.0
                inside += abs(exact_value - float(value)) <= float(width)
    return inside, total, widths


def _keys(row: tuple[Any, ...]) -> int:
    return sum(1 for v in row if isinstance(v, str))


def bank(customers: int, reps: int) -> list[dict[str, Any]]:
    backend = open_backend("duckdb://")
    build_bank(backend, customers)
    policy: Policy = parse_policy(POLICY)
    engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))  # no result cache: every release fresh
    out = []
    for name, sql, untouched in QUESTIONS:
        on, cells_on, widths_on = covered(engine, backend, sql, True, reps)
        off, cells_off, widths_off = covered(engine, backend, sql, False, reps)
        out.append(
            {
                "question": name,
                "nothing_cut": untouched,
                "covered_on": [on, cells_on],
                "covered_off": [off, cells_off],
                "median_ci_on": statistics.median(widths_on) if widths_on else None,
                "median_ci_off": statistics.median(widths_off) if widths_off else None,
            }
        )
    backend.close()
    return out


def clinic(reps: int) -> dict[str, Any]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))
    sql = "SELECT COUNT(*) FROM visits"
    on, cells, widths = covered(engine, backend, sql, True, reps)
    off, _, widths_off = covered(engine, backend, sql, False, reps, "alice")  # (an analyst's ε is 20)
    backend.close()
    return {
        "covered_on": [on, cells],
        "covered_off": [off, cells],
        "median_ci_on": statistics.median(widths),
        "median_ci_off": statistics.median(widths_off),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--customers", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = bank(args.customers, args.reps)
    clinic_figures = clinic(20)
    if args.json:
        print(json.dumps({"bank": rows, "clinic": clinic_figures}, indent=2))
        return
    cut = [r for r in rows if not r["nothing_cut"]]
    inside = sum(r["covered_on"][0] for r in cut)
    cells = sum(r["covered_on"][1] for r in cut)
    for r in rows:
        ratio = r["median_ci_on"] / r["median_ci_off"] if r["median_ci_off"] else float("nan")
        print(
            f"{r['question']:32} {'nothing cut' if r['nothing_cut'] else 'cut/clamped':12} "
            f"covered on {r['covered_on'][0]:3}/{r['covered_on'][1]:<3} off {r['covered_off'][0]:3}/"
            f"{r['covered_off'][1]:<3} median ±{r['median_ci_on']:.4g} vs ±{r['median_ci_off']:.4g} ({ratio:.2f}x)"
        )
    print(f"questions with something cut: {inside}/{cells} cells covered ({100 * inside / max(cells, 1):.0f} %)")
    c = clinic_figures
    print(
        f"clinic COUNT(*) of visits: covered {c['covered_on'][0]}/{c['covered_on'][1]} with bias on, "
        f"{c['covered_off'][0]}/{c['covered_off'][1]} off; median ±{c['median_ci_on']:.4g} vs ±{c['median_ci_off']:.4g}"
    )


if __name__ == "__main__":
    main()
