"""Fixtures for the trust suite: small neighbouring databases, engines over them, an empirical DP checker.

Neighbouring databases are built twice (``D`` and ``D'``) on separate DuckDB instances so that the
generated SQL runs for real on each; sampling then reuses the true aggregates of each database and
calls the engine's release step many times (running the query once, noising it many times is
exactly the mechanism, since the noise is the only randomness).
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from scipy import stats

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import HEALTH_COLUMNS, HEAVY_PATIENTS, demo_policy_path, health_rows, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy, parse_policy

Rows = list[tuple[Any, ...]]

#: One extra patient whose values lie far outside every declared bound (clamping must absorb them).
EXTREME_PATIENT: tuple[Any, ...] = (
    "Outlier",
    "999-99-9999",
    "Widowed",
    "Male",
    dt.date(1921, 1, 1),
    2150,  # a zip nobody else holds in the small table: partition selection must hide it
    "Other",
    "Asthma",
    10_000,
    1.0e6,
    50_000,
)


def health_policy_text(*, analyst_epsilon: float = 10.0, dataset_epsilon: float = 50.0) -> str:
    """The shipped health policy with its budgets replaced (fuzzing and races need other totals)."""
    text = demo_policy_path("health").read_text(encoding="utf-8")
    text = re.sub(r"dataset: \{epsilon: [0-9.]+", f"dataset: {{epsilon: {dataset_epsilon}", text)
    return re.sub(r"analyst: \{epsilon: [0-9.]+", f"analyst: {{epsilon: {analyst_epsilon}", text)


def small_health_rows(n: int = 400) -> Rows:
    """``n`` demo patients squeezed onto five zips (2100..2104), so grouped queries are cheap."""
    rows = []
    for row in health_rows(n):
        values = list(row)
        values[5] = 2100 + values[5] % 5
        rows.append(tuple(values))
    return rows


def health_backend(rows: Rows) -> Backend:
    backend = open_backend("duckdb://")
    backend.load_rows("patients", HEALTH_COLUMNS, rows)
    return backend


@pytest.fixture(scope="session")
def health_policy() -> Policy:
    return load_policy(demo_policy_path("health"))


@pytest.fixture(scope="session")
def clinic_policy() -> Policy:
    return load_policy(demo_policy_path("clinic"))


@pytest.fixture(scope="session")
def health_neighbours() -> Iterator[tuple[Backend, Backend]]:
    """(D, D'): D' is D plus one patient with out-of-bounds values and a unique zip (row-level unit)."""
    rows = small_health_rows()
    d, d_prime = health_backend(rows), health_backend([*rows, EXTREME_PATIENT])
    yield d, d_prime
    d.close()
    d_prime.close()


#: A new patient of the clinic with 300 visits in a department nobody else uses, and 150 prescriptions.
NEW_HEAVY_ID = 99_999
SECRET_DEPARTMENT = "Xenology"


def _add_heavy_stranger(backend: Backend) -> None:
    backend.execute_script(
        f"INSERT INTO patients VALUES ({NEW_HEAVY_ID}, {NEW_HEAVY_ID}, 'Stranger', 109, 'Male', 2199);"
        f"INSERT INTO visits SELECT 1000000 + i, {NEW_HEAVY_ID}, '{SECRET_DEPARTMENT}', DATE '2024-12-31', "
        "1.0e9, true FROM range(300) t(i);"
        f"INSERT INTO prescriptions SELECT 1000000 + i, {NEW_HEAVY_ID}, 'Insulin', 1000 FROM range(150) t(i);"
    )


def _without_patient(backend: Backend, patient: int) -> None:
    for table in ("visits", "prescriptions"):
        backend.execute_script(f"DELETE FROM {table} WHERE patient_id = {patient}")
    backend.execute_script(f"DELETE FROM patients WHERE id = {patient}")


@pytest.fixture(scope="session")
def clinic_neighbours() -> Iterator[tuple[Backend, Backend, Backend]]:
    """(D, D without heavy patient 42, D plus a heavy stranger in a secret department): person-level units."""
    backends = [open_backend("duckdb://") for _ in range(3)]
    for backend in backends:
        load_demo(backend, ["clinic"])
    _without_patient(backends[1], HEAVY_PATIENTS[1])
    _add_heavy_stranger(backends[2])
    yield backends[0], backends[1], backends[2]
    for backend in backends:
        backend.close()


@pytest.fixture
def fresh_engine() -> Callable[[Policy, Backend], Engine]:
    def make(policy: Policy, backend: Backend) -> Engine:
        return Engine(policy, backend, Ledger.open("sqlite:///:memory:"))

    return make


@pytest.fixture(scope="session")
def big_budget_health_policy() -> Policy:
    return parse_policy(health_policy_text(analyst_epsilon=1e9, dataset_epsilon=1e9))


# --- the empirical DP check ------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    event: str
    direction: str
    lower: float
    upper: float
    bound: float


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided (1 − alpha) Clopper–Pearson lower and upper bounds on a binomial proportion."""
    lower = 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    upper = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))
    return lower, upper


