"""Error oracles: no outcome may depend on one person's row, on any backend.

A query that fails only when some row reaches a failing expression tells whether that row exists,
whatever ε is charged. Each attack runs on neighbouring databases (one person absent, ordinary, or
holding an odd value: out of bounds, NaN, ±infinity, huge, tiny) on DuckDB and on PostgreSQL, and
must have the same outcome class everywhere: answered, or refused with one SQLSTATE and message
before anything is charged. tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.worlds import kind_backends, outcomes_on, roomy_policy

POLICY = roomy_policy(
    "oracles",
    """
  t:
    privacy_unit: id
    max_rows_per_unit: 1
    columns:
      id: {type: int, identifier: true}
      problem: {type: text}
      cost: {type: float, lower: 0.0, upper: 2000.0}
      visits: {type: int, lower: 0, upper: 100}
      x: {type: float, lower: -1.0, upper: 1.0}
      d: {type: date, lower: 2020-01-01, upper: 2024-12-31}
      ts: {type: timestamp, lower: 2020-01-01, upper: 2024-12-31}
      d2: {type: date}
""",
)

COLUMNS = (
    "id BIGINT, problem TEXT, cost DOUBLE PRECISION, visits BIGINT, x DOUBLE PRECISION, d DATE, ts TIMESTAMP, d2 DATE"
)


def _f(text: str) -> str:
    return f"CAST('{text}' AS DOUBLE PRECISION)"


def _d(text: str, kind: str = "DATE") -> str:
    return f"CAST('{text}' AS {kind})"


ORDINARY = {
    "problem": "'obesity'",
    "cost": "100.0",
    "visits": "3",
    "x": "0.5",
    "d": _d("2021-06-01"),
    "ts": _d("2021-06-01 10:00:00", "TIMESTAMP"),
    "d2": _d("2021-06-01"),
}
#: The attacked person's row in each neighbouring database (None: not in it).
VARIANTS: dict[str, dict[str, str] | None] = {
    "absent": None,
    "ordinary": ORDINARY,
    "out-of-bounds": ORDINARY
    | {
        "cost": "4999.0",
        "visits": "1000000",
        "x": "7.5",
        "d": _d("infinity"),
        "ts": _d("infinity", "TIMESTAMP"),
        "d2": _d("infinity"),
    },
    "negative-infinity": ORDINARY
    | {
        "cost": _f("-infinity"),
        "x": _f("-infinity"),
        "d": _d("-infinity"),
        "ts": _d("-infinity", "TIMESTAMP"),
        "d2": _d("-infinity"),
    },
    "infinity": ORDINARY | {"cost": _f("infinity"), "x": _f("infinity")},
    "nan": ORDINARY | {"cost": _f("NaN"), "x": _f("NaN")},
    "huge": ORDINARY | {"cost": "1e308", "visits": "9223372036854775807", "x": "-1e308"},
    "tiny": ORDINARY | {"cost": "1e-300", "x": "1e-300"},
}


def _row(person: int, values: dict[str, str]) -> str:
    names = ["problem", "cost", "visits", "x", "d", "ts", "d2"]
    return "(" + ", ".join([str(person), *(values[n] for n in names)]) + ")"


def _others() -> list[str]:
    problems = ["'asthma'", "'diabetes'", "'obesity'", "NULL", "'flu'"]
    rows = []
    for i in range(1, 31):
        rows.append(
            _row(
                i,
                {
                    "problem": problems[i % 5],
                    "cost": f"{(i * 37) % 2000}.25",
                    "visits": str(i % 7),
                    "x": "NULL" if i % 9 == 0 else f"{((i % 11) - 5) / 6:.4f}",
                    "d": _d(f"202{i % 5}-0{1 + i % 9}-1{i % 9}"),
                    "ts": _d(f"202{i % 5}-0{1 + i % 9}-1{i % 9} 0{i % 10}:30:00", "TIMESTAMP"),
                    "d2": _d(f"19{50 + i}-0{1 + i % 9}-0{1 + i % 8}"),
                },
            )
        )
    return rows


def _script(variant: str, people: Mapping[str, dict[str, str] | None] = VARIANTS) -> str:
    """Table ``t``: the others, and ``people[variant]`` (the person) as row 99 unless None."""
    rows = _others()
    person = people[variant]
    if person is not None:
        rows.append(_row(99, person))
    return f"DROP TABLE IF EXISTS t; CREATE TABLE t ({COLUMNS}); INSERT INTO t VALUES {', '.join(rows)}"


@dataclass(frozen=True)
class Attack:
    id: str
    sql: str
    params: tuple[Any, ...] | None = None
    #: The outcome every neighbour must have: "answered", or the SQLSTATE of the refusal.
    expected: str = "answered"


ATTACKS = [
    # defect 1: LIKE patterns PostgreSQL rejects only when a row reaches them
    Attack("like-trailing-escape", "SELECT COUNT(*) FROM t WHERE lower(problem) LIKE 'obesit\\'", expected="22025"),
    Attack("ilike-trailing-escape", "SELECT COUNT(*) FROM t WHERE problem ILIKE 'OBESIT\\'", expected="22025"),
    Attack("not-like-trailing-escape", "SELECT COUNT(*) FROM t WHERE NOT problem LIKE 'obesit\\'", expected="22025"),
    Attack("not-like-operator", "SELECT COUNT(*) FROM t WHERE problem NOT LIKE 'obesit\\'", expected="22025"),
    Attack("like-operator-tilde", "SELECT COUNT(*) FROM t WHERE problem !~~ 'obesit\\'", expected="22025"),
    Attack("like-parameter", "SELECT COUNT(*) FROM t WHERE problem LIKE $1", ("obesit\\",), expected="22025"),
    Attack("like-after-and", "SELECT COUNT(*) FROM t WHERE cost > 4000 AND problem LIKE 'o\\'", expected="22025"),
    Attack("like-escaped-escape", "SELECT COUNT(*) FROM t WHERE problem LIKE 'obesit\\\\'"),
    Attack("like-escaped-wildcards", "SELECT COUNT(*) FROM t WHERE problem LIKE 'obes\\%\\_y\\x%'"),
    Attack("like-parameter-ok", "SELECT COUNT(*) FROM t WHERE lower(problem) LIKE $1", ("obes%",)),
    Attack("like-explicit-escape", "SELECT COUNT(*) FROM t WHERE problem LIKE 'a#' ESCAPE '#'", expected="0A000"),
    Attack("similar-to", "SELECT COUNT(*) FROM t WHERE problem SIMILAR TO 'obes('", expected="0A000"),
    Attack("like-any", "SELECT COUNT(*) FROM t WHERE problem LIKE ANY (ARRAY['obesit\\'])", expected="0A000"),
    # regular expressions and other functions that can fail on data
    Attack("regex-bad", "SELECT COUNT(*) FROM t WHERE problem ~ '('", expected="0A000"),
    Attack("regex-ok", "SELECT COUNT(*) FROM t WHERE problem ~ 'obes'", expected="0A000"),
    Attack("regex-insensitive", "SELECT COUNT(*) FROM t WHERE problem ~* '('", expected="0A000"),
    Attack("regexp-like", "SELECT COUNT(*) FROM t WHERE regexp_like(problem, '(')", expected="0A000"),
    Attack("cast-column", "SELECT COUNT(*) FROM t WHERE CAST(problem AS INT) = 1", expected="0A000"),
    Attack("cast-column-op", "SELECT COUNT(*) FROM t WHERE problem::date > '2020-01-01'", expected="0A000"),
    Attack("to-date", "SELECT COUNT(*) FROM t WHERE to_date(problem, 'YYYY') > '2020-01-01'", expected="0A000"),
    Attack("to-number", "SELECT COUNT(*) FROM t WHERE to_number(problem, '9') > 1", expected="0A000"),
    Attack("substring-negative", "SELECT COUNT(*) FROM t WHERE substring(problem, 1, -1) = 'a'", expected="0A000"),
    Attack("lower-substring", "SELECT COUNT(*) FROM t WHERE lower(substring(problem, 1, -1)) = 'a'", expected="0A000"),
    Attack("cast-in-sum", "SELECT SUM(CAST(problem AS INT)) FROM t", expected="0A000"),
    Attack("case-regex", "SELECT SUM(CASE WHEN problem ~ '(' THEN 1 ELSE 0 END) FROM t", expected="0A000"),
    Attack("case-like", "SELECT SUM(CASE WHEN problem LIKE 'o\\' THEN 1 ELSE 0 END) FROM t", expected="22025"),
    # defect 2: arithmetic over stored values outside the declared bounds
    Attack("division-by-out-of-bounds", "SELECT SUM(1.0 / (cost - 4999)) FROM t"),
    Attack("division-in-case", "SELECT SUM(CASE WHEN cost > 10 THEN 1.0 / (cost - 4999) ELSE 0 END) FROM t"),
    Attack("division-avg", "SELECT AVG(100.0 / (cost + 1)) FROM t"),
    Attack("bigint-overflow", "SELECT SUM(visits * visits * visits * visits) FROM t"),
    Attack("bigint-overflow-grouped", "SELECT problem, SUM(visits * visits * visits * visits) FROM t GROUP BY problem"),
    Attack("overflow-sum-plus", "SELECT SUM(visits + visits) FROM t"),
    Attack("extract-year-infinity", "SELECT SUM(EXTRACT(year FROM d)) FROM t"),
    Attack("extract-year-infinity-ts", "SELECT AVG(EXTRACT(year FROM ts)) FROM t"),
    Attack("extract-month-unbounded", "SELECT SUM(EXTRACT(month FROM d2)) FROM t"),
    Attack("extract-hour-ts", "SELECT SUM(EXTRACT(hour FROM ts)) FROM t"),
    Attack("float-product", "SELECT SUM(x * x * x * x) FROM t"),
    Attack("float-mixed", "SELECT SUM(cost * x - x) FROM t"),
    Attack("float-underflow", "SELECT SUM(x * x * x * x * x * x * x * x * x) FROM t", expected="0A000"),
    Attack("float-division-by-float", "SELECT SUM(x / (cost + 1)) FROM t"),
    Attack("abs-coalesce", "SELECT SUM(ABS(COALESCE(x, 0.25) * 2)) FROM t"),
    # plain columns with NaN, ±infinity, huge or tiny values
    Attack("sum-float", "SELECT SUM(x), SUM(cost) FROM t"),
    Attack("avg-float", "SELECT AVG(x), AVG(cost), COUNT(x) FROM t"),
    Attack("variance-float", "SELECT VAR_POP(x), STDDEV(cost), VAR_SAMP(visits) FROM t"),
    Attack("quantiles", "SELECT MIN(x), median(cost), percentile_cont(0.9) WITHIN GROUP (ORDER BY x) FROM t"),
    Attack("group-by-float", "SELECT x, COUNT(*), SUM(cost) FROM t GROUP BY x"),
    Attack("group-by-date", "SELECT d, SUM(visits) FROM t GROUP BY d"),
    Attack("where-float", "SELECT COUNT(*) FROM t WHERE x > 0.5 OR cost BETWEEN 10 AND 3000 OR x IN (1, 2)"),
    Attack("where-dates", "SELECT COUNT(*) FROM t WHERE d > '2021-01-01' AND ts < '2023-01-01 00:00:00'"),
    Attack("where-column-compare", "SELECT COUNT(*) FROM t WHERE x < cost"),
    # aggregates added as registered types: NaN, ±inf, huge stored values must not fail on any backend
    Attack(
        "bivariate-float", "SELECT corr(x, cost), covar_pop(cost, x), regr_slope(visits, x), regr_r2(x, visits) FROM t"
    ),
    Attack(
        "bivariate-grouped", "SELECT problem, covar_samp(x, visits), regr_intercept(cost, x) FROM t GROUP BY problem"
    ),
    Attack("count-distinct-odd", "SELECT COUNT(DISTINCT x), COUNT(DISTINCT problem), COUNT(DISTINCT d) FROM t"),
    Attack("count-distinct-grouped", "SELECT problem, COUNT(DISTINCT x) FROM t GROUP BY problem"),
    Attack(
        "filter-division",
        "SELECT SUM(1.0 / (cost - 4999)) FILTER (WHERE x > 0), COUNT(*) FILTER (WHERE d > '2021-01-01') FROM t",
    ),
    Attack("filter-trailing-escape", "SELECT COUNT(*) FILTER (WHERE problem LIKE 'o\\') FROM t", expected="22025"),
    # row arithmetic in WHERE and division / casts / % inside aggregates (#36): columns clamped before the
    # arithmetic, divisors that can be 0 read through NULLIF, integer division truncating on both backends
    Attack("where-division-out-of-bounds", "SELECT COUNT(*) FROM t WHERE 1.0 / (cost - 4999) > -0.001"),
    Attack("where-integer-division-by-zero", "SELECT COUNT(*) FROM t WHERE 100 / visits > 2"),
    Attack("where-modulo-by-zero", "SELECT COUNT(*) FROM t WHERE visits % (visits - 3) = 1"),
    Attack("where-bigint-overflow", "SELECT COUNT(*) FROM t WHERE visits * visits * visits * visits > 10"),
    Attack("where-float-arithmetic", "SELECT COUNT(*) FROM t WHERE cost * x + 1 > 0.5 OR x - cost / 2 < -900"),
    Attack("where-cast-integer", "SELECT COUNT(*) FROM t WHERE CAST(cost AS INTEGER) = 100"),
    Attack("where-cast-double", "SELECT COUNT(*) FROM t WHERE CAST(visits AS DOUBLE PRECISION) / 3 > 1"),
    Attack("where-extract-arithmetic", "SELECT COUNT(*) FROM t WHERE EXTRACT(year FROM d) + 1 > 2022"),
    Attack("where-arithmetic-between-in", "SELECT COUNT(*) FROM t WHERE visits + 1 BETWEEN 2 AND 5 OR x * 2 IN (1)"),
    Attack("where-arithmetic-is-null", "SELECT COUNT(*) FROM t WHERE 10 / visits IS NULL"),
    Attack(
        "where-folded-constants",
        "SELECT COUNT(*) FROM t WHERE cost BETWEEN 0.06 - 0.01 AND 1000 + 1 "
        "AND d <= DATE '2024-12-31' - INTERVAL '90' DAY (3)",
    ),
    Attack("where-division-by-constant-zero", "SELECT COUNT(*) FROM t WHERE visits / 0 > 1", expected="22012"),
    Attack("where-float-divisor-near-zero", "SELECT COUNT(*) FROM t WHERE cost / x > 1", expected="0A000"),
    Attack("where-modulo-float", "SELECT COUNT(*) FROM t WHERE cost % 2 = 0", expected="42883"),
    Attack("sum-integer-division", "SELECT SUM(visits / 3), SUM(1000 / visits), AVG(visits % 7) FROM t"),
    Attack(
        "sum-casts",
        "SELECT SUM(CAST(cost AS DOUBLE PRECISION)), AVG(x::float), SUM(CAST(cost AS INTEGER)), "
        "SUM(CAST(x AS BIGINT)), AVG(visits::numeric) FROM t",
    ),
    Attack("sum-scaled-division", "SELECT SUM(cost / 1000.0), AVG(x / 2), SUM(cost / (visits + 1)) FROM t"),
    Attack("sum-cast-text", "SELECT SUM(problem::float) FROM t", expected="0A000"),
]

BACKENDS = ("duckdb", "postgres")


def _outcome(engine: Engine, attack: Attack) -> tuple[Any, ...]:
    try:
        engine.execute(attack.sql, Session("alice", epsilon=1.0, delta=1e-6), list(attack.params or ()) or None)
    except Error as exc:
        charged = len(engine.ledger.charges("oracles", "alice"))
        return ("refused", exc.sqlstate, str(exc), charged)
    return ("answered",)


@pytest.fixture(scope="module")
def oracle_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    with kind_backends(pg_new_database) as backends:
        yield backends


@pytest.fixture(scope="module")
def outcomes(oracle_backends: dict[str, Backend]) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """Every attack's outcome on every backend and neighbouring database, each with a fresh ledger."""
    scripts = {variant: _script(variant) for variant in VARIANTS}
    return outcomes_on(oracle_backends, scripts, [(a.id, a) for a in ATTACKS], _outcome, parse_policy(POLICY))


