"""Who is one person, for ``dpsql policy draft``: foreign keys (declared or found), lookups, the person table.

The draft proposes, with no edits needed, a unit for every table that reaches the person, however many
foreign-key hops away (transactions → accounts → customers):

- **links** (:func:`links`): declared foreign keys to a unique key; where none are declared (DuckDB
  files, CSV loads), an identifier column named after a table or its key (``account_id`` for
  ``accounts.account_id``, ``o_custkey`` for ``customer.c_custkey``) whose values all are values of
  that column, itself unique. Containment of small id ranges alone is no evidence (ids 1–12 of a branch
  table are transaction ids too), hence the name.
- **lookups** (:func:`lookups`): small tables (at most :data:`PUBLIC_ROWS` rows) whose name says
  nothing of people and whose only identifiers are their own key (and ``name``, when others point at
  them): proposed ``public``, for review.
- **the person table** (:func:`person_table`): of the other keyed tables something points at, one whose
  name says people, then the one the most tables point at, then the one the most reach.
- **chains** (:func:`chains`): each table that reaches the person takes the first link of its shortest
  path there; a table with several links to the next table (a loan's borrower and co-signer) takes the
  one named after that table, and the draft names the others for the curator to confirm.

What is read: the schema, and yes/no answers about stored values (unique or not, contained or not, at
most N rows or not): never a value or a count (the curator's tool; nothing goes to an analyst).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from dpsql.backends import quote_ident

from . import introspect
from .unit_check import names_target, unique

#: A table of at most this many rows that names no person is proposed ``public: true`` (for review).
PUBLIC_ROWS = 1000
#: Words in a table's name that say its rows are people: a small ``managers(id, name)`` that others
#: point at is still people, its ``name`` an identifier (never proposed as a public domain).
PEOPLE_WORDS = (
    "employee", "manager", "staff", "user", "person", "people", "customer", "patient", "member",
    "student", "client", "doctor", "nurse", "contact", "owner", "worker", "teacher", "driver",
    "author", "agent", "supervisor", "reviewer", "resident", "citizen", "applicant", "account",
)  # fmt: skip


_IDENTIFIER = re.compile(
    r"^(id|uuid|guid|ssn|email|e_mail|phone|telephone|mobile|name|first_?name|last_?name|surname|full_?name|"
    r"address|street|ip|ip_address|passport|iban|account)$|_id$|_uuid$|_email$|_phone$|_ssn$|key$",
    re.IGNORECASE,
)


def looks_like_identifier(column: str) -> bool:
    """``id``, ``*_id``, ``*key`` (TPC-H's ``c_custkey``), names, e-mails, phone numbers, …"""
    return bool(_IDENTIFIER.search(column))


def of_people(table: str) -> bool:
    """Whether a table's name says its rows are people (see :data:`PEOPLE_WORDS`)."""
    return any(word in table.lower() for word in PEOPLE_WORDS)


class Link(NamedTuple):
    """``table.column`` names a row of ``target`` by its unique ``key``; ``declared`` by a foreign key."""

    table: str
    column: str
    target: str
    key: str
    declared: bool


def short(table: str) -> str:
    """A drafted table's policy name (its source without a schema, lower case)."""
    return table.split(".")[-1].lower()


def _contained(backend: Any, source: str, column: str, target: str, key: str) -> bool:
    """Whether every non-NULL value of ``source.column`` is a value of ``target.key`` (and there is one)."""
    col, k = quote_ident(column), quote_ident(key)
    _, rows = backend.execute(
        f"SELECT COUNT(*), COUNT(q.k) FROM (SELECT DISTINCT {col} AS c FROM {quote_ident(source)} WHERE {col} IS NOT "
        f"NULL) AS r LEFT JOIN (SELECT DISTINCT {k} AS k FROM {quote_ident(target)}) AS q ON r.c = q.k"
    )
    return int(rows[0][0] or 0) > 0 and rows[0][0] == rows[0][1]


def _id_like(column: str) -> bool:
    lowered = column.lower()
    return lowered == "id" or lowered.endswith(("_id", "key", "_uuid"))


def links(backend: Any, tables: list[str], stored: dict[str, dict[str, str]]) -> list[Link]:
    """Declared single-column foreign keys between drafted tables; for columns without one, the links
    their names and values show (see the module docstring)."""
    names = {short(t): t for t in tables}
    found: list[Link] = []
    declared_from: set[tuple[str, str]] = set()
    for table, column, target, key in introspect.foreign_keys(backend):
        if short(table) in names and short(target) in names and short(table) != short(target):
            found.append(Link(short(table), column, short(target), key, True))
            declared_from.add((short(table), column.lower()))
    for name, source in names.items():
        for column in stored[source]:
            if (name, column.lower()) in declared_from or not _id_like(column):
                continue
            for other, other_source in names.items():
                if other == name:
                    continue
                for key in stored[other_source]:
                    if not _id_like(key) or not names_target(column, other, key):
                        continue
                    if introspect.family(stored[source][column]) != introspect.family(stored[other_source][key]):
                        continue
                    if _contained(backend, source, column, other_source, key) and unique(backend, other_source, key):
                        found.append(Link(name, column, other, key, False))
    return found


def own_key(backend: Any, table: str, stored: dict[str, str], pks: dict[str, list[str]]) -> str | None:
    """A table's single-column key: its primary key, else ``id`` or a column named after the table
    whose values are unique."""
    declared = pks.get(short(table))
    if declared is not None:
        return declared[0] if len(declared) == 1 else None
    for column in stored:
        lowered = column.lower()
        if (lowered == "id" or names_target(column, short(table), column)) and unique(backend, table, column):
            return column
    return None


def _small(backend: Any, table: str) -> bool:
    """At most :data:`PUBLIC_ROWS` rows (read as yes or no only)."""
    _, rows = backend.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM {quote_ident(table)} LIMIT {PUBLIC_ROWS + 1}) t")
    return int(rows[0][0]) <= PUBLIC_ROWS


