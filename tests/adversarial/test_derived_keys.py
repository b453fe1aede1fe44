"""Derived GROUP BY domains on neighbouring databases: the released keys never depend on one person.

Each query groups by an expression whose domain follows from the policy (DATE_TRUNC, EXTRACT,
width_bucket, FLOOR arithmetic, CASE literals, predicates) and runs on the neighbouring databases of
``test_error_oracles`` (the attacked person absent, ordinary, or holding an out-of-bounds, NaN,
±infinity, huge or tiny value), on DuckDB and on PostgreSQL. A public (derived) domain must release
exactly the same keys everywhere — empty buckets and unmatched CASE literals included, stored odd
values landing in an edge bucket instead of a new group — and every query must have the same outcome
class (answered, or one refusal before any charge). tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.test_error_oracles import BACKENDS, POLICY, VARIANTS, _script
from tests.adversarial.worlds import Outcomes, kind_backends, outcomes_on


@dataclass(frozen=True)
class KeyAttack:
    id: str
    sql: str
    #: How many keys a public domain releases, NULL included (the test columns are nullable); None: partition
    #: selection (which keys pass is noisy); or the SQLSTATE of the refusal.
    keys: int | str | None


ATTACKS = [
    KeyAttack("trunc-month-date", "SELECT DATE_TRUNC('month', d), COUNT(*) FROM t GROUP BY 1", 61),
    KeyAttack("trunc-year-ts-sum", "SELECT DATE_TRUNC('year', ts) AS y, SUM(visits) FROM t GROUP BY y", 6),
    # weeks of Nov 25 … Dec 23: the week of Monday 2024-12-30 lies wholly outside WHERE (#40 item 3)
    KeyAttack(
        "trunc-week-ts-before",
        "SELECT DATE_TRUNC('week', ts), COUNT(*) FROM t WHERE ts >= '2024-12-01' AND ts < '2024-12-30' GROUP BY 1",
        5,
    ),
    KeyAttack("trunc-where", "SELECT DATE_TRUNC('month', d), COUNT(*) FROM t WHERE d >= '2024-06-01' GROUP BY 1", 7),
    KeyAttack("extract-year", "SELECT EXTRACT(year FROM d), COUNT(*) FROM t GROUP BY 1", 6),
    KeyAttack("extract-dow-ts", "SELECT EXTRACT(dow FROM ts), AVG(cost) FROM t GROUP BY 1", 8),
    KeyAttack("width-bucket-nan", "SELECT width_bucket(cost, 0, 2000, 10), COUNT(*) FROM t GROUP BY 1", 12),
    KeyAttack("floor-float-nullable", "SELECT floor(x * 4), COUNT(*) FROM t GROUP BY 1", 10),
    KeyAttack("floor-int-huge", "SELECT floor(visits / 10) * 10, COUNT(*) FROM t GROUP BY 1", 12),
    KeyAttack("floor-cost-avg", "SELECT floor(cost / 100) * 100 AS c, AVG(x) FROM t GROUP BY c", 22),
    KeyAttack(
        "case-unmatched-literal",
        "SELECT CASE WHEN cost > 5000 THEN 'never' WHEN cost > 1500 THEN 'high' ELSE 'low' END, COUNT(*) "
        "FROM t GROUP BY 1",
        3,
    ),
    KeyAttack(
        "grafana-epoch",
        "SELECT floor(extract(epoch from ts)/86400)*86400, COUNT(*) FROM t WHERE ts >= '2024-12-01' GROUP BY 1",
        31,
    ),
    KeyAttack("predicate-key", "SELECT x > 0, COUNT(*) FROM t GROUP BY 1", 3),
    KeyAttack("where-equality", "SELECT visits, COUNT(*) FROM t WHERE visits IN (3, 1000000) GROUP BY visits", 1),
    KeyAttack("distinct-derived", "SELECT DISTINCT DATE_TRUNC('year', d) FROM t", 6),
    KeyAttack(
        "tableau-quarter-cast",
        "SELECT CAST(DATE_TRUNC('QUARTER', CAST(d AS DATE)) AS DATE), SUM(x) FROM t GROUP BY 1",
        21,
    ),
    KeyAttack(
        "extract-cast-timestamp", "SELECT EXTRACT(year FROM CAST(d AS TIMESTAMP)), COUNT(*) FROM t GROUP BY 1", 6
    ),
    KeyAttack(
        "trunc-cast-ts-to-date", "SELECT DATE_TRUNC('day', CAST(ts AS DATE)), COUNT(*) FROM t GROUP BY 1", "0A000"
    ),
    KeyAttack("cast-text-selection", "SELECT CAST(problem AS TEXT), COUNT(*) FROM t GROUP BY 1", None),
    KeyAttack("trunc-unbounded-selection", "SELECT DATE_TRUNC('month', d2), COUNT(*) FROM t GROUP BY 1", None),
    KeyAttack("float-key-selection", "SELECT cost * 2, COUNT(*) FROM t GROUP BY 1", None),
    KeyAttack("domain-cap", "SELECT DATE_TRUNC('hour', ts), COUNT(*) FROM t GROUP BY 1", "54000"),
    KeyAttack("floor-underflow", "SELECT floor(x * 1e-300), COUNT(*) FROM t GROUP BY 1", "0A000"),
    KeyAttack("case-column-result", "SELECT CASE WHEN x > 0 THEN problem END, COUNT(*) FROM t GROUP BY 1", "0A000"),
]


def _outcome(engine: Engine, attack: KeyAttack) -> tuple[Any, ...]:
    try:
        result = engine.execute(attack.sql, Session("alice", epsilon=1.0, delta=1e-6))
    except Error as exc:
        return ("refused", exc.sqlstate, exc.message, len(engine.ledger.charges("oracles", "alice")))
    return ("answered", frozenset(row[0] for row in result.rows))


@pytest.fixture(scope="module")
def key_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    with kind_backends(pg_new_database) as backends:
        yield backends


def outcomes_of(attacks: list[KeyAttack], backends: dict[str, Backend]) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """Every attack's outcome on every backend and neighbouring database, each with a fresh ledger."""
    scripts = {variant: _script(variant) for variant in VARIANTS}
    return outcomes_on(backends, scripts, [(a.id, a) for a in attacks], _outcome, parse_policy(POLICY))