def test_neighbours_are_loaded_as_intended(oracle_backends: dict[str, Backend]) -> None:
    """The odd values really are stored (not rejected or converted on load) on both backends."""
    for backend in oracle_backends.values():
        backend.execute_script(_script("nan"))
        assert backend.execute("SELECT COUNT(*) FROM t WHERE x = CAST('NaN' AS DOUBLE PRECISION)")[1] == [(1,)]
        backend.execute_script(_script("out-of-bounds"))
        assert backend.execute("SELECT COUNT(*) FROM t WHERE d > CAST('9999-12-31' AS DATE)")[1] == [(1,)]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_outcome_does_not_depend_on_one_person(
    attack: Attack, outcomes: dict[tuple[str, str, str], tuple[Any, ...]]
) -> None:
    seen = {(b, v): outcomes[attack.id, b, v] for b in BACKENDS for v in VARIANTS}
    distinct = set(seen.values())
    assert len(distinct) == 1, f"outcome depends on the data or backend: {seen}"
    (outcome,) = distinct
    if attack.expected == "answered":
        assert outcome == ("answered",)
    else:
        assert outcome[:2] == ("refused", attack.expected)
        assert outcome[3] == 0, "refused after a charge"


def test_like_refusal_reads_like_postgres(outcomes: dict[tuple[str, str, str], tuple[Any, ...]]) -> None:
    assert outcomes["like-trailing-escape", "postgres", "ordinary"][2] == (
        "LIKE pattern must not end with escape character"
    )


