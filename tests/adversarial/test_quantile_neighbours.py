"""Quantile grids on neighbouring databases, DuckDB and PostgreSQL: one outcome everywhere.

The histogram query's cells (exact integers for an int column, 65,536 equal cells for a float) must
be computed identically by both backends for every neighbour (one person absent, ordinary, out of
bounds, at a bound, NaN, ±infinity, huge), and the query must be answered on each, with values of
the same type inside the bounds and a value interval for every interior quantile (#40): no error,
type, range or missing interval that says whether the person is there. Each end of the interval is
ε-DP on the neighbours' real histograms, on both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.rewrite import histogram_query
from dpsql.session import Session
from tests.dp_check import assert_counts_epsilon_dp, sampled_interval_ends

POLICY = """
dataset: neighbours
budget: {dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}
analysts: [{name: alice}]
tables:
  t:
    columns:
      g: {type: text, domain: [a, b]}
      n: {type: int, lower: -50, upper: 50, nullable: false}
      x: {type: float, lower: 0.0, upper: 10.0}
"""

#: The one person who differs: absent, or present with these (n, x).
VARIANTS: dict[str, tuple[int, float] | None] = {
    "absent": None,
    "ordinary": (7, 3.25),
    "at-bounds": (50, 10.0),
    "out-of-bounds": (9_000_000_000, -1e308),
    "nan": (-50, float("nan")),
    "infinity": (-9_000_000_000, float("inf")),
    "minus-infinity": (1, float("-inf")),
    "tiny": (0, 1e-300),
}
QUERIES = [
    "SELECT g, median(n), percentile_disc(0.9) WITHIN GROUP (ORDER BY n), MIN(n), MAX(n) FROM t GROUP BY g",
    "SELECT median(x), percentile_cont(0.1) WITHIN GROUP (ORDER BY x), MIN(x), MAX(x) FROM t",
]


def _rows(person: tuple[int, float] | None) -> list[tuple[str, int, float]]:
    rows = [("a" if i % 3 else "b", i % 101 - 50, (i * 7 % 1000) / 100.0) for i in range(600)]
    return rows + ([("a", *person)] if person else [])


@pytest.fixture(scope="module")
def neighbours(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str], Backend]]:
    backends: dict[tuple[str, str], Backend] = {}
    for variant, person in VARIANTS.items():
        for kind, url in (("duckdb", "duckdb://"), ("postgres", pg_new_database())):
            backend = open_backend(url)
            backend.load_rows("t", [("g", "TEXT"), ("n", "BIGINT"), ("x", "DOUBLE PRECISION")], _rows(person))
            backends[(variant, kind)] = backend
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.mark.parametrize("sql", QUERIES)
def test_histogram_cells_identical_on_both_backends(neighbours: dict[tuple[str, str], Backend], sql: str) -> None:
    policy: Policy = parse_policy(POLICY)
    plan = analyze(sql, policy)
    selected = [i for i, m in enumerate(plan.measures) if m.selected]
    for variant in VARIANTS:
        for i in selected:
            query = histogram_query(plan, i)
            duck = sorted(neighbours[(variant, "duckdb")].execute(query.sql("duckdb"))[1], key=repr)
            pg = sorted(neighbours[(variant, "postgres")].execute(query.sql("postgres"))[1], key=repr)
            assert duck == pg, (variant, i)
            cells = [row[-2] for row in duck if row[-2] is not None]
            limit = (
                100 if plan.measures[i].integer else 65536
            )  # int cells: 101 integers; float: the upper bound's own cell
            assert all(0 <= c <= limit for c in cells), (variant, i)


@pytest.mark.parametrize("sql", QUERIES)
def test_answered_alike_on_every_neighbour(neighbours: dict[tuple[str, str], Backend], sql: str) -> None:
    policy = parse_policy(POLICY)
    for (variant, kind), backend in neighbours.items():
        result = Engine(policy, backend, Ledger.open("sqlite:///:memory:")).execute(sql, Session("alice"))
        assert [c.type for c in result.columns] == (
            ["text", "double precision", "bigint", "bigint", "bigint"]
            if "GROUP BY" in sql
            else ["double precision"] * 4
        ), (variant, kind)
        for row in result.rows:
            values = row[1:] if "GROUP BY" in sql else row
            bounds = (-50, 50) if "GROUP BY" in sql else (0.0, 10.0)
            assert all(bounds[0] <= v <= bounds[1] for v in values), (variant, kind, row)
            if "GROUP BY" in sql:
                assert all(isinstance(v, int) for v in row[2:]), (variant, kind, row)
                assert float(row[1]).is_integer(), (variant, kind, row)
        # every quantile (MIN/MAX: their 95% range) carries a value interval inside the bounds, on every neighbour
        low, high = (-50, 50) if "GROUP BY" in sql else (0.0, 10.0)
        for ranges in result.intervals:
            for o, ends in enumerate(ranges):
                if o == 0 and "GROUP BY" in sql:
                    assert ends is None, (variant, kind, ranges)  # the key
                else:
                    assert ends is not None and low <= ends[0] <= ends[1] <= high, (variant, kind, ranges)
        assert len(result.intervals) == len(result.rows), (variant, kind)


#: Each end of median(n)'s interval at a share of ε = 1 (the query's ε = 3 split in three).
INTERVAL_SQL = "SELECT median(n) FROM t"


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
@pytest.mark.parametrize("variant", ["at-bounds", "out-of-bounds"])
def test_interval_ends_are_epsilon_dp_on_neighbours(
    neighbours: dict[tuple[str, str], Backend], kind: str, variant: str
) -> None:
    """The person absent or present (at a bound, or far beyond it and clamped): every possible lower
    and upper end, P₁ ≤ e^ε·P₂ both ways (Clopper–Pearson, Bonferroni over outcomes and directions),
    from the neighbours' histograms as each backend counts them."""
    policy = parse_policy(POLICY)
    n, epsilon = 3000, 1.0
    samples = []
    for name in ("absent", variant):  # drawn once per distinct release input (the absent person's are shared)
        engine = Engine(policy, neighbours[(name, kind)], Ledger.open("sqlite:///:memory:"))
        prepared = engine.prepare(INTERVAL_SQL, Session("alice", epsilon=3 * epsilon))
        assert prepared.budgeting.shares == [epsilon] * 3
        samples.append(sampled_interval_ends(engine, prepared, n))
    for i in (0, 1):  # lower ends, then upper ends
        outcomes = assert_counts_epsilon_dp(samples[0][i], samples[1][i], n, epsilon, (kind, variant))
        assert len(outcomes) > 2, samples  # the ends vary: the check is not vacuous
