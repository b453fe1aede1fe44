"""The person two hops away, on neighbouring databases (issue #35), DuckDB and PostgreSQL.

labs → visits → patients, declared the natural way (``references`` on both hops, the unit on patients
only). D' adds one patient with 36 lab rows. Before #35 this declaration made every lab row a person:
a ``COUNT(*)`` charged ε = 1 was audited at ε̂ ≥ 5.8. Here the released values are sampled on D and D'
(the engine's own SQL run once on each, its release step sampled many times: exactly the mechanism)
and every threshold event must satisfy P[M(D)∈S] ≤ e^ε·P[M(D')∈S] (Clopper–Pearson, Holm-corrected),
for a count over labs, a foreign-key join that multiplies no cap, a per-person question, a cap set
per query, and a cap chosen under DP (the choice sampled too: it is part of the mechanism).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.curator.check import check_text
from dpsql.engine import Engine, Prepared
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.session import Result, Session
from tests.adversarial.fuzz_grammar import FuzzPolicy, database_script
from tests.kinds import open_empty
from tests.policies import LAPLACE_95, block_budget, policy_yaml, table_yaml
from tests.trust.conftest import dp_violations, threshold_events

N = 4000
QUANTILES = (0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 0.98)

POLICY = policy_yaml(
    "labs",
    table_yaml("patients", "age: {type: int, lower: 0, upper: 100, nullable: false}", unit="id", ids=("id",))
    + table_yaml(
        "visits",
        "ward: {type: text, domain: [a, b], nullable: false}",
        refs="patient_id patients.id",
        rows=8,
        ids=("id", "patient_id"),
    )
    + table_yaml(
        "labs",
        "value: {type: float, lower: 0.0, upper: 10.0, nullable: false}",
        refs="visit_id visits.id",
        rows=10,
        ids=("id", "visit_id"),
    ),
    defaults=LAPLACE_95,
    budget=block_budget("{epsilon: 1.0e6, delta: 1.0e-3}", "{epsilon: 1.0e6, delta: 1.0e-3}"),
    trust=True,
    analysts="[{name: auditor}]",
)


def _script(extra: bool) -> str:
    rng = random.Random(5)
    rows = ["CREATE TABLE patients (id INTEGER, age INTEGER);"]
    rows += ["CREATE TABLE visits (id INTEGER, patient_id INTEGER, ward VARCHAR(4));"]
    rows += ["CREATE TABLE labs (id INTEGER, visit_id INTEGER, value DOUBLE PRECISION);"]
    visit, lab = 1, 1
    patients = [(p, rng.randint(1, 4), [rng.randint(0, 4) for _ in range(6)]) for p in range(1, 61)]
    if extra:
        patients.append((999, 6, [6] * 6))  # the neighbour: 6 visits of 6 labs each
    for patient, visits, labs in patients:
        rows.append(f"INSERT INTO patients VALUES ({patient}, {rng.randint(20, 80)});")
        for v in range(visits):
            rows.append(f"INSERT INTO visits VALUES ({visit}, {patient}, '{'ab'[v % 2]}');")
            for _ in range(labs[v]):
                rows.append(f"INSERT INTO labs VALUES ({lab}, {visit}, {rng.uniform(0, 10):.2f});")
                lab += 1
            visit += 1
    return "\n".join(rows)


@pytest.fixture(params=["duckdb", "postgres"])
def neighbours(request: pytest.FixtureRequest) -> Iterator[tuple[Backend, Backend]]:
    pair = []
    for extra in (False, True):
        backend = open_empty(request.param, request)
        backend.execute_script(_script(extra))
        pair.append(backend)
    yield pair[0], pair[1]
    for backend in pair:
        backend.close()


@dataclass(frozen=True)
class Case:
    sql: str
    cap: int | str | None = None


CASES = [
    Case("SELECT COUNT(*) FROM labs"),
    Case("SELECT SUM(l.value) FROM labs l JOIN visits v ON l.visit_id = v.id"),
    Case(
        "SELECT COUNT(*) FROM (SELECT v.patient_id FROM labs l JOIN visits v ON l.visit_id = v.id "
        "GROUP BY v.patient_id HAVING COUNT(*) > 3) t"
    ),
    Case("SELECT COUNT(*) FROM labs", cap=3),
    Case("SELECT COUNT(*) FROM labs", cap="auto"),
]


def _policy() -> Policy:
    return parse_policy(POLICY, "<labs>")


def _sampler(backend: Backend, case: Case) -> Callable[[], float]:
    """One release of the case on ``backend``: its SQL run once (per cap candidate, for ``auto``), the
    release step — and the cap's choice — sampled afresh on each call."""
    engine = Engine(_policy(), backend, Ledger.open("sqlite:///:memory:"))
    engine._salt = "fixed"  # the engine's secret row-selection salt, the same for both neighbours
    session = Session.configure("auditor", max_rows_per_unit=case.cap)
    prepared = engine.prepare(case.sql, session)
    step = engine.step
    if prepared.cap is None:
        rows = step.query(prepared.sql)
        return lambda: _scalar(step.release_rows(prepared, rows, 0.95))
    choice = prepared.cap
    above = [int(n or 0) for n in step.query(choice.sql)[0]]
    at: dict[int, tuple[Prepared, list[tuple[Any, ...]]]] = {}

    def sample() -> float:
        tau = choice.choose(above)
        if tau not in at:
            chosen, _ = step.at_cap(prepared, tau)
            at[tau] = (chosen, step.query(chosen.sql))
        chosen, rows = at[tau]
        return _scalar(step.release_rows(chosen, rows, 0.95))

    return sample


