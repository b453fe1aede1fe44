"""PEP 249 exception hierarchy whose leaves carry a PostgreSQL SQLSTATE.

Every refusal dpsql makes is one of these, so the DB-API driver, the CLI and the
wire server all report the same SQLSTATE, message, detail and hint. Messages must
never depend on private data: they name clauses, columns and policy lines only.
"""

from __future__ import annotations


class Warning(Exception):
    """PEP 249 Warning."""


class Error(Exception):
    """PEP 249 base error; ``sqlstate`` follows PostgreSQL's error codes."""

    sqlstate: str = "XX000"
    severity: str = "ERROR"

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
        if sqlstate is not None:
            self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint
        self.position = position

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
    sqlstate = "08000"


class DatabaseError(Error):
    pass


class DataError(DatabaseError):
    sqlstate = "22000"


class OperationalError(DatabaseError):
    sqlstate = "58000"


class IntegrityError(DatabaseError):
    sqlstate = "23000"


class InternalError(DatabaseError):
    sqlstate = "XX000"


class ProgrammingError(DatabaseError):
    sqlstate = "42000"


class NotSupportedError(DatabaseError):
    sqlstate = "0A000"


# --- dpsql's named refusals (one class per SQLSTATE we raise) -----------------------


class SyntaxError_(ProgrammingError):
    sqlstate = "42601"


class UndefinedTable(ProgrammingError):
    sqlstate = "42P01"


class UndefinedColumn(ProgrammingError):
    sqlstate = "42703"


class UndefinedFunction(ProgrammingError):
    sqlstate = "42883"


class UndefinedParameter(ProgrammingError):
    sqlstate = "42P02"


class GroupingError(ProgrammingError):
    """A raw (non-aggregated, non-key) value would be released."""

    sqlstate = "42803"


class InsufficientPrivilege(ProgrammingError):
    """Identifier columns and non-exposed objects."""

    sqlstate = "42501"


class DatatypeMismatch(ProgrammingError):
    sqlstate = "42804"


class AmbiguousColumn(ProgrammingError):
    sqlstate = "42702"


class FeatureNotSupported(NotSupportedError):
    sqlstate = "0A000"


class ReadOnlyViolation(ProgrammingError):
    """DDL/DML: dpsql is a read-only gateway (PostgreSQL's read_only_sql_transaction)."""

    sqlstate = "25006"


class ProgramLimitExceeded(OperationalError):
    """A statement exceeds one of dpsql's size limits (PostgreSQL's 54000)."""

    sqlstate = "54000"


class StatementTooComplex(OperationalError):
    """Nesting deeper than the analyzer's recursion allows (PostgreSQL's 54001)."""

    sqlstate = "54001"


class QueryCanceled(OperationalError):
    """The statement ran past its timeout or was cancelled (PostgreSQL's 57014)."""

    sqlstate = "57014"


class InvalidAuthorization(OperationalError):
    """Unknown analyst or failed authentication."""

    sqlstate = "28000"


class InvalidParameterValue(DataError):
    sqlstate = "22023"


class PrivacyBudgetExhausted(OperationalError):
    """The query's cost would exceed an analyst's or the dataset's budget."""

    sqlstate = "53P01"


class LedgerUnavailable(OperationalError):
    """The accountant cannot durably record a charge: fail closed."""

    sqlstate = "58P01"


class BackendError(OperationalError):
    """The database failed; its own message is withheld (it may depend on data)."""

    sqlstate = "58P02"


class PolicyError(Error):
    """A policy file is invalid; the message names file, line and key path."""

    sqlstate = "F0000"
