"""asyncpg: binary protocol everywhere, prepared statements, pools, type introspection, cancellation."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from .conftest import Running


def run(coro):
    return asyncio.run(coro)


def test_fetch_and_prepared(dp_server: Running) -> None:
    async def main() -> None:
        conn = await asyncpg.connect(dp_server.url("carol"))
        try:
            assert await conn.fetchval("SELECT 1") == 1
            rows = await conn.fetch("SELECT sex, COUNT(*) AS n, AVG(bmi) AS b FROM patients GROUP BY sex")
            assert {r["sex"] for r in rows} == {"Female", "Male"}
            assert all(isinstance(r["n"], int) and isinstance(r["b"], float) for r in rows)
            stmt = await conn.prepare("SELECT COUNT(*) AS n FROM patients WHERE age > $1 AND sex = $2")
            assert [p.name for p in stmt.get_parameters()] == ["int8", "text"]
            assert [a.name for a in stmt.get_attributes()] == ["n"]
            assert isinstance(await stmt.fetchval(50, "Male"), int)
        finally:
            await conn.close()

    run(main())


def test_pool(dp_server: Running) -> None:
    async def main() -> None:
        pool = await asyncpg.create_pool(dp_server.url("dave"), min_size=2, max_size=4)
        try:

            async def one(i: int) -> int:
                async with pool.acquire() as conn:
                    return await conn.fetchval("SELECT COUNT(*) FROM patients WHERE visits >= $1", i)

            results = await asyncio.gather(*(one(i) for i in range(8)))
            assert all(isinstance(r, int) for r in results)
        finally:
            await pool.close()

    run(main())


def test_describe_does_not_spend_budget(dp_server: Running) -> None:
    """frugal has ε=3: twenty prepares (Parse + Describe) must cost nothing."""

    async def main() -> None:
        notices: list[str] = []
        conn = await asyncpg.connect(dp_server.url("frugal"))
        conn.add_log_listener(lambda _c, msg: notices.append(msg.message))
        try:
            await conn.execute("SET dpsql.epsilon = 1")
            for i in range(20):
                stmt = await conn.prepare(f"SELECT COUNT(*) AS n{i} FROM patients WHERE age > $1")
                assert stmt.get_attributes()[0].name == f"n{i}"
            # a filter no other test releases: never answered free from an earlier release's cells
            await conn.fetchval("SELECT COUNT(*) FROM patients WHERE age > 3 AND age < 97")
            await asyncio.sleep(0.05)
            assert any("remaining ε=2" in n for n in notices), notices
        finally:
            await conn.close()

    run(main())


def test_cancel_request(dp_server: Running) -> None:
    """asyncpg sends a CancelRequest on timeout; the connection stays usable."""

    async def main() -> None:
        conn = await asyncpg.connect(dp_server.url())
        try:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await conn.fetchval("SELECT pg_sleep(5)", timeout=0.3)
            assert await conn.fetchval("SELECT 1") == 1
            assert time.monotonic() - started < 4
        finally:
            await conn.close()

    run(main())


def test_portal_suspension_with_cursor(dp_server: Running) -> None:
    """A cursor fetches 2 rows per Execute: the DP query runs once, PortalSuspended in between."""

    async def main() -> None:
        notices: list[str] = []
        conn = await asyncpg.connect(dp_server.url("carol"))
        conn.add_log_listener(lambda _c, msg: notices.append(msg.message))
        try:
            async with conn.transaction():
                rows = [
                    r async for r in conn.cursor("SELECT problem, COUNT(*) FROM patients GROUP BY problem", prefetch=2)
                ]
            assert len(rows) == 7
            await asyncio.sleep(0.05)
            assert sum("charged" in n for n in notices) == 1
        finally:
            await conn.close()

    run(main())
