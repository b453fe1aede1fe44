"""PEP 249 exception hierarchy whose leaves carry a PostgreSQL SQLSTATE.

Every refusal dpsql makes is one of these, so the DB-API driver, the CLI and the
wire server all report the same SQLSTATE, message, detail and hint. Messages must
never depend on private data: they name clauses, columns and policy lines only.

As in psycopg, the class decides the SQLSTATE: each code dpsql raises has one class,
registered by ``class X(Base, code="…")`` and found again with :func:`lookup`. The PEP 249
base of that class follows the code's class (its first two characters, :data:`PEP249_BASES`),
so ``except DataError`` catches every 22xxx. The whole catalogue is this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: SQLSTATE → the one class raised with it (filled by ``code=`` in the class statements below).
_BY_CODE: dict[str, type[Error]] = {}


class Warning(Exception):
    """PEP 249 Warning."""


class Error(Exception):
    """PEP 249 base error; ``sqlstate`` follows PostgreSQL's error codes.

    ``sqlstate=`` is kept for old raise sites only: the instance is then built as the class
    registered for that code (so class and code agree), e.g. ``DataError(…, sqlstate="22012")``
    is a :class:`DivisionByZero`. New code raises the class itself.
    """

    sqlstate: str = "XX000"
    severity: str = "ERROR"
    #: ε already charged for the statement that failed (reserved before it ran): told to the analyst
    #: in DETAIL and written to the server log, so log, ledger and analyst agree.
    charged_epsilon: float = 0.0

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is None:
            return
        if code in _BY_CODE:
            raise TypeError(f"SQLSTATE {code} is already {_BY_CODE[code].__name__}")
        cls.sqlstate = code
        _BY_CODE[code] = cls

    def __new__(cls, *args: Any, sqlstate: str | None = None, **kwargs: Any) -> Error:
        target = cls if sqlstate is None or sqlstate == cls.sqlstate else _BY_CODE.get(sqlstate, cls)
        self = super().__new__(target, *args)
        if not isinstance(self, cls):  # Python will not run __init__ for another class: do it here
            self.__init__(*args, sqlstate=sqlstate, **kwargs)  # type: ignore[misc]
        return self

    def __init__(
        self,
        message: str,
        *,
        sqlstate: str | None = None,
        detail: str | None = None,
        hint: str | None = None,
        position: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if sqlstate is not None and sqlstate != self.sqlstate:
            self.sqlstate = sqlstate  # an unregistered code (see relay): the instance keeps it
        self.detail = detail
        self.hint = hint
        self.position = position

    def fatal(self) -> Error:
        """The same error, ending the session (PostgreSQL's FATAL severity)."""
        self.severity = "FATAL"
        return self

    # psycopg-compatible accessors
    @property
    def pgcode(self) -> str:
        return self.sqlstate

    @property
    def pgerror(self) -> str:
        return self.message

    def __str__(self) -> str:
        parts = [self.message]
        if self.detail:
            parts.append(f"DETAIL:  {self.detail}")
        if self.hint:
            parts.append(f"HINT:  {self.hint}")
        return "\n".join(parts)


class InterfaceError(Error):
    """Misuse of the DB-API objects themselves (client side: not a server SQLSTATE)."""

    sqlstate = "08000"


class DatabaseError(Error):
    pass


class DataError(DatabaseError, code="22000"):
    pass


class OperationalError(DatabaseError):
    sqlstate = "58000"


class IntegrityError(DatabaseError, code="23000"):
    pass


class InternalError(DatabaseError, code="XX000"):
    pass


class UniqueViolation(IntegrityError, code="23505"):
    """A key the policy's ``references`` relies on repeats in the data (see :mod:`dpsql.unit_keys`)."""


class ProgrammingError(DatabaseError, code="42000"):
    pass


class NotSupportedError(DatabaseError):
    sqlstate = "0A000"


#: PEP 249 base of each SQLSTATE class (psycopg's map, except 24 and 25, which dpsql reports
#: as ProgrammingError: a fetch without a result, and writes to a read-only gateway).
PEP249_BASES: dict[str, type[Error]] = {
    "08": OperationalError,
    "0A": NotSupportedError,
    "22": DataError,
    "23": IntegrityError,
    "24": ProgrammingError,
    "25": ProgrammingError,
    "26": ProgrammingError,
    "28": OperationalError,
    "34": ProgrammingError,
    "3B": OperationalError,
    "42": ProgrammingError,
    "53": OperationalError,
    "54": OperationalError,
    "55": OperationalError,
    "57": OperationalError,
    "58": OperationalError,
    "F0": OperationalError,
    "XX": InternalError,
}


def lookup(sqlstate: str) -> type[Error]:
    """The class dpsql raises with ``sqlstate``; KeyError if dpsql never raises it."""
    return _BY_CODE[sqlstate]


def registry() -> dict[str, type[Error]]:
    """Every SQLSTATE dpsql raises, with its class (a copy)."""
    return dict(_BY_CODE)


def relay(
    sqlstate: str, message: str, *, detail: str | None = None, hint: str | None = None, position: int | None = None
) -> Error:
    """An error reported by another PostgreSQL server (the shadow catalog), under its own SQLSTATE.

    A registered code gets its class; any other gets the PEP 249 base of its class of codes.
    """
    cls = _BY_CODE.get(sqlstate)
    if cls is not None:
        return cls(message, detail=detail, hint=hint, position=position)
    base = PEP249_BASES.get(sqlstate[:2], OperationalError)
    return base(message, sqlstate=sqlstate, detail=detail, hint=hint, position=position)


# --- dpsql's named refusals: one class per SQLSTATE, grouped by class of code ------------------

# 08: connection exception


class ConnectionFailure(OperationalError, code="08006"):
    """The connection to the catalog server was lost."""


class ProtocolViolation(OperationalError, code="08P01"):
    pass


# 0A: feature not supported


class FeatureNotSupported(NotSupportedError, code="0A000"):
    pass


# 22: data exception


class DatetimeFieldOverflow(DataError, code="22008"):
    pass


class InvalidDatetimeFormat(DataError, code="22007"):
    """A date/time constant that does not parse (constant folding, before anything runs)."""


class IntervalFieldOverflow(DataError, code="22015"):
    """An interval constant whose field overflows PostgreSQL's interval (constant folding)."""


class DivisionByZero(DataError, code="22012"):
    pass


class CharacterNotInRepertoire(DataError, code="22021"):
    """Text that is not valid UTF-8 (``invalid byte sequence for encoding "UTF8"``)."""


class InvalidParameterValue(DataError, code="22023"):
    pass


class InvalidEscapeSequence(DataError, code="22025"):
    pass


class NumericValueOutOfRange(DataError, code="22003"):
    pass


class InvalidTextRepresentation(DataError, code="22P02"):
    pass


class InvalidBinaryRepresentation(DataError, code="22P03"):
    pass


# 24, 25, 26: cursor, transaction and prepared-statement state


class InvalidCursorState(ProgrammingError, code="24000"):
    pass


class ActiveTransaction(ProgrammingError, code="25001"):
    pass


class ReadOnlyViolation(ProgrammingError, code="25006"):
    """DDL/DML: dpsql is a read-only gateway (PostgreSQL's read_only_sql_transaction)."""


class NoActiveTransaction(ProgrammingError, code="25P01"):
    pass


class FailedTransaction(ProgrammingError, code="25P02"):
    pass


class IdleInTransactionTimeout(ProgrammingError, code="25P03"):
    pass


class InvalidStatementName(ProgrammingError, code="26000"):
    """No prepared statement of that name."""


# 28: invalid authorization


class InvalidAuthorization(OperationalError, code="28000"):
    """Unknown analyst or failed authentication."""


class InvalidPassword(OperationalError, code="28P01"):
    pass


# 34, 3B: cursor and savepoint names


class InvalidCursorName(ProgrammingError, code="34000"):
    pass


class InvalidSavepoint(OperationalError, code="3B001"):
    pass


# 42: syntax error or access rule violation


class SyntaxError_(ProgrammingError, code="42601"):
    pass


class InsufficientPrivilege(ProgrammingError, code="42501"):
    """Identifier columns and non-exposed objects."""


class AmbiguousColumn(ProgrammingError, code="42702"):
    pass


class UndefinedColumn(ProgrammingError, code="42703"):
    pass


class UndefinedObject(ProgrammingError, code="42704"):
    pass


class DuplicateAlias(ProgrammingError, code="42712"):
    pass


class GroupingError(ProgrammingError, code="42803"):
    """A raw (non-aggregated, non-key) value would be released."""


class DatatypeMismatch(ProgrammingError, code="42804"):
    pass


class UndefinedFunction(ProgrammingError, code="42883"):
    pass


class UndefinedTable(ProgrammingError, code="42P01"):
    pass


class UndefinedParameter(ProgrammingError, code="42P02"):
    pass


class DuplicateCursor(ProgrammingError, code="42P03"):
    pass


class DuplicatePreparedStatement(ProgrammingError, code="42P05"):
    pass


class InvalidColumnReference(ProgrammingError, code="42P10"):
    pass


# 53, 54, 55: resources, limits, state


class OutOfMemory(OperationalError, code="53200"):
    """A session, an analyst's sessions or the server would hold more bytes than allowed (PostgreSQL's 53200)."""


class TooManyConnections(OperationalError, code="53300"):
    pass


class ConfigurationLimitExceeded(OperationalError, code="53400"):
    pass


class PrivacyBudgetExhausted(OperationalError, code="53P01"):
    """The query's cost would exceed an analyst's or the dataset's budget."""


class ProgramLimitExceeded(OperationalError, code="54000"):
    """A statement exceeds one of dpsql's size limits (PostgreSQL's 54000)."""


class StatementTooComplex(OperationalError, code="54001"):
    """Nesting deeper than the analyzer's recursion allows (PostgreSQL's 54001)."""


class ObjectNotInPrerequisiteState(OperationalError, code="55000"):
    """E.g. a backward FETCH from a cursor declared NO SCROLL (PostgreSQL's 55000)."""


class CantChangeRuntimeParam(OperationalError, code="55P02"):
    pass


# 57: operator intervention


class QueryCanceled(OperationalError, code="57014"):
    """The statement ran past its timeout or was cancelled (PostgreSQL's 57014)."""


class AdminShutdown(OperationalError, code="57P01"):
    pass


class CannotConnectNow(OperationalError, code="57P03"):
    pass


class IdleSessionTimeout(OperationalError, code="57P05"):
    pass


# 58: system error


class SystemError_(OperationalError, code="58000"):
    """A failure outside dpsql (a client library), reported without its text."""


class LedgerUnavailable(OperationalError, code="58P01"):
    """The accountant cannot durably record a charge: fail closed."""


class BackendError(OperationalError, code="58P02"):
    """The database failed; its own message is withheld (it may depend on data)."""


# F0: configuration file


class PolicyError(OperationalError, code="F0000"):
    """A policy file is invalid; the message names file, line and key path."""


# --- classes defined by where they are raised (same code as their base) --------------------------


class CatalogUnavailable(FeatureNotSupported):
    """The shadow catalog server is not running: catalog queries cannot be answered."""

    def __init__(self) -> None:
        super().__init__(
            "catalog queries are not available: the metadata server could not be started",
            hint="DP queries on the policy tables still work; start dpsql with a catalog_dsn.",
        )


class AuthFailed(InvalidPassword):
    """SCRAM proof did not verify."""

    severity = "FATAL"


class ScramProtocolError(ProtocolViolation):
    """Malformed SASL/SCRAM message."""

    severity = "FATAL"


@contextlib.contextmanager
def charged_on_failure(epsilon: float) -> Iterator[None]:
    """Around the work that follows a reservation: a dpsql error raised there says what was charged.

    The budget is reserved durably before a statement runs, and is not refunded when it then fails:
    whether it fails (a timeout, a database error, a division by a noisy zero) may depend on the data
    or the noise, so a refund would turn failures into a free oracle. The analyst reads the charge in
    DETAIL, and the server's log line carries it (``charged_epsilon``), as the ledger does."""
    try:
        yield
    except Error as exc:
        if epsilon > 0 and not exc.charged_epsilon:
            exc.charged_epsilon = epsilon
            note = (
                f"ε={epsilon:.4g} was charged for this statement: the budget is reserved before it runs "
                "and is not refunded when it fails."
            )
            exc.detail = f"{exc.detail}\n{note}" if exc.detail else note
        raise
