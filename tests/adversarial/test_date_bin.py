"""date_bin keys on neighbouring databases: the released bins never depend on one person.

Each query groups by ``date_bin`` over the bounded ``d``/``ts`` columns of ``test_error_oracles`` and
runs on its neighbouring databases (the attacked person absent, ordinary, out of bounds — a
``'infinity'`` date and timestamp —, ``-infinity``, NaN, huge, tiny), on DuckDB and on PostgreSQL.
The bins are a function of the policy's bounds, WHERE's constants, the stride and the origin only:
every neighbour must release exactly the same set (empty bins included, one person alone in a bin
or not, an infinite timestamp clamped into an edge bin instead of a new group or an error), and a
refusal must be the same before any charge. tests/adversarial/README lists the cases.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.adversarial.test_derived_keys import KeyAttack, check_independent, key_backends, outcomes_fixture

__all__ = ["key_backends"]  # the shared module fixture (DuckDB and PostgreSQL backends)

ATTACKS = [
    # 2020-01-01..2024-12-31 in 30-day bins from 2001-01-01: 62 bins, + NULL (d is nullable)
    KeyAttack("bin-30-days-date", "SELECT date_bin('30 days', d, '2001-01-01'), COUNT(*) FROM t GROUP BY 1", 63),
    # the attacked person's ordinary ts (2021-06-01 10:00) is alone in its 6-hour bin in June 2021; the bin
    # of 2021-06-03 00:00 lies wholly outside the WHERE range and is not released (#40 item 3)
    KeyAttack(
        "bin-6-hours-alone",
        "SELECT date_bin('6 hours', ts, TIMESTAMP '2000-01-01') AS b, COUNT(*) FROM t "
        "WHERE ts >= '2021-06-01' AND ts < '2021-06-03' GROUP BY b",
        8,
    ),
    # bins before the origin (floor toward −∞), an infinite ts clamped into the last one
    KeyAttack(
        "bin-before-origin-sum",
        "SELECT date_bin(INTERVAL '90 days', ts, TIMESTAMP '2030-01-01 06:00'), SUM(visits) FROM t GROUP BY 1",
        22,
    ),
    KeyAttack(
        "bin-where-late",
        "SELECT date_bin('7 days', d, TIMESTAMP '2001-01-01'), COUNT(*) FROM t WHERE d >= '2024-12-01' GROUP BY 1",
        6,
    ),
    KeyAttack("bin-distinct", "SELECT DISTINCT date_bin('100 days', d::timestamp, '2020-01-01') FROM t", 20),
    KeyAttack(
        "bin-unbounded-selection", "SELECT date_bin('365 days', d2, '0001-01-01'), COUNT(*) FROM t GROUP BY 1", None
    ),
    # unbounded: clamped to year 1, whose bin would fall before year 1 (BC) — refused from the policy alone
    KeyAttack("bin-unbounded-bc", "SELECT date_bin('365 days', d2, '2001-01-01'), COUNT(*) FROM t GROUP BY 1", "0A000"),
    KeyAttack("bin-months", "SELECT date_bin('1 month', ts, '2001-01-01'), COUNT(*) FROM t GROUP BY 1", "0A000"),
    KeyAttack("bin-zero-stride", "SELECT date_bin('0 hours', ts, '2001-01-01'), COUNT(*) FROM t GROUP BY 1", "22008"),
    KeyAttack("bin-cap", "SELECT date_bin('1 hour', ts, '2001-01-01'), COUNT(*) FROM t GROUP BY 1", "54000"),
]


bin_outcomes = outcomes_fixture(ATTACKS)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_released_bins_do_not_depend_on_one_person(
    attack: KeyAttack, bin_outcomes: dict[tuple[str, str, str], tuple[Any, ...]]
) -> None:
    check_independent(attack, bin_outcomes, "bins")