def lookups(
    backend: Any, tables: list[str], stored: dict[str, dict[str, str]], found: list[Link], keys: dict[str, str | None]
) -> set[str]:
    """Tables proposed public: small, not named after people, pointing at no other drafted table, and
    whose only identifier-like columns are their own key and (when others point at them) ``name``."""
    pointed = {link.target for link in found}
    public = set()
    for table in tables:
        name = short(table)
        if of_people(name) or any(link.table == name for link in found) or not _small(backend, table):
            continue
        allowed = {keys.get(name)} | ({"name"} if name in pointed else set())
        if all(c in allowed or not looks_like_identifier(c) for c in stored[table]):
            public.add(name)
    return public


def _graph(found: Iterable[Link], public: set[str]) -> dict[str, list[Link]]:
    out: dict[str, list[Link]] = {}
    for link in found:
        if link.target not in public and link.table not in public:
            out.setdefault(link.table, []).append(link)
    return out


def _distances(graph: dict[str, list[Link]], person: str) -> dict[str, int]:
    """Hops from each table to ``person`` along links (breadth first over the reversed links)."""
    back: dict[str, list[str]] = {}
    for table, out in graph.items():
        for link in out:
            back.setdefault(link.target, []).append(table)
    distance, queue = {person: 0}, deque([person])
    while queue:
        at = queue.popleft()
        for table in back.get(at, []):
            if table not in distance:
                distance[table] = distance[at] + 1
                queue.append(table)
    return distance


def person_table(
    tables: list[str], found: list[Link], public: set[str], keys: dict[str, str | None]
) -> tuple[str | None, str | None]:
    """(person table, its key): of the keyed, non-public tables that other tables point at, one whose
    name says people (TPC-H's customer, not the supplier or nation more tables point at), then the one
    the most tables point at directly (employees, not the managers the employees point at), then the
    one the most tables reach along links; ties by name."""
    graph = _graph(found, public)
    best: tuple[bool, int, int, str] | None = None
    for table in sorted(short(t) for t in tables):
        if table in public or keys.get(table) is None:
            continue
        reached = len(_distances(graph, table)) - 1
        if reached == 0:
            continue
        direct = len({link.table for out in graph.values() for link in out if link.target == table})
        score = (of_people(table), direct, reached, table)
        if best is None or score[:3] > best[:3]:
            best = score
    return (best[3], keys[best[3]]) if best is not None else (None, None)


def chains(found: list[Link], public: set[str], person: str) -> dict[str, tuple[Link, tuple[str, ...]]]:
    """Each table reaching ``person``: (the link it references, other columns linking to the same table)."""
    graph = _graph(found, public)
    distance = _distances(graph, person)
    out: dict[str, tuple[Link, tuple[str, ...]]] = {}
    for table, table_links in graph.items():
        if table == person or table not in distance:
            continue
        closer = [link for link in table_links if distance.get(link.target, 1 << 30) == distance[table] - 1]
        target = sorted({link.target for link in closer}, key=lambda t: (t != person, t))[0]
        columns = [link for link in closer if link.target == target]
        columns.sort(key=lambda link: (not link.declared, not names_target(link.column, target, link.key), link.column))
        out[table] = (columns[0], tuple(link.column for link in columns[1:]))
    return out
