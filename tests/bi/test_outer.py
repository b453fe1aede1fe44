"""Post-processing over DP sub-queries: each BI shape answered, charged the sum of its inner queries,
typed like PostgreSQL; each refusal with its exact SQLSTATE and message, charging nothing."""

from __future__ import annotations

import decimal
import json
from collections.abc import Iterator

import psycopg
import pytest

from dpsql.cache import ResultCache
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.session import Result, Session

EPS = 0.25


def run(engine: Engine, sql: str, params: list[object] | None = None) -> Result:
    return engine.execute(sql, Session("alice", epsilon=EPS), params)


def charged(engine: Engine) -> float:
    return engine.ledger.spent(engine.policy.dataset, "alice").epsilon


def columns(result: Result) -> list[tuple[str, str]]:
    return [(c.name, c.type) for c in result.columns]


# (sql, expected columns, number of inner DP queries)
SHAPES = [
    (
        "SELECT * FROM (SELECT problem, COUNT(*) AS c FROM patients GROUP BY problem) AS t ORDER BY c DESC LIMIT 5",
        [("problem", "text"), ("c", "bigint")],
        1,
    ),
    ("SELECT COUNT(*) FROM (SELECT problem, COUNT(*) FROM patients GROUP BY problem) AS t", [("count", "bigint")], 1),
    (
        "WITH t AS (SELECT sex, AVG(age) AS a FROM patients GROUP BY sex) SELECT sex, round(a, 1) FROM t",
        [("sex", "text"), ("round", "double precision")],
        1,
    ),
    (
        "SELECT problem, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () FROM patients GROUP BY problem",
        [("problem", "text"), ("?column?", "double precision")],
        1,
    ),
    (
        "SELECT problem, COUNT(*), RANK() OVER (ORDER BY COUNT(*) DESC) FROM patients GROUP BY problem ORDER BY 3",
        [("problem", "text"), ("count", "bigint"), ("rank", "bigint")],
        1,
    ),
    (
        "SELECT sex, SUM(COUNT(*)) OVER (ORDER BY sex) AS running FROM patients GROUP BY sex",
        [("sex", "text"), ("running", "numeric")],
        1,
    ),
    (
        "SELECT 'count' AS stat, COUNT(*) AS v FROM patients UNION ALL SELECT 'mean', AVG(age) FROM patients",
        [("stat", "text"), ("v", "double precision")],
        2,
    ),
    (
        "SELECT t0.* FROM (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) AS t0 ORDER BY t0.n DESC",
        [("sex", "text"), ("n", "bigint")],
        1,
    ),
    (
        "WITH adults AS (SELECT * FROM patients WHERE age >= 18), "
        "g AS (SELECT sex, COUNT(*) AS n FROM adults GROUP BY sex) SELECT SUM(n) AS total FROM g",
        [("total", "numeric")],
        1,
    ),
]


@pytest.mark.parametrize(("sql", "expected", "inners"), SHAPES, ids=[s[0][:50] for s in SHAPES])
def test_shape_answered_and_charged_the_sum(health: Engine, sql: str, expected: list[tuple[str, str]], inners: int):
    result = run(health, sql)
    assert columns(result) == expected
    assert result.rows
    assert result.epsilon_spent == pytest.approx(EPS * inners)
    assert charged(health) == pytest.approx(EPS * inners)  # one reservation of the sum
    assert len(health.ledger.charges("health", "alice")) == 1
    assert any("post-processed" in n for n in result.notices)
    assert health.describe(sql, Session("alice")).columns == result.columns  # Describe agrees, spends nothing
    assert charged(health) == pytest.approx(EPS * inners)


def test_window_shares_sum_to_100(health: Engine) -> None:
    result = run(
        health, "SELECT problem, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct FROM patients GROUP BY problem"
    )
    # each share is released rounded to 6 significant digits (README: rounded cells): the sum is 100 to that
    assert sum(r[1] for r in result.rows) == pytest.approx(100.0, abs=1e-3)


def test_values_are_python_types_of_their_pg_type(health: Engine) -> None:
    result = run(health, "SELECT sex, SUM(COUNT(*)) OVER () AS total, COUNT(*) AS n FROM patients GROUP BY sex")
    for sex, total, n in result.rows:
        assert isinstance(sex, str) and isinstance(total, decimal.Decimal) and isinstance(n, int)


def test_join_with_public_table(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT d.name, d.floor, t.n FROM (SELECT department, COUNT(*) AS n FROM visits GROUP BY department) AS t "
        "JOIN departments d ON d.name = t.department ORDER BY t.n DESC",
        Session("alice", epsilon=EPS),
    )
    assert columns(result) == [("name", "text"), ("floor", "bigint"), ("n", "bigint")]
    assert len(result.rows) == 6 and all(isinstance(r[1], int) for r in result.rows)
    assert [c.noisy for c in result.columns] == [False, False, True]
    assert charged(clinic) == pytest.approx(EPS)


