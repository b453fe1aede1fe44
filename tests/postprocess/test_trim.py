"""``SET dpsql.trim_time = on``: a time series over a bounded column's whole domain trimmed to where a
noisy value stands out of its interval (post-processing), on DuckDB and PostgreSQL and over the wire."""

from __future__ import annotations

import datetime as dt

import psycopg

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.postprocess.trim import trim_time
from dpsql.server import ThreadedServer
from dpsql.session import OutputColumn, Result, Session
from tests.demos import demo_fixture

YEARLY = "SELECT DATE_TRUNC('year', dob) AS y, COUNT(*) AS n FROM patients GROUP BY 1 ORDER BY 1"


backend = demo_fixture("health", kind="both", scope="module")


def test_the_demo_dob_series_is_trimmed_to_the_data(backend: Backend) -> None:
    engine = Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:"), ResultCache())
    session = Session("alice", epsilon=1.0)
    whole = engine.execute(YEARLY, session)
    assert len(whole.rows) == 91  # 1920–2010, the policy's bounds
    session.apply("dpsql.trim_time", True, "on")
    trimmed = engine.execute(YEARLY, session)  # the same release (cache), post-processed: free
    assert trimmed.epsilon_spent == 0
    years = [r[0].year for r in trimmed.rows]
    # the demo's patients are born 1930–2004: the empty 1920s go (a spurious one stands out with
    # probability ~5 %/91 each), the data's span stays
    assert years[0] <= 1930 and years[-1] >= 2004 - 1 and len([y for y in years if y < 1930]) <= 3
    assert years == list(range(years[0], years[-1] + 1))  # nothing dropped inside the span
    assert any("buckets dropped" in n for n in trimmed.notices)


def test_trimming_keeps_inner_zeros_and_leaves_other_results() -> None:
    columns = [OutputColumn("d", "date", False), OutputColumn("n", "bigint", True)]
    rows = [(dt.date(2020, m, 1), n) for m, n in zip(range(1, 7), (0, 4, 40, 0, 35, -4), strict=True)]
    result = Result(columns, rows, [(None, 3.0)] * 6, 1.0, 0.0)
    assert [r[0].month for r in trim_time(result).rows] == [3, 4, 5]
    keyless = Result([OutputColumn("n", "bigint", True)], [(0,)], [(3.0,)], 1.0, 0.0)
    assert trim_time(keyless) is keyless
    silent = Result(columns, [(dt.date(2020, 1, 1), 0)], [(None, 3.0)], 1.0, 0.0)
    assert trim_time(silent) is silent  # nothing stands out: nothing is dropped


def test_set_over_the_wire() -> None:
    engine = Engine.open(load_policy(demo_policy_path("health")), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["health"])
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        with psycopg.connect(host=server.host, port=server.port, user="alice", dbname="health") as conn:
            assert conn.execute("SHOW dpsql.trim_time").fetchone() == ("off",)
            conn.execute("SET dpsql.trim_time = on")
            rows = conn.execute(YEARLY).fetchall()
        assert len(rows) < 91
    finally:
        server.stop()
        engine.close()
