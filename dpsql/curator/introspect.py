"""Which tables and columns a database holds, and the type family of each stored column.

Tables and stored types come from the backend's own catalog (:meth:`Backend.tables`,
:meth:`Backend.columns`); NOT NULL and keys from ``information_schema``, on backends that have it
(:attr:`Backend.information_schema`: DuckDB and PostgreSQL). Schema only, the same on neighbouring
databases, so nothing here depends on any person's data.
"""

from __future__ import annotations

import re
from typing import Literal

from dpsql.backends import Backend

Family = Literal["int", "float", "text", "date", "timestamp", "boolean", "other"]

#: Stored type (lower case) → policy type family; first match wins.
_FAMILIES: tuple[tuple[str, Family], ...] = (
    (r"^(tinyint|smallint|integer|int|bigint|hugeint|utinyint|usmallint|uinteger|ubigint|uhugeint|int[248])$", "int"),
    (r"^(real|float|float[48]|double|double precision|numeric|decimal)", "float"),
    (r"^timestamp|^datetime", "timestamp"),
    (r"^date$", "date"),
    (r"^bool", "boolean"),
    (r"char|text|string|enum|uuid|user-defined|name$", "text"),
)

#: Which stored families each policy type accepts: a cast between them cannot fail on some rows only.
COMPATIBLE: dict[str, frozenset[Family]] = {
    "int": frozenset({"int"}),
    "float": frozenset({"int", "float"}),
    "text": frozenset({"text"}),
    "date": frozenset({"date"}),
    "timestamp": frozenset({"timestamp", "date"}),
    "boolean": frozenset({"boolean"}),
}


def family(stored: str) -> Family:
    """The policy type family of a stored SQL type name (``other`` if none fits)."""
    name = stored.strip().lower()
    for pattern, fam in _FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def tables(backend: Backend) -> list[str]:
    """Tables and views of the current schema, sorted."""
    return backend.tables()


def columns(backend: Backend, table: str) -> dict[str, str] | None:
    """Column name → stored type of ``table`` (optionally ``schema.table``) in table order; None if absent."""
    return backend.columns(table)


def checkable(backend: Backend) -> bool:
    """Backends whose schema can be read here (Spark has no information_schema to ask)."""
    return backend.information_schema


def not_null(backend: Backend, table: str) -> set[str]:
    """Columns of ``table`` declared NOT NULL (a primary key's included): ``nullable: false`` in a draft."""
    _, rows = backend.execute(
        "SELECT column_name FROM information_schema.columns "
        f"WHERE {backend.catalog_where(table)} AND is_nullable = 'NO'"
    )
    return {str(r[0]) for r in rows}


def primary_keys(backend: Backend) -> dict[str, list[str]]:
    """Table → its primary key's columns, in key order, for the current schema."""
    _, rows = backend.execute(
        "SELECT k.table_name, k.column_name FROM information_schema.table_constraints c "
        "JOIN information_schema.key_column_usage k ON k.constraint_name = c.constraint_name "
        "AND k.constraint_schema = c.constraint_schema AND k.table_name = c.table_name "
        "WHERE c.constraint_type = 'PRIMARY KEY' AND c.table_schema = current_schema() "
        "ORDER BY k.table_name, k.ordinal_position"
    )
    keys: dict[str, list[str]] = {}
    for table, column in rows:
        keys.setdefault(str(table), []).append(str(column))
    return keys


def foreign_keys(backend: Backend) -> list[tuple[str, str, str, str]]:
    """Single-column foreign keys of the current schema: (table, column, referenced table, referenced column)."""
    _, rows = backend.execute(
        "SELECT k.constraint_name, k.table_name, k.column_name, u.table_name, u.column_name "
        "FROM information_schema.referential_constraints r "
        "JOIN information_schema.key_column_usage k ON k.constraint_name = r.constraint_name "
        "AND k.constraint_schema = r.constraint_schema "
        "JOIN information_schema.key_column_usage u ON u.constraint_name = r.unique_constraint_name "
        "AND u.constraint_schema = r.unique_constraint_schema AND u.ordinal_position = k.ordinal_position "
        "WHERE k.table_schema = current_schema() ORDER BY 2, 3"
    )
    width: dict[str, int] = {}
    for name, *_ in rows:
        width[str(name)] = width.get(str(name), 0) + 1
    return [(str(t), str(c), str(rt), str(rc)) for name, t, c, rt, rc in rows if width[str(name)] == 1]
