"""Who a row belongs to: each private table's path to the privacy unit along declared foreign keys.

A table names its person directly (``privacy_unit``), or through ``references`` to a table that does,
however many hops away (transactions → accounts → customers; lineitem → orders → customer). The unit
of a row is the value at the end of that chain, fetched by inner joins along it: each hop's ``to`` is
the referenced table's key (a foreign key's target is unique, and ``dpsql policy check`` verifies it),
so a row meets exactly the row it points at, and a row whose chain is broken (its key names no row)
belongs to nobody and is left out. Adding a person can then only add rows whose unit is that person:
a row stays with its owner or, orphaned, is invisible until its owner's row exists — never counted
once for nobody and again for someone (which would let one person move two units' worth).

A table without a unit of its own (``privacy_unit: null``, each row one person) that other tables
reference has the referenced key as its unit: that key names one row, which is one person.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class _Reference(Protocol):
    @property
    def column(self) -> str: ...
    @property
    def table(self) -> str: ...
    @property
    def to(self) -> str: ...


class _Table(Protocol):
    @property
    def public(self) -> bool: ...
    @property
    def privacy_unit(self) -> str | None: ...
    @property
    def references(self) -> _Reference | None: ...


@dataclass(frozen=True, slots=True)
class Hop:
    """One foreign key followed: ``table.column`` names a row of ``target`` by its key ``to``."""

    table: str
    column: str
    target: str
    to: str


@dataclass(frozen=True, slots=True)
class UnitPath:
    """How the rows of ``table`` reach their unit: join along ``hops`` (possibly none), then read
    ``column`` of the last table reached. ``person`` names the unit as the curator declared it
    (``customers.customer_id``), ``chain`` the tables walked, for EXPLAIN and messages."""

    table: str
    hops: tuple[Hop, ...]
    column: str
    person: str
    chain: tuple[str, ...]

    @property
    def owner(self) -> str:
        """The table whose column holds the unit value (``table`` itself when no join is needed)."""
        return self.hops[-1].target if self.hops else self.table

    @property
    def describe(self) -> str:
        """``customers.customer_id (transactions → accounts → customers)``, or the bare unit one hop away."""
        return self.person if len(self.chain) <= 2 else f"{self.person} ({' → '.join(self.chain)})"


class UnitError(ValueError):
    """A ``references`` chain that cannot reach a person (reported at ``loc`` of the policy)."""

    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def resolve_units(tables: Mapping[str, _Table]) -> dict[str, UnitPath | None]:
    """Each table's :class:`UnitPath`; None for public tables and for tables whose rows are each a
    person (no unit, no reference). A chain through a public table, or round in a circle, is an error."""
    keys: dict[str, str] = {}  # a row-level table's key, named by the references that point at it
    for name, table in tables.items():
        ref = table.references
        target = tables.get(ref.table) if ref is not None else None
        if ref is None or target is None or target.privacy_unit is not None or target.references is not None:
            continue
        if keys.setdefault(ref.table, ref.to) != ref.to:
            raise UnitError(
                ("tables", name, "references", "to"),
                f"'{ref.table}' has no privacy_unit and is referenced by two keys ({keys[ref.table]}, {ref.to}): "
                f"declare which one names the person with 'privacy_unit' on '{ref.table}'",
            )
    return {name: _resolve(tables, keys, name, ()) for name in tables}


def _resolve(tables: Mapping[str, _Table], keys: dict[str, str], name: str, seen: tuple[str, ...]) -> UnitPath | None:
    table = tables[name]
    if table.public:
        return None
    unit = table.privacy_unit or (keys.get(name) if table.references is None else None)
    if unit is not None:
        return UnitPath(name, (), unit, f"{name}.{unit}", (name,))
    ref = table.references
    if ref is None:
        return None
    at = ("tables", name, "references", "table")
    if ref.table in (*seen, name):
        loop = " → ".join((*seen, name, ref.table))
        raise UnitError(at, f"references go round in a circle ({loop}): the chain must end at the person's table")
    target = tables[ref.table]
    if target.public:
        raise UnitError(
            at,
            f"'{ref.table}' is public (its rows are nobody's): references must lead towards the person "
            "this table's rows belong to",
        )
    beyond = _resolve(tables, keys, ref.table, (*seen, name))
    assert beyond is not None  # a private target has a unit of its own, one through references, or its key
    hops = (Hop(name, ref.column, ref.table, ref.to), *beyond.hops)
    column = beyond.column
    # the unit value is already in the row that points at the table holding it: no join for that hop
    if hops[-1].to == column:
        column = hops[-1].column
        hops = hops[:-1]
    return UnitPath(name, hops, column, beyond.person, (name, *beyond.chain))
