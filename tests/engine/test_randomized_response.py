"""Randomized response: ε-LDP on write, unbiased estimates on read, no central budget."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from scipy.stats import beta

from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error, PolicyError
from dpsql.ledger import Ledger
from dpsql.localdp import RandomizedResponse
from dpsql.policy import Policy, load_policy, parse_policy
from dpsql.session import Session

DRUGS = ("never", "past", "current")


@pytest.fixture
def survey() -> tuple[Engine, Backend]:
    backend = open_backend("duckdb://")
    load_demo(backend, ["survey"])
    return Engine(load_policy(demo_policy_path("survey")), backend, Ledger.open("sqlite:///:memory:")), backend


def test_perturbation_is_epsilon_ldp() -> None:
    """For every stored value, P(stored | truth a) ≤ e^ε P(stored | truth b), Clopper–Pearson at 20k draws."""
    mechanism, n = RandomizedResponse(1.5, DRUGS), 20000
    samples = {truth: Counter(mechanism.perturb(truth) for _ in range(n)) for truth in DRUGS}
    alpha = 0.001 / (len(DRUGS) ** 3)
    for a in DRUGS:
        for b in DRUGS:
            for stored in DRUGS:
                k_a, k_b = samples[a][stored], samples[b][stored]
                low = beta.ppf(alpha, k_a, n - k_a + 1) if k_a else 0.0
                high = beta.ppf(1 - alpha, k_b + 1, n - k_b)
                assert low <= math.exp(1.5) * high
    assert samples["past"]["past"] / n == pytest.approx(mechanism.keep, abs=0.015)


def test_estimates_are_unbiased_with_honest_intervals() -> None:
    mechanism = RandomizedResponse(1.0, (False, True))
    truth = [True] * 1500 + [False] * 3500
    covered, errors = 0, []
    for _ in range(40):
        observed = Counter(mechanism.perturb(v) for v in truth)
        estimate, half_width = mechanism.estimate(observed, 0.95)[True]
        errors.append(estimate - 1500)
        covered += abs(estimate - 1500) <= half_width
    assert abs(sum(errors) / len(errors)) < 3 * 150 / math.sqrt(len(errors))
    assert covered >= 32  # ~95% nominal; 40 trials


def test_counts_are_debiased_and_free(survey: tuple[Engine, Backend]) -> None:
    engine, _ = survey
    result = engine.execute("SELECT drug_use, COUNT(*) AS n FROM survey GROUP BY drug_use", Session("alice"))
    assert [r[0] for r in result.rows] == list(DRUGS) and result.epsilon_spent == 0
    assert engine.ledger.spent("survey", "alice").epsilon == 0
    truth = {"never": 3500, "past": 1100, "current": 400}  # the demo's true shares of 5,000 respondents
    for (value, estimate), (width,) in zip(result.rows, (a[1:] for a in result.accuracy), strict=True):
        assert width is not None
        assert abs(estimate - truth[value]) <= 4 * width
    single = engine.execute("SELECT COUNT(*) FROM survey WHERE smoker = true", Session("alice"))
    width = single.accuracy[0][0]
    assert width is not None and width > 0 and single.epsilon_spent == 0


def test_insert_stores_perturbed_answers_only(survey: tuple[Engine, Backend]) -> None:
    engine, backend = survey
    values = ", ".join("('West', 50, true, 'current')" for i in range(1000))
    result = engine.execute(f"INSERT INTO survey (region, age, smoker, drug_use) VALUES {values}",
                            Session("alice"))  # fmt: skip
    assert result.command_tag == "INSERT 0 1000" and result.epsilon_spent == 0
    stored = dict(backend.execute("SELECT drug_use, COUNT(*) FROM survey WHERE respondent IS NULL GROUP BY 1")[1])
    keep = RandomizedResponse(1.5, DRUGS).keep
    assert stored["current"] / 1000 == pytest.approx(keep, abs=0.06)  # the truth was 100% 'current'
    assert stored.get("never", 0) > 0 and stored.get("past", 0) > 0


@pytest.mark.parametrize(
    ("sql", "sqlstate", "message"),
    [
        ("SELECT region, COUNT(*) FROM survey WHERE smoker GROUP BY region", "0A000",
         '"smoker" is collected with randomized response: it can only be counted on its own'),
        ("SELECT AVG(age) FROM survey WHERE drug_use = 'past'", "0A000",
         '"drug_use" is collected with randomized response: it can only be counted on its own'),
        ("SELECT COUNT(*) FROM survey WHERE drug_use = 'often'", "22023",
         '"often" is not a possible answer for "drug_use"'),
        ("INSERT INTO survey (region, age, smoker, drug_use) VALUES ('North', 30, true, 'often')",
         "22023", 'invalid value for randomized-response column "drug_use"'),
        ("INSERT INTO survey (region, age) VALUES ('North', 30)", "22023",
         'INSERT must give a value for randomized-response column "smoker"'),
        ("INSERT INTO survey (respondent, smoker, drug_use) VALUES ('x', true, 'past')", "42501",
         'permission denied to write column "respondent" of relation "survey"'),
        ("UPDATE survey SET smoker = false", "25006", "cannot execute UPDATE in a read-only transaction"),
    ],
)  # fmt: skip
def test_refusals(sql: str, sqlstate: str, message: str, survey: tuple[Engine, Backend]) -> None:
    engine, _ = survey
    with pytest.raises(Error) as info:
        engine.execute(sql, Session("alice"))
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)


def test_writes_are_off_unless_the_policy_enables_them(health_policy: Policy, health_duckdb: Backend) -> None:
    engine = Engine(health_policy, health_duckdb, Ledger.open("sqlite:///:memory:"))
    with pytest.raises(Error) as info:
        engine.execute("INSERT INTO patients (age) VALUES (3)", Session("alice"))
    assert (info.value.sqlstate, info.value.message) == ("25006", "cannot execute INSERT in a read-only transaction")


def test_policy_validation() -> None:
    text = (demo_policy_path("survey").read_text()).replace(
        "      region: {type: text, domain: [North, South, East, West], nullable: false, writable: true}",
        "      region: {type: text, nullable: false, randomized_response: {epsilon: 1.0}}",
    )
    with pytest.raises(PolicyError, match="a randomized_response column needs type boolean or a 'domain'"):
        parse_policy(text, "survey.yaml")


def test_same_counts_on_postgres(pg_new_database) -> None:
    backend = open_backend(pg_new_database())
    load_demo(backend, ["survey"])
    engine = Engine(load_policy(demo_policy_path("survey")), backend, Ledger.open("sqlite:///:memory:"))
    result = engine.execute("SELECT smoker, COUNT(*) FROM survey GROUP BY smoker", Session("alice"))
    assert [r[0] for r in result.rows] == [False, True] and result.epsilon_spent == 0
    backend.close()


SURVEY_DDL = (
    "CREATE TABLE survey (respondent TEXT PRIMARY KEY, region TEXT NOT NULL, age INTEGER NOT NULL, "
    "smoker BOOLEAN NOT NULL, drug_use TEXT NOT NULL{extra})"
)
ATTEMPTS = [
    # the membership oracle: succeeded for a new respondent, failed (duplicate key) for a stored one
    "INSERT INTO survey (respondent, region, age, smoker, drug_use) VALUES ('igor', 'North', 40, true, 'past')",
    "INSERT INTO survey (region, age, smoker, drug_use) VALUES ('North', 40, true, 'past')",  # NOT NULL key
    "INSERT INTO survey (region, age, smoker, drug_use) VALUES ('North', 400, true, 'past')",
]


def _outcomes(backend: Backend, extra: str, with_igor: bool) -> list[tuple[object, ...]]:
    """What an analyst sees for each attempt on a survey table holding (or not) respondent igor."""
    backend.execute_script("DROP TABLE IF EXISTS survey")
    backend.execute_script(SURVEY_DDL.format(extra=extra))
    people = [("anna", "North", "past"), ("bert", "South", "never")] + (
        [("igor", "East", "current")] if with_igor else []
    )
    rows = ", ".join(f"('{p}', '{region}', 40, true, '{drug}')" for p, region, drug in people)
    backend.execute_script(f"INSERT INTO survey VALUES {rows}")
    engine = Engine(load_policy(demo_policy_path("survey")), backend, Ledger.open("memory"))
    seen: list[tuple[object, ...]] = []
    for sql in ATTEMPTS:
        try:
            result = engine.execute(sql, Session("alice"))
            seen.append(("ok", result.command_tag, result.epsilon_spent))
        except Error as exc:
            seen.append((type(exc).__name__, exc.sqlstate, exc.message, exc.detail, exc.hint))
    return seen


@pytest.mark.parametrize(
    "extra",
    ["", ", CHECK (age < 100)", ", UNIQUE (drug_use)", ", UNIQUE (region)"],
    ids=["pk", "pk-check", "unique-rr", "unique-writable"],
)
def test_insert_outcome_is_the_same_on_neighbouring_duckdb(extra: str) -> None:
    """Defect 5: a PRIMARY KEY on respondent made INSERT a free membership oracle."""
    outcomes = [_outcomes(open_backend("duckdb://"), extra, with_igor) for with_igor in (False, True)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0][1] == "42501"  # the identifier is never written
    expected = "58P02" if extra in ("", ", CHECK (age < 100)") else "25006"  # NOT NULL key / refused table
    assert [o[1] for o in outcomes[0][1:]] == [expected, expected]


@pytest.mark.parametrize("extra", ["", ", UNIQUE (drug_use)"], ids=["pk", "unique-rr"])
def test_insert_outcome_is_the_same_on_neighbouring_postgres(extra: str, pg_new_database) -> None:
    outcomes = []
    for with_igor in (False, True):
        backend = open_backend(pg_new_database())
        outcomes.append(_outcomes(backend, extra, with_igor))
        backend.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0][1] == "42501"
    assert {o[1] for o in outcomes[0][1:]} == {"58P02" if not extra else "25006"}


@pytest.mark.parametrize("backend_kind", ["duckdb", "postgres"])
def test_generated_key_accepts_writes(backend_kind: str, request: pytest.FixtureRequest) -> None:
    """A key the database generates (sequence / identity) relates no new row to stored ones: writes work."""
    if backend_kind == "duckdb":
        backend = open_backend("duckdb://")
        backend.execute_script("CREATE SEQUENCE ids")
        key = "respondent TEXT PRIMARY KEY DEFAULT ('r' || nextval('ids'))"
    else:
        backend = open_backend(request.getfixturevalue("pg_new_database")())
        key = "respondent TEXT PRIMARY KEY DEFAULT ('r' || gen_random_uuid())"
    backend.execute_script(
        f"CREATE TABLE survey ({key}, region TEXT NOT NULL, age INTEGER NOT NULL, "
        "smoker BOOLEAN NOT NULL, drug_use TEXT NOT NULL)"
    )
    engine = Engine(load_policy(demo_policy_path("survey")), backend, Ledger.open("memory"))
    sql = "INSERT INTO survey (region, age, smoker, drug_use) VALUES ('North', 40, true, 'past')"
    assert engine.execute(sql, Session("alice")).command_tag == "INSERT 0 1"
    assert engine.execute(sql, Session("alice")).command_tag == "INSERT 0 1"
    backend.close()


@pytest.mark.parametrize("prefix", ["/* app=orm */ ", "-- sqlcommenter\n", "  /* a /* nested */ */\n"])
def test_leading_comments_do_not_change_routing(prefix: str, survey: tuple[Engine, Backend]) -> None:
    """ORMs and sqlcommenter prepend comments: an INSERT or EXPLAIN is still one (issue #16)."""
    engine, _ = survey
    session = Session(analyst="alice")
    insert = "INSERT INTO survey (region, age, smoker, drug_use) VALUES ('North', 30, true, 'past')"
    assert engine.execute(prefix + insert, session).command_tag == engine.execute(insert, session).command_tag
    explain = "EXPLAIN SELECT COUNT(*) FROM survey"
    assert engine.execute(prefix + explain, session).rows == engine.execute(explain, session).rows
