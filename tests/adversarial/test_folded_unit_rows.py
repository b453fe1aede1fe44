"""The folded bias totals read each unit's rows from the measurement's own sort (issue #37 item 3).

:func:`dpsql.release.bias.folded_query` takes a cell's unit's rows in all, ``__bn``, from a window beside the
measurement's running count (:func:`dpsql.rewrite.bounding.count_unit_rows`) instead of a per-unit aggregation
joined back with ``IS NOT DISTINCT FROM``. Here, on DuckDB (the backend that folds), on neighbours whose
privacy unit and group key can be NULL (NULL units must share one unit, as the join made them) and where one
unit holds far more rows than the cap: the folded statement's measurement rows are the measurement's own and
its totals those of :func:`dpsql.release.bias.totals_query` run apart, and the statement joins nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.release.bias import split_folded, totals_query
from dpsql.session import Session
from tests.adversarial.worlds import roomy_policy

POLICY = roomy_policy(
    "nullunits",
    """
  events:
    privacy_unit: uid
    max_rows_per_unit: 3
    columns:
      uid: {type: int, identifier: true, nullable: true}
      kind: {type: text, domain: [a, b, c], nullable: true}
      amount: {type: float, lower: 0.0, upper: 10.0, nullable: true}
""",
)
#: Neighbours: the base, plus a unit of 40 rows (odd amounts among them), plus 5 more rows with a NULL unit.
NEIGHBOURS = ("base", "heavy", "null unit")
QUERIES = [
    "SELECT kind, COUNT(*), SUM(amount) FROM events GROUP BY kind",
    "SELECT kind, AVG(amount) AS mean, COUNT(DISTINCT uid) FROM events GROUP BY kind",
    "SELECT kind, SUM(amount) FROM events WHERE amount > 2 GROUP BY kind",
]


def _rows(name: str) -> list[str]:
    rows = [
        f"({'NULL' if p % 5 == 0 else p}, {'NULL' if j % 7 == 0 else repr('abc'[(p + j) % 3])}, {(p * 7 + j) % 14}.25)"
        for p in range(1, 30)
        for j in range(6)
    ]
    if name == "heavy":
        odd = ["CAST('NaN' AS DOUBLE)", "CAST('Infinity' AS DOUBLE)", "-1e300", "NULL"]
        rows += [f"(999, '{'abc'[i % 3]}', {odd[i % 4] if i % 5 == 0 else f'{i % 13}.5'})" for i in range(40)]
    if name == "null unit":
        rows += [f"(NULL, '{'abc'[i % 3]}', 99.0)" for i in range(5)]
    return rows


@pytest.fixture(scope="module")
def worlds() -> Iterator[dict[str, Backend]]:
    backends = {name: open_backend("duckdb://") for name in NEIGHBOURS}
    try:
        for name, backend in backends.items():
            backend.execute_script(
                "CREATE TABLE events (uid BIGINT, kind TEXT, amount DOUBLE); "
                f"INSERT INTO events VALUES {', '.join(_rows(name))}"
            )
        yield backends
    finally:
        for backend in backends.values():
            backend.close()


@pytest.mark.parametrize("sql", QUERIES)
def test_folded_unit_rows_agree_with_the_totals_apart(worlds: dict[str, Backend], sql: str) -> None:
    engine = Engine(parse_policy(POLICY), worlds["base"], Ledger.open("sqlite:///:memory:"))
    prepared = engine.prepare(sql, Session("alice"))
    estimate = prepared.bias
    assert estimate is not None and estimate.folded is not None
    folded = estimate.folded[0]
    assert " JOIN " not in folded.upper() and "__bias_units AS (SELECT * FROM __counted)" in folded
    apart = engine.backend.render(totals_query(prepared.plan, prepared.plan.max_rows, estimate.clamped, estimate.cuts))
    for name, backend in worlds.items():
        measured, totals = split_folded(backend.execute(folded)[1], estimate.folded[1], estimate.nkeys)
        assert _close(measured, backend.execute(prepared.sql)[1]), name
        assert _close(totals, backend.execute(apart)[1]), name
        assert any(row[0] is None for row in totals), name  # the NULL group is there, NULL units in it


def test_ranked_groups_keep_the_join(worlds: dict[str, Backend]) -> None:
    """With groups ranked per unit (``max_groups_per_unit`` below the rows cap) ``__counted`` reads a unit's
    first groups only, so its window cannot count the unit's rows: nothing is taken from it."""
    ranked = POLICY.replace("max_rows_per_unit: 3", "max_rows_per_unit: 3\n    max_groups_per_unit: 1")
    engine = Engine(parse_policy(ranked), worlds["base"], Ledger.open("sqlite:///:memory:"))
    prepared = engine.prepare("SELECT kind, COUNT(*) FROM events GROUP BY kind", Session("alice"))
    folded = prepared.bias.folded if prepared.bias is not None else None
    assert folded is None or "__bias_units AS (SELECT * FROM __counted)" not in folded[0]


def _close(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> bool:
    """Equal rows, floats up to summation order."""
    if len(got) != len(want):
        return False
    for a, b in zip(sorted(got, key=repr), sorted(want, key=repr), strict=True):
        for x, y in zip(a, b, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                if not (math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) or (math.isnan(x) and math.isnan(y))):
                    return False
            elif x != y:
                return False
    return True
