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
key to it ``references`` it, with a ``max_rows_per_unit`` to review; a table with several such keys
(``reviews.employee_id`` and ``reviews.reviewer_id``) references it by the one named after the person
table (else the first), and the others are named for the curator to confirm whose row it is. Without
foreign keys, a column
named after the person table (``patient_id`` for ``patients.id``) whose every stored value is one of
the person table's keys is proposed instead, marked for review (the curator's tool reads that; it
prints no value). ``NOT NULL`` becomes ``nullable: false``. A small table whose only identifier is
its own key (and, if other tables point at it, its ``name``: a department's name names no person) and
that names no person is proposed ``public: true`` for review. In a proposed domain, values held by
fewer than :data:`RARE_UNITS` people of a person-linked table are named as rare (one person's value
must not be published unless it is public knowledge); in a table without a unit, rare by rows; in a
public candidate, nothing is flagged (its rows are no people).

The dataset name comes from the database URL's database or file name only (:func:`dataset_name`),
never its query string, which can carry a host, a port or a password.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import PurePosixPath
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from dpsql.backends import quote_ident
from dpsql.errors import UndefinedTable

from . import introspect

#: Text columns with at most this many distinct values get a proposed domain (for review).
MAX_DOMAIN = 20
#: Domain values held by fewer people than this are flagged as rare in the draft.
RARE_UNITS = 5
#: Words in a table's name that say its rows are people: a small ``managers(id, name)`` that others
#: point at is still people, its ``name`` an identifier (never proposed as a public domain).
PEOPLE_WORDS = (
    "employee", "manager", "staff", "user", "person", "people", "customer", "patient", "member",
    "student", "client", "doctor", "nurse", "contact", "owner", "worker", "teacher", "driver",
    "author", "agent", "supervisor", "reviewer", "resident", "citizen", "applicant", "account",
)  # fmt: skip


def _of_people(table: str) -> bool:
    """Whether a table's name says its rows are people (see :data:`PEOPLE_WORDS`)."""
    return any(word in table.lower() for word in PEOPLE_WORDS)


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


#: URL schemes whose path is a file (its extension is no part of the dataset's name).
_FILE_SCHEMES = frozenset({"duckdb", "sqlite", "file", ""})


def dataset_name(url: str) -> str:
    """The dataset name for a database URL: its database (PostgreSQL, ``?dbname=`` when the path has
    none) or its file's stem, made a plain identifier. Never the query string or the netloc: those
    carry hosts, ports, socket paths and passwords, and the name lands in the policy and ledger paths."""
    parts = urlsplit(url)
    path = unquote(parts.path).rstrip("/")
    if parts.scheme.lower() in _FILE_SCHEMES:
        name = PurePosixPath(path).stem if path not in ("", ":memory:") else ""
    else:
        name = path.rsplit("/", 1)[-1] if path else ""
        if not name:
            name = (parse_qs(parts.query).get("dbname") or [""])[0]
    name = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")
    if name[:1].isdigit():
        name = "db_" + name
    return name or "dataset"


def _singulars(table: str) -> set[str]:
    """The names a column may call ``table`` by: ``employees`` → employees, employee."""
    name = table.split(".")[-1].lower()
    forms = {name}
    if name.endswith("ies"):
        forms.add(name[:-3] + "y")
    if name.endswith("es"):
        forms.add(name[:-2])
    if name.endswith("s"):
        forms.add(name[:-1])
    return forms


def names_table(column: str, table: str) -> bool:
    """Whether ``column`` is named after ``table`` (``employee_id`` for ``employees``)."""
    lowered = column.lower()
    return lowered.endswith("_id") and lowered.removesuffix("_id") in _singulars(table)


class Link(NamedTuple):
    """How a table references the person table: the column chosen as its unit, whether a foreign key
    declares it, and the other columns that also point at a person (for the curator to confirm)."""

    column: str
    declared: bool
    others: tuple[str, ...] = ()


def _choose(candidates: list[str], order: list[str], person: str) -> tuple[str, tuple[str, ...]]:
    """The unit among columns that all point at the person table: the one named after it, else the
    first in column order. Deterministic, so the same schema always drafts the same unit."""
    position = {c: i for i, c in enumerate(order)}
    ranked = sorted(set(candidates), key=lambda c: (not names_table(c, person), position.get(c, len(order)), c))
    return ranked[0], tuple(ranked[1:])


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
    plain: frozenset[str] = frozenset(),
) -> list[str]:
    """A column's draft line(s). ``keys``: the table's primary key (names a person unless the table
    is proposed public, ``keys_public``: then no value is flagged rare either, its rows are no people).
    ``plain``: identifier-looking columns that name no person (a public lookup table's ``name``)."""
    type_name = introspect.family(stored)
    policy_type = type_name if type_name != "other" else "text"
    key = _scalar(column)
    null = ", nullable: false" if required else ""
    if (looks_like_identifier(column) and column not in plain) or column in keys:
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
            # only a person-linked table's counts are people; a public candidate's rows are no one's
            who = "people" if unit else "rows"
            flagged = f"   # RARE (fewer than {RARE_UNITS} {who}): {names}" if rare and not keys_public else ""
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
) -> tuple[str | None, str | None, dict[str, Link]]:
    """(person table, its key, {table: how it references the person table}).

    The person table is the one whose single-column primary key the most drafted tables' foreign keys
    point at; without foreign keys, the table whose ``id`` (or primary key) most tables name as
    ``<table>_id`` with values that are all its keys."""
    names = {t.split(".")[-1].lower(): t for t in tables}
    pks = {t.lower(): cols for t, cols in introspect.primary_keys(backend).items()}
    fks = [fk for fk in introspect.foreign_keys(backend) if fk[0].lower() in names and fk[2].lower() in names]
    pointed: dict[tuple[str, str], dict[str, list[str]]] = {}
    for table, column, ref_table, ref_column in fks:
        if pks.get(ref_table.lower()) == [ref_column] and table.lower() != ref_table.lower():
            pointed.setdefault((ref_table.lower(), ref_column), {}).setdefault(table.lower(), []).append(column)
    if pointed:
        (person, key), referencing = max(pointed.items(), key=lambda kv: (len(kv[1]), kv[0]))
        links = {}
        for table, columns in referencing.items():
            column, others = _choose(columns, list(stored[names[table]]), person)
            links[table] = Link(column, True, others)
        return person, key, links
    best: tuple[str | None, str | None, dict[str, Link]] = (None, None, {})
    for person in sorted(names):
        key = (pks.get(person) or ["id"])[0]
        if len(pks.get(person) or ["id"]) != 1 or key not in stored[names[person]]:
            continue
        found: dict[str, Link] = {}
        for other in sorted(names):
            if other == person:
                continue
            order = list(stored[names[other]])
            named = [c for c in order if names_table(c, person)]
            columns = [c for c in named if _subset(backend, names[other], c, names[person], key)]
            if columns:
                column, others = _choose(columns, order, person)
                found[other] = Link(column, False, others)
        if len(found) > len(best[2]):
            best = (person, key, found)
    return best


