"""Empirical differential privacy: sample the released output on neighbouring databases, bound the ratio.

For each query, the generated SQL runs once on D and once on D' (one person apart); the engine's
release step then noises those true aggregates many times, which is exactly the mechanism. For a
family of events S (thresholds on released values, released key sets), one-sided Clopper–Pearson
bounds with Holm's correction test P[M(D)∈S] ≤ e^ε·P[M(D')∈S] + δ in both directions. A negative
control runs the same detector on a deliberately mis-scaled mechanism and must flag it, so a pass
means something.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine, Prepared
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.noise.mechanisms import NoiseSpec
from dpsql.policy import Policy
from dpsql.release import partition_threshold
from dpsql.session import Result, Session
from tests.policies import without_domain
from tests.trust.conftest import (
    EXTREME_PATIENT,
    SECRET_DEPARTMENT,
    Event,
    dp_violations,
    threshold_events,
)

#: Releases sampled per database in the default suite (heavy variant: ``HEAVY_N``).
N = 6_000
HEAVY_N = 100_000
QUANTILES = (0.01, 0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95, 0.99)
UNIQUE_ZIP = EXTREME_PATIENT[5]

Extract = Callable[[Result], Any]


def _engine(policy: Policy, backend: Backend) -> Engine:
    """An engine that accepts the large δ (0.05) these tests need for statistical power: a query's δ
    is otherwise capped at ``budget.max_query_delta`` (10⁻³) and below the dataset's δ budget."""
    budget = policy.budget.model_copy(
        update={"max_query_delta": 0.5, "dataset": policy.budget.dataset.model_copy(update={"delta": 0.9})}
    )
    return Engine(policy.model_copy(update={"budget": budget}), backend, Ledger.open("sqlite:///:memory:"))


def _sample(engine: Engine, prepared: Prepared, backend: Backend, n: int, extract: Extract) -> list[Any]:
    """Run the generated SQL once on ``backend`` and release its true aggregates ``n`` times."""
    rows = engine.step.query(prepared.sql) if backend is engine.backend else _run_on(backend, prepared.sql)
    return [extract(engine.step.release_rows(prepared, rows, 0.95)) for _ in range(n)]


def _prepare(
    case: Case, backend: Backend, policy: Policy, tamper: Callable[[Prepared], Prepared] | None, salt: str | None
):
    """Plan the case as an engine on ``backend`` would: the SQL may depend on the database's statistics
    (clamps it proves redundant), so each neighbour gets its own plan, as it would in production. The
    row-selection salt is the engine's fixed secret, the same whichever neighbour it serves."""
    engine = _engine(policy, backend)
    if salt is not None:
        engine._salt = salt
    prepared = engine.prepare(case.sql, case.session)
    return engine, (prepared if tamper is None else tamper(prepared))


def _run_on(backend: Backend, sql: str) -> list[tuple[Any, ...]]:
    _, rows = backend.execute(sql)
    return rows


def _scalar(result: Result) -> Any:
    assert len(result.rows) == 1
    return result.rows[0][0]


def _keyed(column: int) -> Extract:
    """Released rows as {key: value of ``column``}; the key set itself is part of the output."""
    return lambda result: {row[0]: row[column] for row in result.rows}


def _mis_scaled(prepared: Prepared, factor: float) -> Prepared:
    """The same query with noise scales divided by ``factor``, still claiming the original ε."""
    specs: list[NoiseSpec | None] = []
    for s in prepared.budgeting.specs:
        assert s is not None
        specs.append(dataclasses.replace(s, scale=s.scale / factor))
    return dataclasses.replace(prepared, budgeting=dataclasses.replace(prepared.budgeting, specs=specs))


def _loose_threshold(prepared: Prepared, delta_factor: float, *, rows_per_unit: int | None = None) -> Prepared:
    """Partition selection whose threshold was computed for ``delta_factor``·δ (and, optionally, as if a
    unit had ``rows_per_unit`` rows), still claiming δ."""
    budgeting = prepared.budgeting
    assert budgeting.threshold is not None and prepared.plan.selection_measure is not None
    spec = budgeting.specs[prepared.plan.selection_measure]
    threshold = partition_threshold(
        spec,
        min(budgeting.selection_delta * delta_factor, 0.5),
        max_partitions=prepared.plan.max_groups,
        max_rows=prepared.plan.max_rows if rows_per_unit is None else rows_per_unit,
    )
    return dataclasses.replace(prepared, budgeting=dataclasses.replace(budgeting, threshold=threshold))


