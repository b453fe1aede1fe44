"""The extended query protocol: Parse, Bind, Describe, Execute and Close over two stores.

A :class:`PlannedStatement` is planned once at Parse (routed, its parameter types and columns
described without running anything, so Describe never spends budget); a :class:`Portal` binds
parameters to it and keeps its outcome while Execute pages through the rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpsql.analyze.statement import explain_target
from dpsql.errors import (
    CatalogUnavailable,
    ConfigurationLimitExceeded,
    DuplicateCursor,
    DuplicatePreparedStatement,
    Error,
    InvalidCursorName,
    InvalidParameterValue,
    InvalidStatementName,
    ProtocolViolation,
    SyntaxError_,
)
from dpsql.session import OutputColumn
from dpsql.sqltext import after_keyword

from . import protocol as pq
from .answers import SessionCommand
from .catalog import Route, refuse_mixed
from .memory import HeldStore, params_size, statement_size
from .protocol import FieldDescription, WireViolation
from .results import Outcome, engine_fields, noisy_flags
from .session_commands import SessionCommands
from .types import oid_for, type_size

if TYPE_CHECKING:
    from .connection import Connection

#: Where a statement goes (:data:`.catalog.Route`, under its old name).
StatementRoute = Route


@dataclass(slots=True)
class PlannedStatement:
    """A planned statement (a prepared statement in the extended protocol)."""

    sql: str
    route: StatementRoute
    command: SessionCommand | None = None
    param_oids: list[int] = field(default_factory=list)
    engine_columns: list[OutputColumn] | None = None
    catalog_fields: list[FieldDescription] | None = None
    noisy: list[bool] | None = None
    #: A long statement's shape and shadow-guard verdict, read in the helper process (:mod:`.offload`).
    shape: str | None = None
    verdict: tuple[str, object] | None = None

    @property
    def explain_target(self) -> str | None:
        """The query of an ``EXPLAIN <query>`` routed to the engine (leading comments allowed)."""
        return after_keyword(self.sql, "explain") if self.route == "engine" else None


@dataclass(slots=True)
class Portal:
    statement: PlannedStatement
    params: tuple[bytes | None, ...] = ()
    param_formats: tuple[int, ...] = ()
    result_formats: tuple[int, ...] = ()
    show_intervals: bool = False
    outcome: Outcome | None = None
    sent: int = 0


def expand_formats(formats: Sequence[int], n: int) -> list[int]:
    """Per-column format codes from Bind's list (none: text; one: for all; else one each)."""
    if not formats:
        return [0] * n
    if len(formats) == 1:
        return [formats[0]] * n
    if len(formats) != n:
        raise ProtocolViolation(f"bind message has {len(formats)} result formats but query has {n} columns")
    return list(formats)


def _check_formats(formats: Sequence[int]) -> None:
    """Text (0) or binary (1) only: anything else is PostgreSQL's ERROR 22023 (the session goes on)."""
    for f in formats:
        if f not in (0, 1):
            raise InvalidParameterValue(f"unsupported format code: {f}")


def _with_format(f: FieldDescription, fmt: int) -> FieldDescription:
    return FieldDescription(f.name, f.type_oid, f.type_size, f.type_mod, f.table_oid, f.column_attr, fmt)


