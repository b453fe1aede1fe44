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

:func:`write_oracles` reads the backend's catalog (schema, not data: :meth:`Backend.write_catalog`)
and names what is in the way; a backend whose catalog cannot be read (None) accepts no writes (fail
closed). :func:`insert` runs the write once both checks pass (the analysis stays below, in
:mod:`dpsql.analyze.insert`, which never imports this module).
"""

from __future__ import annotations

import re

from sqlglot import exp

from dpsql.analyze.insert import parse_insert
from dpsql.analyze.parse import literal_for
from dpsql.backends import Backend
from dpsql.errors import BackendError, Error, ReadOnlyViolation
from dpsql.localdp import perturb_rows
from dpsql.policy import Policy
from dpsql.session import Result

#: Defaults that give every new row a fresh value (no conflict with stored rows by construction).
_GENERATED_DEFAULT = re.compile(r"nextval\s*\(|gen_random_uuid\s*\(|uuid(v4)?\s*\(|uuid_generate_v4\s*\(", re.I)


def write_oracles(backend: Backend, table: str, written: list[str]) -> list[str]:
    """Descriptions of the schema features that would make an INSERT of ``written`` into ``table``
    succeed or fail according to stored rows; empty when the outcome depends on the statement only."""
    catalog = backend.write_catalog(table)
    if catalog is None:
        return [f"the {backend.dialect} backend's constraints cannot be checked"]
    found = list(catalog.triggers)
    defaults = catalog.defaults
    lowered = {c.lower() for c in written}
    for constraint, columns in catalog.keys:
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


def insert(backend: Backend, policy: Policy, tree: exp.Expression) -> Result:
    """The opt-in write path: store rows with their randomized-response columns perturbed.

    The outcome must not depend on stored data (else it is a membership oracle): the
    columns an analyst may give are checked by :func:`parse_insert`, the table's catalog
    by :func:`write_oracles` (no key, foreign key or trigger relating the new
    row to stored ones), both before anything runs; and every failure of the write itself
    is reported as one fixed error, whatever the database's reason.
    """
    table, columns, rows = parse_insert(tree, policy)
    target = table.source or tree.this.this.name
    try:
        oracles = write_oracles(backend, target, columns)
    except Error:
        oracles = ["the catalog could not be read"]
    if oracles:
        raise ReadOnlyViolation(
            "cannot execute INSERT in a read-only transaction",
            hint=f'The table "{tree.this.this.name}" has {oracles[0]}: whether an INSERT succeeded would '
            "depend on rows already stored, so dpsql does not write to it.",
        )
    mechanisms = [table.columns[c].local_mechanism() for c in columns]
    stored = perturb_rows(rows, mechanisms)
    values = exp.values([tuple(literal_for(v) for v in row) for row in stored])
    statement = exp.Insert(
        this=exp.Schema(
            this=exp.table_(table.source or tree.this.this.name, quoted=True),
            expressions=[exp.to_identifier(c, quoted=True) for c in columns],
        ),
        expression=values,
    )
    try:
        backend.execute_script(statement.sql(dialect=backend.dialect))
    except Exception:  # one error for every cause (NOT NULL, CHECK, type, connection): nothing data-dependent
        raise BackendError(
            "the database failed to store the rows",
            hint="Nothing was stored. The reason is withheld: it could depend on other rows.",
        ) from None
    perturbed = [f"{c} (ε={m.epsilon:g})" for c, m in zip(columns, mechanisms, strict=True) if m is not None]
    return Result(
        columns=[],
        rows=[],
        accuracy=[],
        epsilon_spent=0.0,
        delta_spent=0.0,
        notices=[f"dpsql: stored {len(stored)} row(s); randomized response applied to {', '.join(perturbed)}"],
        command_tag=f"INSERT 0 {len(stored)}",
    )
