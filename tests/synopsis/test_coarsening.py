"""Coarsening (issue #29 item 2): a query whose groups are unions of an earlier release's finer groups is
answered by summing its released cells, free, when that is at least as accurate as a fresh answer (or
within ``dpsql.accuracy``); otherwise it is charged. DuckDB and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.policy import load_policy
from dpsql.session import Result, Session
from tests.demos import cached_engine, demo_fixture

COARSENED = "answered by summing the cells of "


backend = demo_fixture("clinic", kind="both", scope="module")


@pytest.fixture
def engine(backend: Backend) -> Iterator[Engine]:
    with cached_engine(load_policy(demo_policy_path("clinic")), backend) as opened:
        yield opened


def run(engine: Engine, sql: str, epsilon: float) -> Result:
    return engine.execute(sql, Session("alice", epsilon=epsilon))


def coarsened(result: Result) -> bool:
    return result.epsilon_spent == 0 and any(COARSENED in n for n in result.notices)


def test_a_total_from_released_finer_groups_is_free_and_consistent(engine: Engine) -> None:
    fine = run(engine, "SELECT department, urgent, COUNT(*) AS n, AVG(cost) FROM visits GROUP BY 1, 2", 4.0)
    assert fine.epsilon_spent == 4.0
    coarse = run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY department ORDER BY 1", 1.0)
    assert coarsened(coarse)
    sums: dict[str, int] = {}
    for department, _, n, _ in fine.rows:
        sums[department] = sums.get(department, 0) + n
    for department, n in coarse.rows:
        if all(m > 0 for d, _, m, _ in fine.rows if d == department):  # no cell shown clipped at 0
            assert n == sums[department]
    assert engine.ledger.spent("clinic", "alice").epsilon == 4.0
    # a filter on a key the release grouped by; AVG from the released sums and counts
    oncology = run(engine, "SELECT urgent, COUNT(*), AVG(cost) FROM visits WHERE department = 'Oncology' GROUP BY 1", 1)
    assert coarsened(oncology) and len(oncology.rows) == 2


def test_less_accurate_than_a_fresh_answer_is_charged(engine: Engine) -> None:
    run(engine, "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1", 0.5)
    yearly = run(engine, "SELECT DATE_TRUNC('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY 1", 1.0)
    assert yearly.epsilon_spent == 1.0  # 12 months at ε=0.5 are far noisier than one year at ε=1
    cheap = run(engine, "SELECT DATE_TRUNC('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY 1", 0.01)
    assert coarsened(cheap)  # ... and far less noisy than one year at ε=0.01


def test_other_filters_are_a_new_measurement(engine: Engine) -> None:
    run(engine, "SELECT department, urgent, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1, 2", 4.0)
    assert run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY 1", 1.0).epsilon_spent == 1.0
    assert run(engine, "SELECT department, COUNT(*) FROM visits WHERE cost > 200 GROUP BY 1", 1.0).epsilon_spent == 1
    same = run(engine, "SELECT department, COUNT(*) FROM visits WHERE cost > 100 GROUP BY 1", 1.0)
    assert coarsened(same)  # the release's own filter


def test_a_value_outside_the_domain_is_a_fresh_answer(engine: Engine) -> None:
    """Issue #38 item 6: released cells stand for the declared values only; a filter on an undeclared one
    (which the data may hold) is not derived from them as an exact 0 a fresh query would contradict, but
    answered fresh and charged, whatever was released before. The same for a filter keeping no cell."""
    run(engine, "SELECT department, urgent, COUNT(*) FROM visits GROUP BY 1, 2", 8.0)
    for sql in (
        "SELECT COUNT(*) FROM visits WHERE department = 'Nowhere'",
        "SELECT COUNT(*) FROM visits WHERE department IN ('Oncology', 'Nowhere')",
        "SELECT urgent, COUNT(*) FROM visits WHERE department <> 'Nowhere' GROUP BY 1",
        "SELECT COUNT(*) FROM visits WHERE department LIKE 'Nowhere%'",
    ):
        fresh = run(engine, sql, 1.0)
        assert fresh.epsilon_spent == 1.0 and not coarsened(fresh), sql
        assert fresh.accuracy[0][-1] is not None and fresh.accuracy[0][-1] > 0, sql
    assert coarsened(run(engine, "SELECT COUNT(*) FROM visits WHERE department IN ('Oncology', 'Neurology')", 1.0))


def test_private_keys_are_never_coarsened(engine: Engine) -> None:
    """Partition selection drops rare keys: summing what survived would not be the coarser count."""
    delta = Session("alice", epsilon=4.0, delta=1e-7)
    engine.execute("SELECT patients.zip, sex, COUNT(*) FROM patients GROUP BY 1, 2", delta)
    result = run(engine, "SELECT sex, COUNT(*) FROM patients GROUP BY 1", 1.0)
    assert result.epsilon_spent == 1.0
