"""``dpsql policy draft``: a starting policy written from a table's schema, for the curator to finish.

The draft is written from the schema (names, types) plus, per text column, whether it holds at most
:data:`MAX_DOMAIN` distinct values — in which case those values are proposed as a ``domain``,
*marked for review* in a comment. Listing stored values is acceptable because the curator owns the
data and the file is theirs; but a domain is published to every analyst (GROUP BY releases exactly
its keys), so a rare value (one person's diagnosis) must not stay in it unless it is public knowledge.
Nothing else is read: no counts, no minima or maxima. Bounds are left as ``TODO`` comments, since a
bound read from the data would itself reveal the most extreme person's value.

Identifier-looking columns (``id``, ``*_id``, names, e-mails, …) are proposed ``identifier: true``.
The draft loads as it is (``dpsql policy check`` passes once the TODOs are decided).

Who is one person comes from the schema (:func:`_people`): the table whose primary key other tables'
foreign keys point at is the person table (``privacy_unit`` its key), and every table with a foreign
key to it ``references`` it, with a ``max_rows_per_unit`` to review. Without foreign keys, a column
named after the person table (``patient_id`` for ``patients.id``) whose every stored value is one of
the person table's keys is proposed instead, marked for review (the curator's tool reads that; it
prints no value). ``NOT NULL`` becomes ``nullable: false``. A small table that names no person is
proposed ``public: true`` for review. In a proposed domain, values held by fewer than
:data:`RARE_UNITS` people (rows, without a unit) are named as rare: one person's value must not be
published unless it is public knowledge.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import yaml

from dpsql.backends import quote_ident
from dpsql.errors import UndefinedTable

from . import introspect

#: Text columns with at most this many distinct values get a proposed domain (for review).
MAX_DOMAIN = 20
#: Domain values held by fewer people than this are flagged as rare in the draft.
RARE_UNITS = 5
#: A table of at most this many rows that names no person is proposed ``public: true`` (for review).
PUBLIC_ROWS = 1000
#: ``max_rows_per_unit`` proposed for a table with many rows per person (to review with the data's owner).
MANY_ROWS = 10

_IDENTIFIER = re.compile(
    r"^(id|uuid|guid|ssn|email|e_mail|phone|telephone|mobile|name|first_?name|last_?name|surname|full_?name|"
    r"address|street|ip|ip_address|passport|iban|account)$|_id$|_uuid$|_email$|_phone$|_ssn$",
    re.IGNORECASE,
)


def looks_like_identifier(column: str) -> bool:
    return bool(_IDENTIFIER.search(column))


def _scalar(value: Any) -> str:
    """One YAML flow scalar (quoted when YAML would read it as something else)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _domain(backend: Any, table: str, column: str, unit: str | None) -> tuple[list[Any], list[Any]] | None:
    """The column's stored values when there are at most MAX_DOMAIN of them (NULL excluded), and those
    held by fewer than :data:`RARE_UNITS` people (rows when the table has no unit column)."""
    col, src = quote_ident(column), quote_ident(table)
    held = f"COUNT(DISTINCT {quote_ident(unit)})" if unit else "COUNT(*)"
    _, rows = backend.execute(
        f"SELECT {col}, {held} < {RARE_UNITS} FROM {src} WHERE {col} IS NOT NULL GROUP BY {col} "
        f"ORDER BY 1 LIMIT {MAX_DOMAIN + 1}"
    )
    if len(rows) > MAX_DOMAIN or not rows:
        return None
    return [r[0] for r in rows], [r[0] for r in rows if r[1]]


