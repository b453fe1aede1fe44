"""The listening server: shared state for all connections, startup/shutdown, TLS, cancel routing."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsql import __version__

from .catalog import CatalogShadow
from .connection import Connection
from .protocol import DEFAULT_MAX_MESSAGE

if TYPE_CHECKING:
    from dpsql.engine import Engine

log = logging.getLogger("dpsql.server")

DEFAULT_PORT = 6543
FALLBACK_SERVER_VERSION = "16.0"


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PostgreSQL DSN for the shadow catalog; None starts a throwaway local server; "" disables catalogs.
    catalog_dsn: str | None = None
    idle_timeout: float | None = None
    statement_timeout: float | None = None
    startup_timeout: float = 60.0
    max_message_size: int = DEFAULT_MAX_MESSAGE
    workers: int = 8
    #: Bytes buffered per connection before reads pause (asyncio StreamReader limit).
    read_buffer: int = 256 * 1024


def make_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


class ServerContext:
    """State shared by all connections of one server."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.policy = engine.policy
        self.defaults = engine.policy.defaults
        self.database = engine.policy.dataset
        self.options = options
        self.executor = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="dpsql-query")
        self.ssl_context = make_ssl_context(options.tls_cert, options.tls_key) if options.tls_cert else None
        self.shadow: CatalogShadow | None = None
        self.server_version = f"{FALLBACK_SERVER_VERSION} (dpsql {__version__})"
        self.connections: dict[int, Connection] = {}
        self._next_pid = 1000

    @property
    def catalog_available(self) -> bool:
        return self.shadow is not None and self.shadow.available

    def start_catalog(self) -> None:
        """Blocking: start the shadow catalog; on failure catalog queries get 0A000, DP queries work."""
        if self.options.catalog_dsn == "":
            return
        shadow = CatalogShadow(self.policy, self.options.catalog_dsn)
        try:
            shadow.start()
        except Exception as exc:
            log.warning("catalog server unavailable, catalog queries will be refused: %s", exc)
            return
        self.shadow = shadow
        if shadow.server_version:
            # Clients pick catalog queries by server version, so advertise the shadow's own version.
            self.server_version = f"{shadow.server_version.split()[0]} (dpsql {__version__})"

    def stop_catalog(self) -> None:
        if self.shadow is not None:
            self.shadow.stop()
            self.shadow = None

    def register(self, conn: Connection) -> int:
        self._next_pid += 1
        self.connections[self._next_pid] = conn
        return self._next_pid

    def unregister(self, conn: Connection) -> None:
        if self.connections.get(conn.pid) is conn:
            del self.connections[conn.pid]

    def cancel(self, pid: int, secret: int) -> None:
        conn = self.connections.get(pid)
        if conn is not None and hmac.compare_digest(
            conn.secret.to_bytes(4, "big"), (secret & 0xFFFFFFFF).to_bytes(4, "big")
        ):
            log.info("cancel request pid=%d", pid)
            conn.cancel()


class Server:
    """An asyncio PostgreSQL-protocol server in front of one :class:`~dpsql.engine.Engine`."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.options = options
        self.ctx = ServerContext(engine, options)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        """Start the catalog and begin listening; returns the bound port (useful with ``port=0``)."""
        await asyncio.get_running_loop().run_in_executor(self.ctx.executor, self.ctx.start_catalog)
        self._server = await asyncio.start_server(
            self._accept, self.options.host, self.options.port, limit=self.options.read_buffer
        )
        log.info(
            "dpsql listening on %s:%d (server_version %s)",
            self.options.host,
            self.port,
            self.ctx.server_version,
        )
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await Connection(self.ctx, reader, writer).serve()
        except asyncio.CancelledError:
            pass  # server shutdown; the connection already said goodbye
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def stop(self) -> None:
        """Stop listening, terminate connections, stop the catalog server and the thread pool."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        await asyncio.get_running_loop().run_in_executor(None, self.ctx.stop_catalog)
        self.ctx.executor.shutdown(wait=False, cancel_futures=True)


async def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    catalog_dsn: str | None = None,
    stop: asyncio.Event | None = None,
    **options: Any,
) -> None:
    """Serve until ``stop`` is set (or the task is cancelled). See :class:`ServerOptions` for ``options``."""
    server = Server(
        engine,
        ServerOptions(host=host, port=port, tls_cert=tls_cert, tls_key=tls_key, catalog_dsn=catalog_dsn, **options),
    )
    await server.start()
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await server.stop()


def run(engine: Engine, host: str = "127.0.0.1", port: int = DEFAULT_PORT, **kwargs: Any) -> None:
    """Blocking entry point for the CLI: serve until SIGINT/SIGTERM, then shut down cleanly."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await serve(engine, host, port, stop=stop, **kwargs)

    asyncio.run(main())


class ThreadedServer:
    """A server on its own event loop in a daemon thread (tests, notebooks, embedding)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = Server(engine, ServerOptions(host=host, port=port, **options))
        self.thread = threading.Thread(target=self.loop.run_forever, name="dpsql-server", daemon=True)
        self.thread.start()
        self.host = host
        self.port: int = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=120)

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
