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


@dataclass(frozen=True, slots=True)
class Source:
    """One table in FROM/JOIN under the alias the query uses."""

    alias: str
    name: str
    table: TablePolicy
    #: The column holding this table's privacy-unit value (None: public, one row per person, or via a join).
    unit_column: str | None
    #: Where the unit lives in another table (group privacy: ``visits.patient_id → patients.id`` while
    #: patients protect ``household_id``): the hidden join that fetches it.
    unit_join: exp.Join | None = None

    @property
    def private(self) -> bool:
        return not self.table.public

    @property
    def unit(self) -> exp.Column | None:
        if self.unit_column is not None:
            return qualified(self, self.unit_column)
        if self.unit_join is not None:
            ref = self.table.references
            assert ref is not None
            return exp.column(self.unit_join.meta["unit"], table=unit_alias(self), quoted=True)
        return None


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
    def unit(self) -> exp.Column | None:
        """The privacy-unit expression all private rows are bounded by (None: row-level)."""
        return next((s.unit for s in self.private if s.unit is not None), None)

    @property
    def unit_description(self) -> str:
        source = next((s for s in self.private if s.unit is not None), None)
        if source is None:
            return "one row (each row is one person)"
        if source.table.privacy_unit is not None:
            return f"{source.name}.{source.table.privacy_unit}"
        ref = source.table.references
        assert ref is not None
        return f"{ref.table}.{self.policy.tables[ref.table].privacy_unit or ref.to}"

    def column_policy(self, alias: str | None, column: str | None) -> ColumnPolicy:
        source = next(s for s in self.sources if s.alias == alias)
        return source.table.columns[column or ""]

    @property
    def max_rows(self) -> int:
        """Rows one unit may contribute after the join: the product of the tables' bounds."""
        return math.prod(s.table.max_rows_per_unit for s in self.private) if self.private else 1

    @property
    def max_groups(self) -> int:
        declared = [s.table.max_groups_per_unit for s in self.private if s.table.max_groups_per_unit]
        return min([*declared, self.max_rows])


def ident_name(identifier: exp.Expression | str | None) -> str:
    """PostgreSQL folding: unquoted identifiers are lower-cased, quoted ones kept."""
    if identifier is None:
        return ""
    if isinstance(identifier, str):
        return identifier
    name = identifier.this if isinstance(identifier, exp.Identifier) else identifier.name
    quoted = isinstance(identifier, exp.Identifier) and identifier.args.get("quoted")
    return str(name) if quoted else str(name).lower()


def unit_alias(source: Source) -> str:
    return f"__unit_{source.alias}"


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
            hint="Identifiers may only appear in JOIN ... ON conditions and in COUNT(DISTINCT <privacy unit>).",
        )
    return source, name, policy


def qualified(source: Source, name: str) -> exp.Column:
    return exp.column(name, table=source.alias, quoted=True)


def from_node(source: Source) -> exp.Table:
    """The FROM entry for a source in generated SQL (backend table name, query alias)."""
    return exp.Table(
        this=exp.to_identifier(source.table.source or source.name, quoted=True),
        alias=exp.TableAlias(this=exp.to_identifier(source.alias, quoted=True)),
    )