def _column_lines(
    backend: Any,
    table: str,
    column: str,
    stored: str,
    required: bool,
    unit: str | None,
    keys: set[str],
    keys_public: bool = False,
) -> list[str]:
    """A column's draft line(s). ``keys``: the table's primary key (names a person unless the table
    is proposed public, ``keys_public``: then no value is flagged rare either, its rows are no people)."""
    type_name = introspect.family(stored)
    policy_type = type_name if type_name != "other" else "text"
    key = _scalar(column)
    null = ", nullable: false" if required else ""
    if looks_like_identifier(column) or column in keys:
        return [f"      {key}: {{type: {policy_type}, identifier: true}}   # looks like an identifier: never queryable"]
    if type_name == "other":
        return [f"      {key}: {{type: text}}   # TODO: stored as {stored}; check the type, or remove the column"]
    if type_name in ("int", "float", "date", "timestamp"):
        example = {"int": "0, upper: 100", "float": "0.0, upper: 100.0"}.get(type_name, "2000-01-01, upper: 2030-12-31")
        return [
            f"      {key}: {{type: {policy_type}{null}}}",
            f"        # TODO bounds: e.g. {{type: {policy_type}, lower: {example}}} — from domain knowledge, not",
            "        # from the data's min/max (those are someone's exact values); SUM/AVG/quantiles need them",
        ]
    if type_name == "text":
        found = _domain(backend, table, column, unit)
        if found is not None:
            values, rare = found
            listed = ", ".join(_scalar(v) for v in values)
            names = ", ".join(_scalar(v) for v in rare)
            flagged = f"   # RARE (fewer than {RARE_UNITS} people): {names}" if rare and not keys_public else ""
            return [
                "      # REVIEW domain: these are the values stored today (read by `dpsql policy draft`). A domain is",
                "      # published: GROUP BY releases exactly these keys to every analyst, so keep only values that",
                "      # are public knowledge (drop a rare one held by a single person), and add any that are missing.",
                f"      {key}: {{type: text, domain: [{listed}]{null}}}{flagged}",
            ]
        return [
            f"      {key}: {{type: text{null}}}   # many values: GROUP BY on it goes through DP partition selection"
        ]
    return [f"      {key}: {{type: {policy_type}{null}}}"]


def _subset(backend: Any, table: str, column: str, person: str, key: str) -> bool:
    """Whether every stored value of ``table.column`` is a key of the person table (the curator's tool
    reads it: the answer is a yes or no, never a value)."""
    col, src = quote_ident(column), quote_ident(table)
    _, rows = backend.execute(
        f"SELECT COUNT(*) FROM {src} WHERE {col} IS NOT NULL AND {col} NOT IN "
        f"(SELECT {quote_ident(key)} FROM {quote_ident(person)} WHERE {quote_ident(key)} IS NOT NULL)"
    )
    return int(rows[0][0]) == 0


def _people(
    backend: Any, tables: list[str], stored: dict[str, dict[str, str]]
) -> tuple[str | None, str | None, dict[str, tuple[str, bool]]]:
    """(person table, its key, {table: (referencing column, declared by a foreign key)}).

    The person table is the one whose single-column primary key the most drafted tables' foreign keys
    point at; without foreign keys, the table whose ``id`` (or primary key) most tables name as
    ``<table>_id`` with values that are all its keys."""
    names = {t.split(".")[-1].lower(): t for t in tables}
    pks = {t.lower(): cols for t, cols in introspect.primary_keys(backend).items()}
    fks = [fk for fk in introspect.foreign_keys(backend) if fk[0].lower() in names and fk[2].lower() in names]
    pointed: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for table, column, ref_table, ref_column in fks:
        if pks.get(ref_table.lower()) == [ref_column] and table.lower() != ref_table.lower():
            pointed.setdefault((ref_table.lower(), ref_column), []).append((table.lower(), column))
    if pointed:
        (person, key), referencing = max(pointed.items(), key=lambda kv: (len(kv[1]), kv[0]))
        return person, key, {t: (c, True) for t, c in referencing}
    best: tuple[str | None, str | None, dict[str, tuple[str, bool]]] = (None, None, {})
    for person in sorted(names):
        key = (pks.get(person) or ["id"])[0]
        if len(pks.get(person) or ["id"]) != 1 or key not in stored[names[person]]:
            continue
        found: dict[str, tuple[str, bool]] = {}
        for other in sorted(names):
            if other == person:
                continue
            for column in stored[names[other]]:
                prefix = column.lower().removesuffix("_id")
                named = column.lower().endswith("_id") and person in {prefix, prefix + "s", prefix + "es"}
                if named and _subset(backend, names[other], column, names[person], key):
                    found[other] = (column, False)
                    break
        if len(found) > len(best[2]):
            best = (person, key, found)
    return best


