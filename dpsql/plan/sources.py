"""The resolved FROM clause a plan reads: its tables, their privacy units, and name resolution.

The analyzer builds :class:`Sources` from FROM and JOIN (:func:`dpsql.analyze.sources.resolve_sources`,
which refuses every join that could multiply or mix persons' rows); the plan carries it to the
rewrite (the FROM entries, the unit rows are bounded by) and to the aggregates, which resolve their
arguments with :func:`resolve_ref` (identifiers are never readable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.errors import AmbiguousColumn, InsufficientPrivilege, UndefinedColumn, UndefinedTable
from dpsql.policy import ColumnPolicy, Policy, TablePolicy
from dpsql.units import UnitPath


@dataclass(frozen=True, slots=True)
class Source:
    """One table in FROM/JOIN under the alias the query uses."""

    alias: str
    name: str
    table: TablePolicy
    #: How its rows reach their person (None: public, or each row is one person). A path with hops
    #: (transactions → accounts → customers) makes the FROM entry a derived table that joins along
    #: the chain and exposes the unit as :data:`UNIT_COLUMN` (:func:`from_node`).
    path: UnitPath | None = None
    #: A per-person relation (:mod:`dpsql.analyze.persons`): the subquery computing one row per person,
    #: read instead of a table, and the sources it reads.
    derived: exp.Subquery | None = None
    inner: tuple[Source, ...] = ()

    @property
    def private(self) -> bool:
        return not self.table.public

    @property
    def unit_column(self) -> str | None:
        """This table's own column holding the unit value (None: public, row-level, or via joins)."""
        return self.path.column if self.path is not None and not self.path.hops else None

    @property
    def unit(self) -> exp.Column | None:
        if self.path is None:
            return None
        return qualified(self, self.path.column if not self.path.hops else UNIT_COLUMN)


#: The column a chained source's derived table adds: the unit value at the end of its chain.
UNIT_COLUMN = "__unit"


@dataclass(slots=True)
class Sources:
    """The resolved FROM clause."""

    policy: Policy
    sources: list[Source]
    joins: list[exp.Join] = field(default_factory=list)

    @property
    def private(self) -> list[Source]:
        return [s for s in self.sources if s.private]

    @property
    def tables(self) -> list[Source]:
        """The stored tables read, through per-person relations too (whose own source is no table)."""
        out: list[Source] = []
        for source in self.sources:
            out += [s for s in source.inner if s.derived is None] if source.derived is not None else [source]
        return out

    @property
    def unit(self) -> exp.Column | None:
        """The privacy-unit expression all private rows are bounded by (None: row-level)."""
        return next((s.unit for s in self.private if s.unit is not None), None)

    @property
    def unit_description(self) -> str:
        source = next((s for s in self.private if s.path is not None), None)
        if source is None or source.path is None:
            return "one row (each row is one person)"
        return source.path.describe

    def column_policy(self, alias: str | None, column: str | None) -> ColumnPolicy:
        source = next(s for s in self.sources if s.alias == alias)
        return source.table.columns[column or ""]

    #: Aliases of private tables joined to by a foreign key from another table of the query: each row
    #: of the referencing table meets at most one of their rows, so they multiply nothing.
    looked_up: set[str] = field(default_factory=set)

    @property
    def max_rows(self) -> int:
        """Rows one unit may contribute after the joins: the product of the tables' caps, where a table
        reached by a foreign key from another (a lookup of one row per referencing row) counts once.

        A cap, not a proof: bounding keeps at most this many rows per unit of the joined relation
        whatever the data holds, so the noise is right even where a key repeats."""
        caps = [s.table.max_rows_per_unit for s in self.private if s.alias not in self.looked_up]
        return math.prod(caps) if caps else 1

    @property
    def max_groups_declared(self) -> int | None:
        """The tightest ``max_groups_per_unit`` of the private tables (None: no table caps groups)."""
        declared = [s.table.max_groups_per_unit for s in self.private if s.table.max_groups_per_unit]
        return min(declared) if declared else None

    @property
    def max_groups(self) -> int:
        return min(self.max_groups_declared or self.max_rows, self.max_rows)


