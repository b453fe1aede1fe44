"""Curator synopses (issue #29 item 3): released once, charged once to the dataset, every covered query
answered free and consistent, on DuckDB and PostgreSQL; what a synopsis cannot answer exactly is charged
as an ordinary query."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import cast

import pytest

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.curator.synopsis_cli import build, ledger_identity
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.errors import Error, InvalidParameterValue
from dpsql.policy import Policy, load_policy, parse_policy
from dpsql.session import Result, Session
from dpsql.synopsis.answer import half_width_factor
from dpsql.synopsis.solve import noise_variance
from dpsql.synopsis.store import prefix
from tests.demos import cached_engine, demo_fixture

CLINIC = demo_policy_path("clinic")
DASHBOARD = "visits_dashboard"
#: A second declaration over the same table: a full cube with sums (AVG, coarsening, filters on both keys).
CUBE_YAML = """
  visits_cube:
    table: visits
    keys: [department, "DATE_TRUNC('month', visit_date)"]
    measures: ["COUNT(*)", "SUM(cost)"]
    epsilon: 3.0
"""


def clinic_policy(extra: str = CUBE_YAML) -> Policy:
    return parse_policy(CLINIC.read_text() + extra, str(CLINIC))


backend = demo_fixture("clinic", kind="both", scope="module")


@pytest.fixture
def engine(backend: Backend) -> Iterator[Engine]:
    with cached_engine(clinic_policy(), backend) as opened:
        yield opened


def run(engine: Engine, sql: str, analyst: str = "alice", epsilon: float | None = None) -> Result:
    return engine.execute(sql, Session(analyst, epsilon=epsilon))


def from_synopsis(result: Result, name: str) -> bool:
    return result.epsilon_spent == 0 and any(f'answered from synopsis "{name}"' in n for n in result.notices)


def test_build_is_charged_once_to_the_dataset_and_answers_are_free(engine: Engine) -> None:
    released = build(engine, DASHBOARD)
    assert released.epsilon == pytest.approx(1.0) and released.axes == ((0,), (1,))
    assert engine.ledger.spent("clinic", ledger_identity(DASHBOARD)).epsilon == pytest.approx(1.0)
    assert engine.ledger.spent("clinic").epsilon == pytest.approx(1.0)
    for sql in (
        "SELECT department, COUNT(*) FROM visits GROUP BY department",
        "SELECT department AS d, COUNT(*) AS n FROM visits GROUP BY department ORDER BY n DESC LIMIT 3",
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1",
        "SELECT DATE_TRUNC('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY 1",
        "SELECT COUNT(*) FROM visits",
    ):
        result = run(engine, sql)
        assert from_synopsis(result, DASHBOARD), sql
    assert engine.ledger.spent("clinic", "alice").epsilon == 0
    assert engine.ledger.spent("clinic").epsilon == pytest.approx(1.0)


def test_answers_are_consistent_across_charts(engine: Engine) -> None:
    build(engine, DASHBOARD)
    departments = run(engine, "SELECT department, COUNT(*) FROM visits GROUP BY department").rows
    months = run(engine, "SELECT DATE_TRUNC('month', visit_date), COUNT(*) FROM visits GROUP BY 1").rows
    years = run(engine, "SELECT DATE_TRUNC('year', visit_date), COUNT(*) FROM visits GROUP BY 1").rows
    total = run(engine, "SELECT COUNT(*) FROM visits").rows[0][0]
    assert len(departments) == 6 and len(months) == 60 and len(years) == 5
    # least squares makes every marginal agree (up to each chart's own rounding to integers)
    assert abs(sum(n for _, n in departments) - total) <= 6
    if 0 not in [n for _, n in months]:  # a negative estimate is shown as 0 (a count is never negative)
        assert abs(sum(n for _, n in months) - total) <= 60
    for year, count in years:
        of_year = [n for m, n in months if m.year == year.year]
        if 0 not in of_year:  # a negative estimate shown as 0 (a count is never negative) breaks the sum
            assert abs(sum(of_year) - count) <= 12


def test_filters_and_coarser_grains_on_the_full_cube(engine: Engine) -> None:
    build(engine, "visits_cube")
    cells = run(
        engine,
        "SELECT department, DATE_TRUNC('quarter', visit_date) AS q, COUNT(*), AVG(cost) FROM visits "
        "WHERE department IN ('Oncology', 'Cardiology') AND visit_date >= '2022-01-01' "
        "AND visit_date <= '2022-12-31' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    assert from_synopsis(cells, "visits_cube")
    assert [(d, q.month) for d, q, _, _ in cells.rows] == [
        (d, m) for d in ("Cardiology", "Oncology") for m in (1, 4, 7, 10)
    ]
    assert all(q.year == 2022 for _, q, _, _ in cells.rows)
    assert all(0 <= avg <= 2000 for *_, avg in cells.rows if avg is not None)  # AVG clamped to the bounds
    year = run(
        engine,
        "SELECT COUNT(*) FROM visits WHERE visit_date >= '2022-01-01' AND visit_date < '2023-01-01'",
    )
    quarters = run(
        engine,
        "SELECT DATE_TRUNC('quarter', visit_date), COUNT(*) FROM visits WHERE visit_date BETWEEN '2022-01-01' "
        "AND '2022-12-31' GROUP BY 1",
    )
    assert from_synopsis(year, "visits_cube") and from_synopsis(quarters, "visits_cube")
    assert len(quarters.rows) == 4 and abs(sum(n for _, n in quarters.rows) - year.rows[0][0]) <= 4


@pytest.mark.parametrize(
    "sql",
    [
        # a range that splits a month: part of a cell is not a released value
        "SELECT department, COUNT(*) FROM visits WHERE visit_date >= '2022-01-15' GROUP BY department",
        "SELECT COUNT(*) FROM visits WHERE visit_date = '2022-01-15'",
        "SELECT COUNT(*) FROM visits WHERE visit_date < '2021-01-01' OR visit_date >= '2022-01-01'",
        # a column the synopsis has no key for
        "SELECT urgent, COUNT(*) FROM visits GROUP BY urgent",
        "SELECT department, COUNT(*) FROM visits WHERE urgent GROUP BY department",
        # a week is not a union of months; a measure it does not hold; another table
        "SELECT DATE_TRUNC('week', visit_date), COUNT(*) FROM visits GROUP BY 1",
        "SELECT department, SUM(cost) FROM visits GROUP BY department",
        "SELECT sex, COUNT(*) FROM patients GROUP BY sex",
        # department × month was not measured by the dashboard synopsis (only its two marginals)
        "SELECT department, DATE_TRUNC('year', visit_date), COUNT(*) FROM visits GROUP BY 1, 2",
    ],
)
def test_what_a_synopsis_cannot_answer_exactly_is_charged(engine: Engine, sql: str) -> None:
    build(engine, DASHBOARD)
    result = run(engine, sql)
    assert result.epsilon_spent > 0 and not any("synopsis" in n for n in result.notices)


def test_every_dashboard_chart_within_twice_the_error_of_answering_it_alone(engine: Engine) -> None:
    """The #29 bar on the engine: 12 charts (bar, pie, table, monthly lines with a time range, a department
    filter changed 5 times) cost exactly the synopsis's ε, each within 2× the noise of the same chart
    answered alone at that whole ε (standard deviations: the released ± over z against the alone query's
    calibrated noise)."""
    released = build(engine, DASHBOARD)
    charts = [
        "SELECT department, COUNT(*) AS count FROM visits GROUP BY department ORDER BY count DESC LIMIT 10000",  # bar
        "SELECT department, COUNT(*) AS count FROM visits GROUP BY department ORDER BY count DESC LIMIT 100",  # pie
        "SELECT department AS department, COUNT(*) AS n FROM visits GROUP BY department LIMIT 1000",  # table
        "SELECT DATE_TRUNC('month', visit_date) AS visit_date, COUNT(*) AS count FROM visits "
        "WHERE visit_date >= '2021-01-01 00:00:00' AND visit_date < '2022-01-01 00:00:00' "
        "GROUP BY DATE_TRUNC('month', visit_date) ORDER BY visit_date",  # monthly line, time range
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1",  # whole range
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) AS c FROM visits GROUP BY 1 ORDER BY c DESC LIMIT 5",
        *(
            f"SELECT department, COUNT(*) AS count FROM visits WHERE department IN ({chosen}) GROUP BY department"
            for chosen in (
                "'Oncology'",
                "'Oncology', 'Cardiology'",
                "'Pediatrics', 'Emergency', 'Neurology'",
                "'Dermatology'",
                "'Cardiology', 'Neurology'",
            )
        ),
        "SELECT department, COUNT(*) AS count FROM visits GROUP BY department HAVING COUNT(*) > 100",
    ]
    assert len(charts) == 12
    z = half_width_factor(0.95, ["laplace"])  # half-width per standard deviation, as the answers use it
    worst = 0.0
    for sql in charts:
        result = run(engine, sql)
        assert from_synopsis(result, DASHBOARD), sql
        widths = [cast(float, acc[-1]) for acc in result.accuracy]  # every measure has a half-width
        alone = engine.prepare(sql, Session("alice", epsilon=released.epsilon)).budgeting.specs[0]
        assert alone is not None
        alone_sd = math.sqrt(noise_variance(alone))
        worst = max(worst, *(w / z / alone_sd for w in widths))
    assert worst <= 2.0, worst
    assert engine.ledger.spent("clinic").epsilon == pytest.approx(released.epsilon)


def test_declaration_change_or_forged_release_is_never_used(engine: Engine, backend: Backend) -> None:
    build(engine, DASHBOARD)
    sql = "SELECT department, COUNT(*) FROM visits GROUP BY department"
    changed = parse_policy(CLINIC.read_text().replace("epsilon: 1.0\n", "epsilon: 1.5\n"), str(CLINIC))
    other = Engine(changed, backend, engine.ledger, ResultCache())
    assert run(other, sql).epsilon_spent > 0  # the release measured another declaration
    key = engine.ledger.synopsis_keys(prefix("clinic"))[-1]
    sealed = json.loads(engine.ledger.synopsis_document(key) or "")
    body = json.loads(sealed["body"])
    body["built_at"] += 1.0
    forged = json.dumps({"mac": sealed["mac"], "body": json.dumps(body)})
    engine.ledger.add_synopsis(key[:-1] + "9", forged)
    fresh = Engine(clinic_policy(), backend, engine.ledger, ResultCache())
    assert from_synopsis(run(fresh, sql), DASHBOARD)  # the genuine release, not the forged newer one


def test_refusals_before_any_charge(engine: Engine) -> None:
    with pytest.raises(InvalidParameterValue, match='synopsis "nope" is not declared'):
        build(engine, "nope")
    bad = Engine(
        clinic_policy("  by_patient:\n    table: visits\n    keys: [patient_id]\n    epsilon: 1.0\n"),
        engine.backend,
        engine.ledger,
        None,
    )
    with pytest.raises(Error) as refused:
        build(bad, "by_patient")
    assert refused.value.sqlstate in ("0A000", "42501")
    assert engine.ledger.spent("clinic").epsilon == 0


def test_demo_policy_declares_the_dashboard_synopsis() -> None:
    policy = load_policy(CLINIC)
    assert policy.synopses[DASHBOARD].measured == ((0,), (1,))


def test_policy_check_reports_synopses_with_their_line() -> None:
    from dpsql.curator.check import check_text

    bad = CLINIC.read_text() + "  by_patient:\n    table: visits\n    keys: [patient_id]\n    epsilon: 1.0\n"
    report = check_text(bad, "clinic.yaml")
    assert any(": synopses.by_patient: " in e and "patient_id" in e for e in report.errors), report.errors
    unknown = CLINIC.read_text() + "  nope:\n    table: nowhere\n    keys: [x]\n    epsilon: 1.0\n"
    assert check_text(unknown, "clinic.yaml").policy is None  # 'table nowhere is not declared' at load
    wide = check_text(CLINIC.read_text() + CUBE_YAML, "clinic.yaml")
    assert wide.ok and any("3 marginals × 2 measures" in w for w in wide.warnings), wide.warnings


def test_a_composite_over_synopsis_answers_is_free(engine: Engine) -> None:
    build(engine, DASHBOARD)
    result = run(
        engine,
        "SELECT department AS k, COUNT(*) AS n FROM visits GROUP BY department UNION ALL "
        "SELECT 'all', COUNT(*) FROM visits",
    )
    assert result.epsilon_spent == 0 and len(result.rows) == 7
    assert any("every DP sub-query was answered from released values" in n for n in result.notices), result.notices
