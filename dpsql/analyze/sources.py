"""FROM and JOIN: which tables a query reads, and what protects a person across them.

Private tables protect a *privacy unit* (a person, or a household): directly through a
column, or through a foreign key to the unit's table. A query may join private tables
only on their unit (so one person's rows meet only that person's rows) and may join any
private table with public lookup tables. Every other join shape — self-joins, cross or
non-equi joins between private tables, joins of tables without a unit — could let one
person's rows multiply or mix with others' beyond the declared bounds, and is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.errors import (
    AmbiguousColumn,
    DuplicateAlias,
    FeatureNotSupported,
    InsufficientPrivilege,
    ProgramLimitExceeded,
    UndefinedColumn,
    UndefinedTable,
)
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
            return exp.column(self.unit_join.meta["unit"], table=_unit_alias(self), quoted=True)
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


def unit_column(policy: Policy, table: TablePolicy) -> str | None:
    """The column of ``table`` whose value *is* the unit (directly, or a foreign key to the unit)."""
    if table.public:
        return None
    if table.privacy_unit is not None:
        return table.privacy_unit
    ref = table.references
    if ref is not None and policy.tables[ref.table].privacy_unit == ref.to:
        return ref.column
    return None


def _unit_alias(source: Source) -> str:
    return f"__unit_{source.alias}"


def _unit_join(policy: Policy, alias: str, table: TablePolicy) -> exp.Join | None:
    """LEFT JOIN to the referenced table when the unit is a coarser column there (e.g. a household)."""
    ref = table.references
    if table.public or table.privacy_unit is not None or ref is None:
        return None
    target = policy.tables[ref.table]
    if target.privacy_unit in (None, ref.to):
        return None
    hidden = f"__unit_{alias}"
    join = exp.Join(
        this=exp.Table(
            this=exp.to_identifier(target.source or ref.table, quoted=True),
            alias=exp.TableAlias(this=exp.to_identifier(hidden, quoted=True)),
        ),
        on=exp.EQ(
            this=exp.column(ref.column, table=alias, quoted=True),
            expression=exp.column(ref.to, table=hidden, quoted=True),
        ),
        side="LEFT",
    )
    join.meta["unit"] = target.privacy_unit
    return join


def _source(node: exp.Expression, policy: Policy) -> Source:
    if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier):
        raise FeatureNotSupported("FROM must name a table", hint="Subqueries and table functions are refused.")
    schema = ident_name(node.args.get("db"))
    name = ident_name(node.this)
    table = policy.tables.get(name)
    if table is None or schema not in ("", "public") or node.args.get("catalog"):
        shown = f"{schema}.{name}" if schema else name
        raise UndefinedTable(
            f'relation "{shown}" does not exist',
            hint=f'Tables in dataset "{policy.dataset}": {", ".join(sorted(policy.tables))}.',
        )
    alias = ident_name(node.args["alias"].this) if node.alias else name
    return Source(
        alias=alias,
        name=name,
        table=table,
        unit_column=unit_column(policy, table),
        unit_join=_unit_join(policy, alias, table),
    )


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


def _conjuncts(node: exp.Expression) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    return [node]


def _check_join_kind(join: exp.Join) -> None:
    join_type, side = (join.args.get("kind") or "").upper(), (join.args.get("side") or "").upper()
    if join_type == "CROSS" or (not join.args.get("on") and not join.args.get("using")):
        raise FeatureNotSupported(
            "cross joins are not supported",
            hint="A cross join pairs every person with every row; join on the privacy unit instead.",
        )
    if join.args.get("using"):
        raise FeatureNotSupported("JOIN ... USING is not supported", hint="Write the condition with ON.")
    if join_type not in ("", "INNER", "OUTER") or side not in ("", "LEFT"):
        raise FeatureNotSupported(
            f"{(side + ' ' + join_type).strip() or join_type} JOIN is not supported", hint="Use JOIN or LEFT JOIN."
        )
    if join.args.get("method"):  # NATURAL, ASOF, ...
        raise FeatureNotSupported(f"{join.args['method'].upper()} JOIN is not supported")


def _follows_reference(a: tuple[Source, str, ColumnPolicy], b: tuple[Source, str, ColumnPolicy]) -> bool:
    """``a.column = b.to`` for a declared ``references`` of a's table: rows keep their unit."""
    ref = a[0].table.references
    return ref is not None and ref.column == a[1] and ref.table == b[0].name and ref.to == b[1]


