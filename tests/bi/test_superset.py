"""A real Apache Superset 6.1 against a real `dpsql serve` (clinic demo): which charts dpsql answers.

Superset runs in its own venv (``bash scripts/superset.sh``; it pins SQLAlchemy 1.4 and cannot share
dpsql's). tests/bi/superset_probe.py is run with that venv's Python: it creates Superset's Flask app
on a copy of a prepared SQLite metadata database, registers ``postgresql+psycopg2://alice@…/clinic``
(Superset's PostgreSQL engine spec) and ``dpsql://alice@…/clinic`` (contrib/superset's
``DpsqlEngineSpec``, installed by scripts/superset.sh and found through its entry point), syncs the
tables' columns and sends each chart-data request of tests/bi/superset_charts.py through Superset's
own ``ChartDataCommand``. Every statement Superset's connections put on the wire is recorded
with the SQLSTATE dpsql answered.

What this shows about privacy: Superset sees only what any client sees — its schema sync reaches the
shadow catalog (identifier columns are not even listed), its row-level requests (histogram, a raw virtual
dataset's LIMIT 1 column probe) are refused before anything runs or is charged, what follows from the
policy alone (a LIMIT 0 probe's columns, filter values of a public domain) is answered free, and every
other chart that is answered is charged its ε in the ledger before the noisy rows reach Superset.

Marked ``bi`` (deselected by default, see pyproject's addopts): run with
``CI=true .venv/bin/python -m pytest -m bi tests/bi``. The summary (chart → answered/refused + SQLSTATE,
with the SQL Superset generated) is printed and written to tests/bi/superset_results.json.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.bi.superset_charts import CASES, DATASETS
from tests.listening import port_of

# `dpsql serve` starts a PostgreSQL of its own (the shadow catalog Superset's sync reads)
pytestmark = [pytest.mark.bi, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("DPSQL_SUPERSET_VENV", ROOT / ".superset-venv"))
TEMPLATE = VENV / "dpsql" / "superset.db"
PROBE = Path(__file__).with_name("superset_probe.py")
RESULTS = Path(__file__).with_name("superset_results.json")
EPSILON = 0.5  # per query, set through the connection's startup options as docs/bi.md shows
DPSQL_EPSILON = 0.25  # per query through dpsql://…?epsilon=0.25 (another ε: no cache hit on the same SQL)
ANALYST = "alice"
BROKE = "analyst"  # the dpsql_exhausted database: its ε per query (25) exceeds its whole budget (20)
#: ``-c dpsql.epsilon=0.5 -c dpsql.show_intervals=on``, URL-encoded as docs/bi.md writes it
INTERVAL_OPTIONS = "-c%20dpsql.epsilon%3D0.5%20-c%20dpsql.show_intervals%3Don"


@dataclass(frozen=True)
class Expect:
    """What dpsql answers today: "answered", a refusal (SQLSTATE + message), or a feature it waits for."""

    outcome: str
    sqlstate: str | None = "00000"
    message: str | None = None
    waiting_for: str | None = None
    cached: bool = False  # answered from dpsql's result cache: nothing charged
    reused: bool = False  # finished from an earlier release of the same measurement (#29 item 1): nothing charged
    free: bool = False  # answered from the policy alone (keys with a public domain, no measurement): nothing charged
    # answered by summing the cells of an earlier release at least as accurate (#29 item 2): nothing charged
    coarsened: bool = False
    epsilon: float = EPSILON  # charged per answered statement
    says: str | None = None  # what Superset shows for a refused chart (DpsqlEngineSpec's message)


EXPECTED: dict[str, Expect] = {
    "big_number": Expect("answered"),
    "big_number_reload": Expect("answered", cached=True),  # Superset resends the same text: a free repeat
    # COUNT(*) by department was released by department_counts' LIMIT 1 column probe (charged there):
    # bar, pie and table are the same measurement with another ORDER BY/LIMIT, finished from it for free
    "bar": Expect("answered", reused=True),
    "pie": Expect("answered", reused=True),
    "table_percent": Expect("answered", reused=True),  # % of total: Superset's post-processing of the noisy counts
    # GROUP BY without a metric, SELECT DISTINCT: department's public domain (the departments table), free
    "native_filter": Expect("answered", free=True),
    "filter_values": Expect("answered", free=True),
    # Raw values of a column: refused for good (a histogram needs every row); use bucketed counts instead.
    "histogram": Expect(
        "refused",
        "42803",
        'column "visits.cost" must appear in the GROUP BY clause or be used in an aggregate function',
    ),
    "line_monthly": Expect("answered"),  # DATE_TRUNC buckets, TO_DATE(...) bounds folded at analysis
    "histogram_buckets": Expect("answered"),  # FLOOR(cost / 200) * 200: a derived domain of 11 buckets
    # Superset's LIMIT 1 column probe of a row-level SQL dataset is refused (test below), so the dataset has
    # no columns and Superset stops before sending anything: only an engine spec sending LIMIT 0 helps.
    "virtual_rows": Expect(
        "failed", sqlstate=None, message="ChartDataQueryFailedError: Error: Columns missing in dataset: ['department']"
    ),
    # with a LIMIT 0 column probe (what a dpsql engine spec would send) the dataset gets its columns for free,
    # and its charts are aggregates over a filter-only sub-query, inlined
    "virtual_rows_limit0": Expect("answered"),
    # post-processing over the DP sub-query, whose text is department_counts' column probe: from the result cache
    "virtual_aggregate": Expect("answered", cached=True),
    # through dpsql:// and DpsqlEngineSpec
    # a total: one released cell per month or department would be noisier than a fresh answer at 0.25, but
    # the two earlier releases combined (inverse variance, issue #38 item 1) are not: free
    "dpsql_big_number": Expect("answered", coarsened=True),
    # the same measurements as bar, line_monthly and virtual_rows_limit0, released above at ε=0.5: at the
    # 0.25 asked here a fresh answer would be noisier, so the earlier cells are summed, free (coarsening)
    "dpsql_bar": Expect("answered", coarsened=True),
    "dpsql_line_monthly": Expect("answered", coarsened=True),
    # the row-level SQL dataset: Superset's own sync got its columns (LIMIT 0 probe), so its chart works
    "dpsql_virtual_rows": Expect("answered", coarsened=True),
    "dpsql_histogram": Expect(
        "refused",
        "42803",
        'column "visits.cost" must appear in the GROUP BY clause or be used in an aggregate function',
        says="Error: dpsql releases aggregates only, never individual rows (SQLSTATE 42803: column "
        '"visits.cost" must appear in the GROUP BY clause or be used in an aggregate function). Give the chart '
        "a metric (COUNT, SUM, AVG, …)",
    ),
    "dpsql_hourly": Expect(
        "refused",
        "54000",
        "GROUP BY key \"DATE_TRUNC('HOUR', visit_date)\" would release 43825 groups (more than 10000)",
        says="Error: This chart would have 43825 groups for \"DATE_TRUNC('HOUR', visit_date)\", more than dpsql "
        "releases in one answer (SQLSTATE 54000). Choose a coarser time grain or bucket, or narrow the time range.",
    ),
    "dpsql_budget_exhausted": Expect(
        "refused",
        "53P01",
        f'privacy budget exhausted for analyst "{BROKE}"',
        says=f'Error: The privacy budget of analyst "{BROKE}" cannot cover this query, so dpsql did not run it '
        "and charged nothing (SQLSTATE 53P01).",
    ),
}


@dataclass
class Served:
    port: int
    home: Path
    log: list[str]


@pytest.fixture(scope="module")
def dpsql_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`dpsql serve --policy schemas/clinic.yaml` as a user starts it, with a ledger of its own."""
    with serve(tmp_path_factory.mktemp("dpsql-home")) as served:
        yield served