Event = tuple[str, Callable[[Any], bool]]


def dp_violations(
    outputs_d: Sequence[Any],
    outputs_d_prime: Sequence[Any],
    events: Sequence[Event],
    epsilon: float,
    delta: float,
    alpha: float = 1e-4,
) -> list[Violation]:
    """Events where P[M(D)∈S] ≤ e^ε·P[M(D')∈S] + δ (either direction) is violated with confidence.

    Each (event, direction) pair is one hypothesis; Holm's step-down correction keeps the family-wise
    false-alarm rate ≤ ``alpha``. The p-value of a pair is the smallest level at which the one-sided
    Clopper–Pearson lower bound on the left side exceeds e^ε times the upper bound on the right + δ,
    found by bisection on the level (both bounds move monotonically with it).
    """
    n, m = len(outputs_d), len(outputs_d_prime)
    tests: list[tuple[float, Violation]] = []
    for name, event in events:
        k_d = sum(1 for o in outputs_d if event(o))
        k_p = sum(1 for o in outputs_d_prime if event(o))
        for direction, (ka, na, kb, nb) in (("D>D'", (k_d, n, k_p, m)), ("D'>D", (k_p, m, k_d, n))):
            p_value = _pair_p_value(ka, na, kb, nb, epsilon, delta)
            lower, _ = clopper_pearson(ka, na, alpha)
            _, upper = clopper_pearson(kb, nb, alpha)
            tests.append((p_value, Violation(name, direction, lower, upper, math.exp(epsilon) * upper + delta)))
    tests.sort(key=lambda t: t[0])
    flagged: list[Violation] = []
    total = len(tests)
    for rank, (p_value, violation) in enumerate(tests):
        if p_value > alpha / (total - rank):
            break  # Holm: stop at the first hypothesis that is not rejected
        flagged.append(violation)
    return flagged


def _pair_p_value(ka: int, na: int, kb: int, nb: int, epsilon: float, delta: float) -> float:
    """Smallest level a (per bound: a/2) at which lower_a(ka) > e^ε·upper_a(kb) + δ; 1 if never."""

    def separated(level: float) -> bool:
        lower, _ = clopper_pearson(ka, na, level / 2)
        _, upper = clopper_pearson(kb, nb, level / 2)
        return lower > math.exp(epsilon) * upper + delta

    if not separated(1.0 - 1e-12):
        return 1.0
    lo, hi = 1e-300, 1.0 - 1e-12
    if separated(lo):
        return lo
    for _ in range(60):  # bisection in log space
        mid = math.sqrt(lo * hi)
        if separated(mid):
            hi = mid
        else:
            lo = mid
    return hi


def threshold_events(samples: Sequence[float], quantiles: Sequence[float]) -> list[Event]:
    """Events ``output ≤ t`` and ``output > t`` for thresholds at the given quantiles of ``samples``."""
    cuts = sorted(set(np.quantile(np.asarray(samples, dtype=np.float64), quantiles).tolist()))
    events: list[Event] = []
    for t in cuts:
        events.append((f"≤ {t:g}", functools.partial(operator.ge, t)))  # t ≥ x
        events.append((f"> {t:g}", functools.partial(operator.lt, t)))  # t < x
    return events
