"""``dpsql policy report --dp-bounds`` at the README's small ε, and the report's suggestion with outliers.

Audit (issue #28, 3a): at ``--epsilon 0.5`` over 5 columns (ε = 0.1 each, 10 rows per person) every
column came back "none" with 25,000–66,000 values: the margin against noise summed over many empty
power-of-two bins was compared with the 1% tail instead of the data's size. And the report suggested
min/max bounds because no candidate lay between p99 and the outliers. On DuckDB and PostgreSQL.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.cli import main
from dpsql.curator.report import build_report
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from tests.kinds import new_database_url
from tests.policies import report_policy, table_yaml

COLUMNS = ("a", "b", "c", "d", "e")

ORDERS = """
a: {type: float, lower: 0, upper: 1000}
b: {type: float, lower: 0, upper: 100000}
c: {type: float, lower: 0, upper: 50}
d: {type: int, lower: 0, upper: 100}
e: {type: float, lower: 0, upper: 5000}
"""
POLICY = report_policy(
    "shop_t",
    table_yaml("people", unit="id", ids=("id",))
    + table_yaml("orders", ORDERS, refs="person people.id", rows=5, ids=("id", "person")),
)

#: lognormal medians of the five columns (σ = 0.8); d is rounded to an int
MEDIANS = {"a": 100.0, "b": 20_000.0, "c": 3.0, "d": 12.0, "e": 700.0}


def _rows(people: int, seed: int) -> list[tuple]:
    """``people`` persons with 3–5 orders each (≥ 10,000 values per column for 3,000 people)."""
    rng = random.Random(seed)
    rows: list[tuple] = []
    for person in range(people):
        for _ in range(rng.randint(3, 5)):
            values = [math.exp(rng.gauss(math.log(MEDIANS[c]), 0.8)) for c in COLUMNS]
            values[3] = round(values[3])
            rows.append((len(rows), person, *values))
    return rows


def _load(backend: Backend, rows: list[tuple], people: int) -> None:
    backend.load_rows("people", [("id", "BIGINT")], [(i,) for i in range(people)], replace=True)
    types = [("id", "BIGINT"), ("person", "BIGINT"), *((c, "DOUBLE PRECISION") for c in COLUMNS)]
    types[5] = ("d", "INTEGER")
    backend.load_rows("orders", types, rows, replace=True)


@pytest.fixture(params=["duckdb", pytest.param("postgres", marks=pytest.mark.postgres)])
def shop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Backend]]:
    url = new_database_url(request.param, request, tmp_path, "shop.duckdb")
    backend = open_backend(url)
    try:
        yield url, backend
    finally:
        backend.close()


def test_small_epsilon_over_five_columns_is_useful_and_charged_once(
    shop: tuple[str, Backend], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dp-bounds-small-epsilon: ε = 0.5 over 5 columns, ~12,000 values each, 5 rows per person: every
    run suggests bounds for every column, the upper bound within a factor 2 of the true p99 (the
    power-of-two bin edge above it, or one bin off) in (almost) every run; each run charges exactly
    the printed ε, once, to the curator. A noisy crossing a few bins too high is rare but real (measured:
    2 of 300 draws beyond 2×, 1 beyond 4× at 32×): of the 20 draws here at most two may miss 4×, so a
    regression (misses in most draws) fails while the test fails by chance about once in 25,000 runs."""
    url, backend = shop
    rows = _rows(3000, seed=11)
    _load(backend, rows, 3000)
    path = tmp_path / "shop_t.yaml"
    path.write_text(POLICY)
    ledger_url = f"sqlite:///{tmp_path}/ledger.sqlite"
    args = ["policy", "report", "--policy", str(path), "--database", url, "--ledger", ledger_url]
    p99 = {}
    for i, c in enumerate(COLUMNS):
        values = sorted(r[2 + i] for r in rows)
        assert len(values) >= 10_000
        p99[c] = values[len(values) * 99 // 100]
    dp = ["--table", "orders", "--dp-bounds", "--epsilon", "0.5", "--charge-as", "cur", "--json"]
    runs, near, far = 4, 0, 0
    for run in range(1, runs + 1):
        assert main([*args, *dp]) == 0
        out = capsys.readouterr()
        data = json.loads(out.out)
        assert data["dp_epsilon"] == 0.5 and data["dp_columns"] == 5
        assert out.err.count("charged ε=0.5 to cur") == 1
        (orders,) = data["tables"]
        for col in orders["columns"]:
            upper = col["dp_upper"]
            assert upper is not None, col["name"]  # never "none" at this size
            far += not 0.25 <= upper / p99[col["name"]] <= 4
            near += 0.5 <= upper / p99[col["name"]] <= 2
        ledger = Ledger.open(ledger_url)
        try:  # exactly the printed ε per run, one audit row per run
            assert ledger.spent("shop_t", "cur").epsilon == pytest.approx(0.5 * run)
            assert ledger.spent("shop_t").epsilon == pytest.approx(0.5 * run)
            audit = ledger.audit("shop_t", analyst="cur")
            assert len(audit) == run and all(row.epsilon == 0.5 for row in audit)
        finally:
            ledger.close()
    assert far <= 2 and near >= runs * len(COLUMNS) - 3, (far, near)


def test_suggestion_clamps_a_few_huge_outliers(shop: tuple[str, Backend]) -> None:
    """report-suggestion-outliers: three values of 10⁹ among ~12,000 of ~100: the suggested bounds are
    the smallest RMSE shown, and their upper bound lies far below the outliers. For k outliers of
    value V the SUM's RMSE √((k(V − U))² + (sU)²), s = 5·√2 the noise sd per unit of bound at ε = 1,
    is smallest at U = V·k²/(k² + s²) ≈ 0.15·V: between p99 and max, which only the ladder offers
    (p99 would leave 3·10⁹ of bias, max 7·10⁹ of noise)."""
    _, backend = shop
    rows = _rows(3000, seed=5)
    for i in range(3):
        rows[i * 1000] = (*rows[i * 1000][:2], 1e9, *rows[i * 1000][3:])
    _load(backend, rows, 3000)
    report = build_report(parse_policy(POLICY), backend, ["orders"])
    (orders,) = report.tables
    a = next(c for c in orders.columns if c.name == "a")
    assert a.quantiles["max"] == 1e9
    (best,) = [ch for ch in a.tradeoff if ch.suggested]
    assert best.rmse == min(ch.rmse for ch in a.tradeoff)
    assert best.label != "min/max" and best.upper is not None and best.upper < 0.25e9, best
    assert best.upper > a.quantiles["p99"]  # not the p99 either: 3·10⁹ of bias there