def test_join_of_two_dp_subqueries(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT a.department, a.n, b.c FROM (SELECT department, COUNT(*) AS n FROM visits GROUP BY department) a "
        "JOIN (SELECT department, AVG(cost) AS c FROM visits GROUP BY department) b ON a.department = b.department",
        Session("alice", epsilon=EPS),
    )
    assert columns(result) == [("department", "text"), ("n", "bigint"), ("c", "double precision")]
    assert charged(clinic) == pytest.approx(2 * EPS)
    assert len(clinic.ledger.charges("clinic", "alice")) == 1


def test_parameters_bind_into_inner_and_outer(health: Engine) -> None:
    result = run(
        health,
        "SELECT * FROM (SELECT sex, COUNT(*) AS n FROM patients WHERE age > %s GROUP BY sex) t WHERE n > %s",
        [30, -1],
    )
    assert {r[0] for r in result.rows} == {"Female", "Male"}


REFUSALS = [
    # the inner query's own refusal, exactly as if it had been sent alone
    (
        "SELECT * FROM (SELECT name, COUNT(*) FROM patients GROUP BY name) t",
        "42501",
        'permission denied for column "name"',
    ),
    (
        "SELECT a.n, b.s FROM (SELECT COUNT(*) AS n FROM patients) a, (SELECT SUM(ln(age)) AS s FROM patients) b",
        "0A000",
        None,
    ),
    # the outer query reading a protected table directly: refused as before
    (
        "SELECT * FROM (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) t JOIN patients p ON p.sex = t.sex",
        "0A000",
        'GROUP BY inside the subquery or CTE "t" is only supported on the privacy unit',
    ),
    (
        "SELECT * FROM (SELECT COUNT(*) AS n FROM patients) t, no_such_table",
        "42P01",
        'relation "no_such_table" does not exist',
    ),
    ("SELECT nope FROM (SELECT COUNT(*) AS n FROM patients) t", "42703", 'column "nope" does not exist'),
    (
        "SELECT * FROM (SELECT COUNT(*) AS n FROM patients) t, read_csv('/etc/passwd')",
        "0A000",
        "FROM must name a table",
    ),
    ("SELECT COUNT(*) OVER () FROM patients", "0A000", "window functions are not supported"),
    (
        "SELECT COUNT(*) FROM (SELECT age FROM patients UNION ALL SELECT age FROM patients) t",
        "0A000",
        None,
    ),
]


@pytest.mark.parametrize(("sql", "state", "message"), REFUSALS, ids=[r[0][:50] for r in REFUSALS])
def test_refusals_exact_and_free(health: Engine, sql: str, state: str, message: str | None) -> None:
    with pytest.raises(Error) as info:
        run(health, sql)
    assert info.value.sqlstate == state
    if message is not None:
        assert str(info.value).split("\n")[0] == message
    assert charged(health) == 0
    assert health.ledger.charges("health", "alice") == []


def test_second_inner_over_budget_charges_nothing(health: Engine) -> None:
    """The total is reserved once: a sum beyond the budget refuses the whole statement, nothing charged."""
    session = Session("bob", epsilon=3.0)  # bob's budget is 5: one inner fits, two do not
    with pytest.raises(Error) as info:
        health.execute(
            "SELECT * FROM (SELECT COUNT(*) AS a FROM patients) x, (SELECT COUNT(*) AS b FROM patients) y", session
        )
    assert info.value.sqlstate == "53P01"
    assert health.ledger.spent("health", "bob").epsilon == 0


def test_through_the_wire_with_psycopg(clinic_server: tuple[str, Engine]) -> None:
    dsn, engine = clinic_server
    before = engine.ledger.spent("clinic", "analyst").epsilon
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT * FROM (SELECT department, COUNT(*) AS c FROM visits GROUP BY department) AS t "
            "ORDER BY c DESC LIMIT %s",
            (3,),
        )
        assert [d.name for d in cur.description] == ["department", "c"]
        assert [d.type_code for d in cur.description] == [25, 20]
        rows = cur.fetchall()
        assert len(rows) == 3 and rows[0][1] >= rows[-1][1]
        cur = conn.execute("SELECT department, SUM(COUNT(*)) OVER () AS total FROM visits GROUP BY department")
        assert [d.type_code for d in cur.description] == [25, 1700]
        conn.execute("SET dpsql.show_intervals = on")
        cur = conn.execute(
            "WITH t AS (SELECT urgent, AVG(cost) AS a FROM visits GROUP BY urgent) SELECT urgent, a FROM t"
        )
        assert [d.name for d in cur.description] == ["urgent", "a", "a_ci95"]
    # the window total is post-processing of the first statement's released department counts
    # (the same measurement, another output): free, so two charges for three statements
    assert engine.ledger.spent("clinic", "analyst").epsilon == pytest.approx(before + 2.0)


@pytest.fixture
def cached_health(health: Engine) -> Iterator[Engine]:
    """The health engine with a result cache (the fixture's engine has none)."""
    engine = Engine(health.policy, health.backend, health.ledger, ResultCache())
    yield engine
    assert engine.cache is not None
    engine.cache.close()


