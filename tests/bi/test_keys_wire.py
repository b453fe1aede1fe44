"""Derived time buckets, DISTINCT and BI types through the wire: psycopg against a real dpsql server."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import psycopg
import pytest

from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.pgtypes import DATE, INT8, NUMERIC, TIMESTAMP, TIMESTAMPTZ
from dpsql.policy import load_policy
from dpsql.server import ThreadedServer


@pytest.fixture(scope="module")
def clinic_dsn() -> Iterator[str]:
    engine = Engine.open(load_policy(demo_policy_path("clinic")), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["clinic"])
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        yield f"host={server.host} port={server.port} user=analyst dbname=clinic"
    finally:
        server.stop()
        engine.close()


@pytest.mark.parametrize("binary", [False, True])
def test_monthly_series_over_psycopg(clinic_dsn: str, binary: bool) -> None:
    with psycopg.connect(clinic_dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1", binary=binary
        )
        rows = cur.fetchall()
        assert cur.description is not None
        # PostgreSQL types date_trunc(text, date) as timestamptz; the session is UTC
        assert [(d.name, d.type_code) for d in cur.description] == [("m", TIMESTAMPTZ), ("count", INT8)]
    assert len(rows) == 60
    assert rows[0][0] == dt.datetime(2020, 1, 1, tzinfo=dt.UTC) and rows[-1][0] == dt.datetime(
        2024, 12, 1, tzinfo=dt.UTC
    )
    assert all(isinstance(r[1], int) for r in rows)


def test_date_filter_parameters_and_casts(clinic_dsn: str) -> None:
    with psycopg.connect(clinic_dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT DATE_TRUNC('month', visit_date)::date AS m, CAST(COUNT(*) AS numeric) AS n FROM visits "
            "WHERE visit_date >= %s GROUP BY DATE_TRUNC('month', visit_date) ORDER BY 1",
            (dt.date(2024, 10, 1),),
        )
        rows = cur.fetchall()
        assert cur.description is not None
        assert [d.type_code for d in cur.description] == [DATE, NUMERIC]
    assert [r[0] for r in rows] == [dt.date(2024, 10, 1), dt.date(2024, 11, 1), dt.date(2024, 12, 1)]


def test_select_distinct_for_filter_lists(clinic_dsn: str) -> None:
    with psycopg.connect(clinic_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT DISTINCT EXTRACT(year FROM visit_date) AS y FROM visits ORDER BY 1").fetchall()
    assert rows == [(2020,), (2021,), (2022,), (2023,), (2024,)]


def test_domain_cap_refusal_over_the_wire(clinic_dsn: str) -> None:
    with (
        psycopg.connect(clinic_dsn, autocommit=True) as conn,
        pytest.raises(psycopg.errors.ProgramLimitExceeded) as info,
    ):
        conn.execute("SELECT DATE_TRUNC('hour', visit_date), COUNT(*) FROM visits GROUP BY 1")
    assert info.value.diag.message_primary == (
        "GROUP BY key \"DATE_TRUNC('HOUR', visit_date)\" would release 43825 groups (more than 10000)"
    )


@pytest.mark.parametrize("binary", [False, True])
def test_date_bin_over_psycopg(clinic_dsn: str, binary: bool) -> None:
    """Grafana-style weekly bins: every bin of the WHERE range, typed as PostgreSQL types them."""
    with psycopg.connect(clinic_dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT date_bin(INTERVAL '7 days', visit_date, TIMESTAMP '2024-01-01') AS time, count(*) AS value "
            "FROM visits WHERE visit_date BETWEEN '2024-01-01' AND '2024-03-31' GROUP BY 1 ORDER BY 1",
            binary=binary,
        )
        rows = cur.fetchall()
        assert cur.description is not None
        assert [d.type_code for d in cur.description] == [TIMESTAMP, INT8]
        tz = conn.execute(
            "SELECT date_bin('1 day', visit_date, '2000-01-01') AS d, count(*) FROM visits "
            "WHERE visit_date >= '2024-12-30' GROUP BY 1",
            binary=binary,
        ).fetchall()
    assert [r[0] for r in rows] == [dt.datetime(2024, 1, 1) + dt.timedelta(days=7 * i) for i in range(13)]
    assert [r[0] for r in tz] == [dt.datetime(2024, 12, 30, tzinfo=dt.UTC), dt.datetime(2024, 12, 31, tzinfo=dt.UTC)]