def check_independent(attack: KeyAttack, outcomes: dict[tuple[str, str, str], tuple[Any, ...]], what: str) -> None:
    """One outcome class on every backend and neighbour; the same released ``what`` (keys, bins) where
    the domain is public; one refusal, charged nothing, where the attack is refused."""
    seen = {(b, v): outcomes[attack.id, b, v] for b in BACKENDS for v in VARIANTS}
    if isinstance(attack.keys, str):
        assert {o[:2] for o in seen.values()} == {("refused", attack.keys)}, seen
        assert len(set(seen.values())) == 1 and next(iter(seen.values()))[3] == 0, seen
        return
    assert {o[0] for o in seen.values()} == {"answered"}, seen
    if attack.keys is None:
        return  # partition selection: which pass is noisy, only the outcome class is fixed
    keys = {o[1] for o in seen.values()}
    assert len(keys) == 1, f"released {what} depend on the data or backend: {seen}"
    assert len(next(iter(keys))) == attack.keys


def outcomes_fixture(attacks: list[KeyAttack]) -> object:
    """A module fixture: :func:`outcomes_of` ``attacks`` over ``key_backends``."""

    def fixture(key_backends: dict[str, Backend]) -> Outcomes:
        return outcomes_of(attacks, key_backends)

    return pytest.fixture(scope="module")(fixture)


key_outcomes = outcomes_fixture(ATTACKS)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_released_keys_do_not_depend_on_one_person(
    attack: KeyAttack, key_outcomes: dict[tuple[str, str, str], tuple[Any, ...]]
) -> None:
    check_independent(attack, key_outcomes, "keys")
