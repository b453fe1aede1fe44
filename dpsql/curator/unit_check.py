"""``dpsql policy check``: does every private table reach the person the curator meant?

A policy can load and still protect the wrong thing: a row id declared as the unit (each of one
person's rows protected as a different person), a table left "one row per person" whose rows are
someone's transactions, a ``references`` to a key that repeats (a row would belong to several people)
or to values that name no row. Each is an error naming the fix, and every fix named is a column that
reaches the person table: it points (by a declared foreign key, or by its name and the values it
holds) at a *key* of a private table that reaches a unit, never back at the table itself.
Containment alone is no evidence: ids 1–12 of a branch table are also transaction ids, so a column
is taken to point at a table only when it is named after it (or its key) or a foreign key says so,
its values repeat and every one of them is a value of that table's unique key.

Exact counts are read from the data (for the curator's terminal or the server's log only).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from typing import Any

from dpsql.backends import quote_ident
from dpsql.policy import Policy

from . import introspect
from .findings import Counts, Finding, unmatched


def _stem(column: str) -> str:
    """A key's name without a one- or two-letter table prefix (``o_custkey`` → ``custkey``)."""
    return re.sub(r"^[a-z]{1,2}_", "", column.lower())


def _singulars(table: str) -> set[str]:
    name = table.split(".")[-1].lower()
    forms = {name, name.removesuffix("s"), name.removesuffix("es")}
    if name.endswith("ies"):
        forms.add(name[:-3] + "y")
    return forms


def names_target(column: str, table: str, key: str) -> bool:
    """Whether ``column`` is named after ``table`` (``account_id`` for ``accounts``) or after its key
    (``account_id`` = ``account_id``; TPC-H's ``o_custkey`` for ``c_custkey``; never a bare ``id``)."""
    lowered = column.lower()
    if lowered.endswith("_id") and lowered.removesuffix("_id") in _singulars(table):
        return True
    stem = _stem(column)
    return stem not in ("id", "key") and stem == _stem(key)


def _names_public(policy: Policy, column: str) -> bool:
    """Whether ``column`` is named after a public table or its key (``branch_id``: a branch, no person)."""
    return any(
        table.public and any(names_target(column, name, key) for key in table.columns)
        for name, table in policy.tables.items()
    )


def unique(backend: Any, source: str, column: str) -> bool:
    """Whether the non-NULL values of ``source.column`` are all different (one aggregate, whole table)."""
    col = quote_ident(column)
    _, rows = backend.execute(f"SELECT COUNT({col}), COUNT(DISTINCT {col}) FROM {quote_ident(source)}")
    return int(rows[0][0] or 0) == int(rows[0][1] or 0)


def _declared_fks(backend: Any) -> dict[tuple[str, str], tuple[str, str]]:
    """(table, column) → (referenced table, column), lower case, from the database's constraints."""
    if not introspect.checkable(backend):
        return {}
    return {(t.lower(), c.lower()): (rt.lower(), rc.lower()) for t, c, rt, rc in introspect.foreign_keys(backend)}


def reaching(
    policy: Policy, name: str, backend: Any, source: str, stored: dict[str, str], candidates: list[str]
) -> tuple[str, str, str] | None:
    """(column, table, key): the first of ``candidates`` (repeating identifiers of ``name``) that points
    at a unique key of another private table reaching a unit (not through ``name``): the column naming
    whose row this is. Declared foreign keys first, then names; every value must be a key value."""
    fks = _declared_fks(backend) if candidates else {}
    targets = []
    for other, table in policy.tables.items():
        path = policy.unit_path(other)
        other_source = table.source or other
        if other == name or path is None or name in path.chain or other_source.startswith(("parquet:", "orc:")):
            continue
        other_stored = introspect.columns(backend, other_source) or {}
        keys = [c for c, p in table.columns.items() if (p.identifier or c == table.privacy_unit) and c in other_stored]
        targets.append((other, other_source, other_stored, keys))
    for column in candidates:
        declared = fks.get((source.lower(), column.lower()))
        ranked = []
        for other, other_source, other_stored, keys in targets:
            for key in keys:
                by_fk = declared == (other_source.lower(), key.lower())
                if not by_fk and not names_target(column, other, key):
                    continue
                if introspect.family(other_stored[key]) != introspect.family(stored.get(column, "")):
                    continue
                ranked.append((not by_fk, other, other_source, key))
        for _, other, other_source, key in sorted(ranked):
            distinct, missing = unmatched(backend, source, column, other_source, key)
            if distinct and not missing and unique(backend, other_source, key):
                return column, other, key
    return None


def _fix(policy: Policy, name: str, backend: Any, source: str, stored: dict[str, str], columns: list[str]) -> str:
    """The declaration that names the person of ``name``'s rows: a ``references`` to the table one of
    ``columns`` points at, else ``privacy_unit`` on the first (it names the person itself)."""
    found = reaching(policy, name, backend, source, stored, columns)
    if found is not None:
        column, other, key = found
        path = policy.unit_path(other)
        person = f"; the person is {path.person}" if path is not None else ""
        return f"'{column}' (declare references: {{column: {column}, table: {other}, to: {key}}}{person})"
    return f"'{columns[0]}' (declare privacy_unit: {columns[0]} and max_rows_per_unit)"


