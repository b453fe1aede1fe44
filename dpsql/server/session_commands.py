"""Session commands the connection answers itself, and the transaction status they drive.

dpsql is read-only, so a transaction is bookkeeping only: :class:`TxStatus` (PostgreSQL's
ReadyForQuery I/T/E) plus the savepoint names. Each :class:`~.answers.Action` has one handler in
:data:`SessionCommands.handlers`; ``SET``/``SHOW`` go through the session's :class:`Settings`.

Cursors (``DECLARE``, run by the connection) are the *released* rows of one query, kept here:
FETCH, MOVE and CLOSE only page through numbers that were already charged for and noised, so
they are post-processing and spend nothing, whatever they ask for and however often.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from dpsql.budget_view import BUDGET_COLUMNS, own_budget
from dpsql.errors import (
    ActiveTransaction,
    FailedTransaction,
    InvalidCursorName,
    InvalidSavepoint,
    InvalidStatementName,
    NoActiveTransaction,
    ObjectNotInPrerequisiteState,
)
from dpsql.pgtypes import PG_TYPE_OIDS, TEXT

from .answers import Action, FetchSpec, SessionCommand
from .memory import HeldStore
from .protocol import Diagnostic, FieldDescription
from .results import Outcome
from .types import encode_value

if TYPE_CHECKING:
    from dpsql.engine import Engine

    from .answers import Settings
    from .extended import PlannedStatement, Portal

SHOW_ALL_COLUMNS = ("name", "setting", "description")
#: ``SHOW dpsql.budget``: the connected analyst's own budget row (see :mod:`dpsql.budget_view`).
SHOW_BUDGET = "dpsql.budget"


class TxStatus(StrEnum):
    """The transaction status byte of ReadyForQuery."""

    IDLE = "I"
    IN_TRANSACTION = "T"
    FAILED = "E"


def _warning(sqlstate: str, text: str) -> Diagnostic:
    return Diagnostic("WARNING", sqlstate, text)


@dataclass(slots=True)
class Cursor:
    """A declared cursor: the released rows and their columns, and PostgreSQL's position in them
    (0: before the first row, 1..n: on a row, n+1: after the last).

    ``encoded`` rows hold wire bytes already (catalog answers, BINARY cursors); ``depth`` is the
    number of savepoints when it was declared (ROLLBACK TO closes the younger ones); a ``hold``
    cursor survives COMMIT (``committed`` once it has).
    """

    fields: list[FieldDescription]
    rows: list[tuple[Any, ...]]
    encoded: bool = False
    scroll: bool | None = None
    hold: bool = False
    depth: int = 0
    committed: bool = False
    pos: int = 0

    def step(self, spec: FetchSpec) -> list[tuple[Any, ...]]:
        """The rows FETCH returns (MOVE skips them), moving the position as PostgreSQL does."""
        n, count = len(self.rows), spec.count
        below = self.pos if spec.direction == "absolute" else 0  # absolute/relative targets behind us
        backward = spec.direction == "backward" or (spec.direction != "forward" and (count or 0) < below)
        if backward and self.scroll is False:
            raise ObjectNotInPrerequisiteState(
                "cursor can only scan forward", hint="Declare it with SCROLL option to enable backward scan."
            )
        if spec.direction in ("absolute", "relative"):
            assert count is not None
            target = (count if count >= 0 else n + 1 + count) if spec.direction == "absolute" else self.pos + count
            self.pos = min(max(target, 0), n + 1)
            return [self.rows[self.pos - 1]] if 0 < self.pos <= n else []
        if spec.direction == "forward":
            if count == 0:  # FETCH 0: the current row again
                return [self.rows[self.pos - 1]] if 0 < self.pos <= n else []
            avail = max(n - self.pos, 0)
            taken = avail if count is None else min(count, avail)
            rows = self.rows[self.pos : self.pos + taken]
            self.pos = self.pos + taken if count is not None and taken == count else n + 1
            return rows
        avail = max(min(self.pos, n + 1) - 1, 0)
        taken = avail if count is None else min(count, avail)
        rows = self.rows[self.pos - 1 - taken : self.pos - 1][::-1]
        self.pos = self.pos - taken if count is not None and taken == count else 0
        return rows


class SessionCommands:
    """Transaction status, savepoints and the handlers of the statements in :mod:`.answers`."""

    def __init__(self, statements: dict[str, PlannedStatement], portals: dict[str, Portal]) -> None:
        self.tx = TxStatus.IDLE
        self.savepoints: list[str] = []
        self.settings: Settings | None = None
        #: The extended protocol's stores (DISCARD ALL and DEALLOCATE empty them).
        self.statements = statements
        self.portals = portals
        #: Set by the connection: ``SHOW dpsql.budget`` reads the analyst's own row from its ledger.
        self.engine: Engine | None = None
        #: Open cursors by name (DECLARE: the connection runs the query and adds them here, with the
        #: bytes of their rows: given back however a cursor closes, see :mod:`.memory`).
        self.cursors: HeldStore[str, Cursor] = HeldStore()
        self.handlers: dict[Action, Callable[[SessionCommand], Outcome | None]] = {
            Action.NOOP: lambda cmd: None,
            Action.SET: self.set,
            Action.RESET: self.reset,
            Action.RESET_ALL: self.reset_all,
            Action.SHOW: self.show,
            Action.SHOW_ALL: self.show_all,
            Action.DISCARD_ALL: self.discard_all,
            Action.BEGIN: self.begin,
            Action.COMMIT: self.commit,
            Action.ROLLBACK: self.rollback,
            Action.ROLLBACK_TO: self.rollback_to,
            Action.SAVEPOINT: self.savepoint,
            Action.RELEASE: self.release,
            Action.CLOSE: self.close,
            Action.DEALLOCATE: self.deallocate,
            Action.FETCH: self.fetch,
            Action.MOVE: self.move,
        }

    # -- transaction status ------------------------------------------------------------------------

    def fail(self) -> None:
        """An error inside a transaction block aborts it (until ROLLBACK)."""
        if self.tx is TxStatus.IN_TRANSACTION:
            self.tx = TxStatus.FAILED

    def _end(self, commit: bool = False) -> None:
        """End the transaction block: WITHOUT HOLD cursors close; WITH HOLD ones survive a COMMIT."""
        self.tx, self.savepoints = TxStatus.IDLE, []
        for name, cursor in list(self.cursors.items()):
            if cursor.hold and (commit or cursor.committed):
                cursor.committed, cursor.depth = True, 0
            else:
                del self.cursors[name]

    def check_not_failed(self, command: SessionCommand | None) -> None:
        allowed = command is not None and command.action in (Action.COMMIT, Action.ROLLBACK, Action.ROLLBACK_TO)
        if self.tx is TxStatus.FAILED and not allowed:
            raise FailedTransaction("current transaction is aborted, commands ignored until end of transaction block")

    # -- dispatch ------------------------------------------------------------------------------------

    def run(self, cmd: SessionCommand) -> Outcome:
        assert self.settings is not None
        return self.handlers[cmd.action](cmd) or Outcome(None, [], cmd.tag)

    def fields(self, cmd: SessionCommand, settings: Settings) -> list[FieldDescription] | None:
        """The columns a command returns (Describe), None for none."""
        if cmd.action is Action.FETCH:
            cursor = self.cursors.get(cmd.name)
            return cursor.fields if cursor is not None else None
        if cmd.action is Action.SHOW and cmd.name.lower() == SHOW_BUDGET:
            return [FieldDescription(name, PG_TYPE_OIDS[type_]) for name, type_ in BUDGET_COLUMNS]
        if cmd.action is Action.SHOW:
            return [FieldDescription(settings.canonical(cmd.name), TEXT)]
        if cmd.action is Action.SHOW_ALL:
            return [FieldDescription(n, TEXT) for n in SHOW_ALL_COLUMNS]
        return None

    # -- settings ------------------------------------------------------------------------------------

    def set(self, cmd: SessionCommand) -> Outcome:
        assert self.settings is not None
        reported = self.settings.set(cmd.name, cmd.value)
        out = Outcome(None, [], "SET")
        if reported:
            out.status.append((reported, self.settings.values[reported]))
        return out

    def reset(self, cmd: SessionCommand) -> Outcome:
        return self.set(SessionCommand(Action.SET, "RESET", cmd.name, None))

    def reset_all(self, cmd: SessionCommand) -> Outcome:
        assert self.settings is not None
        changed = self.settings.reset_all()
        return Outcome(None, [], cmd.tag, status=[(k, self.settings.values[k]) for k in changed])

    def show(self, cmd: SessionCommand) -> Outcome:
        assert self.settings is not None
        if cmd.name.lower() == SHOW_BUDGET and self.engine is not None:
            # the analyst's own figures only; the ledger, not the data
            row = own_budget(self.engine.ledger, self.engine.policy, self.settings.session.analyst)
            return Outcome(self.fields(cmd, self.settings), [row], "SHOW")
        value = self.settings.get(cmd.name)
        return Outcome(self.fields(cmd, self.settings), [(value,)], "SHOW")

    def show_all(self, cmd: SessionCommand) -> Outcome:
        assert self.settings is not None
        rows = [(k, v, "") for k, v in sorted(self.settings.values.items(), key=lambda kv: kv[0].lower())]
        return Outcome(self.fields(cmd, self.settings), rows, "SHOW")

    def discard_all(self, cmd: SessionCommand) -> Outcome:
        if self.tx is not TxStatus.IDLE:
            raise ActiveTransaction("DISCARD ALL cannot run inside a transaction block")
        out = self.reset_all(cmd)
        self.statements.clear()
        self.portals.clear()
        self.cursors.clear()
        return out

    # -- transactions --------------------------------------------------------------------------------

    def begin(self, cmd: SessionCommand) -> Outcome:
        out = Outcome(None, [], "BEGIN")
        if self.tx is not TxStatus.IDLE:
            out.notices.append(_warning("25001", "there is already a transaction in progress"))
        else:
            self.tx, self.savepoints = TxStatus.IN_TRANSACTION, []
        return out

    def commit(self, cmd: SessionCommand) -> Outcome:
        out = Outcome(None, [], "ROLLBACK" if self.tx is TxStatus.FAILED else "COMMIT")
        if self.tx is TxStatus.IDLE:
            out.notices.append(_warning("25P01", "there is no transaction in progress"))
        self._end(commit=self.tx is TxStatus.IN_TRANSACTION)
        return out

    def rollback(self, cmd: SessionCommand) -> Outcome:
        out = Outcome(None, [], "ROLLBACK")
        if self.tx is TxStatus.IDLE:
            out.notices.append(_warning("25P01", "there is no transaction in progress"))
        self._end()
        return out

    def _find_savepoint(self, name: str, verb: str) -> int:
        if self.tx is TxStatus.IDLE:
            raise NoActiveTransaction(f"{verb} can only be used in transaction blocks")
        if name not in self.savepoints:
            raise InvalidSavepoint(f'savepoint "{name}" does not exist')
        return len(self.savepoints) - 1 - self.savepoints[::-1].index(name)

    def rollback_to(self, cmd: SessionCommand) -> None:
        index = self._find_savepoint(cmd.name, "ROLLBACK TO SAVEPOINT")
        self.savepoints = self.savepoints[: index + 1]
        self.tx = TxStatus.IN_TRANSACTION
        for name in [n for n, c in self.cursors.items() if c.depth > index]:  # declared after the savepoint
            del self.cursors[name]

    def savepoint(self, cmd: SessionCommand) -> None:
        if self.tx is TxStatus.IDLE:
            raise NoActiveTransaction("SAVEPOINT can only be used in transaction blocks")
        self.savepoints.append(cmd.name)

    def release(self, cmd: SessionCommand) -> None:
        self.savepoints = self.savepoints[: self._find_savepoint(cmd.name, "RELEASE SAVEPOINT")]

    # -- cursors and prepared statements ---------------------------------------------------------------

    def close(self, cmd: SessionCommand) -> None:
        if cmd.tag == "CLOSE CURSOR ALL":
            self.cursors.clear()
        elif self.cursors.pop(cmd.name, None) is None:
            raise InvalidCursorName(f'cursor "{cmd.name}" does not exist')

    def cursor(self, name: str) -> Cursor:
        cursor = self.cursors.get(name)
        if cursor is None:
            raise InvalidCursorName(f'cursor "{name}" does not exist')
        return cursor

    def fetch(self, cmd: SessionCommand) -> Outcome:
        assert cmd.fetch is not None
        cursor = self.cursor(cmd.name)
        rows = cursor.step(cmd.fetch)
        return Outcome(cursor.fields, rows, f"FETCH {len(rows)}", encoded=cursor.encoded)

    def move(self, cmd: SessionCommand) -> Outcome:
        assert cmd.fetch is not None
        return Outcome(None, [], f"MOVE {len(self.cursor(cmd.name).step(cmd.fetch))}")

    def declared(self, name: str, outcome: Outcome, cmd: SessionCommand) -> Outcome:
        """Keep a DECLAREd query's released rows as cursor ``name``; BINARY cursors hold them encoded."""
        assert outcome.fields is not None and cmd.declare is not None
        fields, rows = outcome.fields, outcome.rows
        if cmd.declare.binary and not outcome.encoded:
            fields = [
                FieldDescription(f.name, f.type_oid, f.type_size, f.type_mod, f.table_oid, f.column_attr, 1)
                for f in fields
            ]
            rows = [tuple(encode_value(v, f.type_oid, 1) for v, f in zip(r, fields, strict=True)) for r in rows]
        self.cursors[name] = Cursor(
            fields,
            rows,
            encoded=outcome.encoded or cmd.declare.binary,
            scroll=cmd.declare.scroll,
            hold=cmd.declare.hold,
            depth=len(self.savepoints),
            committed=self.tx is TxStatus.IDLE,  # WITH HOLD outside a block: its implicit transaction commits
        )
        return Outcome(None, [], "DECLARE CURSOR", notices=outcome.notices, epsilon=0.0)

    def deallocate(self, cmd: SessionCommand) -> None:
        if cmd.tag == "DEALLOCATE ALL":
            for name in [k for k in self.statements if k]:
                del self.statements[name]
        elif self.statements.pop(cmd.name, None) is None:
            raise InvalidStatementName(f'prepared statement "{cmd.name}" does not exist')
