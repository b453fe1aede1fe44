"""``dpsql policy draft``: a starting policy written from a table's schema, for the curator to finish.

The privacy argument and design notes: docs/internals.md, section dpsql/curator/draft.py.
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
from .draft_links import Link, chains, links, looks_like_identifier, lookups, own_key, person_table, short

#: Text columns with at most this many distinct values get a proposed domain (for review).
MAX_DOMAIN = 20
#: Domain values held by fewer people than this are flagged as rare in the draft.
RARE_UNITS = 5
#: ``max_rows_per_unit`` proposed for a table with many rows per person when the data cannot say more
#: (to review with the data's owner); else the 95th percentile of rows per person, rounded up.
MANY_ROWS = 10
#: The share of persons whose rows the proposed cap keeps whole.
CAP_QUANTILE = 0.95
#: Persons needed before a percentile is read (fewer: :data:`MANY_ROWS`, no figure read).
CAP_MIN_UNITS = 100

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
    null_free: bool = False,
) -> list[str]:
    """A column's draft line(s). ``keys``: the table's primary key (names a person unless the table
    is proposed public, ``keys_public``: then no value is flagged rare either, its rows are no people).
    ``plain``: identifier-looking columns that name no person (a public lookup table's key and ``name``,
    a key into one). ``null_free``: no NOT NULL declared, but no NULL stored (``nullable: false`` to
    review)."""
    type_name = introspect.family(stored)
    policy_type = type_name if type_name != "other" else "text"
    key = _scalar(column)
    null = ", nullable: false" if required or null_free else ""
    if (looks_like_identifier(column) and column not in plain) or column in keys:
        return [f"      {key}: {{type: {policy_type}, identifier: true}}   # looks like an identifier: never queryable"]
    if type_name == "other":
        return [f"      {key}: {{type: text}}   # TODO: stored as {stored}; check the type, or remove the column"]
    review = "   # REVIEW nullable: no NULL stored today (no NOT NULL declared)" if null_free and not required else ""
    if type_name in ("int", "float", "date", "timestamp"):
        example = {"int": "0, upper: 100", "float": "0.0, upper: 100.0"}.get(type_name, "2000-01-01, upper: 2030-12-31")
        return [
            f"      {key}: {{type: {policy_type}{null}}}{review}",
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
    return [f"      {key}: {{type: {policy_type}{null}}}{review}"]


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
    pks = {t.lower(): cols for t, cols in introspect.primary_keys(backend).items()}
    keys = {short(t): own_key(backend, t, stored_by[t], pks) for t in tables}
    found = links(backend, tables, stored_by)
    public = lookups(backend, tables, stored_by, found, keys)
    person, key = person_table(tables, found, public, keys)
    who = Who(person, key, chains(found, public, person) if person is not None else {}, public, keys, found)
    for table in tables:
        out += _table_lines(backend, table, stored_by[table], who)
    return "\n".join(out).rstrip("\n") + "\n"


class Who(NamedTuple):
    """Who the drafted tables' rows belong to (:mod:`dpsql.curator.draft_links`)."""

    person: str | None
    key: str | None
    chains: dict[str, tuple[Link, tuple[str, ...]]]
    public: set[str]
    keys: dict[str, str | None]
    links: list[Link]


def _unit_lines(backend: Any, name: str, stored: dict[str, str], who: Who) -> tuple[str | None, list[str]]:
    """(the column the draft counts people by, the lines saying whose rows these are)."""
    if name == who.person and who.key is not None:
        return who.key, [
            f"    # the person table: other tables' keys lead to its {who.key} (one row per person)",
            f"    privacy_unit: {_scalar(who.key)}",
            "    max_rows_per_unit: 1",
        ]
    if name in who.chains:
        link, others = who.chains[name]
        cap, why = _proposed_cap(backend, name, who)
        how = (
            "a foreign key"
            if link.declared
            else f"REVIEW: every {link.column} is {_article(link.target)} {link.target}.{link.key}"
        )
        reference = f"{{column: {_scalar(link.column)}, table: {_scalar(link.target)}, to: {_scalar(link.key)}}}"
        lines = []
        if others:
            verb = "points" if len(others) == 1 else "point"
            lines += [
                f"    # REVIEW: {', '.join(others)} also {verb} at {link.target}.{link.key}: whose data is a row?",
                f"    # The unit is one column: confirm {link.column}, or name another of them instead.",
            ]
        return link.column, [
            *lines,
            f"    references: {reference}   # {how}; the person is {who.person}.{who.key}",
            f"    max_rows_per_unit: {cap}   # REVIEW: rows one person may add (more are dropped){why}",
        ]
    if name in who.public:
        return None, ["    public: true   # REVIEW: small, and names no person: readable without noise"]
    units = [c for c in stored if c.lower().endswith("_id")]
    hint = f" (one of: {', '.join(units)}?)" if units else ""
    return None, [
        "    # TODO privacy_unit: the identifier column naming the person each row belongs to" + hint + ";",
        "    # null means one row per person. With several rows per person set max_rows_per_unit too.",
        "    privacy_unit: null",
        "    max_rows_per_unit: 1",
    ]