@contextmanager
def serve(home: Path, policy: str = "schemas/clinic.yaml") -> Iterator[Served]:
    """`dpsql serve --policy schemas/clinic.yaml` (the demo data) with its ledger under ``home`` (DPSQL_HOME)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "dpsql.cli", "serve", "--policy", policy, "--port", "0"],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    try:
        assert server.stderr is not None
        deadline = time.monotonic() + 90
        while not log or "dpsql serving" not in log[-1]:
            log.append(server.stderr.readline())
            assert log[-1] or server.poll() is None, "dpsql serve exited before serving:\n" + "".join(log)
            assert time.monotonic() < deadline, "dpsql serve did not start within 90 s"
        port = port_of(log[-1])  # it bound port 0 and says which port it got
        threading.Thread(target=lambda: log.extend(server.stderr or ()), daemon=True).start()  # keep draining
        yield Served(port, home, log)
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture(scope="module")
def superset(
    dpsql_serve: Served, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """Run every dataset sync and chart request through Superset once; the tests below read the record.

    One Superset (metadata database) per group of Superset databases: Superset's SQLite metadata schema
    keeps a UNIQUE(table_name) on datasets, so the physical ``visits`` can be a dataset of only one
    database per metadata file. Both groups talk to the same ``dpsql serve`` and ledger.
    """
    python = VENV / "bin" / "python"
    if not python.exists() or not TEMPLATE.exists():
        pytest.fail(f"Superset is not installed in {VENV}: run `bash scripts/superset.sh` first (~4 min)")
    port = dpsql_serve.port
    options = f"-c dpsql.epsilon={EPSILON}".replace(" ", "%20").replace("=", "%3D")
    databases = [
        {"name": "postgresql", "uri": f"postgresql+psycopg2://{ANALYST}@127.0.0.1:{port}/clinic?options={options}"},
        {
            "name": "dpsql",
            "uri": f"dpsql://{ANALYST}@127.0.0.1:{port}/clinic?epsilon={DPSQL_EPSILON}",
            "prefix": "dpsql: ",
        },
        {
            "name": "dpsql_exhausted",
            "uri": f"dpsql://{BROKE}@127.0.0.1:{port}/clinic?epsilon=25",
            "prefix": "dpsql_exhausted: ",
        },
        # the URIs docs/bi.md gives for intervals in Superset, through each connector
        {
            "name": "dpsql_intervals",
            "uri": f"dpsql://{ANALYST}@127.0.0.1:{port}/clinic?epsilon={DPSQL_EPSILON}&show_intervals=on",
            "prefix": "dpsql_intervals: ",
        },
        {
            "name": "pg_intervals",
            "uri": f"postgresql+psycopg2://{ANALYST}@127.0.0.1:{port}/clinic?options={INTERVAL_OPTIONS}",
            "prefix": "pg_intervals: ",
        },
    ]
    databases.append(  # issue #38 item 4: accuracy-first as a URI parameter
        {
            "name": "dpsql_accuracy",
            "uri": f"dpsql://{ANALYST}@127.0.0.1:{port}/clinic?epsilon={DPSQL_EPSILON}&accuracy=100",
            "prefix": "dpsql_accuracy: ",
        }
    )
    record: dict[str, Any] = {"setup": [], "cases": [], "columns": {}, "metrics": {}, "engine_specs": {}}
    for group in (["postgresql"], ["dpsql", "dpsql_exhausted", "dpsql_intervals", "pg_intervals", "dpsql_accuracy"]):
        datasets = {k: v for k, v in DATASETS.items() if v.get("database", "postgresql") in group}
        job = {
            "databases": [d for d in databases if d["name"] in group],
            "datasets": datasets,
            "cases": [c for c in CASES if c["dataset"] in datasets],
        }
        part = _run_probe(python, job, tmp_path_factory.mktemp("superset"))
        for key in ("setup", "cases"):
            record[key].extend(part[key])
        for key in ("columns", "metrics", "engine_specs"):
            record[key].update(part[key])
    _report(record, request.config)
    return record


def _run_probe(python: Path, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """tests/bi/superset_probe.py with Superset's venv, on a fresh copy of the metadata template."""
    shutil.copy(TEMPLATE, work / "superset.db")
    metadata = "sqlite:///" + str(work / "superset.db")
    (work / "superset_config.py").write_text(
        f"SECRET_KEY = {secrets.token_hex(32)!r}\nSQLALCHEMY_DATABASE_URI = {metadata!r}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SUPERSET_CONFIG_PATH=str(work / "superset_config.py"), SUPERSET_HOME=str(work))
    done = subprocess.run(
        [str(python), str(PROBE)],
        input=json.dumps({**job, "output": str(work / "out.json")}),
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    result: dict[str, Any] = json.loads((work / "out.json").read_text())
    return result


def _epsilons(wire: list[dict[str, Any]]) -> list[float]:
    return [
        float(m.group(1))
        for item in wire
        for notice in item.get("notices") or []
        if (m := re.search(r"charged ε=([0-9.e+-]+)", notice))
    ]


def _report(record: dict[str, Any], config: pytest.Config) -> None:
    """tests/bi/superset_results.json and a table in the test output: chart → outcome, SQLSTATE, ε."""
    rows = []
    for step in record["setup"]:
        rows.append({"case": step["step"], "chart": "(dataset setup)", **_summary(step)})
    for case in record["cases"]:
        rows.append({"case": case["name"], "chart": case["chart"], **_summary(case)})
        rows[-1]["superset_sql"] = case.get("sql")
        rows[-1]["superset_error"] = case.get("exception")
    for row in rows:
        expect = EXPECTED.get(row["case"])
        row["waiting_for"] = expect.waiting_for if expect else None
    for row, case in zip(rows[len(record["setup"]) :], record["cases"], strict=True):
        for key in ("estimate", "sqllab_errors"):
            if key in case:
                row[key] = case[key]
    summary = {
        "superset": "6.1.0",
        "epsilon_per_query": {"postgresql": EPSILON, "dpsql": DPSQL_EPSILON},
        "engine_specs": record["engine_specs"],
        "results": rows,
    }
    if RESULTS.exists():  # the synopsis dashboards' sections: test_superset_synopsis.py's and test_superset_demos.py's
        previous = json.loads(RESULTS.read_text())
        summary.update({k: previous[k] for k in ("synopsis_dashboard", "demo_dashboards") if k in previous})
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    out = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if out is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        out.write_line("")
        out.write_line(
            f"Superset 6.1.0 against dpsql serve (clinic demo, ε={EPSILON} per query through postgresql://, "
            f"{DPSQL_EPSILON} through dpsql://) → tests/bi/{RESULTS.name}"
        )
        for row in rows:
            status = row["outcome"] + (f" {row['sqlstate']}" if row["outcome"] == "refused" else "")
            cost = f"ε={sum(row['epsilon_charged']):g}"
            out.write_line(f"  {row['case']:<34} {status:<15} {cost:<8} {(row['message'] or '')[:70]}")


def _summary(item: dict[str, Any]) -> dict[str, Any]:
    """Outcome plus the statements that were not client probes (version, SHOW, search_path)."""
    probes = ("select pg_catalog.version()", "select current_schema()", "show ", "set search_path")
    sent = [w for w in item["wire"] if not w["sql"].strip().lower().startswith(probes)]
    return {
        "outcome": item["outcome"],
        "sqlstate": item["sqlstate"],
        "message": item["message"],
        "sql_on_the_wire": [w["sql"] for w in sent],
        "epsilon_charged": _epsilons(item["wire"]),
    }


def _case(record: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in record["cases"] if c["name"] == name)


def test_connect_and_sync_columns(superset: dict[str, Any]) -> None:
    """The dialect's probes (version(), SHOW …, current_schema()) and the column sync are answered, free."""
    steps = {s["step"]: s for s in superset["setup"]}
    for name in ("test connection", "connect: dialect probes", "sync columns: visits"):
        assert steps[name]["outcome"] == "answered", steps[name]
        assert _epsilons(steps[name]["wire"]) == []
    # the catalog Superset syncs lists only what may be aggregated: identifiers are not columns at all
    assert superset["columns"]["visits"] == ["cost", "department", "urgent", "visit_date"]
    assert superset["metrics"]["visits"] == {"count": "COUNT(*)"}


def test_virtual_dataset_of_rows_is_refused_before_charging(superset: dict[str, Any]) -> None:
    """Superset learns a SQL dataset's columns by running it with LIMIT 1: raw rows, refused, not charged."""
    step = next(s for s in superset["setup"] if s["step"] == "sync columns: visits_sql")
    assert (step["sqlstate"], step["message"]) == (
        "42803",
        'column "visits.department" must appear in the GROUP BY clause or be used in an aggregate function',
    )
    assert step["wire"][-1]["sql"].rstrip().endswith("LIMIT 1")
    assert _epsilons(step["wire"]) == []


def test_limit0_column_probe_is_answered_free(superset: dict[str, Any]) -> None:
    """With LIMIT 0 (what a dpsql engine spec for Superset would send) a SQL dataset's columns need no data."""
    step = next(s for s in superset["setup"] if s["step"] == "sync columns: visits_sql_limit0")
    probes = [w for w in step["wire"] if w["sql"].rstrip().endswith("LIMIT 0")]
    assert probes and all(w["sqlstate"] == "00000" for w in probes), step["wire"]
    assert step["outcome"] == "answered", (step["sqlstate"], step["message"])
    assert _epsilons(step["wire"]) == []
    assert superset["columns"]["visits_sql_limit0"] == ["cost", "department", "visit_date"]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[pytest.mark.xfail(strict=False, reason=f"waiting for: {e.waiting_for}")] if e.waiting_for else [],
        )
        for name, e in EXPECTED.items()
    ],
)
def test_chart(superset: dict[str, Any], name: str) -> None:
    """Each chart type: answered and charged exactly ε per statement it ran, or refused with its SQLSTATE."""
    case = _case(superset, name)
    expect = EXPECTED[name]
    assert case["outcome"] == expect.outcome, (case["sqlstate"], case["message"], case.get("wire"))
    if expect.outcome == "failed":
        assert case["message"] == expect.message
        assert _epsilons(case["wire"]) == []
        return
    if expect.outcome == "refused":
        assert (case["sqlstate"], case["message"]) == (expect.sqlstate, expect.message)
        assert _epsilons(case["wire"]) == [], "a refusal before the run must not be charged"
        if expect.says:  # what the chart shows in Superset: DpsqlEngineSpec's text, dpsql's message kept
            assert case["exception"].startswith(f"ChartDataQueryFailedError: {expect.says}"), case["exception"]
        return
    assert case.get("superset_errors") in (None, [])
    charged = _epsilons(case["wire"])
    if expect.free:
        assert charged == []
    elif expect.cached:
        assert charged == []
        notices = [n for w in case["wire"] for n in w.get("notices") or []]
        assert any("answered from the result cache" in n for n in notices), notices
    elif expect.reused:
        assert charged == []
        notices = [n for w in case["wire"] for n in w.get("notices") or []]
        assert any("answered from an earlier release" in n for n in notices), notices
    elif expect.coarsened:
        assert charged == []
        notices = [n for w in case["wire"] for n in w.get("notices") or []]
        assert any("answered by summing the cells of" in n for n in notices), notices
    else:
        assert charged and all(e == expect.epsilon for e in charged), charged
    rows = case["rows"] if isinstance(case["rows"], list) else [case["rows"]]  # a values request: one count
    assert all(r is not None and r > 0 for r in rows), case["rows"]