def _row_count_selection(prepared: Prepared) -> Prepared:
    """Partition selection thresholding the query's COUNT(*) (rows) instead of its distinct-unit count."""
    star = next(i for i, m in enumerate(prepared.plan.measures) if m.kind == "count_star")
    return dataclasses.replace(prepared, plan=dataclasses.replace(prepared.plan, selection_measure=star))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dataset: str  # "health" (row-level) or "clinic" (person-level)
    sql: str
    session: Session
    extract: Extract
    events: Callable[[Sequence[Any], Sequence[Any]], list[Event]]
    #: Which clinic neighbour D' is: 1 = without heavy patient 42, 2 = plus a heavy stranger.
    neighbour: int = 1


def _scalar_events(a: Sequence[Any], b: Sequence[Any]) -> list[Event]:
    return threshold_events([*a, *b], QUANTILES)


def _of(event: Callable[[Any], bool], read: Callable[[Any], Any]) -> Callable[[Any], bool]:
    """``event`` of what ``read`` takes from an output (``event`` bound now, not when it is called)."""
    return lambda o: event(read(o))


def _keyed_events(key: Any, absent: Any = None) -> Callable[[Sequence[Any], Sequence[Any]], list[Event]]:
    """Threshold events on ``key``'s value (absent counts as -inf) plus, optionally, "``absent`` released"."""

    def build(a: Sequence[Any], b: Sequence[Any]) -> list[Event]:
        values = [o[key] for o in [*a, *b] if key in o]
        events = [
            (f"{key}: {name}", _of(f, lambda o: o.get(key, -math.inf)))
            for name, f in threshold_events(values, QUANTILES)
        ]
        events.append((f"{key} released", lambda o: key in o))
        if absent is not None:
            events.append((f"{absent} released", lambda o: absent in o))
            events.append(("released key set == common keys", lambda o: absent not in o and key in o))
        return events

    return build


CASES = [
    Case(
        "count",
        "health",
        "SELECT COUNT(*) FROM patients WHERE age > 30",
        Session("t", epsilon=1.0),
        _scalar,
        _scalar_events,
    ),
    Case("sum-int", "health", "SELECT SUM(age) FROM patients", Session("t", epsilon=1.0), _scalar, _scalar_events),
    Case("sum-real", "health", "SELECT SUM(bmi) FROM patients", Session("t", epsilon=1.0), _scalar, _scalar_events),
    Case("avg", "health", "SELECT AVG(age) FROM patients", Session("t", epsilon=1.0), _scalar, _scalar_events),
    Case(
        "group-partition-selection",
        "health",
        "SELECT zip, COUNT(*) FROM patients GROUP BY zip",
        Session("t", epsilon=1.0, delta=0.05),
        _keyed(1),
        _keyed_events(2100, absent=UNIQUE_ZIP),
    ),
    Case(
        "join-public-keys",
        "clinic",
        "SELECT d.building, COUNT(*), SUM(v.cost) FROM visits v JOIN departments d ON v.department = d.name "
        "GROUP BY d.building",
        Session("t", epsilon=1.0),
        lambda r: {row[0]: (row[1], row[2]) for row in r.rows},
        lambda a, b: (
            [
                (f"North count {n}", _of(f, lambda o: o["North"][0]))
                for n, f in threshold_events([o["North"][0] for o in [*a, *b]], QUANTILES)
            ]
            + [
                (f"North sum {n}", _of(f, lambda o: o["North"][1]))
                for n, f in threshold_events([o["North"][1] for o in [*a, *b]], QUANTILES)
            ]
        ),
    ),
    Case(
        "join-person-level",
        "clinic",
        "SELECT COUNT(*), AVG(r.dose_mg) FROM patients p JOIN prescriptions r ON r.patient_id = p.id WHERE p.age > 20",
        Session("t", epsilon=1.0),
        lambda r: r.rows[0],
        lambda a, b: (
            [(f"count {n}", _of(f, lambda o: o[0])) for n, f in threshold_events([o[0] for o in [*a, *b]], QUANTILES)]
            + [(f"avg {n}", _of(f, lambda o: o[1])) for n, f in threshold_events([o[1] for o in [*a, *b]], QUANTILES)]
        ),
    ),
    Case(
        "person-level-partition-selection",
        "clinic",
        "SELECT department, COUNT(*) FROM visits GROUP BY department",
        Session("t", epsilon=1.0, delta=0.05),
        _keyed(1),
        _keyed_events("Oncology", absent=SECRET_DEPARTMENT),
        neighbour=2,
    ),
]