def _table_lines(backend: Any, table: str, stored: dict[str, str], who: Who) -> list[str]:
    """One table's lines: who its rows belong to, then its columns."""
    name = short(table)
    out = [f"  {_scalar(name)}:"]
    if name != table:
        out.append(f"    source: {_scalar(table)}")
    unit, lines = _unit_lines(backend, name, stored, who)
    out += [*lines, "    columns:"]
    required = introspect.not_null(backend, table)
    own = who.keys.get(name)
    public = name in who.public
    pointed = {link.target for link in who.links}
    # a public table's columns name no person (its key, and its name when others point at it), and a key
    # into a public lookup table is a plain column too: it names a branch, not a person
    plain = frozenset(
        c
        for c in stored
        if (public and (c == own or (c.lower() == "name" and name in pointed)))
        or any(link.table == name and link.column == c and link.target in who.public for link in who.links)
    )
    keys = set() if public or own is None else {own}
    nulls = _null_free(backend, table, stored, required)
    for column, type_name in stored.items():
        out += _column_lines(
            backend, table, column, type_name, column in required, unit, keys, public, plain, column in nulls
        )
    out.append("")
    return out


def _null_free(backend: Any, table: str, stored: dict[str, str], required: set[str]) -> set[str]:
    """Columns without NOT NULL that hold no NULL today (one scan, a yes or no per column): proposed
    ``nullable: false`` for review, since a schema without constraints (a DuckDB file, a CSV load)
    says nothing, and a nullable column that never is NULL releases a phantom NULL group."""
    open_columns = [c for c in stored if c not in required]
    if not open_columns:
        return set()
    items = ", ".join(f"COUNT(*) = COUNT({quote_ident(c)})" for c in open_columns)
    _, rows = backend.execute(f"SELECT {items} FROM {quote_ident(table)}")
    return {c for c, full in zip(open_columns, rows[0], strict=True) if full}


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _proposed_cap(backend: Any, name: str, who: Who) -> tuple[int, str]:
    """``max_rows_per_unit`` for a table reaching the person: the rows 95 % of its persons have at most,
    rounded up to 1, 2 or 5 × 10^k (a figure of the many, never one person's count), or
    :data:`MANY_ROWS` when too few persons hold rows to read one; and the comment saying which."""
    tables = {short(t): t for t in who.keys}  # policy name → source (drafted tables only)
    joins, alias, table = "", "t0", name
    while table in who.chains and table != who.person:
        link = who.chains[table][0]
        nxt = f"t{len(joins.split(' JOIN ')) if joins else 1}"
        joins += (
            f" JOIN {quote_ident(tables.get(link.target, link.target))} AS {nxt} "
            f"ON {alias}.{quote_ident(link.column)} = {nxt}.{quote_ident(link.key)}"
        )
        alias, table = nxt, link.target
    if table != who.person or who.key is None:
        return MANY_ROWS, ""
    unit = f"{alias}.{quote_ident(who.key)}"
    source = quote_ident(tables.get(name, name))
    _, rows = backend.execute(
        f"SELECT COUNT(*), percentile_disc({CAP_QUANTILE}) WITHIN GROUP (ORDER BY n) FROM "
        f"(SELECT {unit} AS u, COUNT(*) AS n FROM {source} AS t0{joins} GROUP BY {unit}) AS per_unit"
    )
    units, quantile = int(rows[0][0] or 0), rows[0][1]
    if units < CAP_MIN_UNITS or quantile is None:
        return MANY_ROWS, ""
    cap = _round_up(int(quantile))
    return cap, f"; {CAP_QUANTILE:.0%} of {who.person} have at most this many"


def _round_up(n: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, … that is at least ``n``."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= n:
                return m * step
        step *= 10
