"""An empty group's AVG is NULL — decided from the noisy count only, never from the true one.

``dp_avg`` returns NULL when its noisy count is ≤ 0 (PostgreSQL answers NULL for an empty group).
If the true count decided it, a NULL would say "nobody here" exactly. The neighbours: a public
domain value ``rare`` held by nobody, or by one person; on DuckDB and PostgreSQL, every run must
satisfy ``AVG IS NULL ⇔ noisy COUNT ≤ 0`` (the count column *is* AVG's count measure: one measure,
noised once), and both outcomes must occur on both neighbours (the true count is 0 on one, 1 on the
other, so neither decides it). tests/adversarial/README lists the case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session

POLICY = """
dataset: avgnull
defaults: {epsilon: 1.0, delta: 1.0e-6}
budget:
  dataset: {epsilon: 1.0e9, delta: 0.5}
  analyst: {epsilon: 1.0e9, delta: 0.5}
analysts: [{name: alice}]
tables:
  t:
    privacy_unit: id
    max_rows_per_unit: 1
    columns:
      id: {type: int, identifier: true}
      problem: {type: text, domain: [asthma, flu, rare], nullable: false}
      cost: {type: float, lower: 0.0, upper: 100.0, nullable: false}
      visits: {type: int, lower: 0, upper: 10, nullable: false}
"""

SQL = "SELECT problem, COUNT(*), AVG(cost), var_pop(visits) FROM t GROUP BY problem"
RUNS = 30


def _script(with_rare: bool) -> str:
    rows = [f"({i}, '{'asthma' if i % 2 else 'flu'}', {i * 3.5}, {i % 5})" for i in range(1, 21)]
    if with_rare:
        rows.append("(99, 'rare', 42.0, 3)")
    return (
        "DROP TABLE IF EXISTS t; CREATE TABLE t (id BIGINT, problem TEXT, cost DOUBLE PRECISION, visits BIGINT); "
        f"INSERT INTO t VALUES {', '.join(rows)}"
    )


@pytest.fixture(scope="module")
def neighbours(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, bool], Backend]]:
    backends = {}
    for with_rare in (False, True):
        for kind in ("duckdb", "postgres"):
            backend = open_backend("duckdb://" if kind == "duckdb" else pg_new_database())
            backend.execute_script(_script(with_rare))
            backends[(kind, with_rare)] = backend
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
def test_avg_null_follows_the_noisy_count(neighbours: dict[tuple[str, bool], Backend], kind: str) -> None:
    policy = parse_policy(POLICY)
    outcomes: dict[bool, set[bool]] = {}
    for with_rare in (False, True):
        engine = Engine(policy, neighbours[(kind, with_rare)], Ledger.open("sqlite:///:memory:"))
        seen: set[bool] = set()
        for _ in range(RUNS):
            result = engine.execute(SQL, Session("alice", epsilon=0.2))
            assert [r[0] for r in result.rows] == ["asthma", "flu", "rare"]  # the public domain, always
            for row, accuracy in zip(result.rows, result.accuracy, strict=True):
                _, count, avg, var = row
                assert (avg is None) == (count <= 0), row  # the noisy count decides, nothing else
                assert (var is None) == (count <= 0), row  # var_pop: the same shared count measure
                assert (accuracy[2] is None) == (avg is None)  # a NULL has no interval
                if avg is not None:
                    assert 0.0 <= avg <= 100.0
            rare = next(r for r in result.rows if r[0] == "rare")
            seen.add(rare[2] is None)
        outcomes[with_rare] = seen
    # nobody holds "rare" (true count 0) / one person does (true count 1): NULL and a value on both
    assert outcomes == {False: {True, False}, True: {True, False}}