def _policy_and_backends(case: Case, request: pytest.FixtureRequest) -> tuple[Policy, Backend, Backend]:
    if case.dataset == "health":
        d, d_prime = request.getfixturevalue("health_neighbours")
        return request.getfixturevalue("health_policy"), d, d_prime
    clinic = request.getfixturevalue("clinic_neighbours")
    policy = request.getfixturevalue("clinic_policy")
    if case.name == "person-level-partition-selection":  # visits.department without its public domain
        policy = without_domain(policy, "visits", "department")
    return policy, clinic[0], clinic[case.neighbour]


def _run_case(case: Case, request: pytest.FixtureRequest, n: int, tamper: Callable[[Prepared], Prepared] | None = None):
    policy, d, d_prime = _policy_and_backends(case, request)
    engine, prepared = _prepare(case, d, policy, tamper, None)
    engine_prime, prepared_prime = _prepare(case, d_prime, policy, tamper, engine._salt)
    assert prepared_prime.budgeting == prepared.budgeting  # same noise either way: only the clamps may differ
    a = _sample(engine, prepared, d, n, case.extract)
    b = _sample(engine_prime, prepared_prime, d_prime, n, case.extract)
    budgeting = prepared.budgeting
    return dp_violations(a, b, case.events(a, b), budgeting.epsilon, budgeting.delta), a, b


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_released_output_is_dp_on_neighbours(case: Case, request: pytest.FixtureRequest) -> None:
    violations, a, b = _run_case(case, request, N)
    assert not violations, violations
    assert a != b or case.name.startswith("group")  # the neighbours really differ in the released output


@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_released_output_is_dp_on_neighbours_heavy(case: Case, request: pytest.FixtureRequest) -> None:
    violations, _, _ = _run_case(case, request, HEAVY_N)
    assert not violations, violations


NEGATIVE = {
    "count": lambda p: _mis_scaled(p, 1.5),  # noise for 1.5·ε, claiming ε
    "sum-real": lambda p: _mis_scaled(p, 2.0),  # sensitivity halved
    # Two measures at ε/2 each: a marginal event only sees one, so under-state its loss past ε.
    "join-public-keys": lambda p: _mis_scaled(p, 3.0),
    "group-partition-selection": lambda p: _loose_threshold(p, 6.0),  # threshold for 6·δ, claiming δ
    # calibration that forgets a person may hold max_rows_per_unit (20) rows: selection on the row count
    # COUNT(*) (not distinct persons) with scale and threshold per row
    "person-level-partition-selection": lambda p: _loose_threshold(
        _mis_scaled(_row_count_selection(p), 20.0), 1.0, rows_per_unit=1
    ),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_detector_flags_a_mis_scaled_mechanism(name: str, request: pytest.FixtureRequest) -> None:
    """Negative control: the same detector, same sample size, on a mechanism that lies about ε or δ."""
    case = next(c for c in CASES if c.name == name)
    # the measurement at the whole ε (no share spent sizing the bias): the lie is the factor, not diluted
    case = dataclasses.replace(case, session=dataclasses.replace(case.session, bias=False))
    violations, _, _ = _run_case(case, request, N, tamper=NEGATIVE[name])
    assert violations, "the detector did not notice a mechanism that under-states its privacy loss"


# --- deterministic checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "grid_of"),
    [
        ("SELECT COUNT(*), SUM(age), SUM(visits) FROM patients", None),
        ("SELECT SUM(bmi), AVG(bmi) FROM patients", 0),
        ("SELECT sex, COUNT(*), SUM(bmi) FROM patients GROUP BY sex", 1),
    ],
)
def test_released_values_lie_on_their_grid(
    sql: str, grid_of: int | None, health_policy: Policy, health_neighbours: tuple[Backend, Backend]
) -> None:
    """Counts and integer sums are ints; real sums are exact multiples of the power-of-two grid."""
    engine = _engine(health_policy, health_neighbours[1])
    prepared = engine.prepare(sql, Session("t", epsilon=0.7))
    rows = engine.step.query(prepared.sql)
    specs = prepared.budgeting.specs
    for _ in range(300):
        result = engine.step.release_rows(prepared, rows, 0.95)
        for row in result.rows:
            for out, value in zip(prepared.plan.outputs, row, strict=True):
                if out.kind in ("count",) or (out.kind == "sum" and specs[out.measures[0]].grid == 1.0):
                    assert isinstance(value, int), (out, value)
                elif out.kind == "sum":
                    grid = specs[out.measures[0]].grid
                    assert grid < 1 and (value / grid).is_integer(), (value, grid)
    if grid_of is not None:
        assert any(s.grid != 1.0 for s in specs)