def test_ledger_matches_what_superset_was_told(superset: dict[str, Any], dpsql_serve: Served) -> None:
    """Every ε in a NOTICE Superset's connections received is in the ledger, and nothing else is."""
    home = dpsql_serve.home
    noticed = sum(sum(_epsilons(s["wire"])) for s in [*superset["setup"], *superset["cases"]])
    budget = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsql.cli",
            "budget",
            "--policy",
            "schemas/clinic.yaml",
            "--analyst",
            ANALYST,
            "--json",
        ],
        cwd=ROOT,
        env={**os.environ, "DPSQL_HOME": str(home)},
        capture_output=True,
        text=True,
        check=True,
    )
    spent = next(row for row in json.loads(budget.stdout) if row["analyst"] == ANALYST)["epsilon_spent"]
    assert spent == pytest.approx(noticed, rel=1e-3)  # a NOTICE shows ε to 4 significant digits
    assert noticed > 0


def test_server_log_has_no_internal_error(superset: dict[str, Any], dpsql_serve: Served) -> None:
    """Whatever Superset sent, dpsql answered or refused it on purpose: no XX000, no traceback."""
    text = "".join(dpsql_serve.log)
    assert "XX000" not in text and "Traceback" not in text, text[-3000:]
    assert any("alice" in line for line in dpsql_serve.log), "the per-query log lines are missing"


