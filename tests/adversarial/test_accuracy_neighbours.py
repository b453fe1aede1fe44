"""Accuracy reporting on neighbouring databases: nothing in it may depend on one person.

An empty group's AVG is NULL — decided from the noisy count only, never from the true one.

``dp_avg`` returns NULL when its noisy count is ≤ 0 (PostgreSQL answers NULL for an empty group).
If the true count decided it, a NULL would say "nobody here" exactly. The neighbours: a public
domain value ``rare`` held by nobody, or by one person; on DuckDB and PostgreSQL, every run must
satisfy ``AVG IS NULL ⇔ noisy COUNT ≤ 0`` (the count column *is* AVG's count measure: one measure,
noised once), and both outcomes must occur on both neighbours (the true count is 0 on one, 1 on the
other, so neither decides it).

The accuracy NOTICEs (rank error bounds, mode count gaps) must be the same text on every
neighbour, and a "capped at the declared bound" or "is NULL in k of n rows" note must follow from
the released rows alone. tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Result, Session
from tests.adversarial.worlds import neighbour_worlds, roomy_policy

POLICY = roomy_policy(
    "avgnull",
    """
  t:
    privacy_unit: id
    max_rows_per_unit: 1
    columns:
      id: {type: int, identifier: true}
      problem: {type: text, domain: [asthma, flu, rare], nullable: false}
      cost: {type: float, lower: 0.0, upper: 100.0, nullable: false}
      visits: {type: int, lower: 0, upper: 10, nullable: false}
""",
)

SQL = "SELECT problem, COUNT(*), AVG(cost), var_pop(visits) FROM t GROUP BY problem"
RUNS = 30


#: The attacked person's row (None: absent): ordinary, or far out of the policy's bounds.
PERSON = {"absent": None, "rare": "(99, 'rare', 42.0, 3)", "out-of-bounds": "(99, 'rare', 1e9, 1000)"}


def _script(variant: str) -> str:
    rows = [f"({i}, '{'asthma' if i % 2 else 'flu'}', {i * 3.5}, {i % 5})" for i in range(1, 21)]
    if (person := PERSON[variant]) is not None:
        rows.append(person)
    return (
        "DROP TABLE IF EXISTS t; CREATE TABLE t (id BIGINT, problem TEXT, cost DOUBLE PRECISION, visits BIGINT); "
        f"INSERT INTO t VALUES {', '.join(rows)}"
    )


@pytest.fixture(scope="module")
def neighbours(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str], Backend]]:
    with neighbour_worlds(pg_new_database, PERSON, _script) as backends:
        yield backends


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
def test_avg_null_follows_the_noisy_count(neighbours: dict[tuple[str, str], Backend], kind: str) -> None:
    policy = parse_policy(POLICY)
    outcomes: dict[bool, set[bool]] = {}
    for with_rare in (False, True):
        backend = neighbours[(kind, "rare" if with_rare else "absent")]
        engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
        seen: set[bool] = set()
        for _ in range(RUNS):
            result = engine.execute(SQL, Session("alice", epsilon=0.2, bias=False))
            assert [r[0] for r in result.rows] == ["asthma", "flu", "rare"]  # the public domain, always
            for row, accuracy in zip(result.rows, result.accuracy, strict=True):
                _, count, avg, var = row
                assert (avg is None) == (count <= 0), row  # the noisy count decides, nothing else
                assert (var is None) == (count <= 0), row  # var_pop: the same shared count measure
                assert (accuracy[2] is None) == (avg is None)  # a NULL has no interval
                if avg is not None:
                    assert 0.0 <= avg <= 100.0
            rare = next(r for r in result.rows if r[0] == "rare")
            seen.add(rare[2] is None)
        outcomes[with_rare] = seen
    # nobody holds "rare" (true count 0) / one person does (true count 1): NULL and a value on both
    assert outcomes == {False: {True, False}, True: {True, False}}


NOTED = [
    "SELECT problem, MAX(visits), median(cost), AVG(cost) FROM t GROUP BY problem",
    "SELECT mode() WITHIN GROUP (ORDER BY problem), MIN(cost), percentile_disc(0.9) WITHIN GROUP (ORDER BY visits), "
    "MAX(visits) FROM t",
]


def _rows(k: int, n: int) -> str:
    return "" if n == 1 else f" (in {k} of {n} rows)"


def _expected_value_notes(result: Result, sql: str) -> list[str]:
    """The notes that read released values, recomputed from the released rows alone."""
    notes = []
    n = len(result.rows)
    for o, column in enumerate(result.columns):
        values = [row[o] for row in result.rows]
        if column.name in ("max", "percentile_disc"):
            bound, name, declared = 10, "visits", "[0, 10]"
        elif column.name in ("median", "min"):
            bound, name, declared = 100, "cost", "[0, 100]"
        else:
            if column.name == "avg" and (k := values.count(None)):
                notes.append(
                    f"dpsql: avg is NULL{_rows(k, n).replace(' (in', ' in').rstrip(')')}: its noisy count is <= 0 "
                    "(the group looks empty)"
                )
            continue
        for b, text in ((bound, "capped at the declared upper"), (0, "floored at the declared lower")):
            if k := sum(1 for v in values if v == b):
                notes.append(
                    f"dpsql: {column.name} is {text} bound {b} of {name}{_rows(k, n)}: values are clamped "
                    f"to {declared} before the choice"
                )
    return notes


@pytest.mark.parametrize("sql", NOTED)
def test_accuracy_notices_depend_on_released_values_only(
    neighbours: dict[tuple[str, str], Backend], sql: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notes read ε, bounds, grid and caps (the same words on every neighbour) or released values.

    Two checks: the notes about bounds and NULL AVGs are recomputed here from the released rows
    alone; and every note is recomputed with the plan and budgeting built on *another* neighbour
    database, fed this run's released values: the texts must not change, so nothing the plan might
    carry from its own database (it carries nothing: it is built from SQL and policy) reaches them.
    """
    import dpsql.step
    from dpsql.release.accuracy import accuracy_notes

    calls: list[tuple[Any, ...]] = []

    def recording(*args: Any) -> list[str]:
        calls.append(args)
        return accuracy_notes(*args)

    monkeypatch.setattr(dpsql.step, "accuracy_notes", recording)
    policy = parse_policy(POLICY)
    fixed: set[tuple[str, ...]] = set()
    valued = 0
    for (kind, variant), backend in neighbours.items():
        engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
        for _ in range(3):
            result = engine.execute(sql, Session("alice", epsilon=0.5, bias=False))
            notes = [t for t in result.notices if "charged" not in t]
            public = [t for t in notes if "has no ± interval" in t or "covers the noise only" in t]
            public = [t.split("; it means little")[0] for t in public]  # the size warning reads a released count
            fixed.add(tuple(public))  # ε, Δ, grid, domain, bounds and caps: public
            expected = _expected_value_notes(result, sql)
            assert set(expected) <= set(notes), (kind, variant)
            valued += len(expected)
    assert len(fixed) == 1, fixed  # the same words on every neighbour and backend
    assert valued  # some released value sat on a bound (or an AVG was NULL): the check was exercised
    plan, budgeting = calls[0][0], calls[0][1]  # built on the first neighbour database
    assert len(calls) == 3 * len(neighbours)
    for own_plan, own_budgeting, level, result, released, *_ in calls[1:]:  # (then the columns bias widened)
        here = accuracy_notes(own_plan, own_budgeting, level, result, released)
        assert accuracy_notes(plan, budgeting, level, result, released) == here
