"""Issue #40 item 2's clinic bar: the person-level p90 of visit cost at ε = 1, on DuckDB and PostgreSQL.

What the released p90 can be accurate about is the p90 of what the policy lets a query see: at most
20 visits per patient (``max_rows_per_unit``), costs clamped to [0, 2000]; exact 589.9. Measured
(``bench/quantiles.py``, 100 releases from one measurement): median release 591.5, 0.3 % off it; a
single release's median |error| 2.6 %. The exact p90 of *all* visits (885.2) is set by three patients'
900 visits at 4,999 (8 % of the rows, 280 of each patient's 300 beyond the cap); the released value is
33 % below it, and no mechanism under the 20-visit cap can do better: :func:`test_the_cut_visits_are_invisible`
builds a twin clinic whose cut visits cost 10 instead of 4,999 (exact p90 ~575, the same published share
of rows cut): the measurement's SQL returns the very same rows on both, so every release has the same
distribution on both, and no median is within 5 % of 885 and of 575 at once. The printed 95 % value
interval covers the exact p90 by design: its ends cover the 8 % of rows cut the clinic's curator
publishes (``dpsql.noise.exponential.cut_levels``; measured 100 of 100, median interval [~426, 2000];
with ``dpsql.bias`` off, [~434, ~1500], 98 of 100).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import HEAVY_PATIENTS, demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session
from tests.pg import open_demo_backend

P90 = "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY cost) FROM visits"
#: The p90 over what a query may see: each patient's first 20 visits (any 20: a heavy patient's all cost
#: 4,999), cost clamped to the declared bounds. PostgreSQL and DuckDB both have percentile_cont.
VISIBLE = (
    "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY LEAST(GREATEST(cost, 0), 2000)) FROM "
    "(SELECT cost, row_number() OVER (PARTITION BY patient_id ORDER BY id) AS k FROM visits) v WHERE k <= 20"
)
EXACT = "SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY cost) FROM visits"
#: Releases from one measurement (the mechanism's distribution; ~3 ms each).
RELEASES = 21


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def clinic(request: pytest.FixtureRequest) -> Iterator[Backend]:
    backend = open_demo_backend(request, "clinic")
    yield backend
    backend.close()


def _engine(backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))


def _scalar(backend: Backend, sql: str) -> float:
    return float(backend.execute(sql)[1][0][0])


def _measure(engine: Engine) -> tuple[Any, list[Any], dict[int, list[Any]]]:
    prepared = engine.prepare(P90, Session("alice", epsilon=1.0))
    rows = engine.step.query(prepared.sql)
    histograms = {i: sorted(engine.step.query(q)) for i, q in prepared.histograms}
    return prepared, rows, histograms


def test_p90_within_five_percent_of_what_the_cap_lets_it_see(clinic: Backend) -> None:
    """The median of 21 releases within 5 % of the visible p90 (measured 0.3–1 %), and the 95 % value
    interval covering the exact p90 of all visits in at least 17 of 21 (measured 100 of 100; fewer has
    probability below ~1e-4 even at the noise-only 98 %)."""
    engine = _engine(clinic)
    exact, visible = _scalar(clinic, EXACT), _scalar(clinic, VISIBLE)
    assert abs(exact - 885.17) < 0.01 and abs(visible - 589.94) < 0.01
    prepared, rows, histograms = _measure(engine)
    released = [engine.step.release_rows(prepared, rows, 0.95, histograms) for _ in range(RELEASES)]
    values = [float(r.rows[0][0]) for r in released]
    ranges = [end for r in released if (end := r.intervals[0][0]) is not None]
    assert len(ranges) == RELEASES
    assert abs(statistics.median(values) - visible) / visible <= 0.05, statistics.median(values)
    assert sum(low <= exact <= high for low, high in ranges) >= 17, ranges
    assert sum(low <= visible <= high for low, high in ranges) >= 17, ranges


def _cut_to_the_bottom(backend: Backend, engine: Engine, base: dict[int, list[Any]]) -> None:
    """Move each heavy patient's 280 visits beyond the cap to a low cost, choosing the cost (10, 11, …)
    whose salted row order still keeps the 4,999 visits: the measurement's histograms stay ``base``."""
    for patient in HEAVY_PATIENTS:
        cut = f"SELECT id FROM visits WHERE patient_id = {patient} ORDER BY id LIMIT 280"
        for cost in range(10, 60):
            backend.execute_script(f"UPDATE visits SET cost = {cost} WHERE id IN ({cut})")
            if _measure(engine)[2] == base:
                break
        else:
            raise AssertionError(f"no low cost keeps patient {patient}'s 4,999 visits")


def test_the_cut_visits_are_invisible(clinic: Backend) -> None:
    """The twin clinic (cut visits at the bottom, same policy and published cut share) gives the
    measurement the same rows: the released p90 has one distribution for exact p90s 885 and ~575, so
    the issue's 5 %-of-885 bar is out of reach of any mechanism under the 20-visit cap."""
    engine = _engine(clinic)
    _, rows, base = _measure(engine)
    exact = _scalar(clinic, EXACT)
    try:
        _cut_to_the_bottom(clinic, engine, base)
        _, twin_rows, twin = _measure(engine)
        twin_exact = _scalar(clinic, EXACT)
    finally:
        ids = " OR ".join(f"patient_id = {p}" for p in HEAVY_PATIENTS)
        clinic.execute_script(f"UPDATE visits SET cost = 4999.0 WHERE {ids}")
    assert twin == base and twin_rows == rows
    assert abs(exact - 885.17) < 0.01 and twin_exact < 600
    assert exact * 0.95 > twin_exact * 1.05  # no value is within 5 % of both
