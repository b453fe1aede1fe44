"""PostgreSQL type names and OIDs: the one table the wire server, the DB-API and the engine share.

dpsql releases ten types (:data:`PgType`, keys typed as PostgreSQL types them: ``CAST(x AS integer)`` is
int4, ``date_trunc`` of a date is ``timestamp with time zone``); parameters may arrive in any of :data:`OIDS`.
Also PostgreSQL's boolean input syntax (:func:`parse_bool`), used by Bind parameters and by
``SET`` alike.
"""

from __future__ import annotations

from typing import Literal

#: The types dpsql releases (an :class:`~dpsql.session.OutputColumn`'s ``type``).
PgType = Literal[
    "bigint",
    "integer",
    "smallint",
    "double precision",
    "text",
    "date",
    "timestamp",
    "timestamp with time zone",
    "boolean",
    "numeric",
]

BOOL, BYTEA, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 19, 20, 21, 23, 25, 26
FLOAT4, FLOAT8, UNKNOWN = 700, 701, 705
BPCHAR, VARCHAR, DATE, TIMESTAMP, TIMESTAMPTZ, NUMERIC = 1042, 1043, 1082, 1114, 1184, 1700

#: OID of every type name the server understands (canonical PostgreSQL spelling).
OIDS: dict[str, int] = {
    "boolean": BOOL,
    "bytea": BYTEA,
    "name": NAME,
    "bigint": INT8,
    "smallint": INT2,
    "integer": INT4,
    "text": TEXT,
    "oid": OID,
    "real": FLOAT4,
    "double precision": FLOAT8,
    "unknown": UNKNOWN,
    "character": BPCHAR,
    "character varying": VARCHAR,
    "date": DATE,
    "timestamp": TIMESTAMP,
    "timestamp with time zone": TIMESTAMPTZ,
    "numeric": NUMERIC,
}

#: Other spellings PostgreSQL accepts for those names.
ALIASES: dict[str, str] = {
    "int8": "bigint",
    "int4": "integer",
    "int": "integer",
    "int2": "smallint",
    "float8": "double precision",
    "float4": "real",
    "float": "double precision",
    "bool": "boolean",
    "varchar": "character varying",
    "timestamptz": "timestamp with time zone",
    "decimal": "numeric",
}

#: OIDs of the types dpsql releases (wire RowDescription, DB-API type codes).
PG_TYPE_OIDS: dict[str, int] = {
    name: OIDS[name]
    for name in (
        "boolean",
        "bigint",
        "integer",
        "smallint",
        "text",
        "double precision",
        "date",
        "timestamp",
        "timestamp with time zone",
        "numeric",
    )
}

#: typlen of the fixed-size types (RowDescription); -1 (variable) for the others.
TYPE_SIZES: dict[int, int] = {
    BOOL: 1,
    NAME: 64,
    INT8: 8,
    INT2: 2,
    INT4: 4,
    OID: 4,
    FLOAT4: 4,
    FLOAT8: 8,
    DATE: 4,
    TIMESTAMP: 8,
    TIMESTAMPTZ: 8,
}


def oid_for(type_name: str) -> int:
    """OID of a PostgreSQL type name (``text`` for anything unknown)."""
    name = type_name.strip().lower()
    return OIDS.get(ALIASES.get(name, name), TEXT)


def type_size(oid: int) -> int:
    return TYPE_SIZES.get(oid, -1)


_TRUE = frozenset({"t", "true", "y", "yes", "on", "1"})
_FALSE = frozenset({"f", "false", "n", "no", "off", "0"})


def parse_bool(text: str) -> bool:
    """PostgreSQL's boolean input (``on``/``off``, ``true``/``false``, ``yes``/``no``, ``1``/``0``, …).

    Raises ValueError for anything else.
    """
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(text)
