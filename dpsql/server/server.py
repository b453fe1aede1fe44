"""The listening server: shared state for all connections, startup/shutdown, TLS, cancel routing."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dpsql.errors import Error, TooManyConnections
from dpsql.outer.admission import configure as sandbox_admission
from dpsql.version import __version__

from .cancels import CancelRoutes
from .catalog import CatalogShadow
from .connection import Connection
from .cpu_share import DEFAULT_SHARE as CPU_SHARE
from .cpu_share import CpuShare
from .frontdoor import LoginLimiter, PreAuth
from .limits import ShadowPool, WorkSlots
from .memory import (
    ANALYST_MEMORY,
    SERVER_MEMORY,
    SESSION_FLOOR,
    SESSION_MEMORY,
    STATEMENT_MEMORY,
    Memory,
    tune_allocator,
)
from .offload import Offload
from .protocol import DEFAULT_MAX_MESSAGE, DEFAULT_PORT

if TYPE_CHECKING:
    from dpsql.engine import Engine
    from dpsql.policy import Policy

log = logging.getLogger("dpsql.server")


class Reloader(Protocol):
    """What re-reads the policy on ``SIGHUP`` (:func:`dpsql.curator.reload.make_reloader`).

    Calling it builds the engine of the re-read policy (``current`` itself when unchanged) or raises
    to refuse it; :meth:`Server.reload` then swaps engine and catalog and only after that reports the
    outcome through :meth:`refused` or :meth:`applied`, so a reload reported done is visible everywhere
    (answers, NOTICEs, ``\\d+`` and comments)."""

    def __call__(self, current: Engine) -> Engine: ...

    def refused(self, error: BaseException) -> None: ...

    def applied(self, engine: Engine, changed: bool, warning: str | None) -> None: ...


GIL_SWITCH_INTERVAL = 0.0005
#: At shutdown, how long statements still running may finish (seconds).
SHUTDOWN_GRACE = 10.0
FALLBACK_SERVER_VERSION = "16.0"


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PostgreSQL DSN for the shadow catalog; None starts a throwaway local server; "" disables catalogs.
    catalog_dsn: str | None = None
    #: Listen before a local shadow catalog is up (started in a thread; ``dpsql serve`` does, issue #37).
    catalog_background: bool = False
    idle_timeout: float | None = None
    #: A session idle outside a transaction block while holding more than its reserved floor of memory
    #: (WITH HOLD cursors, portals, prepared statements) is ended after this (seconds; None/0: never).
    idle_holding_timeout: float | None = 120.0
    #: The most any statement may run, whatever the session sets (seconds; None/0: no cap).
    statement_timeout: float | None = 60.0
    #: A session's statement timeout until it runs SET statement_timeout (seconds; capped by the above).
    default_statement_timeout: float | None = 60.0
    #: A session idle inside a transaction block longer than this is terminated (seconds; None/0: never).
    idle_in_transaction_timeout: float | None = 600.0
    #: The whole startup (TLS, startup packet, authentication) must finish within this (authentication_timeout).
    startup_timeout: float = 10.0
    #: Sockets that have not authenticated yet: a budget apart from sessions, in all (None: twice
    #: max_connections) and per client address (None: max_connections); at a cap the oldest idle one
    #: is closed, never the newcomer (see :mod:`.frontdoor`).
    max_preauth: int | None = None
    max_preauth_per_address: int | None = None
    #: Wrong passwords: free ones per (account, address), the first and the longest lock (seconds), the
    #: longest a slowed-down (account, address)'s wrong password is held, its places (password checks at
    #: once: at most ``login_slots`` guesses per ``login_max_delay``), failures that lock an account (from
    #: new addresses) or an address (any account), their window.
    login_free_failures: int = 5
    login_lock: float = 1.0
    login_max_lock: float = 30.0
    login_max_delay: float = 16.0
    login_slots: int = 8
    login_account_failures: int = 30
    login_address_failures: int = 60
    login_window: float = 900.0
    max_message_size: int = DEFAULT_MAX_MESSAGE
    workers: int = 8
    #: Worker slots one analyst may hold at once (running or abandoned work); default: half the pool.
    analyst_workers: int | None = None
    #: Statements waiting for a worker slot, all clients together; beyond that 53400.
    max_queued: int = 256
    #: CPU-seconds per second an analyst may use while others are active (:mod:`.cpu_share`); the heaviest
    #: beyond it waits and runs one statement at a time (0: no cap).
    analyst_cpu_share: float = CPU_SHARE
    #: Post-processing sandboxes (:mod:`dpsql.outer.admission`, process-wide): their memory in all (MB;
    #: 256 MB each), how many one analyst may run at once, the CPU-seconds per second (0: unlimited) and
    #: the burst its sandboxes may use before its next one waits, how many may wait (beyond: 53400).
    sandbox_memory: int = 512
    sandbox_per_analyst: int = 1
    sandbox_cpu_rate: float = 0.5
    sandbox_cpu_burst: float = 30.0
    sandbox_max_waiting: int = 64
    max_connections: int = 100
    max_connections_per_analyst: int = 32
    #: Shadow-catalog connections shared by all clients, and how long a catalog query waits for one.
    catalog_pool: int = 10
    catalog_wait: float = 10.0
    max_prepared: int = 1000
    max_portals: int = 1000
    #: Open cursors (DECLARE) per session, and the released rows all of them may hold together.
    max_cursors: int = 100
    max_cursor_rows: int = 1_000_000
    max_settings: int = 1000
    max_setting_length: int = 8192
    #: Bytes held for clients (results being sent, portals, cursors, prepared statements): one
    #: statement's (54000 beyond), one session's, one analyst's sessions' and all sessions' (53200).
    max_statement_memory: int = STATEMENT_MEMORY
    max_session_memory: int = SESSION_MEMORY
    max_analyst_memory: int = ANALYST_MEMORY
    max_memory: int = SERVER_MEMORY
    #: Reserved for each authenticated session out of ``max_memory``, whatever the others hold.
    session_memory_floor: int = SESSION_FLOOR
    #: Refuse sessions that did not negotiate TLS (needs ``tls_cert``), as a ``hostssl`` pg_hba.conf line.
    require_tls: bool = False
    #: At shutdown, how long statements still running may finish (their charge is logged when they do).
    shutdown_grace: float = SHUTDOWN_GRACE
    #: Bytes buffered per connection before reads pause (asyncio StreamReader limit).
    read_buffer: int = 256 * 1024
    #: SO_REUSEPORT on the listening socket, so worker processes share the port (``--processes``).
    reuse_port: bool = False
    #: Under ``--processes``: this worker's index and the supervisor's directory of cancel sockets
    #: (:mod:`.cancels`: a CancelRequest reaching another worker is forwarded to this one).
    worker_index: int | None = None
    cancel_dir: str | None = None


def make_ssl_context(cert: str, key: str | None) -> ssl.SSLContext:
    """TLS ≥ 1.2 with ``cert`` (and ``key``; None: the key is in the certificate's file)."""
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
        #: Long statements are split and routed in a helper process (its own GIL): see offload.py.
        self.offload = Offload.shared()
        #: Sandbox admission is process-wide (memory is): the last server started sets its limits.
        self.sandboxes = sandbox_admission(
            options.sandbox_memory * 1024 * 1024,
            options.sandbox_per_analyst,
            options.sandbox_cpu_rate,
            options.sandbox_cpu_burst,
            options.sandbox_max_waiting,
        )
        #: Sockets still authenticating (their own budget), authenticated sessions per analyst.
        self.preauth = PreAuth(
            options.max_preauth or 2 * options.max_connections,
            options.max_preauth_per_address or options.max_connections,
        )
        self.per_analyst: dict[str, int] = {}
        self.logins = LoginLimiter(
            free_failures=options.login_free_failures,
            lock=options.login_lock,
            max_lock=options.login_max_lock,
            max_delay=options.login_max_delay,
            slots=options.login_slots,
            account_failures=options.login_account_failures,
            address_failures=options.login_address_failures,
            window=options.login_window,
        )
        self._slots: WorkSlots | None = None
        #: Every statement's CPU time, per analyst, with back-pressure (the cap on free work).
        self.cpu_share = CpuShare(options.analyst_cpu_share)
        #: Pool work not finished yet (awaited at shutdown so its real charge gets logged).
        self.inflight: set[asyncio.Future[Any]] = set()
        self.shadow_pool: ShadowPool | None = None
        self.ssl_context = make_ssl_context(options.tls_cert, options.tls_key) if options.tls_cert else None
        if options.require_tls and self.ssl_context is None:
            raise ValueError("require_tls needs tls_cert")
        self.shadow: CatalogShadow | None = None
        self.server_version = f"{FALLBACK_SERVER_VERSION} (dpsql {__version__})"
        self.connections: dict[int, Connection] = {}
        self._next_pid = 1000
        self.cancels = CancelRoutes(options.worker_index, options.cancel_dir)
        self.memory = Memory(
            options.max_statement_memory,
            options.max_session_memory,
            options.max_analyst_memory,
            options.max_memory,
            options.session_memory_floor,
        )
        tune_allocator()  # RSS follows what is held: large blocks go back to the OS when freed

    @property
    def slots(self) -> WorkSlots:
        """Created lazily, on the event loop that uses it."""
        if self._slots is None:
            opts = self.options
            share = opts.analyst_workers or max(1, opts.workers // 2)
            self._slots = WorkSlots(opts.workers, share, opts.max_queued)
        return self._slots

    def pool(self) -> ShadowPool:
        if self.shadow_pool is None:
            assert self.shadow is not None
            opts = self.options
            self.shadow_pool = ShadowPool(self.shadow, opts.catalog_pool, opts.catalog_wait)
        return self.shadow_pool

    @property
    def default_statement_timeout_ms(self) -> int:
        return self.statement_timeout_ms(round((self.options.default_statement_timeout or 0) * 1000))

    def statement_timeout_ms(self, wanted: int) -> int:
        """The timeout a statement runs under: the session's, never above the server's cap (0: none)."""
        cap = round((self.options.statement_timeout or 0) * 1000)
        if cap and (not wanted or wanted > cap):
            return cap
        return wanted

    def admit(self, user: str) -> None:
        """A newly authenticated session: refuse it (FATAL 53300) beyond the global or per-analyst cap.

        Only sessions count here: sockets still authenticating have their own budget (:attr:`preauth`)."""
        opts = self.options
        if len(self.connections) >= opts.max_connections:
            raise TooManyConnections("sorry, too many clients already")
        if self.per_analyst.get(user, 0) >= opts.max_connections_per_analyst:
            raise TooManyConnections(f'too many connections for role "{user}"')
        self.per_analyst[user] = self.per_analyst.get(user, 0) + 1

    def leave(self, user: str) -> None:
        count = self.per_analyst.get(user, 0) - 1
        if count > 0:
            self.per_analyst[user] = count
        else:
            self.per_analyst.pop(user, None)

    @property
    def catalog_available(self) -> bool:
        return self.shadow is not None and self.shadow.available

    def start_catalog(self) -> None:
        """Start the shadow catalog (blocking unless ``catalog_background``); on failure catalog queries get
        0A000, DP queries work."""
        if self.options.catalog_dsn == "":
            return
        shadow = CatalogShadow(self.policy, self.options.catalog_dsn)
        try:
            shadow.start(background=self.options.catalog_background)
        except Exception as exc:
            log.warning("catalog server unavailable, catalog queries will be refused: %s", exc)
            return
        self.shadow = shadow
        if shadow.server_version:
            # Clients pick catalog queries by server version, so advertise the shadow's own version.
            self.server_version = f"{shadow.server_version.split()[0]} (dpsql {__version__})"

    def use_engine(self, engine: Engine) -> None:
        """Serve a reloaded policy (``SIGHUP``): statements already running finish on the engine they
        started with (one policy per statement, never a mix); logins and statements from now on use
        ``engine``, which shares the backend, ledger and result cache (the budget carries on)."""
        self.engine = engine
        self.policy = engine.policy
        self.defaults = engine.policy.defaults

    def prepare_catalog(self, policy: Policy) -> CatalogShadow:
        """Blocking: a started shadow for a reloaded policy (raises when it cannot start). The current
        shadow keeps serving meanwhile; :meth:`swap_catalog` puts the new one in place."""
        shadow = CatalogShadow(policy, self.options.catalog_dsn)
        shadow.start()
        return shadow

    def swap_catalog(self, shadow: CatalogShadow | None) -> tuple[ShadowPool | None, CatalogShadow | None]:
        """On the event loop, in the same step as :meth:`use_engine`: serve ``shadow`` (None: refuse
        catalog queries with 0A000, as after a failed start) and return the old pool and shadow for
        :meth:`retire_catalog`. Never a stale catalog beside a new engine: \\d+ and the comments would
        show the old bounds and caps while answers already use the new ones."""
        old = self.shadow_pool, self.shadow
        self.shadow, self.shadow_pool = shadow, None
        return old

    @staticmethod
    def retire_catalog(old: tuple[ShadowPool | None, CatalogShadow | None]) -> None:
        """Blocking: close a swapped-out shadow; catalog queries still running on it may fail with 08006
        (DP queries are not affected)."""
        pool, shadow = old
        if pool is not None:
            pool.close()
        if shadow is not None:
            shadow.stop()

    def stop_catalog(self) -> None:
        if self.shadow_pool is not None:
            self.shadow_pool.close()
            self.shadow_pool = None
        if self.shadow is not None:
            self.shadow.stop()
            self.shadow = None

    def register(self, conn: Connection) -> int:
        self._next_pid += 1
        while self.cancels.pid_of(self._next_pid) in self.connections:  # after a wrap
            self._next_pid += 1
        pid = self.cancels.pid_of(self._next_pid)
        self.connections[pid] = conn
        return pid

    def unregister(self, conn: Connection) -> None:
        if self.connections.get(conn.pid) is conn:
            del self.connections[conn.pid]

    def cancel(self, pid: int, secret: int) -> None:
        owner = self.cancels.owner(pid)
        if owner is not None:  # another worker's connection: it checks the secret
            self.cancels.forward(owner, pid, secret)
            return
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
        #: Builds the engine of a re-read policy from the current one (``SIGHUP``); raises to refuse it.
        self.reloader: Reloader | None = None
        self._reloading: asyncio.Lock | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        """Start the catalog and begin listening; returns the bound port (useful with ``port=0``)."""
        # Statement analysis is CPU-bound Python in worker threads: with the default 5 ms GIL switch
        # interval, a few long statements add tens of milliseconds to every other client's reply.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL))
        await asyncio.get_running_loop().run_in_executor(self.ctx.executor, self.ctx.start_catalog)
        self._server = await asyncio.start_server(
            self._accept,
            self.options.host,
            self.options.port,
            limit=self.options.read_buffer,
            reuse_port=self.options.reuse_port or None,
        )
        self.ctx.cancels.listen(self.ctx.cancel)
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
        self._tasks.add(task)
        conn = Connection(self.ctx, reader, writer)
        # until it authenticates it holds a place in the pre-auth budget (which may evict an older one)
        conn.pending = self.ctx.preauth.enter(conn.address, conn.evict)
        if conn.pending is None:  # every other pending socket is an account mid-handshake: this one goes
            self._tasks.discard(task)
            conn.evict()
            return
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass  # server shutdown; the connection already said goodbye
        finally:
            self.ctx.preauth.leave(conn.pending)
            self._tasks.discard(task)

    async def reload(self) -> bool:
        """Re-read the policy (``SIGHUP``) without dropping a connection; a bad one is logged and refused
        and the previous policy keeps serving. Off the event loop; reloads never overlap.

        A policy that changes tables or analysts gets its shadow catalog started *before* the swap, and
        engine and catalog are swapped in one step on the event loop; only then is the reload reported
        (:meth:`Reloader.applied`), so ``dpsql reload``'s success means every surface shows the new policy.
        A catalog that cannot start never holds back the policy (it may revoke an analyst or tighten a
        bound): catalog queries are refused (0A000) rather than answered from the old policy's schema."""
        reloader = self.reloader
        if reloader is None:
            log.warning("reload requested, but this server has no policy file to re-read")
            return False
        if self._reloading is None:
            self._reloading = asyncio.Lock()
        loop = asyncio.get_running_loop()
        async with self._reloading:
            current = self.ctx.engine
            try:
                engine = await loop.run_in_executor(None, reloader, current)
            except Error as exc:
                detail = f"\n{exc.detail}" if exc.detail else ""
                log.error("policy reload refused, still serving the previous policy: %s%s", exc.message, detail)
                await loop.run_in_executor(None, reloader.refused, exc)
                return False
            except Exception as exc:
                log.exception("policy reload failed, still serving the previous policy")
                await loop.run_in_executor(None, reloader.refused, exc)
                return False
            if engine is current:
                log.info("policy reload: unchanged")
                await loop.run_in_executor(None, reloader.applied, engine, False, None)
                return True
            old, new = current.policy, engine.policy
            # a catalog that is down (a failed start or refresh) is retried: a reload is the operator's cue
            changed = old.tables != new.tables or old.analysts != new.analysts
            refresh = self.options.catalog_dsn != "" and (changed or self.ctx.shadow is None)
            shadow: CatalogShadow | None = None
            warning = None
            if refresh:
                try:
                    shadow = await loop.run_in_executor(None, self.ctx.prepare_catalog, new)
                except Exception as exc:
                    warning = f"the catalog server for the new policy did not start, catalog queries are refused: {exc}"
                    log.warning("%s", warning)
            self.ctx.use_engine(engine)  # engine and catalog in one step: no await in between
            retired = self.ctx.swap_catalog(shadow) if refresh else None
            log.info(
                "policy reloaded: %d tables, %d analysts; cached plans and results of the old policy are not used",
                len(new.tables),
                len(new.analysts),
            )
            if shadow is not None:
                log.info("catalog refreshed for the reloaded policy")
            await loop.run_in_executor(None, reloader.applied, engine, True, warning)
            if retired is not None:  # cleanup only: nothing reaches the old shadow any more
                try:
                    await loop.run_in_executor(None, self.ctx.retire_catalog, retired)
                except Exception as exc:
                    log.warning("the previous catalog server did not stop cleanly: %s", exc)
            return True

    async def stop(self) -> None:
        """Stop listening, terminate connections, stop the catalog server and the thread pool."""
        if self._server is not None:
            self._server.close()
        self.ctx.cancels.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        if self.ctx.inflight:  # statements already charged: let them finish so their charge is logged
            log.info("waiting for %d statement(s) still running", len(self.ctx.inflight))
            await asyncio.wait(list(self.ctx.inflight), timeout=self.options.shutdown_grace)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
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
    on_listening: Callable[[int], object] | None = None,
    reloader: Reloader | None = None,
    **options: Any,
) -> None:
    """Serve until ``stop`` is set (or the task is cancelled). See :class:`ServerOptions` for ``options``.

    ``on_listening`` is called with the bound port once the socket accepts connections (and the
    shadow catalog is up, unless it starts in the background), so a "serving" message never precedes
    the server. ``reloader`` re-reads the policy on ``SIGHUP`` (see :meth:`Server.reload`)."""
    server = Server(
        engine,
        ServerOptions(host=host, port=port, tls_cert=tls_cert, tls_key=tls_key, catalog_dsn=catalog_dsn, **options),
    )
    server.reloader = reloader
    if reloader is not None:
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[bool]] = set()

        def on_hup() -> None:
            task = loop.create_task(server.reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, on_hup)
    bound = await server.start()
    if on_listening is not None:
        on_listening(bound)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await server.stop()


