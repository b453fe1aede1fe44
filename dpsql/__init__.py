"""dpsql: a differential-privacy SQL gateway that speaks PostgreSQL.

Public API: :func:`connect` (PEP 249 driver), :class:`Engine`, the errors in
:mod:`dpsql.errors`, and the ``dpsql`` command line.

The names below are resolved on first use (PEP 562), so that importing one submodule —
``dpsql.errors``, ``dpsql.version`` — loads that module and what it needs, not the whole engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpsql.version import __version__

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    """The public API, imported on first access (the facade is the one place allowed a lazy import)."""
    if name == "Engine":
        from dpsql.engine import Engine

        return Engine
    if name in __all__:
        from dpsql import dbapi

        return getattr(dbapi, name)
    raise AttributeError(f"module 'dpsql' has no attribute {name!r}")