class ExtendedProtocol:
    """The prepared-statement and portal stores of one connection, and the messages over them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        #: Each entry with the bytes it holds (:mod:`.memory`), given back however it leaves.
        self.statements: HeldStore[str, PlannedStatement] = HeldStore()
        self.portals: HeldStore[str, Portal] = HeldStore()

    async def handle(self, msg: pq.FrontendMessage) -> None:
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

    def sync(self, commands: SessionCommands) -> None:
        """Unnamed and named portals live until the end of the transaction."""
        if commands.tx == "I":
            self.portals.clear()

    # -- Parse ---------------------------------------------------------------------------------------

    async def on_parse(self, msg: pq.Parse) -> None:
        conn = self.conn
        if msg.name and msg.name in self.statements:
            raise DuplicatePreparedStatement(f'prepared statement "{msg.name}" already exists')
        limit = conn.ctx.options.max_prepared
        if msg.name and len(self.statements) >= limit:
            raise ConfigurationLimitExceeded(
                f"too many prepared statements in this session (at most {limit})",
                hint="Close (DEALLOCATE) prepared statements that are no longer needed.",
            )
        if not msg.name:
            self.statements.pop("", None)  # as PostgreSQL: the unnamed statement goes at the next Parse
        hold = conn.memory.hold("prepared statement", statement_size(msg.sql, msg.param_oids))
        try:
            await self._parse(msg)
        except BaseException:
            hold.release()
            raise
        self.statements.attach(msg.name, hold)
        conn.replies.send(pq.parse_complete())

    async def _parse(self, msg: pq.Parse) -> None:
        conn = self.conn
        statements = await conn.split(msg.sql)
        if len(statements) > 1:
            raise SyntaxError_("cannot insert multiple commands into a prepared statement")
        stmt = await conn.plan_async(statements[0] if statements else msg.sql)
        stmt.param_oids = list(msg.param_oids)
        conn.commands.check_not_failed(stmt.command)
        started = time.monotonic()
        try:
            await self._describe_statement(stmt)
        except Error as exc:  # refused at Parse (drivers' extended protocol): no Execute will audit it
            conn.audit_refusal(stmt.sql, exc.sqlstate, started)
            raise
        self.statements[msg.name] = stmt

    async def _describe_statement(self, stmt: PlannedStatement) -> None:
        """Fill parameter types and result columns without running the query (no budget spent)."""
        conn = self.conn
        if stmt.route in ("catalog", "tableless") and (stmt.route == "catalog" or conn.answer_select(stmt.sql) is None):
            if not conn.ctx.catalog_available:
                if stmt.route == "catalog":
                    raise CatalogUnavailable()
                return
            oids, fields = await conn.work.shadow_call(
                "describe", stmt.sql, stmt.param_oids, timeout_ms=conn.timeout_ms(), verdict=stmt.verdict
            )
            stmt.route, stmt.param_oids, stmt.catalog_fields = "catalog", oids, fields
        elif stmt.route == "engine":
            await self._describe_engine(stmt)
        elif stmt.route == "mixed":
            raise refuse_mixed()
        elif stmt.route == "local":
            await conn.describe_session_command(stmt)  # DECLARE: its query's parameter types

    describe_statement = _describe_statement

    async def _describe_engine(self, stmt: PlannedStatement) -> None:
        conn = self.conn
        assert conn.session is not None
        explain = stmt.explain_target
        target = stmt.sql if explain is None else (explain_target(stmt.sql) or explain)  # past (FORMAT JSON)
        engine, session = conn.ctx.engine, conn.session

        def work() -> tuple[Any, list[bool] | None]:
            description = engine.describe(target, session)
            noisy = None if explain is not None else noisy_flags(description.columns)
            return description, noisy

        description, stmt.noisy = await conn.work.run(work, timeout_ms=conn.timeout_ms())
        inferred = [oid_for(t) for t in description.param_types]
        given = stmt.param_oids
        oids = [given[i] if i < len(given) and given[i] else inferred[i] for i in range(len(inferred))]
        stmt.param_oids = oids + given[len(oids) :]
        explained = [OutputColumn("QUERY PLAN", "text", noisy=False)]
        stmt.engine_columns = explained if explain is not None else list(description.columns)

    def fields_for(self, stmt: PlannedStatement, show_intervals: bool) -> list[FieldDescription] | None:
        conn = self.conn
        if stmt.route == "engine":
            if stmt.engine_columns is None:
                return None
            flags = stmt.noisy if show_intervals and stmt.explain_target is None else None
            return engine_fields(stmt.engine_columns, flags, conn.confidence())
        if stmt.route == "catalog":
            return stmt.catalog_fields
        if stmt.route == "tableless":
            values = conn.answer_select(stmt.sql)
            return [FieldDescription(v.name, v.type_oid, type_size(v.type_oid)) for v in values] if values else None
        if stmt.route == "local" and stmt.command is not None:
            assert conn.settings is not None
            return conn.commands.fields(stmt.command, conn.settings)
        return None

    # -- Bind ----------------------------------------------------------------------------------------

    async def on_bind(self, msg: pq.Bind) -> None:
        conn = self.conn
        stmt = self.statements.get(msg.statement)
        if stmt is None:
            raise InvalidStatementName(f'prepared statement "{msg.statement}" does not exist')
        if msg.portal and msg.portal in self.portals:
            raise DuplicateCursor(f'portal "{msg.portal}" already exists')
        if not msg.portal:
            self.portals.pop("", None)  # as PostgreSQL: the unnamed portal goes at the next Bind
        limit = conn.ctx.options.max_portals
        if msg.portal and len(self.portals) >= limit:
            raise ConfigurationLimitExceeded(
                f"too many portals in this session (at most {limit})",
                hint="Close portals, or Sync outside a transaction.",
            )
        _check_formats(msg.param_formats)
        _check_formats(msg.result_formats)
        if len(msg.param_formats) not in (0, 1, len(msg.params)):
            raise WireViolation("bind message has an invalid number of parameter formats")
        expected = len(stmt.param_oids)
        if len(msg.params) != expected:
            raise ProtocolViolation(
                f"bind message supplies {len(msg.params)} parameters, but prepared statement "
                f'"{msg.statement}" requires {expected}'
            )
        assert conn.settings is not None
        portal = Portal(stmt, msg.params, msg.param_formats, msg.result_formats, conn.settings.show_intervals)
        conn.decode_params(stmt, portal)  # validate now: PostgreSQL reports bad input at Bind
        hold = conn.memory.hold("portal", params_size(msg.params))
        if (text := self.statements.hold_of(msg.statement)) is not None:
            hold.parts.append(text.share())  # it keeps the statement alive after a Close of it
        self.portals.put(msg.portal, portal, hold)
        conn.replies.send(pq.bind_complete())

    # -- Describe ------------------------------------------------------------------------------------

    async def on_describe(self, msg: pq.Describe) -> None:
        conn = self.conn
        assert conn.settings is not None
        if msg.target == "S":
            stmt = self.statements.get(msg.name)
            if stmt is None:
                raise InvalidStatementName(f'prepared statement "{msg.name}" does not exist')
            conn.replies.send(pq.parameter_description(stmt.param_oids))
            fields = self.fields_for(stmt, conn.settings.show_intervals)
        elif msg.name not in self.portals and msg.name in conn.commands.cursors:  # cursors are portals too
            fields = conn.commands.cursors[msg.name].fields
        else:
            fields = self._portal_fields(self._portal(msg.name))
        conn.replies.send(pq.row_description(fields) if fields is not None else pq.no_data())

    def _portal(self, name: str) -> Portal:
        portal = self.portals.get(name)
        if portal is None:
            raise InvalidCursorName(f'portal "{name}" does not exist')
        return portal

    def _portal_fields(self, portal: Portal) -> list[FieldDescription] | None:
        fields = portal.outcome.fields if portal.outcome else self.fields_for(portal.statement, portal.show_intervals)
        if fields is None:
            return None
        formats = expand_formats(portal.result_formats, len(fields))
        return [_with_format(f, fmt) for f, fmt in zip(fields, formats, strict=True)]

    # -- Execute and Close ---------------------------------------------------------------------------

    async def on_execute(self, msg: pq.Execute) -> None:
        conn = self.conn
        portal = self._portal(msg.portal)
        if portal.outcome is None:
            portal.outcome = await conn.execute(portal.statement, portal)
            if (hold := portal.outcome.take_hold()) is not None:  # the portal keeps the rows till it closes
                self.portals.attach(msg.portal, hold)
            conn.replies.send_side_effects(portal.outcome)
        outcome = portal.outcome
        if portal.statement.route == "empty":
            conn.replies.send(pq.empty_query_response())
            return
        if outcome.fields is None:
            conn.replies.send(pq.command_complete(outcome.tag))
            return
        if outcome.encoded:
            formats = [f.format for f in outcome.fields]
        else:
            formats = expand_formats(portal.result_formats, len(outcome.fields))
        end = len(outcome.rows) if msg.max_rows <= 0 else min(len(outcome.rows), portal.sent + msg.max_rows)
        batch = outcome.rows[portal.sent : end]
        await conn.replies.send_rows(outcome, batch, formats)
        portal.sent = end
        if end < len(outcome.rows):
            conn.replies.send(pq.portal_suspended())
        else:
            tag = outcome.tag
            if tag.startswith("SELECT "):
                tag = f"SELECT {len(batch)}"
            conn.replies.send(pq.command_complete(tag))

    def on_close(self, msg: pq.Close) -> None:
        if msg.target == "S":
            self.statements.pop(msg.name, None)
        elif self.portals.pop(msg.name, None) is None:
            self.conn.commands.cursors.pop(msg.name, None)  # a DECLAREd cursor is a portal too
        self.conn.replies.send(pq.close_complete())