def _small(backend: Any, table: str) -> bool:
    """At most :data:`PUBLIC_ROWS` rows (read as yes or no only)."""
    _, rows = backend.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM {quote_ident(table)} LIMIT {PUBLIC_ROWS + 1}) t")
    return int(rows[0][0]) <= PUBLIC_ROWS


def draft_policy(backend: Any, tables: list[str], dataset: str) -> str:
    """The draft policy YAML for ``tables`` of ``backend`` (each must exist)."""
    today = dt.date.today().isoformat()
    out = [
        f"# Drafted by `dpsql policy draft` on {today}: review every line before serving it.",
        "# Check it with: dpsql policy check --policy <this file> --database <url>",
        f"dataset: {_scalar(dataset)}",
        "",
        "defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}",
        "",
        "budget:",
        "  # TODO: the total privacy loss you accept, for all analysts together and for each",
        "  dataset: {epsilon: 10.0, delta: 1.0e-5}",
        "  analyst: {epsilon: 5.0, delta: 1.0e-6}",
        "",
        "auth: {trust: false}",
        "analysts:",
        "  - name: analyst",
        "    # password: a SCRAM-SHA-256 verifier from `dpsql passwd` (never plaintext)",
        "",
        "tables:",
    ]
    stored_by: dict[str, dict[str, str]] = {}
    for table in tables:
        stored = introspect.columns(backend, table)
        if stored is None:
            raise UndefinedTable(f'relation "{table}" does not exist')
        stored_by[table] = stored
    person, key, referencing = _people(backend, tables, stored_by)
    pks = {t.lower(): cols for t, cols in introspect.primary_keys(backend).items()}
    for table in tables:
        stored = stored_by[table]
        name = table.split(".")[-1].lower()
        out.append(f"  {_scalar(name)}:")
        if name != table:
            out.append(f"    source: {_scalar(table)}")
        unit: str | None = None
        public = False
        if name == person and key is not None:
            unit = key
            out += [
                f"    # the person table: other tables' keys point at its {key} (one row per person)",
                f"    privacy_unit: {_scalar(key)}",
                "    max_rows_per_unit: 1",
            ]
        elif name in referencing and person is not None and key is not None:
            column, declared = referencing[name]
            unit = column
            why = "a foreign key" if declared else f"REVIEW: every {column} is a {person}.{key} (no foreign key)"
            reference = f"{{column: {_scalar(column)}, table: {_scalar(person)}, to: {_scalar(key)}}}"
            out += [
                f"    references: {reference}   # {why}",
                f"    max_rows_per_unit: {MANY_ROWS}   # REVIEW: rows one person may add (more are dropped)",
            ]
        elif not any(looks_like_identifier(c) for c in stored) and _small(backend, table):
            public = True
            out += ["    public: true   # REVIEW: small, and names no person: readable without noise"]
        else:
            units = [c for c in stored if c.lower().endswith("_id")]
            hint = f" (one of: {', '.join(units)}?)" if units else ""
            out += [
                "    # TODO privacy_unit: the identifier column naming the person each row belongs to" + hint + ";",
                "    # null means one row per person. With several rows per person set max_rows_per_unit too.",
                "    privacy_unit: null",
                "    max_rows_per_unit: 1",
            ]
        out.append("    columns:")
        required = introspect.not_null(backend, table)
        keys = set() if public else set(pks.get(name, []))  # a person table's keys name people
        for column, type_name in stored.items():
            out += _column_lines(backend, table, column, type_name, column in required, unit, keys, public)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
