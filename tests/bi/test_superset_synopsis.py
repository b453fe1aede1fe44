"""A Superset dashboard answered from the clinic's declared synopsis (#29 bar 2), through a real Superset 6.1.

The curator releases ``visits_dashboard`` (schemas/clinic.yaml: COUNT(*) of visits by department and by
month, ε = 1) with ``dpsql synopsis build`` on the database and ledger ``dpsql serve`` then serves. Superset
(tests/bi/superset_probe.py, its own venv) sends the 14 chart-data requests of
tests/bi/superset_charts.py's ``SYNOPSIS_CASES`` through ``dpsql://`` (DpsqlEngineSpec): bar, pie, table,
monthly lines with custom time ranges, Big Numbers, the bar under a department filter changed five
times, a HAVING filter and a month table.

What this shows: the whole dashboard costs the synopsis's ε, once, charged to the dataset as
``synopsis:visits_dashboard`` and never to the analyst Superset logs in as; every chart is post-processing
of the released marginals (the same rows dpsql gives any client for that SQL); and each chart's noise is
within 2× that of the same chart answered alone at the synopsis's whole ε.

Marked ``bi`` like tests/bi/test_superset.py: ``CI=true .venv/bin/python -m pytest -m bi
tests/bi/test_superset_synopsis.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.dev.demo import load_demo
from dpsql.engine import Engine
from dpsql.policy import load_policy
from dpsql.release.apply import widths_at
from dpsql.session import Session
from tests.bi.superset_charts import SYNOPSIS_CASES, SYNOPSIS_DATASETS, SYNOPSIS_MORE_CASES
from tests.bi.test_superset import (
    ANALYST,
    DPSQL_EPSILON,
    RESULTS,
    ROOT,
    TEMPLATE,
    VENV,
    Served,
    _epsilons,
    _run_probe,
    serve,
)

pytestmark = [pytest.mark.bi, pytest.mark.postgres]

POLICY = "schemas/clinic.yaml"
SYNOPSIS = "visits_dashboard"
SYNOPSIS_EPSILON = 1.0  # schemas/clinic.yaml's declaration
FROM_SYNOPSIS = f'answered from synopsis "{SYNOPSIS}"'
#: the clinic's other synopsis (#38): SUM(cost)/AVG(cost) by department and charts filtered on urgent
COSTS = "visits_costs"
COSTS_EPSILON = 0.5  # schemas/clinic.yaml's declaration of visits_costs
BUILT_EPSILON = SYNOPSIS_EPSILON + COSTS_EPSILON  # `dpsql synopsis build` releases both, charged to the dataset
FROM_ANY_SYNOPSIS = 'answered from synopsis "'


def _dpsql(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, "--policy", POLICY],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The curator builds the synopsis (CLI, the demo database, the ledger under DPSQL_HOME), then the
    server starts on the same database and ledger."""
    home = tmp_path_factory.mktemp("dpsql-home")
    built = _dpsql("synopsis", "build", home=home)
    assert built.returncode == 0, built.stderr
    assert f'synopsis "{SYNOPSIS}" of dataset "clinic"' in built.stdout, built.stdout
    assert f"charged ε={SYNOPSIS_EPSILON:g} once to the dataset as synopsis:{SYNOPSIS}" in built.stdout
    assert f"charged ε={COSTS_EPSILON:g} once to the dataset as synopsis:{COSTS}" in built.stdout, built.stdout
    with serve(home) as running:
        yield running