def test_like_matches_alike_on_both_backends(oracle_backends: dict[str, Backend]) -> None:
    """Backslash escapes as in PostgreSQL on both backends (DuckDB has no default escape)."""
    from dpsql.analyze import analyze
    from dpsql.rewrite import to_sql

    policy = parse_policy(POLICY)
    rows = {}
    for name, backend in oracle_backends.items():
        backend.execute_script(
            "DROP TABLE IF EXISTS t; "
            f"CREATE TABLE t ({COLUMNS}); INSERT INTO t (id, problem) VALUES "
            "(1, 'a_b'), (2, 'axb'), (3, 'a%b'), (4, 'a\\b'), (5, 'ab'), (6, 'A_B')"
        )
        for pattern in ["a\\_b", "a\\%b", "a\\\\b", "a\\b", "a_b", "a%"]:
            for op in ("LIKE", "ILIKE"):
                sql = to_sql(analyze(f"SELECT COUNT(*) FROM t WHERE problem {op} '{pattern}'", policy), backend.dialect)
                rows[name, op, pattern] = backend.execute(sql)[1]
    for (name, op, pattern), value in rows.items():
        assert value == rows["postgres", op, pattern], (name, op, pattern)
    assert rows["duckdb", "LIKE", "a\\_b"] == [(1,)]
    assert rows["duckdb", "LIKE", "a\\b"] == [(1,)]  # \b is a literal b, as in PostgreSQL


def test_nan_and_infinity_are_never_proven_in_bounds(oracle_backends: dict[str, Backend]) -> None:
    """DuckDB skips a clamp its statistics prove redundant: never when a NaN or ±infinity is stored."""
    backend = oracle_backends["duckdb"]
    proven = {}
    for variant in ("ordinary", "nan", "infinity", "negative-infinity", "huge"):
        backend.execute_script(_script(variant))
        engine = Engine(parse_policy(POLICY), backend, Ledger.open("sqlite:///:memory:"))
        proven[variant] = engine.prepare("SELECT SUM(x) FROM t", Session("alice")).plan.physical.proven
    assert proven == {
        "ordinary": frozenset({0}),
        "nan": frozenset(),
        "infinity": frozenset(),
        "negative-infinity": frozenset(),
        "huge": frozenset(),
    }