def _scalar(result: Result) -> float:
    return float(result.rows[0][0])


@pytest.mark.parametrize("case", CASES, ids=[f"{c.sql[:50]} cap={c.cap}" for c in CASES])
def test_two_hops_keep_epsilon(neighbours: tuple[Backend, Backend], case: Case) -> None:
    base, neighbour = neighbours
    on_d, on_d_prime = _sampler(base, case), _sampler(neighbour, case)
    outputs_d = [on_d() for _ in range(N)]
    outputs_p = [on_d_prime() for _ in range(N)]
    events = threshold_events(outputs_d + outputs_p, QUANTILES)
    assert dp_violations(outputs_d, outputs_p, events, epsilon=1.0, delta=1e-6) == []


def test_the_neighbour_moves_a_count_by_at_most_the_cap(neighbours: tuple[Backend, Backend]) -> None:
    """Un-noised, the 36-lab patient moves COUNT(*) over labs by the labs cap (10), not by 36."""
    counts = []
    for backend in neighbours:
        engine = Engine(_policy(), backend, Ledger.open("sqlite:///:memory:"))
        prepared = engine.prepare("SELECT COUNT(*) FROM labs", Session("auditor"))
        counts.append(float(engine.step.query(prepared.sql)[0][0]))
    assert counts[1] - counts[0] == 10


def test_a_repeating_chain_key_refuses_before_any_charge(request: pytest.FixtureRequest) -> None:
    """The fuzzer's ``dupkey`` neighbour (an event id of another person's): queries through the key are
    refused with 23505 before anything is charged, on DuckDB without constraints and on PostgreSQL;
    ``policy check`` names the key. With a PRIMARY KEY the database itself refuses such a neighbour."""
    fuzz = FuzzPolicy("pid", 3, 2, "table", True, frozenset(), (0.0, 50.0), (0, 10), (-5.0, 5.0))
    policy = parse_policy(fuzz.yaml(), "<fuzz>")
    for dialect in ("duckdb", "postgres"):
        backend = open_empty(dialect, request)
        backend.execute_script(database_script("dupkey"))
        engine = Engine(policy, backend, Ledger.open("memory"))
        with pytest.raises(Error) as info:
            engine.execute("SELECT COUNT(*) FROM lines", Session("alice"))
        assert info.value.sqlstate == "23505"
        assert info.value.message.startswith('key "events.eid" repeats')
        assert engine.ledger.spent("fuzz", "alice").epsilon == 0  # refused before the charge
        engine.execute("SELECT COUNT(*) FROM events", Session("alice"))  # no chain through eid: answered
        report = check_text(fuzz.yaml(), "fuzz.yaml", backend)
        assert any("tables.lines.references.to: events.eid repeats" in e for e in report.errors), report.errors
        backend.close()
