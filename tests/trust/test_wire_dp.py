"""Empirical DP through the wire server: what psycopg receives satisfies the ε bound too.

The wire front door adds no noise of its own, but it must not add information either (no
exact values in NOTICEs, column types, row counts or errors). So the released outputs are
sampled here as a client sees them, on neighbouring databases, and checked with the same
Clopper–Pearson / Holm detector as the engine-level tests. Every query text is distinct, so
the result cache never answers and each sample is a fresh release.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import psycopg
import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.policy import Policy
from dpsql.server import ThreadedServer

from .conftest import dp_violations, threshold_events

SAMPLES = 700
EPSILON = 1.0


@pytest.fixture(scope="module")
def servers(
    health_neighbours: tuple[Backend, Backend],
    big_budget_health_policy: Policy,
) -> Iterator[tuple[int, int]]:
    from dpsql.ledger import Ledger

    engines = [Engine(big_budget_health_policy, b, Ledger.open("sqlite:///:memory:")) for b in health_neighbours]
    running = [ThreadedServer(engine, catalog_dsn="") for engine in engines]
    try:
        yield running[0].port, running[1].port
    finally:
        for server in running:
            server.stop()


#: A NOTICE holding released interval ends (released under DP, as the value is).
_RELEASED_ENDS = re.compile(r": between \S+ and \S+, at \d+%")


def _sample(port: int, sql: Callable[[int], str]) -> tuple[list[float], list[str]]:
    notices: list[str] = []
    with psycopg.connect(f"host=127.0.0.1 port={port} user=analyst dbname=health", autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute(f"SET dpsql.epsilon = {EPSILON}")
        values = [float(conn.execute(sql(i)).fetchone()[0]) for i in range(SAMPLES)]  # type: ignore[index]
    return values, notices


@pytest.mark.parametrize(
    "query",
    [
        lambda i: f"SELECT COUNT(*) FROM patients WHERE age > {-1 - i}",
        lambda i: f"SELECT median(age) FROM patients WHERE visits > {-1 - i}",
    ],
    ids=["count", "median"],
)
def test_released_values_over_the_wire_are_epsilon_dp(query: Callable[[int], str], servers: tuple[int, int]) -> None:
    (d, notices_d), (d_prime, notices_p) = (_sample(port, query) for port in servers)
    events = threshold_events(d + d_prime, [0.1, 0.3, 0.5, 0.7, 0.9])
    assert dp_violations(d, d_prime, events, EPSILON, 0.0) == []
    # NOTICEs carry only the charge, the remaining budget and the scale-derived intervals: the same on both;
    # a quantile's value interval ("median: between 41 and 70, …") has released ends, DP like the value
    fixed = [{n for n in notices if not _RELEASED_ENDS.search(n)} for notices in (notices_d, notices_p)]
    assert sorted(fixed[0]) == sorted(fixed[1])