DPSQL_SPEC = "dpsql_superset.engine_spec.DpsqlEngineSpec"


def test_engine_spec_found_through_its_entry_point(superset: dict[str, Any]) -> None:
    """Superset resolves dpsql:// to DpsqlEngineSpec (entry point), postgresql:// still to PostgreSQL's."""
    specs = superset["engine_specs"]
    assert specs["get_engine_spec(dpsql)"] == DPSQL_SPEC
    assert specs["get_engine_spec(dpsql, psycopg2)"] == DPSQL_SPEC
    assert specs["get_engine_spec(postgresql, psycopg2)"].endswith(".postgres.PostgresEngineSpec")
    assert specs["available"][DPSQL_SPEC] == ["psycopg2"]  # listed in "+ Database", through its dialect
    assert specs["dpsql"]["backend"] == "dpsql"
    assert (specs["dpsql"]["spec"], specs["dpsql"]["engine_name"]) == (DPSQL_SPEC, "dpsql (differential privacy)")
    assert specs["postgresql"]["spec"].endswith(".PostgresEngineSpec")
    assert (specs["dpsql"]["column_probe_limit"], specs["postgresql"]["column_probe_limit"]) == (0, 1)
    # only the DATE_TRUNC grains dpsql answers are offered (no second/minute arithmetic)
    assert specs["dpsql"]["time_grains"] == ["PT1H", "P1D", "P1W", "P1M", "P3M", "P1Y", "1969-12-29T00:00:00Z/P1W"]
    # ?epsilon= becomes a startup option; a value that is not one number is refused before connecting
    assert specs["dialect_options"] == {
        "dpsql://a@h/db?epsilon=0.5": "-c dpsql.epsilon=0.5",
        "dpsql://a@h/db?epsilon=0.5%20-c%20dpsql.mechanism%3Dgaussian": "ValueError: dpsql URI parameter "
        "epsilon='0.5 -c dpsql.mechanism=gaussian' is not a number",
        "dpsql://a@h/db?epsilon=0.5&show_intervals=on&round=off&trim_time=true": "-c dpsql.epsilon=0.5 "
        "-c dpsql.show_intervals=on -c dpsql.round=off -c dpsql.trim_time=on",
        "dpsql://a@h/db?show_intervals=on%20-c%20dpsql.epsilon%3D9": "ValueError: dpsql URI parameter "
        "show_intervals='on -c dpsql.epsilon=9' must be on or off",
    }
    steps = {s["step"]: s for s in superset["setup"]}
    for prefix in ("dpsql: ", "dpsql_exhausted: ", "dpsql_intervals: ", "pg_intervals: "):
        for name in ("test connection", "connect: dialect probes"):
            assert steps[prefix + name]["outcome"] == "answered", steps[prefix + name]
            assert _epsilons(steps[prefix + name]["wire"]) == []