def unit_findings(
    policy: Policy, name: str, backend: Any, source: str, stored: dict[str, str], counts: Counts
) -> Iterator[Finding]:
    """A table left "one row per person" whose person identifier repeats, and a unit unique per row
    (a row id) in a table whose rows belong to someone else: errors whatever the caps, naming the fix.

    A unique unit passes on the person table itself: the table other tables' chains end at, or one
    whose rows point at no one else's (no ``references``, no repeating identifier that reaches another
    private table, one row per unit)."""
    table = policy.tables[name]
    if table.public:
        return
    present = [c for c in table.columns if c in counts.distinct]
    repeating = [c for c in present if table.columns[c].identifier and counts.repeats(c)]
    person_like = [
        c
        for c in repeating
        if (c.lower() == "id" or c.lower().endswith(("_id", "key"))) and not _names_public(policy, c)
    ]
    path = policy.unit_path(name)
    if table.privacy_unit is None and table.references is None and person_like:
        column = person_like[0]
        referenced = path is not None  # other tables' rows are then each this table's person
        also = f"; the tables referencing it would count one {column} as many people" if referenced else ""
        yield Finding(
            "error",
            ("tables", name),
            f"no 'privacy_unit' (each row is one person), but identifier '{column}' repeats{also}: did you mean "
            + _fix(policy, name, backend, source, stored, person_like),
        )
        return
    unit = table.privacy_unit
    if unit is None or unit not in present or not counts.unique(unit):
        return
    others = [c for c in repeating if c != unit]
    if table.references is not None and table.references.column != unit:
        others = [table.references.column, *(c for c in others if c != table.references.column)]
    if not others:
        return
    found = reaching(policy, name, backend, source, stored, others)
    if found is None:
        pointed_at = any(
            (p := policy.unit_path(other)) is not None and other != name and p.person == f"{name}.{unit}"
            for other in policy.tables
        )
        if pointed_at or (table.references is None and not (person_like and table.max_rows_per_unit > 1)):
            return  # the person table (others' chains end here), or identifiers that point at no one
    column = found[0] if found is not None else others[0]
    yield Finding(
        "error",
        ("tables", name, "privacy_unit"),
        f"'{unit}' is unique per row (a row id, not a person) while '{column}' repeats: each of one person's "
        f"rows would be protected as a different person; did you mean "
        + _fix(policy, name, backend, source, stored, [column, *(c for c in others if c != column)]),
    )


def reference_findings(policy: Policy, name: str, backend: Any, stored: dict[str, str]) -> Iterator[Finding]:
    """``references`` between columns stored as different types (every join along it would fail on the
    database, after its charge), to a key that repeats (a row would belong to several people), or whose
    values the referenced column does not hold (the column names no row there)."""
    table = policy.tables[name]
    ref = table.references
    target = policy.tables.get(ref.table) if ref is not None else None
    if ref is None or target is None:
        return
    target_source = target.source or ref.table
    here = stored.get(ref.column)
    there = (introspect.columns(backend, target_source) or {}).get(ref.to)
    if here is None or there is None:
        return
    if introspect.family(here) != introspect.family(there):
        yield Finding(
            "error",
            ("tables", name, "references"),
            f"'{ref.column}' is stored as {here} but {ref.table}.{ref.to} as {there}: the join to the privacy "
            "unit cannot match them; store both with one type",
        )
        return
    if table.public or target_source.startswith(("parquet:", "orc:")):
        return
    if not unique(backend, target_source, ref.to):
        yield Finding(
            "error",
            ("tables", name, "references", "to"),
            f"{ref.table}.{ref.to} repeats: a foreign key names one row of '{ref.table}' by its key, and a "
            f"'{name}' row would belong to each person whose '{ref.table}' row holds that value; point at a "
            f"unique key of '{ref.table}'",
        )
        return
    source = table.source or name
    distinct, missing = unmatched(backend, source, ref.column, target_source, ref.to)
    if not missing:
        return
    fitting = []
    for col_name, column in table.columns.items():
        if col_name == ref.column or not column.identifier or col_name not in stored:
            continue
        if introspect.family(stored[col_name]) != introspect.family(there):
            continue
        others, absent = unmatched(backend, source, col_name, target_source, ref.to)
        if others and not absent:
            fitting.append(col_name)
    fitting.sort(key=lambda c: -difflib.SequenceMatcher(None, c.lower(), ref.table.lower()).ratio())
    hint = f"; did you mean '{fitting[0]}' (all its values are in {ref.table}.{ref.to})?" if fitting else ""
    yield Finding(
        "error",
        ("tables", name, "references", "column"),
        f"{missing:,} of the {distinct:,} distinct values of '{ref.column}' are not in {ref.table}.{ref.to}: "
        f"'{ref.column}' does not name a row of '{ref.table}', so each of its values would be protected as a "
        f"person of its own{hint}",
    )
