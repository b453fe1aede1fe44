"""COUNT(*) = 0 beside a non-NULL AVG (issue #29 item 6): a row released as empty reads as empty throughout.

AVG(col) divides by a noisy COUNT(col) of its own, so a yearly chart could show COUNT 0 beside an
AVG. :func:`dpsql.postprocess.finish.finish` now reads every count measure of a row whose released
COUNT(*) is 0 as at most 0: AVG and the variances of that row are NULL (PostgreSQL's AVG of an empty
group) and a COUNT(col) beside it is 0. It reads only released noisy values: post-processing, free.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.postprocess.finish import finish
from dpsql.session import Session


@pytest.fixture(scope="module")
def health_policy() -> Policy:
    return load_policy(demo_policy_path("health"))


def _finish(policy: Policy, sql: str, rows: list[tuple[Any, ...]], columns: list[list[float]]) -> list[tuple[Any, ...]]:
    plan = analyze(sql, policy)
    widths: list[list[float | None]] = [[1.0] * len(columns) for _ in rows]
    before = copy.deepcopy(columns)
    result = finish(plan, rows, columns, widths)
    assert columns == before, "released measurements are stored for reuse: never changed in place"
    return result.rows


MIXED = "SELECT sex, COUNT(*), AVG(bmi), COUNT(bmi), ROUND(AVG(bmi), 1) AS r, VAR_POP(bmi) FROM patients GROUP BY sex"


def test_zero_count_row_has_null_avg(health_policy: Policy) -> None:
    plan = analyze(MIXED, health_policy)
    kinds = [m.kind for m in plan.measures]
    assert kinds[0] == "count_star" and "count" in kinds
    # measures: COUNT(*), Σ(bmi−c), COUNT(bmi), Σ(bmi−c)² (the order the analyzer made)
    star, count = 0, kinds.index("count")
    sums = [i for i, k in enumerate(kinds) if k == "sum"]
    columns: list[list[float]] = [[0.0, 0.0] for _ in kinds]  # released values as the noise step gives them
    columns[star] = [0, 120]  # Female: released COUNT(*) 0; Male: 120
    columns[count] = [3.0, 110.0]  # the AVG's own noisy count is positive in both
    for i in sums:
        columns[i] = [12.0, 50.0]
    female, male = _finish(health_policy, MIXED, [("Female",), ("Male",)], columns)
    assert female[1:] == (0, None, 0, None, None)
    assert male[1] == 120 and male[3] == 110 and all(v is not None for v in male[2:])


def test_negative_noise_is_kept_and_positive_counts_win(health_policy: Policy) -> None:
    """Negative noisy counts stay (sums over groups keep their noise); a positive COUNT(*) changes nothing."""
    sql = "SELECT sex, COUNT(*) AS n, COUNT(bmi) AS b, COUNT(bmi) - 0.5 AS raw FROM patients GROUP BY sex"
    female, male = _finish(health_policy, sql, [("Female",), ("Male",)], [[-3, 1], [-1, 4]])
    assert female == ("Female", 0, 0, -1.5)  # the negative noisy COUNT(bmi) is read as is
    assert male == ("Male", 1, 4, 3.5)


def test_direct_path_counts_are_consistent(health_policy: Policy) -> None:
    """Plans of bare keys and counts skip the interpreter: the same rule holds there."""
    sql = "SELECT sex, COUNT(*), COUNT(bmi) FROM patients GROUP BY sex"
    rows = _finish(health_policy, sql, [("Female",), ("Male",)], [[0, 50], [2, 48]])
    assert rows == [("Female", 0, 0), ("Male", 50, 48)]


# --- end to end, DuckDB and PostgreSQL ------------------------------------------------------------------

YEARLY = (
    "SELECT DATE_TRUNC('year', dob) AS y, COUNT(*) AS n, AVG(bmi) AS a, COUNT(bmi) AS b, VAR_POP(bmi) AS v "
    "FROM patients GROUP BY 1 ORDER BY 1"
)


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def health_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    url = "duckdb://" if request.param == "duckdb" else request.getfixturevalue("pg_new_database")()
    backend = open_backend(url)
    try:
        load_demo(backend, ["health"])
        yield backend
    finally:
        backend.close()


def test_yearly_chart_never_shows_count_zero_beside_an_avg(health_backend: Backend, health_policy: Policy) -> None:
    """The demo's yearly DOB chart (groups of 0-3 patients in the 1920s) at a small ε, several times."""
    engine = Engine(health_policy, health_backend, Ledger.open("sqlite:///:memory:"))
    empty = 0
    for epsilon in (0.5, 0.4, 0.3, 0.2):  # another ε each time: a fresh release, not a cached one
        result = engine.execute(YEARLY, Session("alice", epsilon=epsilon))
        assert result.epsilon_spent == pytest.approx(epsilon)
        for _, n, avg, count_bmi, var in result.rows:
            if n == 0:
                empty += 1
                assert (avg, count_bmi, var) == (None, 0, None)
    assert empty > 0, "no row released with COUNT(*) = 0: the test did not exercise the rule"
