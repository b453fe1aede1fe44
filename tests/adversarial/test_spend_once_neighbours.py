"""Issue #29's new front-door features on neighbouring databases (one patient removed; that patient's
stored values made extreme: out of bounds, in an undeclared group), on DuckDB and PostgreSQL: the ε that
``dpsql.accuracy`` picks and charges, its refusals, and ibis-style computed columns of subqueries are the
same on both: they read the query and the policy only."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session

NEIGHBOURS = {
    "D": "",
    "one-patient-absent": "DELETE FROM patients WHERE ssn = (SELECT MIN(ssn) FROM patients)",
    "one-patient-extreme": "UPDATE patients SET age = 100000, dob = DATE '1800-01-01', problem = 'Undeclared' "
    "WHERE ssn = (SELECT MIN(ssn) FROM patients)",
}
ACCURACY = [
    "SELECT sex, COUNT(*) FROM patients GROUP BY sex",
    "SELECT problem, AVG(age) FROM patients GROUP BY problem",  # 22023: its SUM needs more ε than the budget
    "SELECT DATE_TRUNC('year', dob), COUNT(*) FROM patients GROUP BY 1",
    "SELECT MEDIAN(age) FROM patients",  # 0A000: no half-width describes a quantile
]
IBIS = [
    'SELECT "t1"."old", COUNT(*) AS "n" FROM (SELECT "t0"."sex", "t0"."age" > 60 AS "old" FROM "patients" AS "t0") '
    'AS "t1" GROUP BY 1',
    'SELECT "t2"."s", AVG("t2"."a2") FROM (SELECT "t1"."s", "t1"."a" * 2 AS "a2" FROM (SELECT "t0"."sex" AS "s", '
    '"t0"."age" AS "a" FROM "patients" AS "t0") AS "t1") AS "t2" GROUP BY 1',
    'SELECT "t1"."id", COUNT(*) FROM (SELECT "t0"."ssn" || \'x\' AS "id" FROM "patients" AS "t0") AS "t1" GROUP BY 1',
    'SELECT "t1"."r", COUNT(*) FROM (SELECT RANDOM() > 0.5 AS "r" FROM "patients" AS "t0") AS "t1" GROUP BY 1',
]


def _outcome(engine: Engine, sql: str, session: Session) -> tuple[object, ...]:
    try:
        result = engine.execute(sql, session)
    except Error as exc:
        return ("refused", exc.sqlstate, exc.message, exc.hint)
    return ("answered", result.epsilon_spent, tuple(c.name for c in result.columns), len(result.rows))


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
def test_outcomes_do_not_depend_on_one_person(kind: str, request: pytest.FixtureRequest) -> None:
    new_database: Callable[[], str] | None = request.getfixturevalue("pg_new_database") if kind == "postgres" else None
    outcomes = {}
    for name, script in NEIGHBOURS.items():
        backend: Backend = open_backend("duckdb://") if new_database is None else open_backend(new_database())
        load_demo(backend, ["health"])
        if script:
            backend.execute_script(script)
        engine = Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:"))
        seen: list[tuple[object, ...]] = []
        accurate = Session("alice")
        accurate.apply("dpsql.accuracy", 25.0, "25")
        seen += [_outcome(engine, sql, accurate) for sql in ACCURACY]
        seen += [_outcome(engine, sql, Session("alice")) for sql in IBIS]
        outcomes[name] = seen
        engine.close()
    assert outcomes["D"] == outcomes["one-patient-absent"] == outcomes["one-patient-extreme"]
    kinds = [o[0] if o[0] == "answered" else o[1] for o in outcomes["D"]]
    assert kinds == ["answered", "22023", "answered", "0A000", "answered", "answered", "42501", "0A000"]
