"""One client connection: the message loop, statement routing and execution, simple query.

A small state machine: :mod:`.startup` (SSL/GSSENC negotiation, cancel requests,
StartupMessage, SCRAM or trust) → ready (message loop). Every statement is first *planned*
(:class:`~.extended.PlannedStatement`: empty / local / table-free / catalog / engine / mixed)
and then run; planning never runs a query, so Describe never spends budget. Engine and catalog
work runs in the server's thread pool (:mod:`.runner`) so the event loop keeps serving other
clients; replies go out with back-pressure (:mod:`.replies`). The extended protocol's stores live
in :mod:`.extended`, session commands and the transaction status in :mod:`.commands`, the
statements answered here in :mod:`.answers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dpsql.analyze.parse import MAX_STATEMENT_CHARS
from dpsql.analyze.statement import Kind
from dpsql.errors import (
    AdminShutdown,
    CharacterNotInRepertoire,
    ConfigurationLimitExceeded,
    DuplicateCursor,
    Error,
    FeatureNotSupported,
    IdleInTransactionTimeout,
    IdleSessionTimeout,
    NoActiveTransaction,
    ProgramLimitExceeded,
    ProtocolViolation,
    SyntaxError_,
)
from dpsql.ledger.audit import Trace
from dpsql.session import Session
from dpsql.sqltext import after_keyword, split_statements, strip_comments

from . import protocol as pq
from .answers import Action, AnswerContext, SessionCommand, Settings, evaluate_select, parse_session_command
from .catalog import refuse_mixed, route_of, route_of_refused, route_of_statement
from .extended import ExtendedProtocol, PlannedStatement, Portal, expand_formats
from .frontdoor import Pending
from .memory import release_to_os, rows_size
from .protocol import Diagnostic, FieldDescription, WireViolation
from .replies import Replies
from .results import Outcome, engine_fields, engine_rows, noisy_flags, result_notices
from .runner import WorkRunner
from .session_commands import SessionCommands, TxStatus
from .startup import startup
from .types import decode_param, type_size

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger("dpsql.server")

__all__ = ["Connection"]

#: The most the login limiter may stop one startup's deadline for (waiting for a place, holding a failure).
_MAX_LOGIN_WAIT = 300.0
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
        #: Its statements' work in the worker pool (fair share, timeout, cancel).
        self.work = WorkRunner(ctx, lambda: self.user)
        self.admitted = False
        self.tls = False
        #: Its place in the pre-auth budget until it authenticates (set by the server).
        self.pending: Pending | None = None
        #: The bytes this session holds (:mod:`.memory`).
        self.memory = ctx.memory.session()
        self.replies = Replies(writer, self.memory)
        self._startup_deadline: asyncio.Timeout | None = None

    @property
    def address(self) -> str:
        """The client's address (without the port): the key of the per-address limits."""
        info = self.writer.get_extra_info("peername")
        return str(info[0]) if isinstance(info, tuple) and info else "?"

    def authenticated(self) -> None:
        """Authentication succeeded: the socket leaves the pre-auth budget for the sessions' one."""
        if self.pending is not None:
            self.ctx.preauth.leave(self.pending)

    @contextlib.contextmanager
    def startup_paused(self) -> Iterator[None]:
        """The login limiter makes this startup wait (for one of its pair's places, or holding a wrong
        password's reply): the startup deadline stops meanwhile (for at most five minutes), so that the wait
        never times a correct login out."""
        deadline = self._startup_deadline
        when = deadline.when() if deadline is not None else None
        if deadline is None or when is None:
            yield
            return
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline.reschedule(when + _MAX_LOGIN_WAIT)
        try:
            yield
        finally:
            deadline.reschedule(when + min(loop.time() - began, _MAX_LOGIN_WAIT))

    def negotiating(self) -> None:
        """A first packet came (SSLRequest, GSSENCRequest): no longer a silent socket."""
        if self.pending is not None:
            self.pending.stage = max(self.pending.stage, 1)

    def startup_received(self) -> None:
        """The startup packet came: an account is logging in (protected from eviction for a while)."""
        if self.pending is not None and self.pending.stage < 2:
            self.pending.stage, self.pending.started = 2, time.monotonic()

    def evict(self) -> None:
        """Closed to make room in the pre-auth budget: say so (53300) and hang up; the read the
        connection waits on then ends and it cleans up as after any disconnect."""
        hint = "Too many connections from this address have not authenticated yet."
        diag = Diagnostic("FATAL", "53300", "sorry, too many clients already", None, hint)
        with contextlib.suppress(Exception):
            self.writer.write(pq.error_response(diag))
        self.writer.close()

    def cancel(self) -> None:
        """A CancelRequest for this connection (see :class:`~.runner.WorkRunner`)."""
        self.work.cancel()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            try:
                async with asyncio.timeout(self.ctx.options.startup_timeout or None) as deadline:
                    self._startup_deadline = deadline
                    started = await startup(self)
            except TimeoutError:
                log.info("authentication timeout from %s", self.peer)
                raise ProtocolViolation("canceling authentication due to timeout").fatal() from None
            if started:
                await self.message_loop()
        except WireViolation as exc:
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
            self.replies.send_error(exc, "FATAL")

    async def close(self) -> None:
        self.ctx.unregister(self)
        if self.admitted:
            self.admitted = False
            self.ctx.leave(self.user)
        self.work.interrupt_all()  # the client is gone: its statements need not finish
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

    def _idle_limit(self) -> tuple[float | None, str]:
        """How long this session may now wait for the client's next message, and why it would end: inside a
        transaction block idle_in_transaction_session_timeout; outside one while holding more than its
        reserved floor (WITH HOLD cursors, portals, prepared statements) the idle-holding timeout; else the
        server's idle-session timeout (None: no limit)."""
        opts = self.ctx.options
        if self.commands.tx is not TxStatus.IDLE and self.settings is not None and self.settings.idle_in_transaction_ms:
            return self.settings.idle_in_transaction_ms / 1000, "in transaction"
        limits = [(opts.idle_timeout, "idle")]
        if self.memory.beyond_floor > 0:
            limits.append((opts.idle_holding_timeout, "holding"))
        set_limits = [(t, why) for t, why in limits if t]
        return min(set_limits) if set_limits else (None, "idle")

    async def message_loop(self) -> None:
        self.memory.open(self.user)  # its reserved floor, from now on
        while True:
            wait, why = self._idle_limit()
            try:
                type_, payload = await asyncio.wait_for(
                    pq.read_message(self.reader, self.ctx.options.max_message_size), wait
                )
            except TimeoutError:
                if why == "in transaction":
                    raise IdleInTransactionTimeout(
                        "terminating connection due to idle-in-transaction timeout"
                    ).fatal() from None
                detail = None
                if why == "holding":
                    detail = (
                        f"The session held {self.memory.held // 1024} kB of cursors, portals and prepared "
                        f"statements while idle for {wait:g} s; reopen the cursor or prepare the statement again."
                    )
                raise IdleSessionTimeout(
                    "terminating connection due to idle-session timeout", detail=detail
                ).fatal() from None
            try:
                msg = pq.parse_message(type_, payload)
            except pq.BadMessage as exc:
                self._bad_message(type_, exc)
                await self.replies.flush()
                continue
            if isinstance(msg, pq.Terminate):
                return
            if self.ignore_till_sync and not isinstance(msg, pq.Sync):
                continue
            await self.dispatch(msg)
            # the next message is read only once this one's replies are on their way: a client that
            # pipelines without reading is not served further (as PostgreSQL, which blocks in send)
            await self.replies.flush()
            self.trim_memory()

    def _bad_message(self, type_: str, exc: pq.BadMessage) -> None:
        """A well-framed message with bad content (not UTF-8: 22021; an unknown Describe kind: 08P01)
        in a Query: the ERROR and ready again; in an extended-protocol message: the ERROR, then
        everything up to Sync is skipped (as for any failed message there)."""
        if self.ignore_till_sync:
            return
        error = CharacterNotInRepertoire(str(exc)) if exc.sqlstate == "22021" else ProtocolViolation(str(exc))
        self.replies.send_error(error)
        self.commands.fail()  # inside a transaction block it is now aborted, as after any error
        if type_ == "Q":
            self.replies.send(pq.ready_for_query(self.commands.tx))
        else:
            self.ignore_till_sync = True

    async def dispatch(self, msg: pq.FrontendMessage) -> None:
        timeout = self.timeout_ms()
        self.work.deadline = asyncio.get_running_loop().time() + timeout / 1000 if timeout else None
        if isinstance(msg, pq.Query):
            await self.simple_query(msg.sql)
        elif isinstance(msg, pq.Sync):
            self.ignore_till_sync = False
            self.extended.sync(self.commands)
            self.replies.send(pq.ready_for_query(self.commands.tx))
            await self.replies.flush()
        elif isinstance(msg, pq.Flush):
            await self.replies.flush()
        elif isinstance(msg, pq.PasswordData):
            raise WireViolation("unexpected password message")
        elif isinstance(msg, pq.Unsupported):
            await self._extended_error(FeatureNotSupported("COPY and function calls are not supported by dpsql"))
        else:
            try:
                await self.extended.handle(msg)
            except WireViolation:
                raise
            except Exception as exc:
                await self._extended_error(exc)

    # -- planning and running ----------------------------------------------------------------------

    async def plan_async(self, sql: str) -> PlannedStatement:
        """:meth:`plan`, in the worker pool unless the statement is short (parsing can take seconds)."""
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return self.plan(sql)
        stmt: PlannedStatement = await self.work.run(self.plan, sql, timeout_ms=self.timeout_ms(), pure=True)
        return stmt

    async def split(self, sql: str) -> list[str]:
        if len(sql) > MAX_STATEMENT_CHARS:
            raise _too_long(sql)
        if len(sql) <= _INLINE_SQL:
            return split_statements(sql)
        parts: list[str] = await self.work.run(
            self.ctx.offload.split, self.user or "?", sql, timeout_ms=self.timeout_ms(), pure=True
        )
        return parts

    def answer_select(self, sql: str) -> Any:
        """A table-free SELECT answered here; long ones go to the shadow (parsed off the event loop)."""
        if len(sql) > _INLINE_SQL:
            return None
        statement = self.ctx.engine.statements.cached(sql)  # as routed: no second parse
        tree = statement.tree if statement is not None and statement.kind is Kind.QUERY else None
        return evaluate_select(sql, self._answer_context(), tree)

    def plan(self, sql: str) -> PlannedStatement:
        """Route a single statement without running anything (a long one's parsing in the helper
        process, :mod:`.offload`: this thread only waits, so it never holds the GIL for long)."""
        long = len(sql) > _INLINE_SQL
        if not long and not split_statements(sql):
            return PlannedStatement(sql, "empty")
        command = parse_session_command(sql)
        if command is not None:
            return PlannedStatement(sql, "local", command)
        if (problem := _explain_syntax(sql)) is not None:
            raise SyntaxError_(problem)  # as PostgreSQL, never an internal error
        if not long:
            return self._plan_short(sql)
        if (statement := self.ctx.engine.statements.cached(sql)) is not None:  # a repeat: the helper's tree
            return PlannedStatement(sql, route_of_statement(statement, self.ctx.policy), shape=statement.shape)
        routed = self.ctx.offload.route_of(self.user or "?", sql, frozenset(self.ctx.policy.tables))
        routed.install(sql, self.ctx.engine.statements)  # parsed there: the engine reads that tree
        return PlannedStatement(sql, routed.route, shape=routed.shape, verdict=routed.verdict)

    def _plan_short(self, sql: str) -> PlannedStatement:
        """Route on the statement the engine parses and classifies (its cache, by text): the engine, the
        log line's fingerprint and a table-free answer reuse that one tree (one parse per statement)."""
        statements = self.ctx.engine.statements
        try:
            statement = statements.get(sql)
        except Exception:  # refused by the engine when it runs (its SQLSTATE, its audit row); routed as ever
            failed = statements.failure(sql)
            if failed is None:
                return PlannedStatement(sql, route_of(sql, self.ctx.policy))
            return PlannedStatement(sql, route_of_refused(failed, self.ctx.policy), shape=failed.shape)
        return PlannedStatement(sql, route_of_statement(statement, self.ctx.policy), shape=statement.shape)

    async def execute(self, stmt: PlannedStatement, portal: Portal | None = None) -> Outcome:
        """Run a planned statement; logs one line with analyst, fingerprint, ε, outcome and latency."""
        started = time.monotonic()
        outcome: Outcome | None = None
        state, charged = "ok", 0.0
        self.work.late = False
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
            if not self.work.late:  # else logged when the engine work ends, with what it really charged
                self._log_query(stmt, outcome.epsilon if outcome else charged, state, started)

    def audit_refusal(self, sql: str, sqlstate: str, started: float) -> None:
        """Record a statement refused before the engine saw it (catalog guard, mixed routes, Parse):
        free, but a curator spotting a probing analyst needs it in the audit. Never raises."""
        self.ctx.engine.audit.record(Trace(sql, self.user, started), sqlstate)

    def _log_query(self, stmt: PlannedStatement, epsilon: float, state: str, started: float, note: str = "") -> None:
        if state != "ok" and stmt.route in ("catalog", "mixed", "tableless"):  # the engine audits its own
            self.audit_refusal(stmt.sql, state, started)
        level = logging.DEBUG if stmt.route in ("local", "empty", "tableless") else logging.INFO
        log.log(
            level,
            "query analyst=%s fingerprint=%s route=%s epsilon=%g outcome=%s latency_ms=%.1f%s",
            self.user,
            self.ctx.engine.fingerprint(stmt.sql, stmt.shape),  # keyed, of the shape: never the constants
            stmt.route,
            epsilon,
            state,
            (time.monotonic() - started) * 1000,
            note,
        )

    async def _execute(self, stmt: PlannedStatement, portal: Portal | None) -> Outcome:
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
            values = self.answer_select(stmt.sql)
            if values is not None:
                fields = [FieldDescription(v.name, v.type_oid, type_size(v.type_oid)) for v in values]
                return Outcome(fields, [tuple(v.value for v in values)], "SELECT 1")
        if stmt.route in ("tableless", "catalog"):
            return await self._run_catalog(stmt, portal)
        return await self._run_engine(stmt, portal)

    # -- cursors -----------------------------------------------------------------------------------

    async def _cursor_query(self, stmt: PlannedStatement) -> PlannedStatement:
        """The query of ``DECLARE … FOR <query>``, planned like any statement (same routes, same refusals;
        a long one off the event loop)."""
        assert stmt.command is not None and stmt.command.value is not None
        inner = await self.plan_async(stmt.command.value)
        if inner.route in ("local", "empty"):
            raise SyntaxError_("DECLARE CURSOR needs a query")
        inner.param_oids = list(stmt.param_oids)
        return inner

    async def describe_session_command(self, stmt: PlannedStatement) -> None:
        """Parse of a session statement: DECLARE describes its query (parameter types), nothing runs."""
        if stmt.command is not None and stmt.command.action is Action.DECLARE:
            inner = await self._cursor_query(stmt)
            await self.extended.describe_statement(inner)
            stmt.param_oids = inner.param_oids

    def _check_declare(self, cmd: SessionCommand) -> None:
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

    async def _declare(self, stmt: PlannedStatement, portal: Portal | None) -> Outcome:
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
        if cmd.declare.binary and inner.route in ("catalog", "tableless") and self.answer_select(inner.sql) is None:
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

    def _answer_context(self) -> AnswerContext:
        assert self.settings is not None
        return AnswerContext(self.user, self.ctx.database, self.ctx.server_version, self.pid, self.settings.get)

    async def _run_catalog(self, stmt: PlannedStatement, portal: Portal | None) -> Outcome:
        if portal is None:
            args: tuple[Any, ...] = (stmt.sql,)
        else:
            args = (stmt.sql, portal.params, stmt.param_oids, portal.param_formats, portal.result_formats)
        # the rows' bytes are taken while they are read: a result the session cannot hold is cut there
        hold = self.memory.hold("result")
        try:
            res = await self.work.shadow_call(
                "execute", *args, timeout_ms=self.timeout_ms(), reserve=hold.grow, verdict=stmt.verdict
            )
        except BaseException:
            hold.release()
            raise
        return Outcome(res.fields, res.rows, res.tag, encoded=True, hold=hold)

    def timeout_ms(self) -> int:
        if self.settings is None:
            return self.ctx.default_statement_timeout_ms
        return self.ctx.statement_timeout_ms(self.settings.statement_timeout_ms)

    def decode_params(self, stmt: PlannedStatement, portal: Portal | None) -> list[Any] | None:
        if portal is None or not portal.params:
            return None
        formats = expand_formats(portal.param_formats, len(portal.params))
        oids = stmt.param_oids + [0] * (len(portal.params) - len(stmt.param_oids))
        return [decode_param(v, oid, fmt) for v, oid, fmt in zip(portal.params, oids, formats, strict=True)]

    def confidence(self) -> float:
        assert self.session is not None
        return self.session.confidence or self.ctx.defaults.confidence

    async def _run_engine(self, stmt: PlannedStatement, portal: Portal | None) -> Outcome:
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

        def late(f: asyncio.Future[Any], charged: float) -> None:
            """The client stopped waiting (timeout, cancel, disconnect, shutdown): log what it cost anyway,
            as the ledger has it (``charged``: what the statement reserved) and the client was told."""
            note = " (finished after the client stopped waiting)"
            if f.cancelled():
                self._log_query(stmt, charged, "57014", started, " (never started)")
            elif (exc := f.exception()) is not None:
                told = exc.charged_epsilon if isinstance(exc, Error) else 0.0
                state = exc.sqlstate if isinstance(exc, Error) else "XX000"
                self._log_query(stmt, max(charged, told), state, started, note)
            else:
                self._log_query(stmt, f.result()[0].epsilon_spent, "ok", started, note)

        result, flags, rows, size = await self.work.run(work, timeout_ms=self.timeout_ms(), on_late=late)
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

    # -- simple query ------------------------------------------------------------------------------

    async def simple_query(self, sql: str) -> None:
        try:
            statements = await self.split(sql)
        except Exception as exc:
            self.replies.send_error(exc)
            self.commands.fail()
            statements = None
        if statements == []:
            self.replies.send(pq.empty_query_response())
        for text in statements or ():
            try:
                stmt = await self.plan_async(text)
                outcome = await self.execute(stmt)
            except Exception as exc:
                self.replies.send_error(exc)
                self.commands.fail()
                break
            try:
                self.replies.send_side_effects(outcome)
                if outcome.fields is not None:
                    self.replies.send(pq.row_description(outcome.fields))
                    await self.replies.send_rows(outcome, outcome.rows, [0] * len(outcome.fields))
                self.replies.send(pq.command_complete(outcome.tag))
            except Error as exc:  # a reply too large to hold in the socket buffer (53200)
                self.replies.send_error(exc)
                self.commands.fail()
                break
            finally:
                outcome.release()
            # each statement's reply drains before the next statement runs: many statements in one
            # message never pile their replies up in the socket buffer of a client that does not read
            await self.replies.flush()
        self.replies.send(pq.ready_for_query(self.commands.tx))
        await self.replies.flush()

    # -- extended query ----------------------------------------------------------------------------

    async def _extended_error(self, exc: BaseException) -> None:
        self.replies.send_error(exc)
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