@pytest.fixture(scope="module")
def dashboard(served: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Superset syncs ``visits`` through dpsql:// and runs every chart of the dashboard once."""
    return _superset(served, SYNOPSIS_CASES, tmp_path_factory.mktemp("superset"))


def _superset(served: Served, cases: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    python = VENV / "bin" / "python"
    if not python.exists() or not TEMPLATE.exists():
        pytest.fail(f"Superset is not installed in {VENV}: run `bash scripts/superset.sh` first (~4 min)")
    uri = f"dpsql://{ANALYST}@127.0.0.1:{served.port}/clinic?epsilon={DPSQL_EPSILON}"
    job = {"databases": [{"name": "dpsql", "uri": uri}], "datasets": SYNOPSIS_DATASETS, "cases": cases}
    return _run_probe(python, job, work)


def _charts(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return list(dashboard["cases"])


def _chart_sql(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The statements of a chart that read visits (not the dialect's probes)."""
    return [w for w in case["wire"] if "FROM public.visits" in w["sql"]]


def test_dashboard_has_every_chart_type_of_the_bar(dashboard: dict[str, Any]) -> None:
    names = [c["name"] for c in _charts(dashboard)]
    assert len(names) >= 12
    assert {"bar", "pie", "table", "line_2021", "month_table", "bar_having"} <= set(names)
    assert sum(1 for n in names if n.startswith("bar_filter_")) == 5
    steps = {s["step"]: s for s in dashboard["setup"]}
    assert steps["sync columns: dpsql_visits"]["outcome"] == "answered"


@pytest.mark.parametrize("name", [c["name"] for c in SYNOPSIS_CASES])
def test_chart_answered_from_the_synopsis(dashboard: dict[str, Any], name: str) -> None:
    """Every chart is answered, from the synopsis (its NOTICE), with nothing charged to the analyst."""
    case = next(c for c in _charts(dashboard) if c["name"] == name)
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"), case["sql"])
    assert not case.get("superset_errors"), case["superset_errors"]
    (statement,) = _chart_sql(case)
    notices = statement.get("notices") or []
    assert any(FROM_SYNOPSIS in n for n in notices), (statement["sql"], notices)
    assert _epsilons(case["wire"]) == []
    assert case["rows"] and all(r is not None and r > 0 for r in case["rows"]), case["rows"]


def test_dashboard_costs_exactly_the_synopsis_epsilon(dashboard: dict[str, Any], served: Served) -> None:
    """The ledger: the dataset spent the synopses' ε, charged once each (synopsis:visits_dashboard and
    synopsis:visits_costs); the analyst Superset logs in as spent nothing."""
    assert dashboard["cases"]
    budget = _dpsql("budget", "--json", home=served.home)
    assert budget.returncode == 0, budget.stderr
    rows = {row["analyst"]: row for row in json.loads(budget.stdout)}
    assert rows["(dataset)"]["epsilon_spent"] == pytest.approx(BUILT_EPSILON)
    assert rows[ANALYST]["epsilon_spent"] == 0


def _plain(value: Any) -> Any:
    """A value as the probe's JSON holds it (psycopg2's rows went through ``json.dump(default=str)``)."""
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def _direct(served: Served, sql: str) -> tuple[list[list[Any]], list[float | None], list[str]]:
    """``sql`` sent by another client (psycopg 3) with the intervals shown: its rows, each row's 95% CI
    half-width of the count, and the NOTICEs."""
    notices: list[str] = []
    with psycopg.connect(host="127.0.0.1", port=served.port, user=ANALYST, dbname="clinic") as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("SET dpsql.show_intervals = on")
        cursor = conn.execute(sql)
        names = [c.name for c in cursor.description or []]
        fetched = cursor.fetchall()
    ci = [i for i, n in enumerate(names) if n.endswith("_ci95")]
    rows = [[_plain(v) for i, v in enumerate(row) if i not in ci] for row in fetched]
    widths = [float(row[ci[0]]) if ci and row[ci[0]] is not None else None for row in fetched]
    return rows, widths, notices


def test_each_chart_is_what_dpsql_returns_for_its_sql(dashboard: dict[str, Any], served: Served) -> None:
    """The rows Superset fetched are the rows any client gets for the same SQL (post-processing of one
    release: deterministic), and Superset's chart data holds the same counts."""
    for case in _charts(dashboard):
        (statement,) = _chart_sql(case)
        rows, _widths, notices = _direct(served, statement["sql"])
        assert any(FROM_SYNOPSIS in n for n in notices), notices
        assert statement["rows"] == rows, (case["name"], statement["sql"])
        shown = sorted(r["count"] for r in case["data"][0])
        assert shown == sorted(r[-1] for r in rows), case["name"]


@pytest.fixture(scope="module")
def analysis() -> Iterator[Engine]:
    """An engine on the demo data, used only to price queries (nothing runs, nothing is charged)."""
    engine = Engine.open(load_policy(ROOT / POLICY), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["clinic"])
    try:
        yield engine
    finally:
        engine.close()


def _alone_half_width(engine: Engine, sql: str) -> float:
    """The 95% half-width dpsql would release for ``sql``'s count answered alone at the synopsis's whole ε
    (a function of the noise it would draw, public: nothing runs, nothing is charged)."""
    width = widths_at(engine.prepare(sql, Session(ANALYST, epsilon=SYNOPSIS_EPSILON)).budgeting, 0.95)[0]
    assert width is not None
    return width


#: Big Numbers: a total is a sum over a whole marginal (6 departments, or 12 of the 60 months), so its
#: noise is several times that of one COUNT(*) answered alone. Answered from the synopsis all the same
#: (free), but outside the 2x bar; a synopsis would need a marginal of its own ([]) for them.
TOTALS = ("big_number", "big_number_2021")


@pytest.fixture(scope="module")
def error_ratios(dashboard: dict[str, Any], served: Served, analysis: Engine) -> dict[str, float]:
    """Per chart: the largest 95% half-width dpsql released for it from the synopsis (its ``count_ci95``),
    over the half-width it would release for the same SQL answered alone at the synopsis's whole ε. Both
    are intervals of the same noise family at the same confidence, so this is the ratio of the noises."""
    ratios = _ratios(dashboard["cases"], served, analysis)
    _report("charts", dashboard["cases"], ratios)
    return ratios


#: AVG(cost): its ± is that of a ratio of two noisy sums, and the half-width of the same chart alone is not
#: one noise's (``widths_at`` gives its SUM's): no ratio of noises to compare. Its NOTICE still says if wider.
NOT_ONE_NOISE = ("avg_cost_bar",)


def _ratios(cases: list[dict[str, Any]], served: Served, analysis: Engine) -> dict[str, float]:
    """``error_ratios`` of the charts answered from the synopsis (asked again by another client: free)."""
    ratios: dict[str, float] = {}
    for case in cases:
        statement = _chart_sql(case)
        if "estimate" in case or not _from_synopsis(statement):  # an EXPLAIN has no released widths
            continue
        if case["name"] in NOT_ONE_NOISE:
            continue
        _rows, widths, _notices = _direct(served, statement[0]["sql"])
        released = [w for w in widths if w is not None]
        assert released, case["name"]
        ratios[case["name"]] = max(released) / _alone_half_width(analysis, statement[0]["sql"])
    return ratios


def _from_synopsis(statement: list[dict[str, Any]]) -> bool:
    return len(statement) == 1 and any(FROM_ANY_SYNOPSIS in n for n in statement[0].get("notices") or [])


def _widening(statement: list[dict[str, Any]]) -> float | None:
    """The factor of the NOTICE ``these ± are up to k× those of a fresh answer at ε=…`` (the chart's ε)."""
    for notice in statement[0].get("notices") or [] if statement else []:
        if m := re.search(r"these ± are up to ([0-9.e+]+)× those of a fresh answer", notice):
            return float(m.group(1))
    return None


def test_each_chart_within_twice_the_error_of_answering_it_alone(error_ratios: dict[str, float]) -> None:
    """#29 bar 2 through Superset: bars, pie, table, monthly lines, filtered bars, HAVING, month table."""
    charts = {name: r for name, r in error_ratios.items() if name not in TOTALS}
    assert len(charts) >= 12
    assert max(charts.values()) <= 2.0, charts


def test_totals_are_free_but_noisier_than_alone(error_ratios: dict[str, float]) -> None:
    """A Big Number over the synopses: in visits_dashboard the least-squares combination of the sums of both
    marginals (each measured at ε/2), sqrt(4 · 60/11) ≈ 4.67 times the noise of one COUNT(*) answered alone
    at ε; combined with visits_costs' sum of its 12 department × urgent cells (its ε=0.5 halved between COUNT(*)
    and SUM(cost)) it is narrower (4.5× in the run recorded), still more than 2×; over one year (12 of the 60
    months, visits_dashboard only) more."""
    assert 2.0 < error_ratios["big_number"] < math.sqrt(4 * 60 / 11)
    assert error_ratios["big_number_2021"] > 2.0


def _report(part: str, cases: list[dict[str, Any]], ratios: dict[str, float]) -> None:
    """The dashboard's section of tests/bi/superset_results.json (test_superset.py keeps it): its ``charts``,
    then the ``later_charts`` sent after them."""
    rows = []
    for case in cases:
        statement = _chart_sql(case)
        rows.append(
            {
                "case": case["name"],
                "chart": case["chart"],
                "outcome": case["outcome"],
                "from_synopsis": _from_synopsis(statement),
                "epsilon_charged": _epsilons(case["wire"]),
                "rows": case.get("rows"),
                "error_vs_alone": round(ratios[case["name"]], 3) if case["name"] in ratios else None,
                "widening_notice": _widening(statement),
                "superset_sql": [w["sql"] for w in statement],
            }
        )
    summary = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    section = summary.setdefault("synopsis_dashboard", {})
    section.update(synopsis=SYNOPSIS, epsilon=SYNOPSIS_EPSILON, database="dpsql:// (DpsqlEngineSpec)")
    section[part] = rows
    if part == "charts":
        section.pop("later_charts", None)  # written by this run's later fixture, after this
        section.pop("other_charts", None)
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")


def test_superset_sql_of_the_monthly_line(dashboard: dict[str, Any]) -> None:
    """The time range reaches dpsql as TO_DATE bounds (PostgresEngineSpec.convert_dttm), folded at
    analysis into the months the synopsis holds."""
    case = next(c for c in _charts(dashboard) if c["name"] == "line_2021")
    (statement,) = _chart_sql(case)
    sql = " ".join(statement["sql"].split())
    assert re.search(r"visit_date >= TO_DATE\('2021-01-01', 'YYYY-MM-DD'\)", sql), sql
    assert case["rows"] == [12]


# --- after the dashboard: the shapes it lacks, then the dashboard again (#38 bars) ----------------------
# These tests come last in this file on purpose: the charts charged below release cells that later answers
# combine with the synopsis (the dashboard's ± narrow), so the comparisons above must run first.


#: SQL Lab's "Estimate cost" of the Big Number (DpsqlEngineSpec: dpsql's EXPLAIN, free)
ESTIMATE_TOTAL = {
    "name": "estimate_big_number",
    "chart": "SQL Lab's Estimate cost of the Big Number's SQL: ε=0, from the synopsis, and how much wider",
    "dataset": "dpsql_visits",
    "kind": "estimate",
    "sql": "SELECT COUNT(*) AS count FROM public.visits LIMIT 10000",
}


@pytest.fixture(scope="module")
def later(
    dashboard: dict[str, Any], served: Served, analysis: Engine, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """After the dashboard: AVG/SUM(cost), a filter on urgent, quarters, years, a range off the month edges
    (``SYNOPSIS_MORE_CASES``), then every chart of the dashboard rendered again (``again_<name>``), in a
    Superset of its own on the same server and ledger."""
    again = [{**case, "name": "again_" + case["name"]} for case in SYNOPSIS_CASES]
    cases = [*SYNOPSIS_MORE_CASES, *again, ESTIMATE_TOTAL]
    record = _superset(served, cases, tmp_path_factory.mktemp("superset-later"))
    record["ratios"] = _ratios(record["cases"], served, analysis)
    _report("later_charts", record["cases"], record["ratios"])
    return record


def test_charts_outside_the_dashboard_are_answered_fresh_or_from_the_synopsis(later: dict[str, Any]) -> None:
    """#38: each shape the synopsis lacks is answered: from the synopsis (free; quarters and years are sums
    of its months) or as a fresh query charged the chart's ε, never anything in between."""
    for case in later["cases"]:
        assert case["outcome"] == "answered", (case["name"], case["sqlstate"], case["message"], case.get("exception"))
        if case["name"] == ESTIMATE_TOTAL["name"]:
            continue
        statement = _chart_sql(case)
        charged = _epsilons(case["wire"])
        if _from_synopsis(statement):
            assert charged == [], case["name"]
        else:
            assert charged and all(e == DPSQL_EPSILON for e in charged), (case["name"], charged)
    free = {c["name"] for c in later["cases"] if _from_synopsis(_chart_sql(c))}
    assert {"line_quarterly_2021", "line_yearly", "avg_cost_bar", "sum_cost_bar", "bar_urgent"} <= free
    assert "line_off_edges" not in free  # partial months at both ends: a fresh query
    for name in ("avg_cost_bar", "sum_cost_bar", "bar_urgent"):  # from the cost synopsis
        case = next(c for c in later["cases"] if c["name"] == name)
        assert any(f'synopsis "{COSTS}"' in n for n in _chart_sql(case)[0]["notices"]), name


def test_rerendering_the_dashboard_after_other_charts_is_free(
    later: dict[str, Any], error_ratios: dict[str, float]
) -> None:
    """#38 bar: re-rendering the dashboard (filters changed on its keys, months, the totals) after other
    charts costs 0: every chart from the synopsis again, its ± no wider than the first time (the cells the
    other charts released may narrow them: they are combined by inverse variance)."""
    first = {c["name"]: c for c in SYNOPSIS_CASES}
    for case in later["cases"]:
        if case["name"].removeprefix("again_") not in first or not case["name"].startswith("again_"):
            continue
        assert case["outcome"] == "answered", (case["name"], case["sqlstate"], case["message"])
        assert _from_synopsis(_chart_sql(case)), case["name"]
        assert _epsilons(case["wire"]) == [], case["name"]
        first_ratio = error_ratios[case["name"].removeprefix("again_")]
        assert later["ratios"][case["name"]] <= first_ratio * (1 + 1e-6), case["name"]


def test_wider_answers_are_flagged(
    dashboard: dict[str, Any], error_ratios: dict[str, float], later: dict[str, Any]
) -> None:
    """#38 bar: a synopsis answer whose ± is wider than the same chart answered alone at the chart's own ε
    (the dpsql:// database's 0.25) says so in a NOTICE with its factor; one that is not wider does not."""
    ratios = {**error_ratios, **later["ratios"]}
    for case in [*dashboard["cases"], *later["cases"]]:
        statement = _chart_sql(case)
        if "estimate" in case or case["name"] in NOT_ONE_NOISE or not _from_synopsis(statement):
            continue
        at_chart_epsilon = ratios[case["name"]] * DPSQL_EPSILON / SYNOPSIS_EPSILON  # Laplace: ± ∝ 1/ε
        flagged = _widening(statement)
        if at_chart_epsilon > 1.1:
            assert flagged is not None and flagged >= 1.0, (case["name"], at_chart_epsilon, flagged)
        elif at_chart_epsilon < 0.9:
            assert flagged is None, (case["name"], at_chart_epsilon, flagged)


def test_ledger_after_other_charts(later: dict[str, Any], served: Served) -> None:
    """The analyst paid exactly what the charged charts' NOTICEs said; the synopsis was never charged again."""
    charged = sum(sum(_epsilons(c["wire"])) for c in later["cases"])
    budget = _dpsql("budget", "--json", home=served.home)
    assert budget.returncode == 0, budget.stderr
    rows = {row["analyst"]: row for row in json.loads(budget.stdout)}
    assert rows[ANALYST]["epsilon_spent"] == pytest.approx(charged, rel=1e-3)
    assert rows["(dataset)"]["epsilon_spent"] == pytest.approx(BUILT_EPSILON + charged, rel=1e-3)


def test_estimate_cost_says_free_and_how_much_wider(later: dict[str, Any]) -> None:
    """#38 item 4 through Superset: "Estimate cost" of a chart the synopsis answers (a total, wider than a
    fresh answer at the chart's ε) is ε=0, says where from and how much wider, and charges nothing."""
    case = next(c for c in later["cases"] if c["name"] == ESTIMATE_TOTAL["name"])
    (estimate,) = case["estimate"]
    assert estimate["epsilon"] == "0", estimate
    assert estimate["free"].startswith(FROM_SYNOPSIS) and f'synopsis "{COSTS}"' in estimate["free"], estimate
    assert "those of a fresh answer" in estimate["wider"], estimate
    assert estimate["ci95"].startswith("count ci95=±"), estimate
    assert _epsilons(case["wire"]) == []