def ident_name(identifier: exp.Expression | str | None) -> str:
    """PostgreSQL folding: unquoted identifiers are lower-cased, quoted ones kept."""
    if identifier is None:
        return ""
    if isinstance(identifier, str):
        return identifier
    name = identifier.this if isinstance(identifier, exp.Identifier) else identifier.name
    quoted = isinstance(identifier, exp.Identifier) and identifier.args.get("quoted")
    return str(name) if quoted else str(name).lower()


def resolve_ref(column: exp.Column, sources: Sources, *, identifiers: bool = False) -> tuple[Source, str, ColumnPolicy]:
    """A column reference → (its table, its name, its policy); identifiers only where allowed."""
    qualifier = ident_name(column.args.get("table"))
    name = ident_name(column.this)
    if qualifier:
        candidates = [s for s in sources.sources if s.alias == qualifier]
        if not candidates:
            raise UndefinedTable(f'missing FROM-clause entry for table "{qualifier}"')
    else:
        candidates = sources.sources
    matches = [s for s in candidates if name in s.table.columns]
    if not matches:
        listed = ", ".join(
            f"{s.alias}.{c}" if len(sources.sources) > 1 else c
            for s in candidates
            for c, p in s.table.columns.items()
            if not p.identifier
        )
        raise UndefinedColumn(f'column "{name}" does not exist', hint=f"Queryable columns: {listed}.")
    if len(matches) > 1:
        raise AmbiguousColumn(f'column reference "{name}" is ambiguous', hint="Qualify it with its table name.")
    source = matches[0]
    policy = source.table.columns[name]
    if policy.identifier and not identifiers:
        raise InsufficientPrivilege(
            f'permission denied for column "{name}"',
            detail=f'"{name}" is declared an identifier in the policy and can never be queried.',
            hint="Identifiers may appear in JOIN ... ON, IS [NOT] NULL, COUNT(...) and COUNT(DISTINCT <privacy unit>) "
            "only. To aggregate per person, GROUP BY the privacy unit in a FROM-subquery and aggregate its rows "
            "(one per person) in the outer query.",
        )
    return source, name, policy


def qualified(source: Source, name: str) -> exp.Column:
    return exp.column(name, table=source.alias, quoted=True)


def _table(policy: TablePolicy, name: str, alias: str) -> exp.Table:
    return exp.Table(
        this=exp.to_identifier(policy.source or name, quoted=True),
        alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True)),
    )


def from_node(source: Source, policy: Policy) -> exp.Table | exp.Subquery:
    """The FROM entry for a source in generated SQL (backend table name, query alias).

    A table whose unit is joins away is the derived table ``(SELECT t.*, <unit> AS __unit FROM t JOIN
    hop … ) AS t``: inner joins, so a row whose chain is broken belongs to nobody and is left out
    (:mod:`dpsql.units` says why that keeps one person's influence within one unit)."""
    if source.derived is not None:
        return source.derived.copy()
    path = source.path
    if path is None or not path.hops:
        return _table(source.table, source.name, source.alias)
    inner = exp.select(exp.Column(this=exp.Star(), table=exp.to_identifier(source.alias, quoted=True)))
    inner = inner.from_(_table(source.table, source.name, source.alias), copy=False)
    previous = source.alias
    for i, hop in enumerate(path.hops):
        hidden = f"__hop{i}_{source.alias}"
        on = exp.EQ(
            this=exp.column(hop.column, table=previous, quoted=True),
            expression=exp.column(hop.to, table=hidden, quoted=True),
        )
        inner = inner.join(_table(policy.tables[hop.target], hop.target, hidden), on=on, copy=False)
        previous = hidden
    inner = inner.select(exp.alias_(exp.column(path.column, table=previous, quoted=True), UNIT_COLUMN, quoted=True))
    return exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(source.alias, quoted=True)))
