"""The health and adult demos' dashboards through a real Superset 6.1, each over its one declared synopsis (#38).

For each demo the curator releases the policy's synopsis (``dpsql synopsis build``: health's
``patients_dashboard`` ε=1.25, adult's ``adult_dashboard`` ε=1.25, charged once to the dataset), ``dpsql serve``
serves it, and Superset (tests/bi/superset_probe.py, its own venv) sends the charts of
tests/bi/superset_charts.py's ``DEMO_DASHBOARDS`` through ``dpsql://…?epsilon=0.25``: bars, tables of two
keys, AVG/SUM of a measured column, a filtered bar, a Big Number — and the charts the synopsis does not hold
(a column that is not a key, a measure it lacks), which are fresh queries charged the chart's ε.

With tests/bi/test_superset_synopsis.py (the clinic) this is the "one declared synopsis per demo dataset"
measurement of issue #38: what the charts cost in all. The record is in tests/bi/superset_results.json under
``demo_dashboards``. Marked ``bi``: ``CI=true .venv/bin/python -m pytest -m bi tests/bi/test_superset_demos.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bi.superset_charts import DEMO_DASHBOARDS
from tests.bi.test_superset import ANALYST, DPSQL_EPSILON, RESULTS, ROOT, TEMPLATE, VENV, _epsilons, _run_probe, serve

pytestmark = [pytest.mark.bi, pytest.mark.postgres]

SYNOPSIS_EPSILON = {"health": 1.25, "adult": 1.25}  # schemas/<demo>.yaml's declarations
FROM_SYNOPSIS = 'answered from synopsis "'


def _dpsql(*args: str, policy: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, "--policy", policy],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per demo: its synopsis built, served, every chart sent through Superset; then the ledger's figures."""
    python = VENV / "bin" / "python"
    if not python.exists() or not TEMPLATE.exists():
        pytest.fail(f"Superset is not installed in {VENV}: run `bash scripts/superset.sh` first (~4 min)")
    out: dict[str, dict[str, Any]] = {}
    for demo, spec in DEMO_DASHBOARDS.items():
        policy = f"schemas/{demo}.yaml"
        home = tmp_path_factory.mktemp(f"dpsql-home-{demo}")
        built = _dpsql("synopsis", "build", policy=policy, home=home)
        assert built.returncode == 0, built.stderr
        with serve(home, policy) as served:
            uri = f"dpsql://{ANALYST}@127.0.0.1:{served.port}/{demo}?epsilon={DPSQL_EPSILON}"
            job = {"databases": [{"name": "dpsql", "uri": uri}], "datasets": spec["datasets"], "cases": spec["cases"]}
            record = _run_probe(python, job, tmp_path_factory.mktemp(f"superset-{demo}"))
        budget = _dpsql("budget", "--json", policy=policy, home=home)
        assert budget.returncode == 0, budget.stderr
        record["ledger"] = {row["analyst"]: row["epsilon_spent"] for row in json.loads(budget.stdout)}
        out[demo] = record
    _report(out)
    return out


def _statement(case: dict[str, Any]) -> dict[str, Any] | None:
    reads = [w for w in case["wire"] if "FROM public." in w["sql"]]
    return reads[-1] if reads else None


def _from_synopsis(case: dict[str, Any]) -> bool:
    statement = _statement(case)
    return statement is not None and any(FROM_SYNOPSIS in n for n in statement.get("notices") or [])


def _widening(case: dict[str, Any]) -> float | None:
    """The factor of the NOTICE ``these ± are up to k× those of a fresh answer at ε=0.25`` (None: not wider)."""
    statement = _statement(case)
    for notice in statement.get("notices") or [] if statement else []:
        if m := re.search(r"these ± are up to ([0-9.e+]+)× those of a fresh answer", notice):
            return float(m.group(1))
    return None


def _report(demos: dict[str, dict[str, Any]]) -> None:
    summary = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    section: dict[str, Any] = {}
    for demo, record in demos.items():
        section[demo] = {
            "synopsis_epsilon": SYNOPSIS_EPSILON[demo],
            "ledger": record["ledger"],
            "charts": [
                {
                    "case": case["name"],
                    "chart": case["chart"],
                    "outcome": case["outcome"],
                    "sqlstate": case["sqlstate"],
                    "from_synopsis": _from_synopsis(case),
                    "epsilon_charged": _epsilons(case["wire"]),
                    "widening_notice": _widening(case),
                    "superset_sql": [s["sql"] for s in [_statement(case)] if s],
                }
                for case in record["cases"]
            ],
        }
    summary["demo_dashboards"] = section
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")


@pytest.mark.parametrize("demo", list(DEMO_DASHBOARDS))
def test_every_chart_is_answered(demos: dict[str, dict[str, Any]], demo: str) -> None:
    for case in demos[demo]["cases"]:
        assert case["outcome"] == "answered", (case["name"], case["sqlstate"], case["message"], case.get("exception"))
        assert not case.get("superset_errors"), case["superset_errors"]


@pytest.mark.parametrize("demo", list(DEMO_DASHBOARDS))
def test_synopsis_charts_are_free_and_the_rest_charged_once(demos: dict[str, dict[str, Any]], demo: str) -> None:
    """Every chart over the synopsis's keys and measures is answered from it, free; the charts it does not
    hold are fresh queries charged the chart's ε once."""
    outside = set(DEMO_DASHBOARDS[demo]["outside"])
    for case in demos[demo]["cases"]:
        charged = _epsilons(case["wire"])
        if case["name"] in outside:
            assert not _from_synopsis(case) and charged == [DPSQL_EPSILON], (case["name"], charged)
        else:
            assert _from_synopsis(case) and charged == [], (case["name"], charged, _statement(case))


@pytest.mark.parametrize("demo", list(DEMO_DASHBOARDS))
def test_ledger(demos: dict[str, dict[str, Any]], demo: str) -> None:
    """The analyst paid what the NOTICEs said; the dataset that plus the synopsis, once."""
    record = demos[demo]
    charged = sum(sum(_epsilons(c["wire"])) for c in record["cases"])
    assert record["ledger"][ANALYST] == pytest.approx(charged, rel=1e-3)
    assert record["ledger"]["(dataset)"] == pytest.approx(SYNOPSIS_EPSILON[demo] + charged, rel=1e-3)
