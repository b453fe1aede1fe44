"""dpsql: a differential-privacy SQL gateway that speaks PostgreSQL.

Public API: :func:`connect` (PEP 249 driver), :class:`Engine`, the errors in
:mod:`dpsql.errors`, and the ``dpsql`` command line.
"""

from dpsql.dbapi import (
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    Warning,
    apilevel,
    connect,
    paramstyle,
    threadsafety,
)
from dpsql.engine import Engine

__version__ = "0.1.0"

__all__ = [
    "DataError",
    "DatabaseError",
    "Engine",
    "Error",
    "IntegrityError",
    "InterfaceError",
    "InternalError",
    "NotSupportedError",
    "OperationalError",
    "ProgrammingError",
    "Warning",
    "__version__",
    "apilevel",
    "connect",
    "paramstyle",
    "threadsafety",
]