#: After SIGTERM, how long the cleanup after the statements' grace may take (closing sockets, the catalog,
#: the ledger); past grace + this the process ends at once, whatever thread is still busy.
SHUTDOWN_MARGIN = 5.0


def shutdown_deadline(grace: float) -> float:
    """Seconds from SIGTERM until a ``dpsql serve`` process has ended, however stuck (README: Limits)."""
    return grace + SHUTDOWN_MARGIN


def _exit_by(seconds: float) -> None:
    """End this process ``seconds`` from now if it is still there: a worker thread stuck in a parse or a
    database call must not keep a stopped server alive (threads of the pool are joined at exit)."""

    def end() -> None:
        time.sleep(seconds)
        log.error("shutdown took longer than %.0f s: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=end, name="dpsql-exit-deadline", daemon=True).start()


def run(engine: Engine, host: str = "127.0.0.1", port: int = DEFAULT_PORT, **kwargs: Any) -> None:
    """Blocking entry point for the CLI: serve until SIGINT/SIGTERM, then shut down cleanly, within
    :func:`shutdown_deadline` of the signal (the process ends at the deadline whatever still runs)."""
    deadline = shutdown_deadline(float(kwargs.get("shutdown_grace", SHUTDOWN_GRACE)))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping() -> None:
            if not stop.is_set():
                _exit_by(deadline)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stopping)
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
