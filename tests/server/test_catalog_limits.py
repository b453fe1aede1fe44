"""A catalog query cannot fill the server's memory: its result is read row by row and cut at a cap."""

from __future__ import annotations

import time

import psycopg
import pytest

from dpsql.server.catalog import MAX_CATALOG_RESULT_ROWS

from .conftest import Running


def test_huge_catalog_result_is_refused_not_buffered(dp_server: Running) -> None:
    """A cross join of catalog tables (hundreds of millions of rows within the shadow's timeout)
    is cancelled once it passes the cap: 54000, and the session stays usable."""
    with psycopg.connect(dp_server.url(), autocommit=True) as conn:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as info:
            conn.execute("SELECT a.oid, b.oid, c.oid FROM pg_catalog.pg_class a, pg_catalog.pg_class b, pg_class c")
        assert f"exceeds {MAX_CATALOG_RESULT_ROWS} rows" in str(info.value)
        assert time.monotonic() - started < 5
        assert conn.execute("SELECT count(*) FROM pg_catalog.pg_namespace").fetchone()[0] > 0  # type: ignore[index]


def test_cancel_reaches_a_streaming_catalog_query(dp_server: Running) -> None:
    """Reading rows one at a time must not block the thread that sends the cancel (psycopg's
    get_result holds the GIL while libpq waits): a pg_sleep is cut by the client's timeout."""
    with psycopg.connect(dp_server.url(), autocommit=True) as conn:
        conn.execute("SET statement_timeout = 300")
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(4)")
        assert time.monotonic() - started < 3