@pytest.mark.parametrize(("sql", "expected", "inners"), SHAPES, ids=[s[0][:50] for s in SHAPES])
def test_exact_repeat_is_a_free_cache_hit(
    cached_health: Engine, sql: str, expected: list[tuple[str, str]], inners: int
) -> None:
    """The released inner rows are cached under their own keys; the outer statement is recomputed (free)."""
    first = run(cached_health, sql)
    again = run(cached_health, sql)
    assert again.rows == first.rows and again.columns == first.columns
    assert again.epsilon_spent == 0 and again.remaining_epsilon is None
    assert any("result cache" in n for n in again.notices)
    assert charged(cached_health) == pytest.approx(EPS * inners)
    assert len(cached_health.ledger.charges("health", "alice")) == 1


def test_inner_release_shared_with_the_same_query_sent_alone(cached_health: Engine) -> None:
    """An aggregate released alone is public: wrapping it in post-processing costs nothing more, and a
    composite charges only its inner queries not released before."""
    alone = run(cached_health, "SELECT problem, COUNT(*) AS c FROM patients GROUP BY problem")
    wrapped = run(
        cached_health, "SELECT * FROM (SELECT problem, COUNT(*) AS c FROM patients GROUP BY problem) t ORDER BY c DESC"
    )
    assert sorted(wrapped.rows) == sorted(alone.rows) and wrapped.epsilon_spent == 0
    both = run(
        cached_health,
        "SELECT 'n' AS k, COUNT(*) AS v FROM patients UNION ALL SELECT 'a', AVG(age) FROM patients",
    )
    assert both.epsilon_spent == pytest.approx(2 * EPS)
    one_new = run(
        cached_health,
        "SELECT 'n' AS k, COUNT(*) AS v FROM patients UNION ALL SELECT 'm', SUM(age) FROM patients",
    )
    assert one_new.epsilon_spent == pytest.approx(EPS)  # COUNT(*) was released by the previous statement
    assert one_new.rows[0] == both.rows[0]
    assert charged(cached_health) == pytest.approx(4 * EPS)


COMPOSITE = "SELECT 'count' AS stat, COUNT(*) AS v FROM patients UNION ALL SELECT 'mean', AVG(age) FROM patients"


def test_explain_composite_shows_each_dp_query_and_the_post_processing(health: Engine) -> None:
    lines = [r[0] for r in run(health, f"EXPLAIN {COMPOSITE}").rows]
    assert lines[0] == (
        f"Post-processing  (epsilon={2 * EPS:g} delta=0; 2 DP queries, reserved together; post-processing is free)"
    )
    assert "  Post-processing SQL (over the released rows, in a sandbox):" in lines
    assert [line for line in lines if line.startswith("  ->  ")] == [
        "  ->  DP sub-query, released as __dpsql_released_1:",
        "  ->  DP sub-query, released as __dpsql_released_2:",
    ]
    assert sum("DP Aggregate" in line for line in lines) == 2
    assert charged(health) == 0


def test_explain_format_json_of_a_composite(health: Engine) -> None:
    (row,) = run(health, f"EXPLAIN (FORMAT JSON) {COMPOSITE}").rows
    (top,) = json.loads(row[0])
    plan = top["Plan"]
    assert plan["Node Type"] == "Post-processing" and plan["Epsilon"] == pytest.approx(2 * EPS)
    assert "__dpsql_released_1" in plan["Post-processing SQL"]
    assert [p["Node Type"] for p in plan["Plans"]] == ["DP Aggregate", "DP Aggregate"]
    assert [p["Epsilon"] for p in plan["Plans"]] == [EPS, EPS]
    assert charged(health) == 0


@pytest.mark.parametrize(("sql", "state", "message"), REFUSALS, ids=[r[0][:50] for r in REFUSALS])
def test_explain_refuses_what_execution_refuses(health: Engine, sql: str, state: str, message: str | None) -> None:
    with pytest.raises(Error) as info:
        run(health, f"EXPLAIN {sql}")
    assert info.value.sqlstate == state
    if message is not None:
        assert str(info.value).split("\n")[0] == message
    assert charged(health) == 0


def test_plain_queries_are_remembered_probes_and_parameters_are_not(health: Engine) -> None:
    """A plain single query is recognised once per text (route then costs a dict lookup); a probe, a
    composite and a LIMIT whose value is a parameter are never remembered as plain."""
    plain = "SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex ORDER BY n DESC LIMIT 1"
    probe = "SELECT sex, COUNT(*) FROM patients GROUP BY sex LIMIT 0"
    by_parameter = "SELECT sex, COUNT(*) FROM patients GROUP BY sex LIMIT %s"
    statements = health.statements
    run(health, plain)
    assert statements.plain(plain)
    for _ in range(2):
        assert run(health, probe).rows == [] and not statements.plain(probe)
    assert len(run(health, by_parameter, [1]).rows) == 1
    assert run(health, by_parameter, [0]).rows == [] and not statements.plain(by_parameter)
    run(health, COMPOSITE)
    assert not statements.plain(COMPOSITE)
    assert charged(health) == pytest.approx(4 * EPS)