SHAPE_QUERIES = [
    f"SELECT COUNT(*), SUM(age), AVG(bmi) FROM patients WHERE zip = {UNIQUE_ZIP}",
    "SELECT COUNT(*), SUM(age), AVG(bmi) FROM patients WHERE age > 200",
    "SELECT sex, problem, COUNT(*), AVG(age) FROM patients GROUP BY sex, problem",
    f"SELECT marital_status, COUNT(*) FROM patients WHERE zip = {UNIQUE_ZIP} GROUP BY marital_status",
    "SELECT COUNT(*) FROM patients WHERE age > 30 ORDER BY 1 LIMIT 1",
    "SELECT MAX(age) FROM patients",
    "SELECT COUNT(*) FROM patients WHERE age / 0 > 1",
    "SELECT age, COUNT(*) FROM patients GROUP BY age ORDER BY 2 DESC LIMIT 1",
]


def _shape(engine: Engine, sql: str) -> Any:
    """What is released deterministically: error class and message, or row count, key columns and NULLs."""
    try:
        result = engine.execute(sql, Session("alice", epsilon=0.5, delta=1e-6))
    except Error as exc:
        return ("error", type(exc).__name__, exc.sqlstate, exc.message)
    plan = engine.prepare(sql, Session("alice", epsilon=0.5, delta=1e-6)).plan
    if not plan.public_keys:
        return ("rows", [c.name for c in result.columns], "keys via partition selection")
    keys = [i for i, o in enumerate(plan.outputs) if o.kind == "key"]
    return (
        "rows",
        [c.name for c in result.columns],
        len(result.rows),
        [tuple(row[i] for i in keys) for row in result.rows] if not plan.order else None,
        # AVG/variance are NULL when their *noisy* count is ≤ 0: post-processing of noise, not a shape
        [
            tuple(v is None for v, c in zip(row, result.columns, strict=True) if c.name not in _NULL_BY_NOISE)
            for row in result.rows
        ],
    )


_NULL_BY_NOISE = {"avg", "variance", "var_pop", "var_samp", "stddev", "stddev_pop", "stddev_samp"}


@pytest.mark.parametrize("sql", SHAPE_QUERIES)
def test_neighbours_release_the_same_shape(
    sql: str, health_policy: Policy, health_neighbours: tuple[Backend, Backend]
) -> None:
    """Same error class, same NULL-vs-empty shape, same public key set on D and D'."""
    d, d_prime = health_neighbours
    assert _shape(_engine(health_policy, d), sql) == _shape(_engine(health_policy, d_prime), sql)


def test_error_or_not_does_not_depend_on_one_person(
    health_policy: Policy, health_neighbours: tuple[Backend, Backend]
) -> None:
    """A failing constant behind a predicate only the extra person satisfies (once a DuckDB error oracle)."""
    sql = f"SELECT COUNT(*) FROM patients WHERE zip = {UNIQUE_ZIP} AND age = CAST('abc' AS int)"
    d, d_prime = health_neighbours
    assert _shape(_engine(health_policy, d), sql) == _shape(_engine(health_policy, d_prime), sql)
