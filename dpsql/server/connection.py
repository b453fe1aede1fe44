"""One client connection: startup, authentication, then the simple and extended query protocols.

The connection is a small state machine: ``startup`` (SSL/GSSENC negotiation, cancel requests,
StartupMessage, SCRAM or trust) → ``ready`` (message loop). Every statement is first
*planned* (:class:`Statement`: empty / local / table-free / catalog / engine / mixed) and then
run; planning never runs a query, so Describe never spends budget. Engine and catalog work runs
in the server's thread pool so the event loop keeps serving other clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpsql.analyze.parse import MAX_STATEMENT_CHARS
from dpsql.errors import Error, FeatureNotSupported, ProgramLimitExceeded, QueryCanceled
from dpsql.session import OutputColumn, Session

from . import protocol as pq
from .auth import AuthFailed, ScramExchange, ScramProtocolError, Verifier, mock_exchange, parse_sasl_initial
from .catalog import CatalogUnavailable, classify, refuse_mixed
from .limits import ConfigurationLimitExceeded, Job, is_broken
from .local import (
    REPORTED,
    ActiveTransaction,
    FailedTransaction,
    LocalCommand,
    LocalContext,
    NoActiveTransaction,
    Settings,
    default_gucs,
    evaluate_select,
    parse_local,
)
from .protocol import Diagnostic, FieldDescription, ProtocolViolation
from .results import Outcome, engine_fields, engine_rows, noisy_flags, result_notices
from .sqltext import split_statements
from .types import decode_param, encode_value, oid_for, type_size

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger("dpsql.server")

TEXT = 25


class Fatal(Error):
    severity = "FATAL"


@dataclass(slots=True)
class Statement:
    """A planned statement (a prepared statement in the extended protocol)."""

    sql: str
    route: str  # empty | local | tableless | catalog | engine | mixed
    command: LocalCommand | None = None
    param_oids: list[int] = field(default_factory=list)
    engine_columns: list[OutputColumn] | None = None
    catalog_fields: list[FieldDescription] | None = None
    noisy: list[bool] | None = None


@dataclass(slots=True)
class Portal:
    statement: Statement
    params: tuple[bytes | None, ...] = ()
    param_formats: tuple[int, ...] = ()
    result_formats: tuple[int, ...] = ()
    show_intervals: bool = False
    outcome: Outcome | None = None
    sent: int = 0


def _expand(formats: Sequence[int], n: int) -> list[int]:
    if not formats:
        return [0] * n
    if len(formats) == 1:
        return [formats[0]] * n
    if len(formats) != n:
        raise Error(f"bind message has {len(formats)} result formats but query has {n} columns", sqlstate="08P01")
    return list(formats)


def _check_formats(formats: Sequence[int]) -> None:
    if any(f not in (0, 1) for f in formats):
        raise ProtocolViolation("unsupported format code")


_EXPLAIN_PREFIX = re.compile(r"^\s*explain\s+", re.IGNORECASE)
#: Rows sent between two flushes of a large result (backpressure from slow clients).
_STREAM_BATCH = 1024
#: Statements longer than this are split, parsed and routed in the worker pool, not on the event loop.
_INLINE_SQL = 4096


class ShadowLost(Error):
    sqlstate = "08006"


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
        self.tx = "I"
        self.savepoints: list[str] = []
        self.statements: dict[str, Statement] = {}
        self.portals: dict[str, Portal] = {}
        self.ignore_till_sync = False
        self._cancel = asyncio.Event()
        #: Work of this connection still running in the pool (abandoned or not), interrupted on close.
        self._jobs: set[Job] = set()
        self._admitted = False
        #: Set when the statement being executed was abandoned and will be logged when it ends.
        self._late = False
        #: When the current message's statement timeout expires (loop time), None: no timeout.
        self._deadline: float | None = None
        self._tls = False

    # -- plumbing ---------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def flush(self) -> None:
        await self.writer.drain()

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
    ) -> Any:
        """Run ``fn`` in the pool under this analyst's fair share of worker slots.

        The statement timeout covers the wait for a slot and the run. A CancelRequest, the
        timeout or the client going away interrupts the backend statement when the backend
        allows it; the slot stays taken until the work has really stopped. ``on_done`` runs
        (on the loop) exactly once: when the work finishes, whoever still waits for it, or with
        None when it never started. ``on_late`` runs only if nobody waits for the work any more.
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
                    started = await self.startup()
            except TimeoutError:
                log.info("authentication timeout from %s", self.peer)
                raise Fatal("canceling authentication due to timeout", sqlstate="08P01") from None
            if started:
                await self.message_loop()
        except ProtocolViolation as exc:
            log.info("protocol violation from %s: %s", self.peer, exc)
            self._send_fatal(exc)
        except Fatal as exc:
            self._send_fatal(exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            self._send_fatal(Fatal("terminating connection due to administrator command", sqlstate="57P01"))
            raise
        except Exception as exc:  # the server must survive anything one client does
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
        if self._admitted:
            self._admitted = False
            self.ctx.leave(self.user)
        loop = asyncio.get_running_loop()
        for job in list(self._jobs):  # the client is gone: its statements need not finish
            loop.run_in_executor(None, job.interrupt)
        with contextlib.suppress(Exception):
            await self.writer.drain()
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)

    # -- startup -----------------------------------------------------------------------------------

    async def startup(self) -> bool:
        """Negotiate encryption and authenticate; False when the connection only carried a cancel."""
        while True:
            payload = await pq.read_startup(self.reader)
            msg = pq.parse_startup(payload)
            if isinstance(msg, pq.SSLRequest):
                await self._negotiate_tls()
            elif isinstance(msg, pq.GSSEncRequest):
                self.send(b"N")
                await self.flush()
            elif isinstance(msg, pq.CancelRequest):
                self.ctx.cancel(msg.pid, msg.secret)
                return False
            else:
                break
        await self._start_session(msg)
        return True

    async def _negotiate_tls(self) -> None:
        if self.ctx.ssl_context is None or self._tls:
            self.send(b"N")
            await self.flush()
            return
        # Data pipelined after SSLRequest would be read as if it came over TLS (CVE-2021-23214).
        if len(getattr(self.reader, "_buffer", b"")):
            raise ProtocolViolation("received unencrypted data after SSL request")
        self.send(b"S")
        await self.flush()
        await self.writer.start_tls(self.ctx.ssl_context)
        self._tls = True

    async def _start_session(self, msg: pq.StartupMessage) -> None:
        if msg.major != 3:
            raise Fatal(
                f"unsupported frontend protocol {msg.major}.{msg.minor}: server supports 3.0 to 3.0",
                sqlstate="0A000",
            )
        params = msg.params
        unknown_options = [k for k in params if k.startswith("_pq_.")]
        if msg.minor > 0 or unknown_options:
            self.send(pq.negotiate_protocol_version(0, unknown_options))
        if params.get("replication", "false").lower() not in ("false", "off", "no", "0"):
            raise Fatal("replication connections are not supported by dpsql", sqlstate="0A000")
        user = params.get("user", "")
        if not user:
            raise Fatal("no PostgreSQL user name specified in startup packet", sqlstate="28000")
        await self._authenticate(user)
        try:
            self.ctx.admit(user)  # 53300 beyond --max-connections / --max-connections-per-analyst
        except Error as exc:
            log.info("connection refused analyst=%s peer=%s: %s", user, self.peer, exc.message)
            raise Fatal(exc.message, sqlstate=exc.sqlstate) from None
        self._admitted = True
        self.user = user
        self.session = Session(analyst=user)
        gucs = default_gucs(self.ctx.server_version, user, params.get("application_name", ""), self.ctx.defaults)
        gucs["statement_timeout"] = str(self.ctx.default_statement_timeout_ms)
        idle_tx = self.ctx.options.idle_in_transaction_timeout
        gucs["idle_in_transaction_session_timeout"] = str(round((idle_tx or 0) * 1000))
        opts = self.ctx.options
        self.settings = Settings(self.session, gucs, max_custom=opts.max_settings, max_length=opts.max_setting_length)
        self._apply_startup_settings(params)
        for name in REPORTED:
            self.send(pq.parameter_status(name, self.settings.values.get(name, "")))
        self.pid = self.ctx.register(self)
        self.send(pq.backend_key_data(self.pid, self.secret))
        self.send(pq.ready_for_query(self.tx))
        await self.flush()
        log.info("connection analyst=%s pid=%d peer=%s tls=%s", user, self.pid, self.peer, self._tls)

    def _apply_startup_settings(self, params: dict[str, str]) -> None:
        assert self.settings is not None
        skip = {"user", "database", "replication", "options", "application_name"}
        pairs = [(k, v) for k, v in params.items() if k not in skip and not k.startswith("_pq_.")]
        pairs += re.findall(r"(?:-c\s*|--)([A-Za-z_.]+)=(\S+)", params.get("options", ""))
        for key, value in pairs:
            try:
                self.settings.set(key, value)
            except Error as exc:
                raise Fatal(exc.message, sqlstate=exc.sqlstate, hint=exc.hint) from None

    async def _authenticate(self, user: str) -> None:
        policy = self.ctx.policy
        analyst = policy.analyst(user)
        if policy.auth.trust:
            # As PostgreSQL under trust: authentication succeeds, then the role lookup fails (a known
            # name simply logs in, so no answer could hide which names exist).
            self.send(pq.auth_ok())
            if analyst is None:
                raise Fatal(f'role "{user}" does not exist', sqlstate="28000")
            return
        failed = Fatal(f'password authentication failed for user "{user}"', sqlstate="28P01")
        if analyst is not None and analyst.password is not None:
            exchange = ScramExchange(Verifier.parse(analyst.password))
            reason = "wrong password"
        else:  # unknown role or no verifier: the same exchange, doomed to fail at the same point
            exchange = mock_exchange(self.ctx.engine, user)
            reason = "unknown role" if analyst is None else "no password set"
        self.send(pq.auth_sasl(["SCRAM-SHA-256"]))
        await self.flush()
        try:
            mechanism, first = parse_sasl_initial(await self._read_password())
            if mechanism != "SCRAM-SHA-256":
                raise ScramProtocolError("client selected an invalid SASL authentication mechanism")
            self.send(pq.auth_sasl_continue(exchange.first(first)))
            await self.flush()
            final = exchange.final(await self._read_password())
        except AuthFailed:
            log.info("authentication failed analyst=%s peer=%s reason=%s", user, self.peer, reason)
            raise failed from None
        except ScramProtocolError as exc:
            raise Fatal(exc.message, sqlstate="08P01", detail=exc.detail, hint=exc.hint) from None
        self.send(pq.auth_sasl_final(final))
        self.send(pq.auth_ok())

    async def _read_password(self) -> bytes:
        type_, payload = await asyncio.wait_for(
            pq.read_message(self.reader, self.ctx.options.max_message_size), self.ctx.options.startup_timeout
        )
        if type_ != "p":
            raise ProtocolViolation(f"expected SASL response, got message type {ord(type_)}")
        return payload

    # -- message loop ------------------------------------------------------------------------------

    async def message_loop(self) -> None:
        idle = self.ctx.options.idle_timeout
        while True:
            in_tx = self.tx != "I" and self.settings is not None and self.settings.idle_in_transaction_ms > 0
            wait = self.settings.idle_in_transaction_ms / 1000 if in_tx and self.settings else idle
            try:
                type_, payload = await asyncio.wait_for(
                    pq.read_message(self.reader, self.ctx.options.max_message_size), wait
                )
            except TimeoutError:
                if in_tx:
                    raise Fatal("terminating connection due to idle-in-transaction timeout", sqlstate="25P03") from None
                raise Fatal("terminating connection due to idle-session timeout", sqlstate="57P05") from None
            msg = pq.parse_message(type_, payload)
            if isinstance(msg, pq.Terminate):
                return
            if self.ignore_till_sync and not isinstance(msg, pq.Sync):
                continue
            await self.dispatch(msg)

    async def dispatch(self, msg: pq.FrontendMessage) -> None:
        timeout = self._timeout_ms()
        self._deadline = asyncio.get_running_loop().time() + timeout / 1000 if timeout else None
        if isinstance(msg, pq.Query):
            await self.simple_query(msg.sql)
        elif isinstance(msg, pq.Sync):
            self.ignore_till_sync = False
            if self.tx == "I":
                self.portals.clear()
            self.send(pq.ready_for_query(self.tx))
            await self.flush()
        elif isinstance(msg, pq.Flush):
            await self.flush()
        elif isinstance(msg, pq.PasswordData):
            raise ProtocolViolation("unexpected password message")
        elif isinstance(msg, pq.Unsupported):
            await self._extended_error(FeatureNotSupported("COPY and function calls are not supported by dpsql"))
        else:
            await self.extended(msg)

    # -- planning and running ----------------------------------------------------------------------

    async def plan_async(self, sql: str) -> Statement:
        """:meth:`plan`, in the worker pool unless the statement is short (parsing can take seconds)."""
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return self.plan(sql)
        stmt: Statement = await self.run_blocking(self.plan, sql, timeout_ms=self._timeout_ms(), pure=True)
        return stmt

    async def split(self, sql: str) -> list[str]:
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return split_statements(sql)
        parts: list[str] = await self.run_blocking(split_statements, sql, timeout_ms=self._timeout_ms(), pure=True)
        return parts

    def _evaluate_local(self, sql: str) -> Any:
        """A table-free SELECT answered here; long ones go to the shadow (parsed off the event loop)."""
        if len(sql) > _INLINE_SQL:
            return None
        return evaluate_select(sql, self._local_context())

    def plan(self, sql: str) -> Statement:
        """Route a single statement without running anything."""
        if not split_statements(sql):
            return Statement(sql, "empty")
        command = parse_local(sql)
        if command is not None:
            return Statement(sql, "local", command)
        return Statement(sql, classify(sql, self.ctx.policy))

    def _check_failed_tx(self, stmt: Statement) -> None:
        allowed = stmt.command is not None and stmt.command.action in ("commit", "rollback", "rollback_to")
        if self.tx == "E" and not allowed:
            raise FailedTransaction("current transaction is aborted, commands ignored until end of transaction block")

    async def execute(self, stmt: Statement, portal: Portal | None = None) -> Outcome:
        """Run a planned statement; logs one line with analyst, fingerprint, ε, outcome and latency."""
        started = time.monotonic()
        outcome: Outcome | None = None
        state = "ok"
        self._late = False
        try:
            self._check_failed_tx(stmt)
            outcome = await self._execute(stmt, portal)
            return outcome
        except asyncio.CancelledError:
            state = "57P01"
            raise
        except BaseException as exc:
            state = exc.sqlstate if isinstance(exc, Error) else "XX000"
            raise
        finally:
            if not self._late:  # else logged when the engine work ends, with what it really charged
                self._log_query(stmt, outcome.epsilon if outcome else 0.0, state, started)

    def _log_query(self, stmt: Statement, epsilon: float, state: str, started: float, note: str = "") -> None:
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
            return self.run_command(stmt.command)
        if stmt.route == "mixed":
            raise refuse_mixed()
        if stmt.route == "tableless" and not (portal and portal.params):
            values = self._evaluate_local(stmt.sql)
            if values is not None:
                fields = [FieldDescription(v.name, v.type_oid, type_size(v.type_oid)) for v in values]
                return Outcome(fields, [tuple(v.value for v in values)], "SELECT 1")
        if stmt.route in ("tableless", "catalog"):
            return await self._run_catalog(stmt, portal)
        return await self._run_engine(stmt, portal)

    def _local_context(self) -> LocalContext:
        assert self.settings is not None
        return LocalContext(self.user, self.ctx.database, self.ctx.server_version, self.pid, self.settings.get)

    async def _shadow_call(self, method: str, *args: Any, timeout_ms: int = 0) -> Any:
        """Run one call on a pooled shadow connection; it returns to the pool when the call has ended."""
        if not self.ctx.catalog_available:
            raise CatalogUnavailable()
        pool = self.ctx.pool()
        user = self.user
        try:
            session = await pool.acquire(user)
        except Error:
            raise
        except Exception as exc:
            log.warning("cannot connect to the catalog server: %s", exc)
            raise ShadowLost(
                "could not connect to the catalog server", hint="DP queries still work; retry catalog queries later."
            ) from None

        def call() -> Any:
            job = Job.current()
            try:
                with job.stoppable(session.cancel) if job else contextlib.nullcontext():
                    return getattr(session, method)(*args)
            except Exception as exc:
                if is_broken(session):
                    log.warning("catalog server connection lost: %s", exc)
                    raise ShadowLost(
                        "the connection to the catalog server was lost",
                        hint="DP queries still work; retry catalog queries later.",
                    ) from None
                raise

        return await self.run_blocking(call, timeout_ms=timeout_ms, on_done=lambda _f: pool.release(user, session))

    async def _run_catalog(self, stmt: Statement, portal: Portal | None) -> Outcome:
        if portal is None:
            args: tuple[Any, ...] = (stmt.sql,)
        else:
            args = (stmt.sql, portal.params, stmt.param_oids, portal.param_formats, portal.result_formats)
        res = await self._shadow_call("execute", *args, timeout_ms=self._timeout_ms())
        return Outcome(res.fields, res.rows, res.tag, encoded=True)

    def _timeout_ms(self) -> int:
        if self.settings is None:
            return self.ctx.default_statement_timeout_ms
        return self.ctx.statement_timeout_ms(self.settings.statement_timeout_ms)

    def _decode_params(self, stmt: Statement, portal: Portal | None) -> list[Any] | None:
        if portal is None or not portal.params:
            return None
        formats = _expand(portal.param_formats, len(portal.params))
        oids = stmt.param_oids + [0] * (len(portal.params) - len(stmt.param_oids))
        return [decode_param(v, oid, fmt) for v, oid, fmt in zip(portal.params, oids, formats, strict=True)]

    def _confidence(self) -> float:
        assert self.session is not None
        return self.session.confidence or self.ctx.defaults.confidence

    async def _run_engine(self, stmt: Statement, portal: Portal | None) -> Outcome:
        assert self.session is not None and self.settings is not None
        params = self._decode_params(stmt, portal)
        show = portal.show_intervals if portal is not None else self.settings.show_intervals
        engine, session, sql = self.ctx.engine, self.session, stmt.sql

        def work() -> tuple[Any, list[bool] | None]:
            result = engine.execute(sql, session, params)
            flags = noisy_flags(sql, result.columns) if show and result.command_tag == "SELECT" else None
            return result, flags

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

        result, flags = await self.run_blocking(work, timeout_ms=self._timeout_ms(), on_late=late)
        fields = engine_fields(result.columns, flags, self._confidence())
        tag = f"SELECT {len(result.rows)}" if result.command_tag == "SELECT" else result.command_tag
        outcome = Outcome(fields, engine_rows(result, flags), tag, epsilon=result.epsilon_spent)
        outcome.notices = result_notices(result, self._confidence())
        return outcome

    # -- local commands ----------------------------------------------------------------------------

    def run_command(self, cmd: LocalCommand) -> Outcome:
        assert self.settings is not None
        handler = getattr(self, f"_cmd_{cmd.action}")
        result: Outcome | None = handler(cmd)
        return result or Outcome(None, [], cmd.tag)

    def _cmd_noop(self, cmd: LocalCommand) -> None:
        return None

    def _cmd_set(self, cmd: LocalCommand) -> Outcome:
        assert self.settings is not None
        reported = self.settings.set(cmd.name, cmd.value)
        out = Outcome(None, [], "SET")
        if reported:
            out.status.append((reported, self.settings.values[reported]))
        return out

    def _cmd_reset(self, cmd: LocalCommand) -> Outcome:
        return self._cmd_set(LocalCommand("set", "RESET", cmd.name, None))

    def _cmd_reset_all(self, cmd: LocalCommand) -> Outcome:
        assert self.settings is not None
        changed = self.settings.reset_all()
        return Outcome(None, [], cmd.tag, status=[(k, self.settings.values[k]) for k in changed])

    def _cmd_show(self, cmd: LocalCommand) -> Outcome:
        assert self.settings is not None
        value = self.settings.get(cmd.name)
        name = self.settings.canonical(cmd.name)
        return Outcome([FieldDescription(name, TEXT)], [(value,)], "SHOW")

    def _cmd_show_all(self, cmd: LocalCommand) -> Outcome:
        assert self.settings is not None
        rows = [(k, v, "") for k, v in sorted(self.settings.values.items(), key=lambda kv: kv[0].lower())]
        fields = [FieldDescription(n, TEXT) for n in ("name", "setting", "description")]
        return Outcome(fields, rows, "SHOW")

    def _cmd_discard_all(self, cmd: LocalCommand) -> Outcome:
        if self.tx != "I":
            raise ActiveTransaction("DISCARD ALL cannot run inside a transaction block")
        out = self._cmd_reset_all(cmd)
        self.statements.clear()
        self.portals.clear()
        return out

    def _warn(self, sqlstate: str, text: str) -> Diagnostic:
        return Diagnostic("WARNING", sqlstate, text)

    def _cmd_begin(self, cmd: LocalCommand) -> Outcome:
        out = Outcome(None, [], "BEGIN")
        if self.tx != "I":
            out.notices.append(self._warn("25001", "there is already a transaction in progress"))
        else:
            self.tx, self.savepoints = "T", []
        return out

    def _cmd_commit(self, cmd: LocalCommand) -> Outcome:
        out = Outcome(None, [], "ROLLBACK" if self.tx == "E" else "COMMIT")
        if self.tx == "I":
            out.notices.append(self._warn("25P01", "there is no transaction in progress"))
        self.tx, self.savepoints = "I", []
        return out

    def _cmd_rollback(self, cmd: LocalCommand) -> Outcome:
        out = Outcome(None, [], "ROLLBACK")
        if self.tx == "I":
            out.notices.append(self._warn("25P01", "there is no transaction in progress"))
        self.tx, self.savepoints = "I", []
        return out

    def _find_savepoint(self, name: str, verb: str) -> int:
        if self.tx == "I":
            raise NoActiveTransaction(f"{verb} can only be used in transaction blocks")
        if name not in self.savepoints:
            raise Error(f'savepoint "{name}" does not exist', sqlstate="3B001")
        return len(self.savepoints) - 1 - self.savepoints[::-1].index(name)

    def _cmd_rollback_to(self, cmd: LocalCommand) -> None:
        index = self._find_savepoint(cmd.name, "ROLLBACK TO SAVEPOINT")
        self.savepoints = self.savepoints[: index + 1]
        self.tx = "T"

    def _cmd_savepoint(self, cmd: LocalCommand) -> None:
        if self.tx == "I":
            raise NoActiveTransaction("SAVEPOINT can only be used in transaction blocks")
        self.savepoints.append(cmd.name)

    def _cmd_release(self, cmd: LocalCommand) -> None:
        self.savepoints = self.savepoints[: self._find_savepoint(cmd.name, "RELEASE SAVEPOINT")]

    def _cmd_close(self, cmd: LocalCommand) -> None:
        if cmd.tag != "CLOSE CURSOR ALL":
            raise Error(f'cursor "{cmd.name}" does not exist', sqlstate="34000")

    def _cmd_deallocate(self, cmd: LocalCommand) -> None:
        if cmd.tag == "DEALLOCATE ALL":
            self.statements = {k: v for k, v in self.statements.items() if not k}
        elif self.statements.pop(cmd.name, None) is None:
            raise Error(f'prepared statement "{cmd.name}" does not exist', sqlstate="26000")

    # -- sending results ---------------------------------------------------------------------------

    async def send_rows(self, outcome: Outcome, rows: Sequence[tuple[Any, ...]], formats: Sequence[int]) -> None:
        """DataRow messages, flushed every ``_STREAM_BATCH`` rows: a large result streams to the client
        with backpressure instead of piling up, encoded, in the socket buffer."""
        assert outcome.fields is not None
        oids = [f.type_oid for f in outcome.fields]
        for start in range(0, len(rows), _STREAM_BATCH):
            for row in rows[start : start + _STREAM_BATCH]:
                cells = (
                    row
                    if outcome.encoded
                    else [encode_value(v, o, f) for v, o, f in zip(row, oids, formats, strict=True)]
                )
                self.send(pq.data_row(cells))
            if start + _STREAM_BATCH < len(rows):
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
            if self.tx == "T":
                self.tx = "E"
            statements = None
        if statements == []:
            self.send(pq.empty_query_response())
        for text in statements or ():
            try:
                stmt = await self.plan_async(text)
                outcome = await self.execute(stmt)
            except Exception as exc:
                self.send_error(exc)
                if self.tx == "T":
                    self.tx = "E"
                break
            self.send_side_effects(outcome)
            if outcome.fields is not None:
                self.send(pq.row_description(outcome.fields))
                await self.send_rows(outcome, outcome.rows, [0] * len(outcome.fields))
            self.send(pq.command_complete(outcome.tag))
            if len(outcome.rows) > 500:
                await self.flush()
        self.send(pq.ready_for_query(self.tx))
        await self.flush()

    # -- extended query ----------------------------------------------------------------------------

    async def _extended_error(self, exc: BaseException) -> None:
        self.send_error(exc)
        if self.tx == "T":
            self.tx = "E"
        self.ignore_till_sync = True

    async def extended(self, msg: pq.FrontendMessage) -> None:
        try:
            if isinstance(msg, pq.Parse):
                await self.on_parse(msg)
            elif isinstance(msg, pq.Bind):
                await self.on_bind(msg)
            elif isinstance(msg, pq.Describe):
                await self.on_describe(msg)
            elif isinstance(msg, pq.Execute):
                await self.on_execute(msg)
            elif isinstance(msg, pq.Close):
                self.on_close(msg)
        except ProtocolViolation:
            raise
        except Exception as exc:
            await self._extended_error(exc)

    async def on_parse(self, msg: pq.Parse) -> None:
        if msg.name and msg.name in self.statements:
            raise Error(f'prepared statement "{msg.name}" already exists', sqlstate="42P05")
        limit = self.ctx.options.max_prepared
        if msg.name and len(self.statements) >= limit:
            raise ConfigurationLimitExceeded(
                f"too many prepared statements in this session (at most {limit})",
                hint="Close (DEALLOCATE) prepared statements that are no longer needed.",
            )
        statements = await self.split(msg.sql)
        if len(statements) > 1:
            raise Error("cannot insert multiple commands into a prepared statement", sqlstate="42601")
        stmt = await self.plan_async(statements[0] if statements else msg.sql)
        stmt.param_oids = list(msg.param_oids)
        self._check_failed_tx(stmt)
        await self._describe_statement(stmt)
        self.statements[msg.name] = stmt
        self.send(pq.parse_complete())

    async def _describe_statement(self, stmt: Statement) -> None:
        """Fill parameter types and result columns without running the query (no budget spent)."""
        if stmt.route in ("catalog", "tableless") and (
            stmt.route == "catalog" or self._evaluate_local(stmt.sql) is None
        ):
            if not self.ctx.catalog_available:
                if stmt.route == "catalog":
                    raise CatalogUnavailable()
                return
            oids, fields = await self._shadow_call("describe", stmt.sql, stmt.param_oids, timeout_ms=self._timeout_ms())
            stmt.route, stmt.param_oids, stmt.catalog_fields = "catalog", oids, fields
        elif stmt.route == "engine":
            await self._describe_engine(stmt)
        elif stmt.route == "mixed":
            raise refuse_mixed()

    async def _describe_engine(self, stmt: Statement) -> None:
        assert self.session is not None
        target = stmt.sql
        explain = _EXPLAIN_PREFIX.match(target) is not None
        if explain:
            target = _EXPLAIN_PREFIX.sub("", target, count=1)
        engine, session = self.ctx.engine, self.session

        def work() -> tuple[Any, list[bool] | None]:
            description = engine.describe(target, session)
            noisy = None if explain else noisy_flags(stmt.sql, description.columns)
            return description, noisy

        description, stmt.noisy = await self.run_blocking(work, timeout_ms=self._timeout_ms())
        inferred = [oid_for(t) for t in description.param_types]
        given = stmt.param_oids
        oids = [given[i] if i < len(given) and given[i] else inferred[i] for i in range(len(inferred))]
        stmt.param_oids = oids + given[len(oids) :]
        stmt.engine_columns = [OutputColumn("QUERY PLAN", "text")] if explain else list(description.columns)

    def _fields_for(self, stmt: Statement, show_intervals: bool) -> list[FieldDescription] | None:
        if stmt.route == "engine":
            if stmt.engine_columns is None:
                return None
            explain = _EXPLAIN_PREFIX.match(stmt.sql) is not None
            flags = stmt.noisy if show_intervals and not explain else None
            return engine_fields(stmt.engine_columns, flags, self._confidence())
        if stmt.route == "catalog":
            return stmt.catalog_fields
        if stmt.route == "tableless":
            values = self._evaluate_local(stmt.sql)
            return [FieldDescription(v.name, v.type_oid, type_size(v.type_oid)) for v in values] if values else None
        if stmt.route == "local" and stmt.command is not None:
            if stmt.command.action == "show":
                assert self.settings is not None
                return [FieldDescription(self.settings.canonical(stmt.command.name), TEXT)]
            if stmt.command.action == "show_all":
                return [FieldDescription(n, TEXT) for n in ("name", "setting", "description")]
        return None

    async def on_bind(self, msg: pq.Bind) -> None:
        stmt = self.statements.get(msg.statement)
        if stmt is None:
            raise Error(f'prepared statement "{msg.statement}" does not exist', sqlstate="26000")
        if msg.portal and msg.portal in self.portals:
            raise Error(f'portal "{msg.portal}" already exists', sqlstate="42P03")
        limit = self.ctx.options.max_portals
        if msg.portal and len(self.portals) >= limit:
            raise ConfigurationLimitExceeded(
                f"too many portals in this session (at most {limit})",
                hint="Close portals, or Sync outside a transaction.",
            )
        _check_formats(msg.param_formats)
        _check_formats(msg.result_formats)
        if len(msg.param_formats) not in (0, 1, len(msg.params)):
            raise ProtocolViolation("bind message has an invalid number of parameter formats")
        expected = len(stmt.param_oids)
        if len(msg.params) != expected:
            raise Error(
                f"bind message supplies {len(msg.params)} parameters, but prepared statement "
                f'"{msg.statement}" requires {expected}',
                sqlstate="08P01",
            )
        assert self.settings is not None
        portal = Portal(stmt, msg.params, msg.param_formats, msg.result_formats, self.settings.show_intervals)
        self._decode_params(stmt, portal)  # validate now: PostgreSQL reports bad input at Bind
        self.portals[msg.portal] = portal
        self.send(pq.bind_complete())

    async def on_describe(self, msg: pq.Describe) -> None:
        assert self.settings is not None
        if msg.kind == "S":
            stmt = self.statements.get(msg.name)
            if stmt is None:
                raise Error(f'prepared statement "{msg.name}" does not exist', sqlstate="26000")
            self.send(pq.parameter_description(stmt.param_oids))
            fields = self._fields_for(stmt, self.settings.show_intervals)
        else:
            portal = self._portal(msg.name)
            fields = self._portal_fields(portal)
        self.send(pq.row_description(fields) if fields is not None else pq.no_data())

    def _portal(self, name: str) -> Portal:
        portal = self.portals.get(name)
        if portal is None:
            raise Error(f'portal "{name}" does not exist', sqlstate="34000")
        return portal

    def _portal_fields(self, portal: Portal) -> list[FieldDescription] | None:
        fields = portal.outcome.fields if portal.outcome else self._fields_for(portal.statement, portal.show_intervals)
        if fields is None:
            return None
        formats = _expand(portal.result_formats, len(fields))
        return [_with_format(f, fmt) for f, fmt in zip(fields, formats, strict=True)]

    async def on_execute(self, msg: pq.Execute) -> None:
        portal = self._portal(msg.portal)
        if portal.outcome is None:
            portal.outcome = await self.execute(portal.statement, portal)
            self.send_side_effects(portal.outcome)
        outcome = portal.outcome
        if portal.statement.route == "empty":
            self.send(pq.empty_query_response())
            return
        if outcome.fields is None:
            self.send(pq.command_complete(outcome.tag))
            return
        formats = [f.format for f in outcome.fields] if outcome.encoded else self._formats(portal, outcome)
        end = len(outcome.rows) if msg.max_rows <= 0 else min(len(outcome.rows), portal.sent + msg.max_rows)
        batch = outcome.rows[portal.sent : end]
        await self.send_rows(outcome, batch, formats)
        portal.sent = end
        if end < len(outcome.rows):
            self.send(pq.portal_suspended())
        else:
            tag = outcome.tag
            if tag.startswith("SELECT "):
                tag = f"SELECT {len(batch)}"
            self.send(pq.command_complete(tag))

    @staticmethod
    def _formats(portal: Portal, outcome: Outcome) -> list[int]:
        assert outcome.fields is not None
        return _expand(portal.result_formats, len(outcome.fields))

    def on_close(self, msg: pq.Close) -> None:
        if msg.kind == "S":
            self.statements.pop(msg.name, None)
        else:
            self.portals.pop(msg.name, None)
        self.send(pq.close_complete())


def _with_format(f: FieldDescription, fmt: int) -> FieldDescription:
    return FieldDescription(f.name, f.type_oid, f.type_size, f.type_mod, f.table_oid, f.column_attr, fmt)


def _drop_admission(admission: asyncio.Future[None], slots: Any, user: str) -> None:
    """Give back a worker slot whose statement will not run (or stop waiting for it)."""
    if not admission.done():
        admission.cancel()  # the acquire coroutine releases whatever it already holds
    elif not admission.cancelled() and admission.exception() is None:
        slots.release(user)
