"""CASE branches and date/time constants (issue #26, items 4 and 7): bounded analysis, PostgreSQL's errors.

A ``GROUP BY CASE`` key is analysed branch by branch before any charge. That work was quadratic in
the branches (sqlglot's ``Case.when`` copies the whole CASE: 800 branches took 43 s, free, and kept
burning CPU after the statement timeout); it is now linear, a CASE may have at most 1,000 WHEN
branches (54000, free), and analysis stops at a checkpoint per branch once the server has given up
on the statement (57014).

Date/time constants are folded in Python before anything runs. A huge year in ``make_date``, a
bigint argument, an interval whose field overflows or a ``date_bin`` stride beyond 64-bit
microseconds raised a Python exception (XX000); they now raise PostgreSQL's error (22008, 22015,
42883, 22023 for a unit it does not know), the same on every neighbouring database and backend,
before any charge. Dates PostgreSQL accepts but Python cannot hold (years 10000 and later) are
22008 with a hint. tests/adversarial/README lists the cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from dpsql.analyze import analyze, expressions
from dpsql.analyze.checks import MAX_CASE_BRANCHES
from dpsql.analyze.keys import choices
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error, QueryCanceled
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.server.limits import Job
from dpsql.server.server import ThreadedServer
from dpsql.session import Session

ALICE = Session("alice", epsilon=1.0)


def _age_case(branches: int) -> str:
    whens = " ".join(f"WHEN age < {i} THEN 'a{i}'" for i in range(1, branches + 1))
    return f"CASE {whens} END"


def _spent(engine: Engine) -> tuple[int, float]:
    dataset = engine.policy.dataset
    return len(engine.ledger.charges(dataset, "alice")), engine.ledger.spent(dataset, "alice").epsilon


# --- CASE: linear analysis, a cap, a checkpoint ---------------------------------------------------


def test_case_with_1000_branches_is_analysed_fast(health: Engine) -> None:
    """case-1000-branches: linear now (~0.3 s on a laptop; 43 s for 800 branches before). The bound is generous."""
    sql = f"SELECT {_age_case(MAX_CASE_BRANCHES)} AS k, COUNT(*) FROM patients GROUP BY k"
    started = time.monotonic()
    explained = health.explain(sql, ALICE)  # analysis and rewrite, nothing run or charged
    assert time.monotonic() - started < 10
    assert explained is not None and _spent(health) == (0, 0.0)
    result = health.execute(sql, ALICE)
    assert len(result.rows) == MAX_CASE_BRANCHES + 1  # every label (a public derived domain) and NULL
    assert _spent(health) == (1, 1.0)


CAPPED = [
    ("group-by-key", "SELECT {case} AS k, COUNT(*) FROM patients GROUP BY k"),
    ("group-by-ordinal", "SELECT {case}, COUNT(*) FROM patients GROUP BY 1"),
    ("inside-sum", "SELECT SUM({case_num}) FROM patients"),
    ("where", "SELECT COUNT(*) FROM patients WHERE {case} = 'a3'"),
    ("explain", "EXPLAIN SELECT {case} AS k, COUNT(*) FROM patients GROUP BY k"),
]


@pytest.mark.parametrize("branches", [MAX_CASE_BRANCHES + 1, 5000])
@pytest.mark.parametrize(("where", "template"), CAPPED, ids=[c[0] for c in CAPPED])
def test_case_branch_cap_is_54000_and_free(health: Engine, where: str, template: str, branches: int) -> None:
    """case-branch-cap: a CASE with more than 1,000 WHEN branches -> 54000 right after parsing, nothing charged."""
    numbers = " ".join(f"WHEN age < {i} THEN {i}" for i in range(1, branches + 1))
    sql = template.format(case=_age_case(branches), case_num=f"CASE {numbers} ELSE 0 END")
    started = time.monotonic()
    with pytest.raises(Error) as refused:
        health.execute(sql, ALICE)
    assert time.monotonic() - started < 10
    assert (refused.value.sqlstate, refused.value.message) == (
        "54000",
        f"a CASE expression may have at most {MAX_CASE_BRANCHES} WHEN branches (this one has {branches})",
    )
    assert _spent(health) == (0, 0.0)


def test_interrupted_analysis_stops_at_a_case_branch(health: Engine) -> None:
    """case-analysis-interrupted: the server interrupts a statement's job at its timeout; analysis checks
    it once per CASE branch and stops (57014) instead of finishing, unseen, and charging afterwards."""
    sql = f"SELECT {_age_case(MAX_CASE_BRANCHES)} AS k, COUNT(*) FROM patients GROUP BY k"

    def interrupted(work: Callable[[], Any]) -> Any:
        def run() -> Any:
            job = Job.current()
            assert job is not None
            job.interrupt()  # what the server does once the statement timeout has passed
            return work()

        return Job().run(run)

    with pytest.raises(QueryCanceled):
        interrupted(lambda: analyze(sql, health.policy))  # pure analysis: no database statement to stop it
    with pytest.raises(QueryCanceled):
        interrupted(lambda: health.execute(sql, ALICE))
    assert _spent(health) == (0, 0.0)
    assert analyze(sql, health.policy).keys  # outside an interrupted job the checkpoint does nothing


def test_server_stops_analysis_at_the_statement_timeout(health: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """case-statement-timeout: through dpsql serve, a CASE whose analysis outlasts statement_timeout
    (each branch slowed to 5 ms here) -> 57014, and the abandoned analysis stops at the next branch
    instead of running on unseen (the server waits for it when stopping), nothing charged."""
    analysed: list[float] = []
    checkpoint = expressions.checkpoint  # the one choices imported

    def slow_checkpoint() -> None:
        analysed.append(time.monotonic())
        time.sleep(0.005)
        checkpoint()

    monkeypatch.setattr(choices, "checkpoint", slow_checkpoint)  # CASE branches are checked there
    sql = f"SELECT {_age_case(MAX_CASE_BRANCHES)} AS k, COUNT(*) FROM patients GROUP BY k"
    server = ThreadedServer(health, catalog_dsn="")
    try:
        with psycopg.connect(host="127.0.0.1", port=server.port, user="alice", dbname="health") as conn:
            conn.autocommit = True
            conn.execute("SET statement_timeout = 500")
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(sql)
            assert refused.value.sqlstate == "57014"
    finally:
        server.stop()  # waits for statements still running in the pool
    assert len(analysed) < MAX_CASE_BRANCHES  # 1,000 branches take at least 5 s here
    assert _spent(health) == (0, 0.0)


# --- date/time constants and date_bin strides on neighbouring databases --------------------------

#: A constant expression: id, SQL, SQLSTATE, message (PostgreSQL 15's, or dpsql's for years past 9999).
CONSTANTS = [
    ("make-date-huge-year", "make_date(1000000, 1, 1)", "22008", "date out of range: 1000000-01-01"),
    ("make-date-year-zero", "make_date(0, 1, 1)", "22008", "date field value out of range: 0-01-01"),
    (
        "make-date-bigint",
        "make_date(3000000000, 1, 1)",
        "42883",
        "function make_date(bigint, integer, integer) does not exist",
    ),
    (
        "make-date-numeric",
        "make_date(99999999999999999999, 1, 1)",
        "42883",
        "function make_date(numeric, integer, integer) does not exist",
    ),
    (
        "make-timestamp-huge-year",
        "make_timestamp(1000000, 1, 1, 0, 0, 0)",
        "22008",
        "timestamp out of range: 1000000-01-01 0:00:00",
    ),
    (
        "make-timestamp-huge-second",
        "make_timestamp(2022, 1, 1, 0, 0, 1e300)",
        "22008",
        "time field value out of range: 0:00:1e+300",
    ),
    (
        "make-timestamp-numeric-hour",
        "make_timestamp(2022, 1, 1, 99999999999999999999, 0, 0)",
        "42883",
        "function make_timestamp(integer, integer, integer, numeric, integer, integer) does not exist",
    ),
    ("to-timestamp-huge", "to_timestamp(1e20)", "22008", 'timestamp out of range: "1e+20"'),
    ("date-plus-bigint", "DATE '2020-01-01' + 3000000000", "42883", "operator does not exist: date + bigint"),
    ("date-plus-huge", "DATE '2020-01-01' + 2000000000", "22008", "date out of range"),
    (
        "interval-field-overflow",
        "DATE '2020-01-01' + INTERVAL '1000000000000 days'",
        "22015",
        'interval field value out of range: "1000000000000 days"',
    ),
    ("interval-months-overflow", "NOW() - INTERVAL '1000000000 years'", "22008", "interval out of range"),
    ("timestamp-overflow", "DATE '2020-01-01' + INTERVAL '100000000 years'", "22008", "timestamp out of range"),
]

#: Where the constant stands: WHERE, inside aggregates, a GROUP BY key, the select list, HAVING.
PLACES = {
    "where": "SELECT COUNT(*) FROM visits WHERE visit_date > {c}",
    "filter": "SELECT COUNT(*) FILTER (WHERE visit_date > {c}) FROM visits",
    "sum-case": "SELECT SUM(CASE WHEN visit_date > {c} THEN cost ELSE 0 END) FROM visits",
    "group-by": "SELECT CASE WHEN visit_date > {c} THEN 'late' ELSE 'early' END AS k, COUNT(*) FROM visits GROUP BY k",
    "output": "SELECT COUNT(*), {c} FROM visits",
    "having": "SELECT department, COUNT(*) FROM visits GROUP BY department HAVING {c} IS NOT NULL",
}

#: Whole statements: id, SQL, and a SQLSTATE and message, or the number of keys released everywhere.
KEYS: list[tuple[str, str, tuple[str, str] | int]] = [
    (
        "bin-stride-overflow",  # 10^9 days is an interval, but not 64-bit microseconds
        "SELECT date_bin('1000000000 days', visit_date, '2020-01-01') AS b, COUNT(*) FROM visits GROUP BY b",
        ("22008", "interval out of range"),
    ),
    (
        "bin-stride-field-overflow",
        "SELECT date_bin('100000000000000 hours', visit_date, '2020-01-01') AS b, COUNT(*) FROM visits GROUP BY b",
        ("22015", 'interval field value out of range: "100000000000000 hours"'),
    ),
    (
        "bin-huge-years",
        "SELECT date_bin('100000000 years', visit_date, '2020-01-01') AS b, COUNT(*) FROM visits GROUP BY b",
        ("0A000", "timestamps cannot be binned into intervals containing months or years"),
    ),
    (
        "bin-years-overflow",
        "SELECT date_bin('1000000000 years', visit_date, '2020-01-01') AS b, COUNT(*) FROM visits GROUP BY b",
        ("22008", "interval out of range"),
    ),
    (
        "bin-widest-stride",  # the widest stride there is: one bin, from the origin
        "SELECT date_bin('106751991 days', visit_date, '2020-01-01') AS b, COUNT(*) FROM visits GROUP BY b",
        1,
    ),
    (
        "trunc-unknown-unit",
        "SELECT date_trunc('fortnight', visit_date) AS m, COUNT(*) FROM visits GROUP BY m",
        ("22023", 'unit "fortnight" not recognized for type timestamp with time zone'),
    ),
    (
        "extract-unknown-unit",
        "SELECT SUM(EXTRACT(fortnight FROM visit_date)) FROM visits",
        ("22023", 'unit "fortnight" not recognized for type date'),
    ),
    (
        "trunc-unit-alias",  # PostgreSQL's abbreviations name the same units
        "SELECT date_trunc('mon', visit_date) AS m, COUNT(*) FROM visits WHERE visit_date >= '2024-01-01' GROUP BY m",
        12,
    ),
    (
        "case-branches-backends",  # a long CASE the backend evaluates: one label per 8.0 of cost, and 'top'
        "SELECT CASE "
        + " ".join(f"WHEN cost < {8 * i} THEN 'c{i}'" for i in range(1, 251))
        + " ELSE 'top' END AS k, COUNT(*) FROM visits GROUP BY k",
        251,
    ),
]

NEIGHBOURS = {
    "as-loaded": None,
    "patient-42-odd-values": "UPDATE visits SET cost = 1e300, visit_date = DATE '2999-12-31' WHERE patient_id = 42",
    "patient-42-absent": "DELETE FROM visits WHERE patient_id = 42; DELETE FROM prescriptions WHERE patient_id = 42; "
    "DELETE FROM patients WHERE id = 42",
}
BACKENDS = ("duckdb", "postgres")


def _outcome(backend: Backend, policy: Policy, sql: str) -> tuple[Any, ...]:
    engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
    try:
        result = engine.execute(sql, Session("alice", epsilon=1.0))
    except Error as exc:
        return ("refused", exc.sqlstate, exc.message, _spent(engine))
    return ("answered", frozenset(row[0] for row in result.rows), _spent(engine))


def _statements() -> dict[str, str]:
    found = {f"{case}@{place}": PLACES[place].format(c=sql) for case, sql, _, _ in CONSTANTS for place in PLACES}
    found.update({case: sql for case, sql, _ in KEYS})
    return found


@pytest.fixture(scope="module")
def date_outcomes(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str, str], tuple[Any, ...]]]:
    found: dict[tuple[str, str, str], tuple[Any, ...]] = {}
    statements = _statements()
    policy = load_policy(demo_policy_path("clinic"))
    for name, url in (("duckdb", "duckdb://"), ("postgres", pg_new_database())):
        backend = open_backend(url)
        try:
            load_demo(backend, ["clinic"])
            for neighbour, change in NEIGHBOURS.items():
                if change:
                    backend.execute_script(change)
                for case, sql in statements.items():
                    found[case, name, neighbour] = _outcome(backend, policy, sql)
        finally:
            backend.close()
    yield found


def _everywhere(outcomes: dict[tuple[str, str, str], tuple[Any, ...]], case: str) -> tuple[Any, ...]:
    seen = {(b, n): outcomes[case, b, n] for b in BACKENDS for n in NEIGHBOURS}
    distinct = set(seen.values())
    assert len(distinct) == 1, f"outcome depends on the data or backend: {seen}"
    return distinct.pop()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(("case", "sql", "sqlstate", "message"), CONSTANTS, ids=[c[0] for c in CONSTANTS])
def test_date_constants_raise_postgres_errors_before_any_charge(
    date_outcomes: dict[tuple[str, str, str], tuple[Any, ...]],
    case: str,
    sql: str,
    sqlstate: str,
    message: str,
    place: str,
) -> None:
    assert _everywhere(date_outcomes, f"{case}@{place}") == ("refused", sqlstate, message, (0, 0.0))


@pytest.mark.parametrize(("case", "sql", "expected"), KEYS, ids=[k[0] for k in KEYS])
def test_date_keys_are_the_same_everywhere(
    date_outcomes: dict[tuple[str, str, str], tuple[Any, ...]], case: str, sql: str, expected: tuple[str, str] | int
) -> None:
    outcome = _everywhere(date_outcomes, case)
    if isinstance(expected, tuple):
        assert outcome == ("refused", *expected, (0, 0.0))
    else:
        assert outcome[0] == "answered" and len(outcome[1]) == expected and outcome[2] == (1, 1.0)
