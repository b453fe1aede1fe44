"""Quantile value intervals covering the published share of rows cut, on neighbouring databases (DuckDB and
PostgreSQL): the person absent, or present with rows far beyond the cap (ordinary, out of bounds, NaN).

The ends aim at public levels (:func:`dpsql.noise.exponential.cut_levels`), so the answer's shape and its
notes (numbers masked) are the same on every neighbour, and each end stays ε-DP on the neighbours' real
histograms, as each backend counts them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.dp_check import assert_counts_epsilon_dp, sampled_interval_ends

POLICY = """
dataset: cut
budget: {dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}
analysts: [{name: alice}]
tables:
  people:
    privacy_unit: id
    max_rows_per_unit: 1
    columns:
      id: {type: int, identifier: true}
  visits:
    references: {column: person, table: people, to: id}
    max_rows_per_unit: 3
    published_rows_cut: 0.2
    columns:
      person: {type: int, identifier: true}
      x: {type: float, lower: 0.0, upper: 10.0, nullable: false}
"""

#: The person who differs: absent, or present with 40 visits (37 beyond the cap) at this value.
VARIANTS: dict[str, float | None] = {"absent": None, "ordinary": 9.5, "out-of-bounds": 1e308, "nan": float("nan")}
SQL = "SELECT median(x) FROM visits"


def _load(backend: Backend, value: float | None) -> None:
    people = [(i,) for i in range(1, 301)]
    visits = [(i, (i * 37 % 1000) / 100.0) for i in range(1, 301) for _ in range(1 + i % 5)]
    if value is not None:
        people.append((999,))
        visits += [(999, value)] * 40
    backend.load_rows("people", [("id", "INTEGER")], people)
    backend.load_rows("visits", [("person", "INTEGER"), ("x", "DOUBLE PRECISION")], visits)


@pytest.fixture(scope="module")
def neighbours(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str], Backend]]:
    backends: dict[tuple[str, str], Backend] = {}
    for variant, value in VARIANTS.items():
        for kind, url in (("duckdb", "duckdb://"), ("postgres", pg_new_database())):
            backend = open_backend(url)
            _load(backend, value)
            backends[(variant, kind)] = backend
    yield backends
    for backend in backends.values():
        backend.close()


def test_answered_alike_on_every_neighbour(neighbours: dict[tuple[str, str], Backend]) -> None:
    policy = parse_policy(POLICY)
    shapes = set()
    for (variant, kind), backend in neighbours.items():
        result = Engine(policy, backend, Ledger.open("sqlite:///:memory:")).execute(SQL, Session("alice"))
        (ends,) = result.intervals[0]
        assert ends is not None and 0.0 <= ends[0] <= ends[1] <= 10.0, (variant, kind, ends)
        notes = tuple(re.sub(r"[0-9.]+", "#", n) for n in result.notices)
        assert any("rows cut beyond the cap the curator published for the table" in n for n in result.notices), notes
        shapes.add(notes)
    assert len(shapes) == 1, shapes


def _sampled_ends(backend: Backend, n: int, epsilon: float) -> tuple[Counter[float], Counter[float]]:
    engine = Engine(parse_policy(POLICY), backend, Ledger.open("sqlite:///:memory:"))
    prepared = engine.prepare(SQL, Session("alice", epsilon=3 * epsilon))
    assert prepared.budgeting.shares == [epsilon] * 3 and prepared.budgeting.interval_cut == 0.2
    return sampled_interval_ends(engine, prepared, n)


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
@pytest.mark.parametrize("variant", ["ordinary", "out-of-bounds"])
def test_cut_ends_are_epsilon_dp_on_neighbours(
    neighbours: dict[tuple[str, str], Backend], kind: str, variant: str
) -> None:
    """Every possible lower and upper end of median(x)'s interval at ε = 1 each: P₁ ≤ e^ε·P₂ both ways
    (Clopper–Pearson, Bonferroni over outcomes and directions), n = 2,000 releases per neighbour (drawn
    once per distinct release input: :func:`tests.dp_check.sampled_interval_ends`)."""
    n, epsilon = 2000, 1.0
    absent = _sampled_ends(neighbours[("absent", kind)], n, epsilon)
    present = _sampled_ends(neighbours[(variant, kind)], n, epsilon)
    for i in (0, 1):  # lower ends, then upper ends
        outcomes = assert_counts_epsilon_dp(absent[i], present[i], n, epsilon, (kind, variant))
        assert len(outcomes) > 2, (absent[i], present[i])  # the ends vary: the check is not vacuous
