"""dpsql's PostgreSQL wire-protocol (v3) front door, on asyncio.

Any PostgreSQL client (psql, psycopg, asyncpg, pg8000, JDBC, SQLAlchemy, BI tools) connects to
port **6543** by default and speaks plain SQL; aggregate queries go through the DP engine,
session statements are answered locally, and catalog queries go to an empty shadow schema.

- :func:`serve` — coroutine: listen until the ``stop`` event is set or the task is cancelled.
- :func:`run` — blocking: serve until SIGINT/SIGTERM (what ``dpsql serve`` calls).
- :func:`make_verifier` — a PostgreSQL-format SCRAM-SHA-256 verifier (for ``dpsql passwd``).
- :class:`ThreadedServer` — a server on a background thread (tests, notebooks).
"""

from .auth import make_verifier
from .protocol import DEFAULT_PORT
from .server import Server, ServerOptions, ThreadedServer, run, serve

__all__ = ["DEFAULT_PORT", "Server", "ServerOptions", "ThreadedServer", "make_verifier", "run", "serve"]