def _lookups(backend: Any, tables: list[str], stored: dict[str, dict[str, str]]) -> set[str]:
    """Drafted tables other tables point at (a foreign key, or a ``<table>_id`` column): lookup tables,
    whose ``name`` names the thing looked up (a department), not a person."""
    names = {t.split(".")[-1].lower() for t in tables}
    found = {ref.lower() for t, _, ref, _ in introspect.foreign_keys(backend) if t.lower() != ref.lower()} & names
    for table in names:
        for other, columns in stored.items():
            if other.split(".")[-1].lower() != table and any(names_table(c, table) for c in columns):
                found.add(table)
    return found


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
    lookups = _lookups(backend, tables, stored_by)
    for table in tables:
        stored = stored_by[table]
        name = table.split(".")[-1].lower()
        out.append(f"  {_scalar(name)}:")
        if name != table:
            out.append(f"    source: {_scalar(table)}")
        unit: str | None = None
        public = False
        # a lookup table's own key and (when others point at it) its name identify no person
        own = set(pks.get(name) or (["id"] if "id" in stored else []))
        plain = frozenset(
            c for c in stored if c.lower() == "name" and name in lookups and c not in own and not _of_people(name)
        )
        if name == person and key is not None:
            unit = key
            out += [
                f"    # the person table: other tables' keys point at its {key} (one row per person)",
                f"    privacy_unit: {_scalar(key)}",
                "    max_rows_per_unit: 1",
            ]
        elif name in referencing and person is not None and key is not None:
            column, declared, others = referencing[name]
            unit = column
            why = "a foreign key" if declared else f"REVIEW: every {column} is a {person}.{key} (no foreign key)"
            reference = f"{{column: {_scalar(column)}, table: {_scalar(person)}, to: {_scalar(key)}}}"
            if others:
                verb = "points" if len(others) == 1 else "point"
                out += [
                    f"    # REVIEW: {', '.join(others)} also {verb} at {person}.{key}: whose data is a row?",
                    f"    # The unit is one column: confirm {column}, or name another of them instead.",
                ]
            out += [
                f"    references: {reference}   # {why}",
                f"    max_rows_per_unit: {MANY_ROWS}   # REVIEW: rows one person may add (more are dropped)",
            ]
        elif not any(
            (looks_like_identifier(c) and c not in own | plain) or (person is not None and names_table(c, person))
            for c in stored
        ) and _small(backend, table):
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
            out += _column_lines(
                backend,
                table,
                column,
                type_name,
                column in required,
                unit,
                keys,
                public,
                plain if public else frozenset(),
            )
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