def test_dpsql_virtual_dataset_synced_by_superset_with_limit0(superset: dict[str, Any]) -> None:
    """Superset's own sync of a row-level SQL dataset through dpsql:// sends LIMIT 0: columns, free."""
    step = next(s for s in superset["setup"] if s["step"] == "dpsql: sync columns: dpsql_visits_sql")
    assert step["outcome"] == "answered", (step["sqlstate"], step["message"])
    probes = [w["sql"].rstrip() for w in step["wire"] if "FROM visits" in w["sql"]]
    assert probes and all(p.endswith("LIMIT 0") for p in probes), step["wire"]
    assert _epsilons(step["wire"]) == []
    assert superset["columns"]["dpsql_visits_sql"] == ["cost", "department", "visit_date"]


def test_dpsql_table_preview_is_limit0_and_free(superset: dict[str, Any]) -> None:
    """SQL Lab's table preview lists the synced columns with LIMIT 0 (SELECT * would be refused, 42803)."""
    case = _case(superset, "dpsql_preview")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    sql = " ".join(case["sql"][0].split())
    assert sql == "SELECT department, visit_date, cost, urgent FROM public.visits LIMIT 0", sql  # catalog order
    assert case["rows"] == [0]
    assert _epsilons(case["wire"]) == []


def test_dpsql_cost_estimate_is_dpsqls_explain(superset: dict[str, Any]) -> None:
    """SQL Lab's "estimate cost" shows the ε the query would be charged, from EXPLAIN, which spends nothing."""
    case = _case(superset, "dpsql_estimate")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    explained = [" ".join(w["sql"].split()) for w in case["wire"] if w["sql"].startswith("EXPLAIN")]
    assert explained == [f"EXPLAIN {case['sql'][0]}"]
    (estimate,) = case["estimate"]
    # what it would really cost: nothing, answered from the cells released earlier (issue #38 item 4)
    assert (estimate["epsilon"], estimate["delta"], estimate["mechanism"]) == ("0", "0", "laplace")
    assert estimate["free"].startswith("answered by summing the cells of"), estimate
    assert estimate["ci95"].startswith("count ci95=±")
    assert _epsilons(case["wire"]) == []


