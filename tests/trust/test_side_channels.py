"""Side channels: what docs/trust.md claims about timing and error messages, tested.

* The release step (snap to grid, add integer noise drawn from the per-thread pool, post-process)
  takes the same time on the true aggregates of two neighbouring databases, and its noise step (the
  part that reads true values) the same on absurdly different values too: medians agree within a
  tolerance. The post-processing after the noise (notes on empty groups, clipped intervals) reads only
  released values, so its time may follow them, as the answer itself does.
* Refusals do not depend on the data: for a set of refused queries, the error class, SQLSTATE,
  message, detail, hint and position are identical on two neighbouring databases (one has an extra
  person with extreme, out-of-bounds values and a unique zip), and so is EXPLAIN's output.

What is *not* claimed (see docs/trust.md): the backend's own execution time depends on the data,
as in any SQL engine, and dpsql does not pad latency.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.policy import Policy, parse_policy
from dpsql.release.apply import apply
from dpsql.session import Session
from tests.trust.conftest import health_policy_text

REPS = 1500

RELEASE_QUERIES = (
    "SELECT COUNT(*), SUM(visits) FROM patients",
    "SELECT AVG(bmi), SUM(age) FROM patients WHERE sex = 'Male'",
    "SELECT problem, COUNT(*), AVG(age) FROM patients GROUP BY problem",
)

REFUSED = (
    "SELECT * FROM patients",
    "SELECT name FROM patients",
    "SELECT ssn, COUNT(*) FROM patients GROUP BY ssn",
    "SELECT COUNT(*) FROM nowhere",
    "SELECT COUNT(nope) FROM patients",
    "DELETE FROM patients",
    "SELECT COUNT(*) FROM patients; SELECT 1",
    "SELECT frobnicate(age) FROM patients",
    "SELECT COUNT(*) OVER () FROM patients",
    "SELECT COUNT(*) FROM patients WHERE age IN (SELECT age FROM patients)",
    "SELECT COUNT(*) FROM patients WHERE age / 0 > 1",
    "SELECT COUNT(*) FROM patients WHERE age > 'old'",
    "SELECT COUNT(*) FROM patients a JOIN patients b ON a.zip = b.zip",
    "SELECT COUNT(*) FROM patients WHERE zip = 2150 UNION SELECT age FROM patients",
    "SELEC COUNT(*) FROM patients",
    "SELECT COUNT(*) FROM patients WHERE name = 'Outlier'",
)


def _time_release(engine: Engine, prepared: Any, rows: list[tuple[Any, ...]], whole: bool) -> Callable[[], float]:
    def once() -> float:
        started = time.perf_counter_ns()
        if whole:
            engine.step.release_rows(prepared, rows, 0.95)
        else:  # the noise step alone: what touches the true values
            apply(prepared.plan, prepared.budgeting, rows, 0.95, None, prepared.cache)
        return float(time.perf_counter_ns() - started)

    return once


def _extreme(rows: list[tuple[Any, ...]], factor: float) -> list[tuple[Any, ...]]:
    """Same shape, wildly different magnitudes (keys kept, measures scaled)."""
    return [tuple(v * factor if isinstance(v, int | float) and not isinstance(v, bool) else v for v in r) for r in rows]


@pytest.fixture(scope="module")
def big_policy() -> Policy:
    return parse_policy(health_policy_text(analyst_epsilon=1e9, dataset_epsilon=1e9))


@pytest.mark.exclusive
@pytest.mark.parametrize("sql", RELEASE_QUERIES)
def test_release_time_does_not_depend_on_true_values(
    sql: str,
    big_policy: Policy,
    health_neighbours: tuple[Backend, Backend],
    fresh_engine: Callable[[Policy, Backend], Engine],
) -> None:
    d, d_prime = health_neighbours
    engine = fresh_engine(big_policy, d)
    prepared = engine.prepare(sql, Session("alice"))
    rows_d = d.execute(prepared.sql)[1]
    rows_p = d_prime.execute(prepared.sql)[1]
    assert len(rows_d) == len(rows_p)  # public domains / no keys: same number of cells
    variants = {
        "D": rows_d,
        "D'": rows_p,
        "x0": _extreme(rows_d, 0),
        "x1e6": _extreme(rows_d, 10**6),
    }
    timers = {name: _time_release(engine, prepared, rows, whole=False) for name, rows in variants.items()}
    timers |= {f"{name} (whole)": _time_release(engine, prepared, variants[name], whole=True) for name in ("D", "D'")}
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(50):  # warm-up (plan caches, first pool refill)
        for timer in timers.values():
            timer()
    order = random.Random(0)
    names = list(timers)
    for _ in range(REPS):  # interleaved in a shuffled order, so drift, load and caches hit every variant alike
        order.shuffle(names)
        for name in names:
            samples[name].append(timers[name]())
    medians = {name: statistics.median(s) for name, s in samples.items()}
    print(f"\nrelease medians (µs) for {sql!r}: " + ", ".join(f"{k}={v / 1000:.1f}" for k, v in medians.items()))
    for group in (["D", "D'", "x0", "x1e6"], ["D (whole)", "D' (whole)"]):
        reference = medians[group[0]]
        tolerance = max(0.25 * reference, 15_000.0)  # 25 % or 15 µs
        for name in group:
            assert abs(medians[name] - reference) <= tolerance, (name, medians)


def _outcome(engine: Engine, sql: str) -> tuple[Any, ...]:
    try:
        engine.execute(sql, Session("alice"))
    except Error as exc:
        return (type(exc).__name__, exc.sqlstate, exc.message, exc.detail, exc.hint, exc.position)
    return ("answered",)


def test_refusals_are_identical_on_neighbouring_databases(
    big_policy: Policy,
    health_neighbours: tuple[Backend, Backend],
    fresh_engine: Callable[[Policy, Backend], Engine],
) -> None:
    d, d_prime = health_neighbours
    engine_d, engine_p = fresh_engine(big_policy, d), fresh_engine(big_policy, d_prime)
    outcomes = []
    for sql in REFUSED:
        on_d, on_p = _outcome(engine_d, sql), _outcome(engine_p, sql)
        assert on_d == on_p, sql
        assert on_d[0] != "answered", f"not refused: {sql}"
        outcomes.append(on_d[1])
    print(f"\nrefusal SQLSTATEs (identical on D and D'): {outcomes}")


def test_budget_refusal_and_explain_are_identical_on_neighbouring_databases(
    health_neighbours: tuple[Backend, Backend],
    fresh_engine: Callable[[Policy, Backend], Engine],
) -> None:
    d, d_prime = health_neighbours
    policy = parse_policy(health_policy_text(analyst_epsilon=1.5, dataset_epsilon=100.0))
    engine_d, engine_p = fresh_engine(policy, d), fresh_engine(policy, d_prime)
    explain = "EXPLAIN SELECT zip, COUNT(*), AVG(bmi) FROM patients GROUP BY zip"
    # The Backend SQL line shows "<secret>" in place of each engine's own salt, so the plans compare equal.
    assert engine_d.execute(explain, Session("alice")).rows == engine_p.execute(explain, Session("alice")).rows
    for engine in (engine_d, engine_p):
        engine.execute("SELECT COUNT(*) FROM patients", Session("alice"))
    assert _outcome(engine_d, "SELECT SUM(age) FROM patients") == _outcome(engine_p, "SELECT SUM(age) FROM patients")
    assert _outcome(engine_d, "SELECT SUM(age) FROM patients")[1] == "53P01"
