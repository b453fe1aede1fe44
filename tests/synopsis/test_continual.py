"""Continual release (issue #38 item 3): a ``continual`` synopsis refreshed after its time column's bound
grows by one month releases that month only (charged once), earlier periods stay, and answers span all
of them — as one release over every month would. DuckDB and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.curator.synopsis_cli import ledger_identity, release
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.errors import InvalidParameterValue
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.session import Result, Session
from dpsql.synopsis.answer import estimate
from dpsql.synopsis.current import Stitched
from dpsql.synopsis.store import prefix
from tests.pg import open_demo_backend

CLINIC = demo_policy_path("clinic")
SERIES = """
  visits_series:
    table: visits
    keys: [department, "DATE_TRUNC('month', visit_date)"]
    measures: ["COUNT(*)", "SUM(cost)"]
    continual: true
    epsilon: 2.0
"""


def policy(upper: str) -> Policy:
    text = CLINIC.read_text().replace("upper: 2024-12-31", f"upper: {upper}") + SERIES
    return parse_policy(text, str(CLINIC))


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    opened = open_demo_backend(request, "clinic")
    yield opened
    opened.close()


def engine_on(backend: Backend, ledger: Ledger, upper: str) -> Engine:
    return Engine(policy(upper), backend, ledger, ResultCache())


def run(engine: Engine, sql: str) -> Result:
    return engine.execute(sql, Session("alice"))


def from_series(result: Result) -> bool:
    return result.epsilon_spent == 0 and any('answered from synopsis "visits_series"' in n for n in result.notices)


def test_a_new_month_is_released_alone_and_answers_span_both(backend: Backend) -> None:
    ledger = Ledger.open("sqlite:///:memory:")
    november = engine_on(backend, ledger, "2024-11-30")
    first = release(november, "visits_series")
    assert first.charged and first.released.generation == 1 and len(first.released.keys[1].domain) == 59
    assert from_series(run(november, "SELECT DATE_TRUNC('year', visit_date), COUNT(*) FROM visits GROUP BY 1"))
    # the curator extends the bound by one month: until the refresh, the series does not cover the policy
    december = engine_on(backend, ledger, "2024-12-31")
    year = "SELECT COUNT(*), AVG(cost) FROM visits WHERE visit_date >= '2024-01-01' AND visit_date < '2025-01-01'"
    assert run(december, year).epsilon_spent > 0
    refreshed = release(december, "visits_series", after=1)
    assert refreshed.charged and refreshed.released.generation == 2
    assert [str(v)[:7] for v in refreshed.released.keys[1].domain] == ["2024-12"]  # that month only
    charges = [c.fingerprint for c in ledger.charges("clinic", ledger_identity("visits_series"))]
    assert sorted(charges) == ["synopsis visits_series g1", "synopsis visits_series g2"]
    assert ledger.spent("clinic", ledger_identity("visits_series")).epsilon == pytest.approx(4.0)
    assert len(ledger.synopsis_keys(prefix("clinic", "visits_series"))) == 2  # the first period stays
    # answers span both pieces: 2024 from eleven months of the first and December of the second
    fresh_engine = engine_on(backend, ledger, "2024-12-31")
    spanning = run(fresh_engine, year)
    assert from_series(spanning)
    monthly = run(fresh_engine, "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1")
    assert from_series(monthly) and len(monthly.rows) == 60
    whole = fresh_engine.step.deriver.synopses(ledger, fresh_engine.step._database_identity or "")
    assert isinstance(whole[0], Stitched) and len(whole[0].parts) == 2
    # one consistent series across pieces: a year's estimate is the sum of its months' (before display
    # clips noisy counts at 0), and its variance the pieces' variances added
    session = Session("alice")
    by_month = fresh_engine.prepare("SELECT DATE_TRUNC('month', visit_date), COUNT(*) FROM visits GROUP BY 1", session)
    by_year = fresh_engine.prepare("SELECT DATE_TRUNC('year', visit_date), COUNT(*) FROM visits GROUP BY 1", session)
    months, years = (
        estimate(by_month.plan, whole[0], fresh_engine.policy),
        estimate(by_year.plan, whole[0], fresh_engine.policy),
    )
    assert months is not None and years is not None
    assert list(years.values[0]) == pytest.approx(list(months.values[0].reshape(5, 12).sum(axis=1)))
    assert from_series(run(fresh_engine, "SELECT DATE_TRUNC('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY 1"))
    # nothing new to release: refused, nothing charged
    with pytest.raises(InvalidParameterValue, match="no new period"):
        release(fresh_engine, "visits_series", after=2)
    assert ledger.spent("clinic", ledger_identity("visits_series")).epsilon == pytest.approx(4.0)
    for opened in (november, december, fresh_engine):
        opened.audit.close()
    ledger.close()