def test_dpsql_budget_refusal_as_sql_lab_reports_it(superset: dict[str, Any]) -> None:
    """SQL Lab turns the 53P01 into the spec's friendly error (custom_errors), nothing charged."""
    case = _case(superset, "dpsql_budget_exhausted_sqllab")
    assert (case["sqlstate"], case["message"]) == ("53P01", f'privacy budget exhausted for analyst "{BROKE}"')
    (error,) = case["sqllab_errors"]
    assert error["type"] == "QUERY_SECURITY_ACCESS_ERROR"
    assert error["message"].startswith(f'The privacy budget of analyst "{BROKE}" cannot cover this query'), error
    assert _epsilons(case["wire"]) == []


def test_dpsql_other_refusal_as_sql_lab_reports_it(superset: dict[str, Any]) -> None:
    """A refusal the spec has no message of its own for: dpsql's text with its SQLSTATE (Superset 6.1's
    SQL Lab hands extract_errors a string; it used to fail with "'str' object has no attribute '__cause__'")."""
    case = _case(superset, "dpsql_bad_date_sqllab")
    assert (case["sqlstate"], case["message"]) == ("22008", "date field value out of range: 2022-13-01")
    assert case["sqllab_errors"] == [
        {
            "type": "GENERIC_DB_ENGINE_ERROR",
            "message": "dpsql: date field value out of range: 2022-13-01 (SQLSTATE 22008)",
        }
    ]
    assert _epsilons(case["wire"]) == []


