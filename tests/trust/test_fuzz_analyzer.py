"""Property-based fuzzing of the analyzer through ``Engine.execute``.

Whatever the SQL text, the engine either returns a Result in which every aggregate cell comes from a
noisy measure (and the query was charged), or raises ``dpsql.errors.Error`` — never another exception.
Run with ``pytest -s`` to see how many cases ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlglot import exp

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.session import Session
from tests.trust.conftest import health_backend, small_health_rows

EXAMPLES = 300
COUNTS = {"soup": 0, "grammar": 0, "answered": 0, "refused": 0}

COLUMNS = [
    "age",
    "bmi",
    "visits",
    "zip",
    "sex",
    "problem",
    "marital_status",
    "ethnicity",
    "dob",
    "name",
    "ssn",
    "height",
    '"SSN"',
    "patients.age",
    "p.age",
    "q.zip",
]
NUMERIC = ["age", "bmi", "visits", "zip"]
TEXT = {
    "sex": ["Male", "Female", "x"],
    "problem": ["Obesity", "None"],
    "marital_status": ["Single"],
    "ethnicity": ["White"],
}
AGGREGATES = [
    "COUNT(*)",
    "COUNT({c})",
    "SUM({c})",
    "AVG({c})",
    "MIN({c})",
    "MAX({c})",
    "COUNT(DISTINCT {c})",
    "median({c})",
    "stddev({c})",
    "SUM({c} * 2)",
    "percentile_cont(0.5) WITHIN GROUP (ORDER BY {c})",
]
FUNCS = [
    "round({x})",
    "abs({x})",
    "coalesce({x}, 0)",
    "greatest({x}, 1)",
    "least({x}, 1)",
    "{x} + 1",
    "{x} * 2",
    "{x} / 2",
    "-{x}",
    "({x})",
    "CAST({x} AS int)",
    "{x} / 0",
    "ln({x})",
    "pg_sleep(1)",
    "random()",
    "{x} % 3",
    "round({x}, 2)",
]
LITERALS = [
    "0",
    "1",
    "-1",
    "2138",
    "1e308",
    "'abc'",
    "'Male'",
    "NULL",
    "TRUE",
    "'2000-01-01'",
    "9223372036854775807",
    "1.5",
    "'NaN'",
    "CAST('1' AS int)",
    "CAST('x' AS int)",
    "DATE '2001-02-03'",
    "$1",
    "''",
]
OPS = ["=", "<>", "<", ">", "<=", ">=", "!=", "LIKE", "IS", "IS NOT", "IN", "BETWEEN"]
TOKENS = [
    "SELECT",
    "FROM",
    "WHERE",
    "GROUP",
    "BY",
    "HAVING",
    "ORDER",
    "LIMIT",
    "OFFSET",
    "patients",
    "COUNT",
    "(",
    ")",
    "*",
    ",",
    ";",
    "AND",
    "OR",
    "NOT",
    "UNION",
    "JOIN",
    "ON",
    "AS",
    "DISTINCT",
    "CASE",
    "WHEN",
    "THEN",
    "END",
    "'",
    '"',
    "--",
    "/*",
    "*/",
    "::",
    "EXPLAIN",
    "WITH",
    "OVER",
    "VALUES",
    "SUM",
    "AVG",
    "$$",
    *COLUMNS,
    *LITERALS,
    *OPS,
]


GOOD_COLUMNS = ["age", "bmi", "visits", "zip", "sex", "problem"]
GOOD_LITERALS = ["0", "1", "30", "2138", "'Male'", "'Obesity'", "'2000-01-01'", "1.5", "NULL"]


def _column(draw: st.DrawFn) -> str:
    """Mostly declared, usable columns (so many queries are answered), sometimes anything."""
    return draw(st.sampled_from(GOOD_COLUMNS if draw(st.integers(0, 3)) else COLUMNS))


def _literal(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(GOOD_LITERALS if draw(st.integers(0, 2)) else LITERALS))


@st.composite
def predicates(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.integers(0, 5 if depth < 2 else 2))
    column = _column(draw)
    if kind <= 1:
        return f"{column} {draw(st.sampled_from(OPS[:7]))} {_literal(draw)}"
    if kind == 2:
        values = [_literal(draw) for _ in range(draw(st.integers(0, 3)))]
        return f"{column} IN ({', '.join(values)})"
    left, right = draw(predicates(depth + 1)), draw(predicates(depth + 1))
    if kind == 3:
        return f"({left} AND {right})"
    if kind == 4:
        return f"({left} OR {right})"
    return f"NOT ({left})"


@st.composite
def outputs(draw: st.DrawFn) -> str:
    aggregate = draw(st.sampled_from(AGGREGATES[:4] if draw(st.integers(0, 2)) else AGGREGATES))
    aggregate = aggregate.format(c=draw(st.sampled_from(NUMERIC)) if draw(st.integers(0, 3)) else _column(draw))
    if draw(st.integers(0, 2)) == 0:
        aggregate = draw(st.sampled_from(FUNCS)).format(x=aggregate)
    if draw(st.integers(0, 5)) == 0:
        aggregate = f"{aggregate} {draw(st.sampled_from(['+', '-', '*', '/']))} {_literal(draw)}"
    return aggregate


@st.composite
def grammar_selects(draw: st.DrawFn) -> str:
    keys = list(dict.fromkeys(_column(draw) for _ in range(draw(st.integers(0, 2)))))
    keys = [k for k in keys if "." not in k]
    items = [*keys, *draw(st.lists(outputs(), min_size=1, max_size=3))]
    if draw(st.integers(0, 8)) == 0:
        items.append(draw(st.sampled_from(COLUMNS + LITERALS)))
    sql = f"SELECT {draw(st.sampled_from(['', '', '', 'DISTINCT ']))}{', '.join(items)} FROM "
    sources = ["patients p JOIN patients q ON p.zip = q.zip", "(SELECT * FROM patients) t", "pg_class", "doctors"]
    sql += "patients" if draw(st.integers(0, 4)) else draw(st.sampled_from(sources))
    if draw(st.booleans()):
        sql += f" WHERE {draw(predicates())}"
    if keys or draw(st.integers(0, 4)) == 0:
        sql += " GROUP BY " + ", ".join(keys or [draw(st.sampled_from(COLUMNS))])
    if draw(st.integers(0, 3)) == 0:
        sql += f" HAVING {draw(outputs())} > {_literal(draw)}"
    if draw(st.integers(0, 3)) == 0:
        sql += f" ORDER BY {draw(st.integers(1, len(items) + 1))}{draw(st.sampled_from(['', ' DESC']))}"
    if draw(st.integers(0, 3)) == 0:
        sql += f" LIMIT {draw(st.sampled_from(['0', '1', '-1', '10', 'ALL', '1e3']))}"
    return sql + draw(st.sampled_from(["", "", "", ";", " -- x", "; SELECT 1"]))


token_soup = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=25).map(" ".join)


@pytest.fixture(scope="module")
def tiny_backend() -> Iterator[Backend]:
    backend = health_backend(small_health_rows(60))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def fuzz_engine(big_budget_health_policy: Policy, tiny_backend: Backend) -> Engine:
    return Engine(big_budget_health_policy, tiny_backend, Ledger.open("sqlite:///:memory:"))


_MEASURE = re.compile(r"^m\d+$")


def _check(engine: Engine, sql: str) -> None:
    session = Session("alice", epsilon=0.5, delta=1e-6)
    try:
        result = engine.execute(sql, session)
    except Error:
        COUNTS["refused"] += 1
        return
    COUNTS["answered"] += 1
    if result.command_tag == "EXPLAIN":
        assert result.epsilon_spent == 0
        return
    prepared = engine.prepare(sql, session)
    plan = prepared.plan
    for out in plan.outputs:
        uses_measure = any(_MEASURE.match(v.name) for v in out.expr.find_all(exp.Var))
        # an exact (non-noisy) output never depends on a measure; noisy ones come from measures only
        assert out.noisy == uses_measure or out.kind == "key", (sql, out)
        if out.kind == "key" and not plan.public_keys:
            assert prepared.budgeting.threshold is not None, sql  # private keys go through partition selection
    if plan.measures and plan.limit != 0:  # LIMIT 0 is a schema probe: no rows, nothing charged
        assert result.epsilon_spent == pytest.approx(0.5), sql
    if any(out.noisy for out in plan.outputs) and result.rows:
        assert result.epsilon_spent > 0, sql
    for row in result.rows:
        assert len(row) == len(result.columns)


_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(sql=token_soup)
def test_token_soup_is_refused_or_answered_safely(fuzz_engine: Engine, sql: str) -> None:
    COUNTS["soup"] += 1
    _check(fuzz_engine, sql)


@_SETTINGS
@given(sql=grammar_selects())
def test_grammar_selects_are_refused_or_answered_safely(fuzz_engine: Engine, sql: str) -> None:
    COUNTS["grammar"] += 1
    _check(fuzz_engine, sql)


def test_report_fuzz_counts() -> None:
    """Printed with ``pytest -s``: how many generated statements ran and how they ended."""
    print(f"\nfuzz cases: {COUNTS}")
    if COUNTS["soup"] or COUNTS["grammar"]:
        assert COUNTS["answered"] > 0
