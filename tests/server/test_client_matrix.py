"""Every real client: the same DP answer as the DB-API driver, the same SQLSTATE, one charge per query."""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
from collections.abc import Callable

import asyncpg
import pg8000.native
import psycopg
import pytest
import sqlalchemy as sa

import dpsql
from dpsql.session import Session

from .conftest import MATRIX_CLIENTS, Running

EPSILON = 2.0
REFUSED = "SELECT ssn FROM patients"
Outcome = tuple[int, str]  # (noisy count, SQLSTATE of the refused query)


def _sql(threshold: int) -> str:
    return f"SELECT COUNT(*) FROM patients WHERE age > {threshold}"


def _psycopg(server: Running, user: str, sql: str) -> Outcome:
    with psycopg.connect(server.dsn(user), autocommit=True) as conn:
        conn.execute(f"SET dpsql.epsilon = {EPSILON}")
        count = conn.execute(sql).fetchone()[0]  # type: ignore[index]
        with pytest.raises(psycopg.Error) as info:
            conn.execute(REFUSED)
        return count, str(info.value.sqlstate)


def _asyncpg(server: Running, user: str, sql: str) -> Outcome:
    async def run() -> Outcome:
        conn = await asyncpg.connect(server.url(user))
        try:
            await conn.execute(f"SET dpsql.epsilon = {EPSILON}")
            count = await conn.fetchval(sql)
            with pytest.raises(asyncpg.PostgresError) as info:
                await conn.fetch(REFUSED)
            return count, str(info.value.sqlstate)
        finally:
            await conn.close()

    return asyncio.run(run())


def _pg8000(server: Running, user: str, sql: str) -> Outcome:
    conn = pg8000.native.Connection(user, host=server.host, port=server.port, database="health")
    try:
        conn.run(f"SET dpsql.epsilon = {EPSILON}")
        count = conn.run(sql)[0][0]
        with pytest.raises(pg8000.native.DatabaseError) as info:
            conn.run(REFUSED)
        return count, str(info.value.args[0]["C"])
    finally:
        conn.close()


def _psql(server: Running, user: str, sql: str) -> Outcome:
    psql = shutil.which("psql")
    assert psql is not None, "psql must be installed (scripts/setup.sh installs postgresql-client)"
    base = [psql, "-X", "-At", "-v", "ON_ERROR_STOP=1", "-h", server.host, "-p", str(server.port), "-U", user, "health"]
    env = {"PGCONNECT_TIMEOUT": "10", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([*base, "-c", f"SET dpsql.epsilon = {EPSILON}", "-c", sql],
                        capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    verbose = [*base[:1], "-X", "-At", "-v", "VERBOSITY=verbose", *base[3:]]
    bad = subprocess.run([*verbose, "-c", REFUSED], capture_output=True, text=True, timeout=30, env=env)
    sqlstate = bad.stderr.split("ERROR:", 1)[1].split(":", 1)[0].strip()
    return int(ok.stdout.strip().splitlines()[-1]), sqlstate


def _sqlalchemy(server: Running, user: str, sql: str) -> Outcome:
    engine = sa.create_engine(server.url(user, "postgresql+psycopg"))
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SET dpsql.epsilon = {EPSILON}")
            count = conn.exec_driver_sql(sql).scalar_one()
            with pytest.raises(sa.exc.DBAPIError) as info:
                conn.exec_driver_sql(REFUSED)
            return count, str(info.value.orig.sqlstate)
    finally:
        engine.dispose()


CLIENTS: dict[str, Callable[[Running, str, str], Outcome]] = {
    "psycopg": _psycopg,
    "asyncpg": _asyncpg,
    "pg8000": _pg8000,
    "psql": _psql,
    "sqlalchemy": _sqlalchemy,
}
assert set(CLIENTS) == set(MATRIX_CLIENTS)


@pytest.mark.parametrize("client", MATRIX_CLIENTS)
def test_client_matches_the_dbapi_driver(client: str, dp_server: Running) -> None:
    analyst = f"m_{client}"
    sql = _sql(20 + MATRIX_CLIENTS.index(client))  # distinct text: no result-cache hit between clients
    before = dp_server.engine.ledger.spent(dp_server.engine.policy.dataset, analyst)
    count, sqlstate = CLIENTS[client](dp_server, analyst, sql)
    after = dp_server.engine.ledger.spent(dp_server.engine.policy.dataset, analyst)
    assert after.queries - before.queries == 1 and after.epsilon - before.epsilon == pytest.approx(EPSILON)

    with dpsql.connect(engine=dp_server.engine, analyst="analyst") as conn, conn.cursor() as cur:
        explanation = conn.explain(sql)
        with pytest.raises(dpsql.Error) as info:
            cur.execute(REFUSED)
    assert sqlstate == info.value.sqlstate == "42501"
    truth = dp_server.engine.backend.execute(sql)[1][0][0]
    session = Session(analyst, epsilon=EPSILON)
    half_width = dp_server.engine.explain(sql, session).columns[0]["ci"]
    assert explanation.columns[0]["name"] == "count"
    # the released count lies within the 1e-9 tail of the noise the engine reports for it
    assert abs(count - truth) <= half_width * math.log(1e9) / math.log(40)
