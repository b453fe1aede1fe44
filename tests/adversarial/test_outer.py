"""Post-processing over DP sub-queries and schema probes on neighbouring databases, DuckDB and PostgreSQL.

Every composite statement and probe must have one outcome class on every neighbour (one person absent,
ordinary, out of bounds, ±infinity, NaN, huge, tiny): answered with the same columns, types and charge,
or refused with one SQLSTATE and message before anything is charged. Values may differ (noise), the
shape may not. Listed in tests/adversarial/README.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.worlds import Outcomes, kind_backends, outcomes_on

from .test_error_oracles import BACKENDS, POLICY, VARIANTS, _script

CASES: list[tuple[str, str]] = [
    (
        "subquery-top-k",
        "SELECT * FROM (SELECT problem, COUNT(*) AS c FROM t GROUP BY problem) s ORDER BY c DESC LIMIT 2",
    ),
    ("count-released-rows", "SELECT COUNT(*) FROM (SELECT problem, COUNT(*) FROM t GROUP BY problem) s"),
    ("cte-arithmetic", "WITH s AS (SELECT AVG(x) AS a, SUM(cost) AS c FROM t) SELECT a * 2, c / 0 FROM s"),
    ("window-share", "SELECT problem, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () FROM t GROUP BY problem"),
    ("window-rank", "SELECT problem, RANK() OVER (ORDER BY SUM(visits) DESC) FROM t GROUP BY problem"),
    ("union-all", "SELECT 'n' AS k, COUNT(*) AS v FROM t UNION ALL SELECT 'cost', AVG(cost) FROM t"),
    ("divide-by-noisy", "SELECT 1 / (n - n) FROM (SELECT COUNT(*) AS n FROM t) s"),
    ("cast-noisy", "SELECT CAST(CAST(a AS TEXT) AS DOUBLE PRECISION) FROM (SELECT AVG(x) AS a FROM t) s"),
    (
        "second-inner-fails",
        "SELECT * FROM (SELECT COUNT(*) AS n FROM t) a, (SELECT SUM(CAST(problem AS INT)) AS s FROM t) b",
    ),
    ("outer-reads-table", "SELECT * FROM (SELECT COUNT(*) AS n FROM t) a JOIN t ON true"),
    ("outer-file", "SELECT * FROM (SELECT COUNT(*) AS n FROM t) a, read_csv('/etc/passwd')"),
    ("outer-unknown-column", "SELECT nope FROM (SELECT COUNT(*) AS n FROM t) a"),
    ("probe-limit-0", "SELECT problem, SUM(cost) FROM t GROUP BY problem LIMIT 0"),
    ("probe-false-where", "SELECT COUNT(*), AVG(x) FROM t WHERE 1 = 0"),
    ("probe-composite", "SELECT * FROM (SELECT problem, COUNT(*) AS c FROM t GROUP BY problem) s LIMIT 0"),
    ("probe-raw-rows", "SELECT problem, cost, d FROM t WHERE cost > 50 LIMIT 0"),
    ("probe-raw-identifier", "SELECT id, cost FROM t WHERE 1 = 0"),
]
EXPECTED = {
    "second-inner-fails": "0A000",
    "outer-reads-table": "0A000",
    "outer-file": "0A000",
    "outer-unknown-column": "42703",
    "probe-raw-identifier": "42501",
}
FREE = {"probe-limit-0", "probe-false-where", "probe-composite", "probe-raw-rows"}


def _outcome(engine: Engine, sql: str) -> tuple[Any, ...]:
    try:
        result = engine.execute(sql, Session("alice", epsilon=1.0, delta=1e-6))
    except Error as exc:
        return ("refused", exc.sqlstate, str(exc), len(engine.ledger.charges("oracles", "alice")))
    shape = tuple((c.name, c.type, c.noisy) for c in result.columns)
    return ("answered", shape, engine.ledger.spent("oracles", "alice").epsilon)


@pytest.fixture(scope="module")
def outer_outcomes(pg_new_database: Callable[[], str]) -> Iterator[Outcomes]:
    scripts = {variant: _script(variant) for variant in VARIANTS}
    with kind_backends(pg_new_database) as backends:
        yield outcomes_on(backends, scripts, CASES, _outcome, parse_policy(POLICY))


@pytest.mark.parametrize(("case", "sql"), CASES, ids=[c for c, _ in CASES])
def test_outer_outcome_does_not_depend_on_one_person(
    case: str, sql: str, outer_outcomes: dict[tuple[str, str, str], tuple[Any, ...]]
) -> None:
    seen = {(b, v): outer_outcomes[case, b, v] for b in BACKENDS for v in VARIANTS}
    distinct = set(seen.values())
    assert len(distinct) == 1, f"outcome depends on the data or backend: {seen}"
    (outcome,) = distinct
    if case in EXPECTED:
        assert outcome[:2] == ("refused", EXPECTED[case])
        assert outcome[3] == 0, "refused after a charge"
    else:
        assert outcome[0] == "answered"
        assert outcome[2] == (0 if case in FREE else pytest.approx(2.0 if case == "union-all" else 1.0))


def test_sandbox_is_locked_down() -> None:
    """The post-processing sandbox cannot read files, change its settings or load extensions."""
    import duckdb

    from dpsql.outer.sandbox import Sandbox

    with Sandbox() as box:
        for sql in (
            "SELECT * FROM read_csv('/etc/passwd')",
            "SET enable_external_access = true",
            "SET memory_limit = '100GB'",
            "INSTALL httpfs",
            "ATTACH '/tmp/x.duckdb' AS x",
        ):
            with pytest.raises(duckdb.Error):
                box.con.execute(sql)
