"""mode() and top-k: report-noisy-max over public candidates."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from scipy.stats import beta

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.noise.exponential import select_mode
from dpsql.policy import Policy
from dpsql.rewrite import histogram_query
from dpsql.session import Session


def test_mode_is_epsilon_dp() -> None:
    """Neighbouring count vectors (one row added): each winner's probability ratio ≤ e^ε (Clopper–Pearson)."""
    epsilon, n = 1.0, 20000
    d1, d2 = [5, 6, 2, 6], [5, 7, 2, 6]
    samples = [Counter(select_mode(d, epsilon, 1.0) for _ in range(n)) for d in (d1, d2)]
    alpha = 0.001 / 8
    for outcome in range(4):
        for a, b in ((samples[0], samples[1]), (samples[1], samples[0])):
            if a[outcome] == 0:
                continue
            low = beta.ppf(alpha, a[outcome], n - a[outcome] + 1)
            high = beta.ppf(1 - alpha, b[outcome] + 1, n - b[outcome]) if b[outcome] < n else 1.0
            assert low <= math.exp(epsilon) * high, (outcome, a[outcome], b[outcome])


def test_mode_finds_a_clear_winner(engine: Engine) -> None:
    answers: Counter[object] = Counter()
    for _ in range(20):
        engine.ledger = Ledger.open("sqlite:///:memory:")
        answers[
            engine.execute("SELECT mode() WITHIN GROUP (ORDER BY problem) FROM patients", Session("alice")).rows[0][0]
        ] += 1
    # the demo has two near-tied leaders (20% each); every other problem is far behind
    assert set(answers) <= {"Hypertension", "None"}


def test_grouped_mode_names_and_types(engine: Engine) -> None:
    result = engine.execute(
        "SELECT sex, mode() WITHIN GROUP (ORDER BY ethnicity) AS usual FROM patients GROUP BY sex", Session("alice")
    )
    assert [(c.name, c.type) for c in result.columns] == [("sex", "text"), ("usual", "text")]
    assert {r[1] for r in result.rows} <= {"Asian", "Black", "Hispanic", "White", "Other"}


def test_top_k_over_public_keys_is_post_processing(engine: Engine) -> None:
    result = engine.execute(
        "SELECT problem, COUNT(*) AS n FROM patients GROUP BY problem ORDER BY n DESC LIMIT 3", Session("alice")
    )
    assert len(result.rows) == 3 and result.epsilon_spent == 1.0
    assert [r[1] for r in result.rows] == sorted((r[1] for r in result.rows), reverse=True)


def test_mode_histogram_identical_on_duckdb_and_postgres(health_policy: Policy, health_duckdb: Backend,
                                                         health_pg: Backend) -> None:  # fmt: skip
    plan = analyze("SELECT sex, mode() WITHIN GROUP (ORDER BY problem) FROM patients GROUP BY sex", health_policy)
    query = histogram_query(plan, 0)
    assert sorted(health_duckdb.execute(query.sql("duckdb"))[1]) == sorted(health_pg.execute(query.sql("postgres"))[1])


def test_mode_needs_a_public_domain() -> None:
    from dpsql.dev.demo import demo_policy_path
    from dpsql.policy import load_policy

    with pytest.raises(Error) as info:
        analyze("SELECT mode() WITHIN GROUP (ORDER BY occupation) FROM adult", load_policy(demo_policy_path("adult")))
    assert (info.value.sqlstate, info.value.message) == (
        "0A000",
        'mode() needs a public domain for column "occupation"',
    )


def test_mode_on_person_level_data_bounds_heavy_patients() -> None:
    from dpsql.dev.demo import demo_policy_path
    from dpsql.policy import load_policy

    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))
    explanation = engine.explain("SELECT mode() WITHIN GROUP (ORDER BY drug) FROM prescriptions", Session("alice"))
    assert explanation.columns[0]["sensitivity"] == 10  # max_rows_per_unit of prescriptions
    backend.close()
