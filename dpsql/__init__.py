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

try:  # one source: the installed package's metadata (pyproject.toml)
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("dpsql")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

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