def test_dpsql_sql_lab_answers_an_aggregate(superset: dict[str, Any]) -> None:
    """SQL Lab's own run of an aggregate through dpsql:// (with its row LIMIT): answered, charged once."""
    case = _case(superset, "dpsql_sqllab_answered")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    assert case.get("sqllab_errors") is None and case["rows"] == [2], case
    assert _epsilons(case["wire"]) == [DPSQL_EPSILON]


def test_dpsql_virtual_dataset_payload_is_not_a_500(superset: dict[str, Any]) -> None:
    """A SQL dataset's payload (what Explore and GET /api/v1/dataset load) through dpsql://: its
    ``select_star`` names a table that does not exist; it is ``SELECT * … LIMIT 0``, not an HTTP 500."""
    case = _case(superset, "dpsql_virtual_payload")
    assert "exception" not in case, case["exception"]
    assert " ".join(case["sql"][0].split()) == "SELECT * FROM dpsql_visits_sql LIMIT 0"
    assert case["rows"] == [3]  # the synced columns: cost, department, visit_date
    assert _epsilons(case["wire"]) == []


def test_dpsql_unsupported_shape_as_sql_lab_reports_it(superset: dict[str, Any]) -> None:
    """A 0A000 (a minute bucket) in SQL Lab: the spec's message around dpsql's own, nothing charged."""
    case = _case(superset, "dpsql_minute_sqllab")
    assert (case["sqlstate"], case["message"]) == ("0A000", 'DATE_TRUNC("minute") is not supported in GROUP BY')
    (error,) = case["sqllab_errors"]
    assert error == {
        "type": "GENERIC_DB_ENGINE_ERROR",
        "message": 'dpsql does not answer this query shape (SQLSTATE 0A000: DATE_TRUNC("minute") is not supported '
        "in GROUP BY). Simplify the chart: no series limit, simple metrics over declared columns, time grains "
        "from hour to year.",
    }
    assert _epsilons(case["wire"]) == []


