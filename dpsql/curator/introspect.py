"""Which tables and columns a database holds, and the type family of each stored column.

Read from ``information_schema`` (DuckDB and PostgreSQL both have it): schema only, the same on
neighbouring databases, so nothing here depends on any person's data.
"""

from __future__ import annotations

import re
from typing import Any, Literal

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


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _where(backend: Any, table: str) -> str:
    *schema, name = table.split(".")
    schema_sql = _quoted(schema[-1]) if schema else "current_schema()"
    if backend.dialect == "duckdb":  # DuckDB identifiers are case-insensitive
        return f"lower(table_name) = lower({_quoted(name)}) AND lower(table_schema) = lower({schema_sql})"
    return f"table_name = {_quoted(name)} AND table_schema = {schema_sql}"


def tables(backend: Any) -> list[str]:
    """Tables and views of the current schema, sorted."""
    _, rows = backend.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() ORDER BY 1"
    )
    return [str(r[0]) for r in rows]


def columns(backend: Any, table: str) -> dict[str, str] | None:
    """Column name → stored type of ``table`` (optionally ``schema.table``) in table order; None if absent."""
    _, rows = backend.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        f"WHERE {_where(backend, table)} ORDER BY ordinal_position"
    )
    if not rows:
        return None
    return {str(name): str(type_name) for name, type_name in rows}


def checkable(backend: Any) -> bool:
    """Backends whose schema can be read here (Spark has no information_schema to ask)."""
    return getattr(backend, "dialect", "") in ("duckdb", "postgres")
