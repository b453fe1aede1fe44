"""What can make the outcome of an analyst's INSERT depend on rows already stored.

An INSERT that succeeds or fails according to stored data is a membership oracle: with a
UNIQUE constraint on ``respondent``, inserting ``'igor'`` fails exactly when Igor is in
the table. dpsql therefore only writes where the outcome is a function of the statement
and the schema alone:

* analysts give values only for randomized-response columns and columns the policy marks
  ``writable: true`` (never identifiers; checked in :func:`dpsql.analyze.insert.parse_insert`);
* the table must have no constraint relating the new row to stored rows on those columns:
  no PRIMARY KEY, UNIQUE, FOREIGN KEY or EXCLUDE constraint, no unique index, no trigger or
  rule. A key over columns the analyst does not write is allowed only when every column of
  it has no default (the row then fails NOT NULL or never conflicts, whatever is stored)
  or a generated one (a sequence or a random UUID), never a constant default;
* NOT NULL and CHECK constraints depend only on the new row (and its perturbed values),
  and every failure reaches the analyst as one fixed error, whatever its cause.

:func:`write_oracles` reads the backend's catalog (schema, not data) and names what is in
the way; backends whose catalog it cannot read accept no writes (fail closed).
"""

from __future__ import annotations

import re
from typing import Any

from dpsql.backends import Backend, quote_ident

#: Defaults that give every new row a fresh value (no conflict with stored rows by construction).
_GENERATED_DEFAULT = re.compile(r"nextval\s*\(|gen_random_uuid\s*\(|uuid(v4)?\s*\(|uuid_generate_v4\s*\(", re.I)


def write_oracles(backend: Backend, table: str, written: list[str]) -> list[str]:
    """Descriptions of the schema features that would make an INSERT of ``written`` into ``table``
    succeed or fail according to stored rows; empty when the outcome depends on the statement only."""
    if backend.dialect == "duckdb":
        keys, defaults, triggers = _duckdb_catalog(backend, table)
    elif backend.dialect == "postgres":
        keys, defaults, triggers = _postgres_catalog(backend, table)
    else:
        return [f"the {backend.dialect} backend's constraints cannot be checked"]
    found = list(triggers)
    lowered = {c.lower() for c in written}
    for constraint, columns in keys:
        if columns is None:
            found.append(f"a {constraint} over an expression")
            continue
        if constraint == "FOREIGN KEY" and any(c.lower() in lowered for c in columns):
            found.append(f'a FOREIGN KEY on "{", ".join(columns)}"')
        elif constraint != "FOREIGN KEY":
            if any(c.lower() in lowered for c in columns):
                found.append(f'a {constraint} on "{", ".join(columns)}"')
            elif any(defaults.get(c) is not None and not _GENERATED_DEFAULT.search(defaults[c] or "") for c in columns):
                found.append(f'a {constraint} on "{", ".join(columns)}" whose default is not generated')
    return found


def _duckdb_catalog(
    backend: Backend, table: str
) -> tuple[list[tuple[str, list[str] | None]], dict[str, str | None], list[str]]:
    name = table.replace("'", "''")
    _, rows = backend.execute(
        "SELECT constraint_type, constraint_column_names FROM duckdb_constraints() "
        f"WHERE table_name = '{name}' AND constraint_type IN ('PRIMARY KEY', 'UNIQUE', 'FOREIGN KEY')"
    )
    keys: list[tuple[str, list[str] | None]] = [(constraint, list(columns)) for constraint, columns in rows]
    _, rows = backend.execute(f"SELECT expressions FROM duckdb_indexes() WHERE table_name = '{name}' AND is_unique")
    for (expressions,) in rows:
        text = str(expressions).strip("[]")
        parts = [p.strip().strip('"') for p in text.split(",")]
        simple = all(re.fullmatch(r"\w+", p) for p in parts)
        keys.append(("unique index", parts if simple else None))
    _, rows = backend.execute(f"SELECT column_name, column_default FROM duckdb_columns() WHERE table_name = '{name}'")
    return keys, {c: d for c, d in rows}, []


def _postgres_catalog(
    backend: Backend, table: str
) -> tuple[list[tuple[str, list[str] | None]], dict[str, str | None], list[str]]:
    regclass = quote_ident(table).replace("'", "''")
    relation = f"to_regclass('{regclass}')"
    names = {"p": "PRIMARY KEY", "u": "UNIQUE", "f": "FOREIGN KEY", "x": "EXCLUDE constraint"}
    _, rows = backend.execute(
        "SELECT c.contype::text, ARRAY(SELECT a.attname::text FROM unnest(c.conkey) k "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k) "
        f"FROM pg_constraint c WHERE c.conrelid = {relation} AND c.contype IN ('p', 'u', 'f', 'x')"
    )
    keys: list[tuple[str, list[str] | None]] = [(names[contype], list(columns)) for contype, columns in rows]
    _, rows = backend.execute(
        "SELECT i.indexprs IS NOT NULL OR i.indpred IS NOT NULL, ARRAY(SELECT a.attname::text FROM unnest(i.indkey) k "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k) "
        f"FROM pg_index i WHERE i.indrelid = {relation} AND (i.indisunique OR i.indisexclusion) "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)"
    )
    keys += [("unique index", None if expression else list(columns)) for expression, columns in rows]
    _, rows = backend.execute(
        f"SELECT a.attname::text, pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a LEFT JOIN pg_attrdef d "
        f"ON d.adrelid = a.attrelid AND d.adnum = a.attnum WHERE a.attrelid = {relation} AND a.attnum > 0 "
        "AND NOT a.attisdropped"
    )
    defaults: dict[str, Any] = {c: d for c, d in rows}
    _, rows = backend.execute(
        f"SELECT (SELECT count(*) FROM pg_trigger WHERE tgrelid = {relation} AND NOT tgisinternal) "
        f"+ (SELECT count(*) FROM pg_rewrite WHERE ev_class = {relation} AND rulename <> '_RETURN')"
    )
    triggers = ["a trigger or rule"] if rows and rows[0][0] else []
    return keys, defaults, triggers