def _ci95(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_show_intervals_is_for_sql_lab_not_charts(superset: dict[str, Any]) -> None:
    """``dpsql://…?show_intervals=on`` under a chart: dpsql sends ``count_ci95`` after ``count``, but a
    Superset chart keeps the first N columns it asked for and renames them by position, so with two
    metrics the second metric's name labels count's 95% half-width. Hence docs/bi.md: intervals on a
    database used by SQL Lab only, never by charts."""
    case = _case(superset, "dpsql_intervals_table")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    (sent,) = [w for w in case["wire"] if "AVG(cost)" in w["sql"] and w["sql"].rstrip().endswith("1000")]
    assert len(sent["rows"]) == 6 and all(len(r) == 5 for r in sent["rows"])  # dept, count, ci, avg, ci
    assert all(_ci95(r[2]) and _ci95(r[4]) for r in sent["rows"]), sent["rows"]
    assert case["colnames"] == [["department", "count", "avg_cost"]], case["colnames"]
    (rows,) = case["data"]
    assert {(r["department"], r["avg_cost"]) for r in rows} == {(r[0], r[2]) for r in sent["rows"]}
    step = next(s for s in superset["setup"] if s["step"] == "dpsql_intervals: sync columns: intervals_visits")
    assert step["outcome"] == "answered" and _epsilons(step["wire"]) == []  # LIMIT 0 probe: free


def test_postgresql_uri_options_give_sql_lab_ci95_columns(superset: dict[str, Any]) -> None:
    """``postgresql+psycopg2://…?options=-c%20dpsql.epsilon%3D0.5%20-c%20dpsql.show_intervals%3Don``
    (Superset's PostgreSQL connector): SQL Lab's result has ``count_ci95`` beside ``count``."""
    case = _case(superset, "pg_intervals_sqllab")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    assert case["sqllab_columns"] == ["urgent", "count", "count_ci95"], case
    rows = [r for w in case["wire"] if "urgent" in w["sql"] for r in w.get("rows", [])]
    assert len(rows) == 2 and all(_ci95(r[2]) for r in rows), rows


def test_dpsql_spec_surfaces_notices_in_sql_lab_and_log(superset: dict[str, Any]) -> None:
    """DpsqlEngineSpec reads the NOTICEs psycopg2 collected: a SQL Lab query's ``extra.dpsql_notices``
    (returned with its results) and Superset's log carry dpsql's charge and intervals, as sent."""
    case = _case(superset, "dpsql_sqllab_answered")
    sent = [n for w in case["wire"] if "urgent" in w["sql"] for n in w["notices"]]
    assert any(n.startswith(f"NOTICE:  dpsql: charged ε={DPSQL_EPSILON:g};") for n in sent), sent
    assert case["sqllab_extra"]["dpsql_notices"] == sent
    assert any("CI half-widths" in n for n in sent), sent
    for notice in sent:
        assert f"dpsql notice (database dpsql): {notice}" in case["logged"], case["logged"]
    chart = _case(superset, "dpsql_big_number")  # a chart: Superset's log only (no other place for it)
    expected = "dpsql notice (database dpsql): NOTICE:  dpsql: answered by summing the cells of 2 earlier"
    assert any(m.startswith(expected) for m in chart["logged"]), chart["logged"]


def _notices(case: dict[str, Any]) -> list[str]:
    return [n for w in case["wire"] for n in w.get("notices") or []]


def _half_widths(case: dict[str, Any]) -> list[float]:
    """The ± of dpsql's ``CI half-widths`` NOTICEs (the numbers after each ``±``)."""
    found = [m for n in _notices(case) if "half-width" in n for m in re.findall(r"±([0-9.e+]+)(?:–([0-9.e+]+))?", n)]
    return [float(x) for pair in found for x in pair if x]


def test_accuracy_in_the_dpsql_uri(superset: dict[str, Any]) -> None:
    """Issue #38 item 4: ``dpsql://…?accuracy=100`` used to be an HTTP 400 in Superset. A chart through it
    is charged the least ε meeting ±100 (not the URI's ε=0.25) and its ± meet it."""
    case = _case(superset, "dpsql_accuracy_chart")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("exception"))
    (charged,) = _epsilons(case["wire"])
    assert charged != DPSQL_EPSILON and 0 < charged < 5
    widths = _half_widths(case)
    assert widths and max(widths) <= 100, _notices(case)


def test_accuracy_set_in_a_sql_lab_run(superset: dict[str, Any]) -> None:
    """docs/bi.md's SQL Lab recipe: ``SET dpsql.accuracy = '±100';`` in the same run as the query holds for
    that run (SQL Lab runs its statements in order on one connection); the next run is back at the URI's ε."""
    case = _case(superset, "dpsql_accuracy_sqllab_set")
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("sqllab_errors"))
    assert case.get("sqllab_errors") is None and case["rows"] == [2], case
    (charged,) = _epsilons(case["wire"])
    assert charged != DPSQL_EPSILON
    assert _half_widths(case) and max(_half_widths(case)) <= 100, _notices(case)
    following = _case(superset, "dpsql_accuracy_sqllab_next")
    assert following["outcome"] == "answered" and following["rows"] == [2], following
    assert _epsilons(following["wire"]) == [DPSQL_EPSILON]


@pytest.mark.parametrize("name", ["dpsql_budget_total_sqllab", "dpsql_budget_grouped_sqllab"])
def test_budget_view_aggregates_in_sql_lab(superset: dict[str, Any], name: str) -> None:
    """Issue #38 item 4: a chart's SQL over ``dpsql_budget`` (SUM, GROUP BY) was 0A000; answered, free."""
    case = _case(superset, name)
    assert case["outcome"] == "answered", (case["sqlstate"], case["message"], case.get("sqllab_errors"))
    assert case.get("sqllab_errors") is None and case["rows"] == [1], case
    assert _epsilons(case["wire"]) == []
