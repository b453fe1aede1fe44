"""One client connection: the message loop, statement routing and execution, simple query.

A small state machine: :mod:`.startup` (SSL/GSSENC negotiation, cancel requests,
StartupMessage, SCRAM or trust) → ready (message loop). Every statement is first *planned*
(:class:`~.extended.Statement`: empty / local / table-free / catalog / engine / mixed) and then
run; planning never runs a query, so Describe never spends budget. Engine and catalog work runs
in the server's thread pool so the event loop keeps serving other clients. The extended protocol's
stores live in :mod:`.extended`, session commands and the transaction status in :mod:`.commands`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from dpsql.analyze.parse import MAX_STATEMENT_CHARS
from dpsql.audit import Trace
from dpsql.errors import (
    AdminShutdown,
    ConfigurationLimitExceeded,
    ConnectionFailure,
    DuplicateCursor,
    Error,
    FeatureNotSupported,
    IdleInTransactionTimeout,
    IdleSessionTimeout,
    NoActiveTransaction,
    ProgramLimitExceeded,
    QueryCanceled,
    SyntaxError_,
)
from dpsql.errors import ProtocolViolation as StartupTimeout
from dpsql.session import Session

from . import protocol as pq
from .catalog import CatalogUnavailable, classify, refuse_mixed
from .commands import SessionCommands, TxStatus
from .extended import ExtendedProtocol, Portal, Statement, expand_formats
from .frontdoor import Pending
from .limits import Job, is_broken
from .local import Action, LocalCommand, LocalContext, Settings, evaluate_select, parse_local
from .memory import release_to_os, rows_size
from .protocol import Diagnostic, FieldDescription, ProtocolViolation
from .results import Outcome, engine_fields, engine_rows, noisy_flags, result_notices
from .sqltext import after_keyword, split_statements, strip_comments
from .startup import startup
from .types import decode_param, encode_value, type_size

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger("dpsql.server")

__all__ = ["Connection", "Portal", "Statement"]

#: Reply bytes written between two drains of the socket (backpressure from slow clients): a client
#: that does not read stops the server producing more, whatever the size of its rows.
_DRAIN_BYTES = 256 * 1024
#: Statements longer than this are split, parsed and routed in the worker pool, not on the event loop.
_INLINE_SQL = 4096


def _too_long(sql: str) -> Error:
    return ProgramLimitExceeded(
        f"statement is too long ({len(sql)} characters; at most {MAX_STATEMENT_CHARS})",
        hint="Shorten the statement: fewer constants in IN lists, fewer aggregates.",
    )


class Connection:
    """Serves one socket until Terminate, EOF, a FATAL error or server shutdown."""

    def __init__(self, ctx: ServerContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ctx = ctx
        self.reader = reader
        self.writer = writer
        self.pid = 0
        self.secret = secrets.randbits(31)
        self.session: Session | None = None
        self.settings: Settings | None = None
        self.user = ""
        self.extended = ExtendedProtocol(self)
        self.commands = SessionCommands(self.extended.statements, self.extended.portals)
        self.commands.engine = ctx.engine  # SHOW dpsql.budget
        self.ignore_till_sync = False
        self._cancel = asyncio.Event()
        #: Work of this connection still running in the pool (abandoned or not), interrupted on close.
        self._jobs: set[Job] = set()
        self.admitted = False
        #: Set when the statement being executed was abandoned and will be logged when it ends.
        self._late = False
        #: When the current message's statement timeout expires (loop time), None: no timeout.
        self._deadline: float | None = None
        self.tls = False
        #: Its place in the pre-auth budget until it authenticates (set by the server).
        self.pending: Pending | None = None
        #: The bytes this session holds (:mod:`.memory`); ``_wire``: a large reply not yet drained.
        self.memory = ctx.memory.session()
        self._wire = self.memory.hold("reply")
        self._unflushed = 0

    @property
    def address(self) -> str:
        """The client's address (without the port): the key of the per-address limits."""
        info = self.writer.get_extra_info("peername")
        return str(info[0]) if isinstance(info, tuple) and info else "?"

    def authenticated(self) -> None:
        """Authentication succeeded: the socket leaves the pre-auth budget for the sessions' one."""
        if self.pending is not None:
            self.ctx.preauth.leave(self.pending)

    def startup_received(self) -> None:
        if self.pending is not None:
            self.pending.stage = 1

    def evict(self) -> None:
        """Closed to make room in the pre-auth budget: say so (53300) and hang up; the read the
        connection waits on then ends and it cleans up as after any disconnect."""
        hint = "Too many connections from this address have not authenticated yet."
        diag = Diagnostic("FATAL", "53300", "sorry, too many clients already", None, hint)
        with contextlib.suppress(Exception):
            self.writer.write(pq.error_response(diag))
        self.writer.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.writer.write(data)
        self._unflushed += len(data)

    async def flush(self) -> None:
        """Wait until the socket buffer has drained below asyncio's high-water mark (at once when it
        is below already): until the client reads, nothing more is produced for it."""
        await self.writer.drain()
        self._unflushed = 0
        if self._wire.nbytes:
            self._wire.give_back()

    def send_error(self, exc: BaseException, severity: str | None = None) -> Diagnostic:
        diag = self.diagnostic(exc, severity)
        self.send(pq.error_response(diag))
        return diag

    @staticmethod
    def diagnostic(exc: BaseException, severity: str | None = None) -> Diagnostic:
        if isinstance(exc, ProtocolViolation):
            return Diagnostic("FATAL", "08P01", str(exc))
        if isinstance(exc, Error) and exc.sqlstate != "XX000":
            sev = severity or str(getattr(exc, "severity", "ERROR"))
            return Diagnostic(sev, exc.sqlstate, exc.message, exc.detail, exc.hint, exc.position)
        # anything unexpected: the details (and the traceback) go to the operator's log only
        log.error("internal error", exc_info=exc)
        return Diagnostic(severity or "ERROR", "XX000", "internal error")

    async def run_blocking(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_ms: int = 0,
        on_done: Callable[[Any], None] | None = None,
        on_late: Callable[[Any], None] | None = None,
        pure: bool = False,
        checkout: Callable[[], Awaitable[object]] | None = None,
    ) -> Any:
        """Run ``fn`` in the pool under this analyst's fair share of worker slots.

        The statement timeout covers the wait for a slot and the run. A CancelRequest, the
        timeout or the client going away interrupts the backend statement when the backend
        allows it; the slot stays taken until the work has really stopped. ``on_done`` runs
        (on the loop) exactly once: when the work finishes, whoever still waits for it, or with
        None when it never started. ``on_late`` runs only if nobody waits for the work any more.
        ``checkout`` is awaited once the slot is held, before ``fn`` starts (a shared resource such
        as a catalog connection is then held for the run only, never while waiting for a slot);
        ``on_done`` gives it back.
        """
        loop = asyncio.get_running_loop()
        self._cancel.clear()
        deadline = loop.time() + timeout_ms / 1000 if timeout_ms > 0 else None
        if self._deadline is not None:  # the statement timeout runs from the message's arrival
            deadline = self._deadline if deadline is None else min(deadline, self._deadline)

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        slots, user = self.ctx.slots, self.user or "?"
        waiter: asyncio.Future[Any] = asyncio.ensure_future(self._cancel.wait())
        try:
            admission = asyncio.ensure_future(slots.acquire(user))
            try:
                try:
                    done, _ = await asyncio.wait(
                        {admission, waiter}, timeout=remaining(), return_when=asyncio.FIRST_COMPLETED
                    )
                except BaseException:
                    _drop_admission(admission, slots, user)
                    raise
                if admission not in done:
                    _drop_admission(admission, slots, user)
                    raise self._canceled()
                admission.result()  # 53400 when the queue is full
                if checkout is not None:
                    await self._checkout(checkout, waiter, remaining(), slots, user)
                job = Job(pure)
                self._jobs.add(job)
                try:
                    future = loop.run_in_executor(self.ctx.executor, job.run, fn, *args)
                except BaseException:
                    self._jobs.discard(job)
                    slots.release(user)
                    raise
            except BaseException:
                if on_done is not None:
                    on_done(None)
                raise

            def finished(f: asyncio.Future[Any]) -> None:
                slots.release(user)
                self._jobs.discard(job)
                self.ctx.inflight.discard(f)
                if on_done is not None:
                    on_done(f)

            self.ctx.inflight.add(future)
            future.add_done_callback(finished)
            try:
                waiting: set[asyncio.Future[Any]] = {future, waiter}
                done, _ = await asyncio.wait(waiting, timeout=remaining(), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                self._abandon(job, future, on_late)
                raise
            if future in done:
                return future.result()
            self._abandon(job, future, on_late)
            raise self._canceled()
        finally:
            waiter.cancel()

    async def _checkout(
        self,
        checkout: Callable[[], Awaitable[object]],
        waiter: asyncio.Future[Any],
        timeout: float | None,
        slots: Any,
        user: str,
    ) -> None:
        """Await ``checkout`` while holding a worker slot; on failure, cancel or timeout give the slot back."""
        got = asyncio.ensure_future(checkout())
        try:
            done, _ = await asyncio.wait({got, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if got not in done:
                raise self._canceled()
            got.result()
        except BaseException:
            got.cancel()  # its own cleanup gives back whatever it had not handed over yet
            slots.release(user)
            raise

    def _canceled(self) -> QueryCanceled:
        if self._cancel.is_set():
            return QueryCanceled("canceling statement due to user request")
        return QueryCanceled("canceling statement due to statement timeout")

    def _abandon(self, job: Job, future: asyncio.Future[Any], on_late: Callable[[Any], None] | None) -> None:
        """Nobody waits for ``future`` any more: stop its backend statement if possible, log its end."""
        if not future.done():
            asyncio.get_running_loop().run_in_executor(None, job.interrupt)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # silence late failures
        if on_late is not None:
            self._late = True
            future.add_done_callback(on_late)

    def cancel(self) -> None:
        self._cancel.set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            try:
                async with asyncio.timeout(self.ctx.options.startup_timeout or None):
                    started = await startup(self)
            except TimeoutError:
                log.info("authentication timeout from %s", self.peer)
                raise StartupTimeout("canceling authentication due to timeout").fatal() from None
            if started:
                await self.message_loop()
        except ProtocolViolation as exc:
            log.info("protocol violation from %s: %s", self.peer, exc)
            self._send_fatal(exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            self._send_fatal(AdminShutdown("terminating connection due to administrator command"))
            raise
        except Exception as exc:  # the server must survive anything one client does
            if not (isinstance(exc, Error) and exc.severity == "FATAL"):
                log.exception("connection error")
            self._send_fatal(exc)
        finally:
            await self.close()

    @property
    def peer(self) -> str:
        info = self.writer.get_extra_info("peername")
        return f"{info[0]}:{info[1]}" if isinstance(info, tuple) else "?"

    def _send_fatal(self, exc: BaseException) -> None:
        with contextlib.suppress(Exception):
            self.send_error(exc, "FATAL")

    async def close(self) -> None:
        self.ctx.unregister(self)
        if self.admitted:
            self.admitted = False
            self.ctx.leave(self.user)
        loop = asyncio.get_running_loop()
        for job in list(self._jobs):  # the client is gone: its statements need not finish
            loop.run_in_executor(None, job.interrupt)
        # everything the session held goes now, not when the connection object happens to be collected
        self.extended.portals.clear()
        self.extended.statements.clear()
        self.commands.cursors.clear()
        self.memory.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.drain(), 2)
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)
        transport = self.writer.transport
        if transport.get_write_buffer_size():  # a client that does not read: drop what it never will
            transport.abort()
        self.trim_memory()

    def trim_memory(self) -> None:
        """Once a lot was given back (a large result sent, a session gone), hand free memory back to
        the OS so RSS falls again (in a thread: it may take a few milliseconds)."""
        if self.ctx.memory.trim_due():
            asyncio.get_running_loop().run_in_executor(None, release_to_os)

    # -- message loop ------------------------------------------------------------------------------

    async def message_loop(self) -> None:
        idle = self.ctx.options.idle_timeout
        self.memory.analyst = self.user
        while True:
            in_tx = (
                self.commands.tx is not TxStatus.IDLE
                and self.settings is not None
                and self.settings.idle_in_transaction_ms > 0
            )
            wait = self.settings.idle_in_transaction_ms / 1000 if in_tx and self.settings else idle
            try:
                type_, payload = await asyncio.wait_for(
                    pq.read_message(self.reader, self.ctx.options.max_message_size), wait
                )
            except TimeoutError:
                if in_tx:
                    raise IdleInTransactionTimeout(
                        "terminating connection due to idle-in-transaction timeout"
                    ).fatal() from None
                raise IdleSessionTimeout("terminating connection due to idle-session timeout").fatal() from None
            msg = pq.parse_message(type_, payload)
            if isinstance(msg, pq.Terminate):
                return
            if self.ignore_till_sync and not isinstance(msg, pq.Sync):
                continue
            await self.dispatch(msg)
            # the next message is read only once this one's replies are on their way: a client that
            # pipelines without reading is not served further (as PostgreSQL, which blocks in send)
            await self.flush()
            self.trim_memory()

    async def dispatch(self, msg: pq.FrontendMessage) -> None:
        timeout = self.timeout_ms()
        self._deadline = asyncio.get_running_loop().time() + timeout / 1000 if timeout else None
        if isinstance(msg, pq.Query):
            await self.simple_query(msg.sql)
        elif isinstance(msg, pq.Sync):
            self.ignore_till_sync = False
            self.extended.sync(self.commands)
            self.send(pq.ready_for_query(self.commands.tx))
            await self.flush()
        elif isinstance(msg, pq.Flush):
            await self.flush()
        elif isinstance(msg, pq.PasswordData):
            raise ProtocolViolation("unexpected password message")
        elif isinstance(msg, pq.Unsupported):
            await self._extended_error(FeatureNotSupported("COPY and function calls are not supported by dpsql"))
        else:
            try:
                await self.extended.handle(msg)
            except ProtocolViolation:
                raise
            except Exception as exc:
                await self._extended_error(exc)

    # -- planning and running ----------------------------------------------------------------------

    async def plan_async(self, sql: str) -> Statement:
        """:meth:`plan`, in the worker pool unless the statement is short (parsing can take seconds)."""
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return self.plan(sql)
        stmt: Statement = await self.run_blocking(self.plan, sql, timeout_ms=self.timeout_ms(), pure=True)
        return stmt

    async def split(self, sql: str) -> list[str]:
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return split_statements(sql)
        parts: list[str] = await self.run_blocking(
            self.ctx.offload.split, self.user or "?", sql, timeout_ms=self.timeout_ms(), pure=True
        )
        return parts

    def evaluate_local(self, sql: str) -> Any:
        """A table-free SELECT answered here; long ones go to the shadow (parsed off the event loop)."""
        if len(sql) > _INLINE_SQL:
            return None
        return evaluate_select(sql, self._local_context())

    def plan(self, sql: str) -> Statement:
        """Route a single statement without running anything (a long one's parsing in the helper
        process, :mod:`.offload`: this thread only waits, so it never holds the GIL for long)."""
        long = len(sql) > _INLINE_SQL
        if not long and not split_statements(sql):
            return Statement(sql, "empty")
        command = parse_local(sql)
        if command is not None:
            return Statement(sql, "local", command)
        if (problem := _explain_syntax(sql)) is not None:
            raise SyntaxError_(problem)  # as PostgreSQL, never an internal error
        if not long:
            return Statement(sql, classify(sql, self.ctx.policy))
        route = self.ctx.offload.classify(self.user or "?", sql, frozenset(self.ctx.policy.tables))
        return Statement(sql, "empty" if route == "empty" else route)  # type: ignore[arg-type]

    async def execute(self, stmt: Statement, portal: Portal | None = None) -> Outcome:
        """Run a planned statement; logs one line with analyst, fingerprint, ε, outcome and latency."""
        started = time.monotonic()
        outcome: Outcome | None = None
        state, charged = "ok", 0.0
        self._late = False
        try:
            self.commands.check_not_failed(stmt.command)
            outcome = await self._execute(stmt, portal)
            return outcome
        except asyncio.CancelledError:
            state = "57P01"
            raise
        except BaseException as exc:
            state = exc.sqlstate if isinstance(exc, Error) else "XX000"
            charged = exc.charged_epsilon if isinstance(exc, Error) else 0.0
            raise
        finally:
            if not self._late:  # else logged when the engine work ends, with what it really charged
                self._log_query(stmt, outcome.epsilon if outcome else charged, state, started)

    def audit_refusal(self, sql: str, sqlstate: str, started: float) -> None:
        """Record a statement refused before the engine saw it (catalog guard, mixed routes, Parse):
        free, but a curator spotting a probing analyst needs it in the audit. Never raises."""
        self.ctx.engine.audit.record(Trace(sql, self.user, started), sqlstate)

    def _log_query(self, stmt: Statement, epsilon: float, state: str, started: float, note: str = "") -> None:
        if state != "ok" and stmt.route in ("catalog", "mixed", "tableless"):  # the engine audits its own
            self.audit_refusal(stmt.sql, state, started)
        level = logging.DEBUG if stmt.route in ("local", "empty", "tableless") else logging.INFO
        log.log(
            level,
            "query analyst=%s fingerprint=%s route=%s epsilon=%g outcome=%s latency_ms=%.1f%s",
            self.user,
            self.ctx.engine.fingerprint(stmt.sql),  # keyed, of the shape: never the constants
            stmt.route,
            epsilon,
            state,
            (time.monotonic() - started) * 1000,
            note,
        )

    async def _execute(self, stmt: Statement, portal: Portal | None) -> Outcome:
        if stmt.route == "empty":
            return Outcome(None, [], "")
        if stmt.route == "local":
            assert stmt.command is not None
            if stmt.command.action is Action.DECLARE:
                return await self._declare(stmt, portal)
            return self.commands.run(stmt.command)
        if stmt.route == "mixed":
            raise refuse_mixed()
        if stmt.route == "tableless" and not (portal and portal.params):
            values = self.evaluate_local(stmt.sql)
            if values is not None:
                fields = [FieldDescription(v.name, v.type_oid, type_size(v.type_oid)) for v in values]
                return Outcome(fields, [tuple(v.value for v in values)], "SELECT 1")
        if stmt.route in ("tableless", "catalog"):
            return await self._run_catalog(stmt, portal)
        return await self._run_engine(stmt, portal)

    # -- cursors -----------------------------------------------------------------------------------

    async def _cursor_query(self, stmt: Statement) -> Statement:
        """The query of ``DECLARE … FOR <query>``, planned like any statement (same routes, same refusals;
        a long one off the event loop)."""
        assert stmt.command is not None and stmt.command.value is not None
        inner = await self.plan_async(stmt.command.value)
        if inner.route in ("local", "empty"):
            raise SyntaxError_("DECLARE CURSOR needs a query")
        inner.param_oids = list(stmt.param_oids)
        return inner

    async def describe_local(self, stmt: Statement) -> None:
        """Parse of a session statement: DECLARE describes its query (parameter types), nothing runs."""
        if stmt.command is not None and stmt.command.action is Action.DECLARE:
            inner = await self._cursor_query(stmt)
            await self.extended.describe_statement(inner)
            stmt.param_oids = inner.param_oids

    def _check_declare(self, cmd: LocalCommand) -> None:
        """Everything DECLARE refuses, checked before its query runs (so before any charge)."""
        assert cmd.declare is not None
        if self.commands.tx is TxStatus.IDLE and not cmd.declare.hold:
            raise NoActiveTransaction("DECLARE CURSOR can only be used in transaction blocks")
        if cmd.name in self.commands.cursors:
            raise DuplicateCursor(f'cursor "{cmd.name}" already exists')
        limit = self.ctx.options.max_cursors
        if len(self.commands.cursors) >= limit:
            raise ConfigurationLimitExceeded(
                f"too many open cursors in this session (at most {limit})",
                hint="CLOSE cursors that are no longer needed; COMMIT or ROLLBACK closes them all.",
            )

    async def _declare(self, stmt: Statement, portal: Portal | None) -> Outcome:
        """``DECLARE name CURSOR FOR <query>``: run the query once, exactly as if sent alone (same
        analysis, refusals, single charge, audit row and log line), and keep its released rows.

        Privacy: the cursor holds only released (noised, charged) values, so FETCH and MOVE are
        post-processing. The refusals here depend on the session and the policy only; the
        buffered-rows cap depends on the number of released rows, itself a DP output.
        """
        cmd = stmt.command
        assert cmd is not None and cmd.declare is not None
        self._check_declare(cmd)
        inner = await self._cursor_query(stmt)
        if cmd.declare.binary and inner.route in ("catalog", "tableless") and self.evaluate_local(inner.sql) is None:
            raise FeatureNotSupported("DECLARE BINARY is not supported for catalog queries")
        inner_portal = None
        if portal is not None and portal.params:
            inner_portal = Portal(inner, portal.params, portal.param_formats, (), portal.show_intervals)
        outcome = await self.execute(inner, inner_portal)
        try:
            if outcome.fields is None:
                raise SyntaxError_("DECLARE CURSOR needs a query that returns rows")
            held = sum(len(c.rows) for c in self.commands.cursors.values()) + len(outcome.rows)
            limit = self.ctx.options.max_cursor_rows
            if held > limit:
                raise ConfigurationLimitExceeded(
                    f"cursors would hold too many rows ({held}; at most {limit} in all open cursors of a session)",
                    hint="The query was answered and charged; add LIMIT, or CLOSE other cursors first.",
                )
            declared = self.commands.declared(cmd.name, outcome, cmd)
            if (hold := outcome.take_hold()) is not None:  # the cursor keeps the rows, and their bytes
                hold.what = "cursor"
                self.commands.cursors.attach(cmd.name, hold)
            return declared
        finally:
            outcome.release()

    def _local_context(self) -> LocalContext:
        assert self.settings is not None
        return LocalContext(self.user, self.ctx.database, self.ctx.server_version, self.pid, self.settings.get)

    async def shadow_call(self, method: str, *args: Any, timeout_ms: int = 0, **kwargs: Any) -> Any:
        """Run one call on a pooled shadow connection; it returns to the pool when the call has ended."""
        if not self.ctx.catalog_available:
            raise CatalogUnavailable()
        pool = self.ctx.pool()
        user = self.user
        held: list[Any] = []

        async def checkout() -> None:
            """A pooled connection, taken only once the worker slot is held."""
            try:
                held.append(await pool.acquire(user))
            except Error:
                raise
            except Exception as exc:
                log.warning("cannot connect to the catalog server: %s", exc)
                raise ConnectionFailure(
                    "could not connect to the catalog server",
                    hint="DP queries still work; retry catalog queries later.",
                ) from None

        def checkin(_f: Any) -> None:
            if held:
                pool.release(user, held.pop())

        def call() -> Any:
            session = held[0]
            job = Job.current()
            session.arm()
            try:
                with job.stoppable(session.cancel) if job else contextlib.nullcontext():
                    return getattr(session, method)(*args, **kwargs)
            except Exception as exc:
                if is_broken(session):
                    log.warning("catalog server connection lost: %s", exc)
                    raise ConnectionFailure(
                        "the connection to the catalog server was lost",
                        hint="DP queries still work; retry catalog queries later.",
                    ) from None
                raise

        return await self.run_blocking(call, timeout_ms=timeout_ms, on_done=checkin, checkout=checkout)

    async def _run_catalog(self, stmt: Statement, portal: Portal | None) -> Outcome:
        if portal is None:
            args: tuple[Any, ...] = (stmt.sql,)
        else:
            args = (stmt.sql, portal.params, stmt.param_oids, portal.param_formats, portal.result_formats)
        # the rows' bytes are taken while they are read: a result the session cannot hold is cut there
        hold = self.memory.hold("result")
        try:
            res = await self.shadow_call("execute", *args, timeout_ms=self.timeout_ms(), reserve=hold.grow)
        except BaseException:
            hold.release()
            raise
        return Outcome(res.fields, res.rows, res.tag, encoded=True, hold=hold)

    def timeout_ms(self) -> int:
        if self.settings is None:
            return self.ctx.default_statement_timeout_ms
        return self.ctx.statement_timeout_ms(self.settings.statement_timeout_ms)

    def decode_params(self, stmt: Statement, portal: Portal | None) -> list[Any] | None:
        if portal is None or not portal.params:
            return None
        formats = expand_formats(portal.param_formats, len(portal.params))
        oids = stmt.param_oids + [0] * (len(portal.params) - len(stmt.param_oids))
        return [decode_param(v, oid, fmt) for v, oid, fmt in zip(portal.params, oids, formats, strict=True)]

    def confidence(self) -> float:
        assert self.session is not None
        return self.session.confidence or self.ctx.defaults.confidence

    async def _run_engine(self, stmt: Statement, portal: Portal | None) -> Outcome:
        assert self.session is not None and self.settings is not None
        params = self.decode_params(stmt, portal)
        show = portal.show_intervals if portal is not None else self.settings.show_intervals
        engine, session, sql = self.ctx.engine, self.session, stmt.sql

        def work() -> tuple[Any, list[bool] | None, list[tuple[Any, ...]], int]:
            result = engine.execute(sql, session, params)
            flags = noisy_flags(result.columns) if show and result.command_tag == "SELECT" else None
            rows = engine_rows(result, flags)
            return result, flags, rows, rows_size(rows)  # released rows only: post-processing

        started = time.monotonic()

        def late(f: asyncio.Future[Any]) -> None:
            """The client stopped waiting (timeout, cancel, disconnect, shutdown): log what it cost anyway."""
            note = " (finished after the client stopped waiting)"
            if f.cancelled():
                self._log_query(stmt, 0.0, "57014", started, " (never started)")
            elif (exc := f.exception()) is not None:
                self._log_query(stmt, 0.0, exc.sqlstate if isinstance(exc, Error) else "XX000", started, note)
            else:
                self._log_query(stmt, f.result()[0].epsilon_spent, "ok", started, note)

        result, flags, rows, size = await self.run_blocking(work, timeout_ms=self.timeout_ms(), on_late=late)
        try:
            hold = self.memory.hold("result", size)
        except Error as exc:  # too large to hold: refused after the charge, as the cursor row cap
            exc.charged_epsilon = result.epsilon_spent
            exc.hint = f"The query was answered and charged. {exc.hint or ''}".strip()
            raise
        fields = engine_fields(result.columns, flags, self.confidence())
        tag = f"SELECT {len(result.rows)}" if result.command_tag == "SELECT" else result.command_tag
        outcome = Outcome(fields, rows, tag, epsilon=result.epsilon_spent, hold=hold)
        outcome.notices = result_notices(result, self.confidence(), per_row=flags is None)
        return outcome

    # -- sending results ---------------------------------------------------------------------------

    async def send_rows(self, outcome: Outcome, rows: Sequence[tuple[Any, ...]], formats: Sequence[int]) -> None:
        """DataRow messages, drained every ``_DRAIN_BYTES``: a large result streams to the client with
        backpressure instead of piling up, encoded, in the socket buffer. A single message larger
        than that is a second copy of its row until the client reads it: its bytes are held
        (53200 when the session cannot, the reply then ends with the error)."""
        assert outcome.fields is not None
        oids = [f.type_oid for f in outcome.fields]
        for row in rows:
            cells = (
                row if outcome.encoded else [encode_value(v, o, f) for v, o, f in zip(row, oids, formats, strict=True)]
            )
            message = pq.data_row(cells)
            del cells
            if len(message) > _DRAIN_BYTES:
                self._wire.grow(len(message))
            self.send(message)
            del message  # the socket buffer's copy is the only one while we wait for the client
            if self._unflushed >= _DRAIN_BYTES:
                await self.flush()

    def send_side_effects(self, outcome: Outcome) -> None:
        for name, value in outcome.status:
            self.send(pq.parameter_status(name, value))
        for notice in outcome.notices:
            self.send(pq.notice_response(notice))

    # -- simple query ------------------------------------------------------------------------------

    async def simple_query(self, sql: str) -> None:
        try:
            statements = await self.split(sql)
        except Exception as exc:
            self.send_error(exc)
            self.commands.fail()
            statements = None
        if statements == []:
            self.send(pq.empty_query_response())
        for text in statements or ():
            try:
                stmt = await self.plan_async(text)
                outcome = await self.execute(stmt)
            except Exception as exc:
                self.send_error(exc)
                self.commands.fail()
                break
            try:
                self.send_side_effects(outcome)
                if outcome.fields is not None:
                    self.send(pq.row_description(outcome.fields))
                    await self.send_rows(outcome, outcome.rows, [0] * len(outcome.fields))
                self.send(pq.command_complete(outcome.tag))
            except Error as exc:  # a reply too large to hold in the socket buffer (53200)
                self.send_error(exc)
                self.commands.fail()
                break
            finally:
                outcome.release()
            # each statement's reply drains before the next statement runs: many statements in one
            # message never pile their replies up in the socket buffer of a client that does not read
            await self.flush()
        self.send(pq.ready_for_query(self.commands.tx))
        await self.flush()

    # -- extended query ----------------------------------------------------------------------------

    async def _extended_error(self, exc: BaseException) -> None:
        self.send_error(exc)
        self.commands.fail()
        self.ignore_till_sync = True


def _explain_syntax(sql: str) -> str | None:
    """PostgreSQL's syntax error for ``EXPLAIN`` with no statement after it (or its options), or with
    another ``EXPLAIN`` as its statement; None for anything else."""
    rest = after_keyword(sql, "explain")
    if rest is None:
        return None
    rest = strip_comments(rest).strip().rstrip(";").strip()
    if rest.startswith("("):
        rest = rest[rest.find(")") + 1 :].strip() if ")" in rest else ""
    if not rest:
        return "syntax error at end of input"
    if after_keyword(rest, "explain") is not None:
        return 'syntax error at or near "EXPLAIN"'
    return None


def _drop_admission(admission: asyncio.Future[None], slots: Any, user: str) -> None:
    """Give back a worker slot whose statement will not run (or stop waiting for it)."""
    if not admission.done():
        admission.cancel()  # the acquire coroutine releases whatever it already holds
    elif not admission.cancelled() and admission.exception() is None:
        slots.release(user)