def _join_condition(join: exp.Join, sources: Sources, unify: dict[str, str]) -> exp.Expression:
    """Validate ``ON`` (a conjunction of column equalities) and record which units it equates."""
    normalised = []
    for conjunct in _conjuncts(join.args["on"]):
        if not isinstance(conjunct, exp.EQ) or not all(
            isinstance(side, exp.Column) for side in (conjunct.this, conjunct.expression)
        ):
            raise FeatureNotSupported(
                "JOIN conditions must be equalities between columns",
                hint="Non-equi joins can pair one person's rows with many others'.",
            )
        left = resolve_ref(conjunct.this, sources, identifiers=True)
        right = resolve_ref(conjunct.expression, sources, identifiers=True)
        if left[0].private and right[0].private:
            on_units = left[1] == left[0].unit_column and right[1] == right[0].unit_column
            if not on_units and not _follows_reference(left, right) and not _follows_reference(right, left):
                raise FeatureNotSupported(
                    f'private tables "{left[0].name}" and "{right[0].name}" must be joined on their privacy unit',
                    hint="Join on the privacy-unit columns or along a foreign key declared in the policy "
                    "(references); joining on other columns mixes different persons' rows.",
                )
            _union(unify, left[0].alias, right[0].alias)
        normalised.append(exp.EQ(this=qualified(left[0], left[1]), expression=qualified(right[0], right[1])))
    condition: exp.Expression = normalised[0]
    for extra in normalised[1:]:
        condition = exp.And(this=condition, expression=extra)
    return condition


#: Tables in one query's FROM and JOINs (each join can multiply the rows the database works through).
MAX_JOINED_TABLES = 8


def resolve_sources(tree: exp.Select, policy: Policy) -> Sources:
    """Resolve FROM and JOINs; refuse every join that could multiply or mix persons' rows."""
    sources = Sources(policy, [_source(tree.args["from_"].this, policy)])
    joins = tree.args.get("joins") or []
    if len(joins) + 1 > MAX_JOINED_TABLES:
        raise ProgramLimitExceeded(
            f"a query may join at most {MAX_JOINED_TABLES} tables",
            hint="Every join multiplies the work the database does; split the question into smaller queries.",
        )
    for join in joins:
        _check_join_kind(join)
        source = _source(join.this, policy)
        if any(s.alias == source.alias for s in sources.sources):
            raise DuplicateAlias(f'table name "{source.alias}" specified more than once')
        if any(s.name == source.name for s in sources.sources):
            if source.private:
                raise FeatureNotSupported(
                    f'self-joins of private table "{source.name}" are not supported',
                    hint="A self-join can count one person's rows many times over.",
                )
            # A public table joined with itself adds no information and multiplies rows: a chain of
            # them is a free way to hold the database (the query is charged, then runs for hours).
            raise FeatureNotSupported(
                f'self-joins of public table "{source.name}" are not supported',
                hint="Join each public table once.",
            )
        sources.sources.append(source)
    if joins:
        for source in sources.private:
            if source.unit is None:
                raise FeatureNotSupported(
                    f'table "{source.name}" has no privacy unit and cannot be joined',
                    hint="Declare privacy_unit (or references) for it in the policy.",
                )
    unify: dict[str, str] = {}
    for join in joins:
        condition = _join_condition(join, sources, unify)
        sources.joins.append(
            exp.Join(this=_table_node(_by_alias(sources, join)), on=condition, side=join.args.get("side"))
        )
    sources.joins.extend(s.unit_join for s in sources.sources if s.unit_join is not None)
    private = sources.private
    if len(private) > 1:
        roots = {_root(unify, s.alias) for s in private}
        if len(roots) > 1:
            raise FeatureNotSupported(
                "private tables must be joined on their privacy unit",
                hint="Add ON conditions equating the tables' privacy-unit columns "
                f"({', '.join(f'{s.alias}.{s.unit_column}' for s in private)}).",
            )
    return sources


def _root(parent: dict[str, str], alias: str) -> str:
    """Union-find: the representative of the set of tables joined on one unit."""
    while parent.get(alias, alias) != alias:
        alias = parent[alias]
    return alias


def _union(parent: dict[str, str], a: str, b: str) -> None:
    parent[_root(parent, a)] = _root(parent, b)


def _by_alias(sources: Sources, join: exp.Join) -> Source:
    alias = ident_name(join.this.args["alias"].this) if join.this.alias else ident_name(join.this.this)
    return next(s for s in sources.sources if s.alias == alias)


def _table_node(source: Source) -> exp.Table:
    return exp.Table(
        this=exp.to_identifier(source.table.source or source.name, quoted=True),
        alias=exp.TableAlias(this=exp.to_identifier(source.alias, quoted=True)),
    )


def from_node(source: Source) -> exp.Table:
    """The FROM entry for a source in generated SQL (backend table name, query alias)."""
    return _table_node(source)
