"""Every past release usable (issue #38 item 1): the index keeps every release over public keys (not the
first eight per table and filter), holds the most useful ones' cells within a memory budget, and answers
from the inverse-variance combination of all releases that cover a query — never worse than the best one.
DuckDB and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.policy import parse_policy
from dpsql.session import Result, Session
from dpsql.synopsis import reuse
from tests.demos import cached_engine, demo_fixture

CLINIC = demo_policy_path("clinic")
#: A bigger analyst budget than the demo's (every chart of a dashboard, then its re-renders).
BIG_BUDGET = CLINIC.read_text().replace("analyst: {epsilon: 20.0", "analyst: {epsilon: 90.0")

#: Charts a dashboard server saw first (issue #38: the trendline, an AVG bar, an urgent bar, time lines).
OTHER_CHARTS = [
    "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1",
    "SELECT department, AVG(cost) FROM visits GROUP BY 1",
    "SELECT urgent, COUNT(*) FROM visits GROUP BY 1",
    "SELECT DATE_TRUNC('year', visit_date), COUNT(*) FROM visits GROUP BY 1",
    "SELECT DATE_TRUNC('quarter', visit_date), COUNT(*) FROM visits GROUP BY 1",
    "SELECT DATE_TRUNC('week', visit_date), COUNT(*) FROM visits GROUP BY 1",
    "SELECT DATE_TRUNC('day', visit_date), COUNT(*) FROM visits GROUP BY 1",
    "SELECT urgent, DATE_TRUNC('month', visit_date), COUNT(*) FROM visits GROUP BY 1, 2",
    "SELECT DATE_TRUNC('month', visit_date), SUM(cost) FROM visits GROUP BY 1",
    "SELECT department, urgent, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1, 2",
]
FILTERS = ["'Cardiology', 'Oncology'", "'Oncology'", "'Neurology', 'Emergency', 'Dermatology'", "'Pediatrics'"]


backend = demo_fixture("clinic", kind="both", scope="module")


@pytest.fixture
def engine(backend: Backend) -> Iterator[Engine]:
    with cached_engine(parse_policy(BIG_BUDGET, str(CLINIC)), backend) as opened:
        yield opened


def run(engine: Engine, sql: str, epsilon: float = 1.0) -> Result:
    return engine.execute(sql, Session("alice", epsilon=epsilon, bias=False))  # noise-only ± are combined


def derived(result: Result) -> bool:
    return result.epsilon_spent == 0 and any("answered by summing the cells of" in n for n in result.notices)


def test_a_release_after_many_others_still_answers_filters_and_coarser_grains(engine: Engine) -> None:
    for sql in OTHER_CHARTS:
        assert run(engine, sql).epsilon_spent == 1.0, sql
    bar = "SELECT department AS department, COUNT(*) AS count FROM public.visits GROUP BY department"
    assert run(engine, bar).epsilon_spent == 1.0
    spent = engine.ledger.spent("clinic", "alice").epsilon
    for chosen in FILTERS:  # a dashboard re-rendered with its department filter changed, then coarser grains
        sql = (
            f"SELECT department AS department, COUNT(*) AS count FROM public.visits WHERE department IN ({chosen}) "
            "GROUP BY department ORDER BY count DESC LIMIT 10000"
        )
        assert derived(run(engine, sql)), sql
        if "," not in chosen:  # one cell: as accurate as a fresh total (two cells would be √2× wider: charged)
            assert derived(run(engine, f"SELECT COUNT(*) FROM visits WHERE department = {chosen}")), chosen
    for urgent in ("urgent", "NOT urgent", "urgent = TRUE"):  # a filter on the other key of an earlier release
        sql = f"SELECT DATE_TRUNC('month', visit_date), COUNT(*) FROM visits WHERE {urgent} GROUP BY 1"
        assert derived(run(engine, sql)), sql
    assert engine.ledger.spent("clinic", "alice").epsilon == spent


def test_releases_are_combined_never_worse_than_the_best(engine: Engine) -> None:
    """Two releases of the department bar at ε=1 and ε=1.01: a query at ε=1.4 is narrower than either
    (not free from one alone) but their combination is narrower still (std ∝ 1/√(1+1.01²) < 1/1.4)."""
    first = run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY 1", 1.0)
    second = run(engine, "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1", 1.01)
    assert first.epsilon_spent == 1.0 and second.epsilon_spent == 1.01
    combined = run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1", 1.4)
    assert derived(combined) and any("2 earlier, finer releases, combined" in n for n in combined.notices)
    width = combined.accuracy[0][1]
    assert width is not None and width < min(w for (_, w) in first.accuracy + second.accuracy if w is not None)
    assert width == pytest.approx(first.accuracy[0][1] / (1 + 1.01**2) ** 0.5, rel=0.02)
    # the estimate lies between the two releases' values (a weighted mean), department by department
    for (department, n), (d1, a), (d2, b) in zip(combined.rows, sorted(first.rows), sorted(second.rows), strict=True):
        assert department == d1 == d2 and min(a, b) - 1 <= n <= max(a, b) + 1
    # at ε=2 even the combination is wider than a fresh answer: charged
    assert run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1", 2.0).epsilon_spent == 2.0


def test_cells_kept_by_use_within_the_memory_budget(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the memory budget the least used releases' cells are dropped (their signatures stay) and read
    again from the cache when a query needs them; the most used stay loaded."""
    index = engine.step.deriver.index
    assert index is not None
    run(engine, "SELECT department, urgent, COUNT(*) FROM visits GROUP BY 1, 2", 4.0)
    for _ in range(3):
        assert derived(run(engine, "SELECT department, COUNT(*) FROM visits WHERE department = 'Oncology' GROUP BY 1"))
        run(engine, "SELECT urgent, COUNT(*) FROM visits GROUP BY 1", 1.0)
    busy = [e for state in index._bases.values() for e in state.entries if e.uses > 0]
    assert len(busy) == 1 and busy[0].released is not None
    monkeypatch.setattr(reuse, "MEMORY_BYTES", busy[0].nbytes)
    for sql in OTHER_CHARTS[:4]:
        run(engine, sql, 0.5)
    entries = [e for state in index._bases.values() for e in state.entries]
    assert len(entries) >= 4 and sum(e.released is not None for e in entries) <= 2
    assert busy[0].released is not None  # the used one was kept, later arrivals were dropped
    # an evicted release is read again when useful
    evicted = next(e for e in entries if e.released is None)
    assert evicted.document and derived(run(engine, "SELECT COUNT(*) FROM visits WHERE urgent"))
