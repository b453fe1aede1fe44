"""GROUP BY keys that crashed the analysis: casts of nullable time buckets, columns WHERE keeps only NULL,
WHERE equalities whose constants no value can equal.

Analysis crashes (a Python ``ValueError`` / ``AssertionError`` / ``TypeError`` instead of an answer or a
refusal):

- ``CAST(date_bin(…) AS TIMESTAMP)`` (and of ``DATE_TRUNC``) over a nullable column cast the NULL of the
  bucket domain as a date;
- arithmetic on an operand that ``WHERE x IS NULL`` leaves NULL on every row (its domain holds no value)
  asked that empty domain for its least value (``CAST(x AS BIGINT) * 1e20 + cost``, a divisor);
- ``d IN (TIMESTAMP …, TIMESTAMP …)`` / OR-ed ``d = TIMESTAMP …`` on a date key compared the constants as
  dates (found by the sensitivity fuzzer's narrowing shapes); ``visits IN (3, 2.5)`` released a 2.5 group
  for an integer column.

All now have a clear meaning, derived from the policy and the SQL only: the cast keeps the buckets and
NULL; ``+ - * /`` are strict, so an operand NULL on every row WHERE keeps makes the key NULL on every such
row, and the backend never applies the operator (nothing can overflow or divide by zero, whatever the other
operand's bounds). The key's domain is {NULL}. A date equals a timestamp only at midnight (both backends
promote the date), an integer never equals 2.5: those constants add no group. Each query runs on the
neighbouring databases of ``test_error_oracles`` plus one where the attacked person's row is NULL in every
column WHERE tests, on DuckDB and PostgreSQL: the same keys everywhere, or the same refusal (SQLSTATE,
message) before any charge.
tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.test_error_oracles import BACKENDS, ORDINARY, POLICY, VARIANTS
from tests.adversarial.test_error_oracles import _script as oracle_script
from tests.adversarial.worlds import Outcomes, kind_backends, outcomes_on

#: The oracle neighbours, and the attacked person with NULL wherever a WHERE below tests IS NULL.
NEIGHBOURS: dict[str, dict[str, str] | None] = VARIANTS | {
    "null": ORDINARY | {"visits": "NULL", "x": "NULL", "d": "NULL", "ts": "NULL"}
}

HUGE = "100000000000000000000"  # 10^20: numeric on PostgreSQL, beyond BIGINT


@dataclass(frozen=True)
class NullAttack:
    id: str
    sql: str
    #: the keys every neighbour releases (a count, NULL included), or (SQLSTATE, message) of the refusal
    expect: int | tuple[str, str]


ATTACKS = [
    # d, ts nullable: 2020-01-01..2024-12-31 in 7-day bins from a Monday: 262 bins + NULL
    NullAttack(
        "cast-date-bin-date",
        "SELECT CAST(date_bin('7 days', d, TIMESTAMP '2001-01-01') AS TIMESTAMP) AS b, COUNT(*) FROM t GROUP BY b",
        263,
    ),
    NullAttack(
        "cast-date-bin-ts",
        "SELECT CAST(date_bin('7 days', ts, TIMESTAMP '2001-01-01') AS TIMESTAMP), SUM(visits) FROM t GROUP BY 1",
        263,
    ),
    NullAttack(
        "cast-trunc-is-null",
        "SELECT CAST(DATE_TRUNC('month', d) AS TIMESTAMP), COUNT(*) FROM t WHERE d IS NULL GROUP BY 1",
        1,
    ),
    NullAttack(
        "cast-date-bin-in",
        "SELECT CAST(date_bin('1 day', d, TIMESTAMP '2001-01-01') AS TIMESTAMP), COUNT(*) FROM t "
        "WHERE d IN ('2021-06-01', '2022-01-01') GROUP BY 1",
        2,
    ),
    NullAttack(
        "null-times-huge",
        f"SELECT CAST(visits AS BIGINT) * {HUGE} AS v, COUNT(*) FROM t WHERE visits IS NULL GROUP BY v",
        1,
    ),
    NullAttack(
        "null-times-huge-plus-bounded",
        f"SELECT CAST(x AS BIGINT) * {HUGE} + cost AS v, COUNT(*) FROM t WHERE x IS NULL GROUP BY v",
        1,
    ),
    NullAttack(
        "bounded-plus-null-times-bigint-max",
        "SELECT cost + CAST(x AS BIGINT) * 9223372036854775807 AS v, AVG(cost) FROM t WHERE x IS NULL GROUP BY v",
        1,
    ),
    NullAttack(
        "null-divisor",
        f"SELECT visits / (CAST(x AS BIGINT) * {HUGE}) AS v, COUNT(*) FROM t WHERE x IS NULL GROUP BY v",
        1,
    ),
    NullAttack(
        "null-dividend-zero-divisor",
        "SELECT CAST(x AS BIGINT) / visits AS v, COUNT(*) FROM t WHERE x IS NULL GROUP BY v",
        1,
    ),
    NullAttack(
        "date-in-timestamps",
        "SELECT d, COUNT(*) FROM t WHERE d IN (TIMESTAMP '2021-06-01 00:00:00', TIMESTAMP '2022-01-01 12:00:00') "
        "GROUP BY d",
        1,  # 2021-06-01 only: no date equals noon
    ),
    NullAttack(
        "date-or-timestamp",
        "SELECT d, COUNT(*) FROM t WHERE d = TIMESTAMP '2021-06-01 00:00:00' OR d = DATE '2023-03-13' GROUP BY d",
        2,
    ),
    NullAttack("int-in-fraction", "SELECT visits, COUNT(*) FROM t WHERE visits IN (3, 2.5) GROUP BY visits", 1),
    NullAttack("int-or-fraction", "SELECT visits, SUM(cost) FROM t WHERE visits = 2.5 OR visits = 4 GROUP BY 1", 1),
    # without the IS NULL, the same expressions are refused from the bounds, before any charge
    NullAttack(
        "huge-without-is-null",
        f"SELECT CAST(visits AS BIGINT) * {HUGE} + cost AS v, COUNT(*) FROM t GROUP BY v",
        ("0A000", "a GROUP BY expression can exceed 2^53 in magnitude"),
    ),
    NullAttack(
        "divisor-without-is-null",
        "SELECT cost / visits AS v, COUNT(*) FROM t WHERE x IS NULL GROUP BY v",
        ("0A000", "division by an expression that can be zero"),
    ),
]


def _script(variant: str) -> str:
    return oracle_script(variant, NEIGHBOURS)


def _outcome(engine: Engine, attack: NullAttack) -> tuple[Any, ...]:
    try:
        result = engine.execute(attack.sql, Session("alice", epsilon=1.0, delta=1e-6))
    except Error as exc:
        return ("refused", exc.sqlstate, exc.message, len(engine.ledger.charges("oracles", "alice")))
    return ("answered", frozenset(row[0] for row in result.rows), result.delta_spent)


@pytest.fixture(scope="module")
def null_outcomes(pg_new_database: Callable[[], str]) -> Iterator[Outcomes]:
    scripts = {variant: _script(variant) for variant in NEIGHBOURS}
    with kind_backends(pg_new_database) as backends:
        yield outcomes_on(backends, scripts, [(a.id, a) for a in ATTACKS], _outcome, parse_policy(POLICY))


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_null_only_keys_do_not_depend_on_one_person(
    attack: NullAttack, null_outcomes: dict[tuple[str, str, str], tuple[Any, ...]]
) -> None:
    seen = {(b, v): null_outcomes[attack.id, b, v] for b in BACKENDS for v in NEIGHBOURS}
    if isinstance(attack.expect, tuple):
        assert set(seen.values()) == {("refused", *attack.expect, 0)}, seen  # refused before any charge
        return
    assert {o[0] for o in seen.values()} == {"answered"}, seen
    assert len(set(seen.values())) == 1, f"released keys depend on the data or backend: {seen}"
    keys, delta = next(iter(seen.values()))[1:]
    assert len(keys) == attack.expect and delta == 0  # a public domain: no partition selection
    if "IS NULL" in attack.sql:
        assert keys == {None}
