"""The opt-in write path: which INSERTs may run, and storing their rows perturbed.

The outcome of a write must not depend on stored data (else it is a membership oracle):
the columns an analyst may give are checked here (:func:`parse_insert`), the table's catalog
by :func:`dpsql.writes.write_oracles`, both before anything runs; randomized-response columns
are perturbed (ε-local DP, :func:`dpsql.localdp.perturb_rows`) before they reach the database.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dpsql.analyze.parse import literal_for
from dpsql.backends import Backend
from dpsql.errors import (
    BackendError,
    Error,
    FeatureNotSupported,
    InsufficientPrivilege,
    InvalidParameterValue,
    ReadOnlyViolation,
    SyntaxError_,
    UndefinedColumn,
    UndefinedTable,
)
from dpsql.localdp import perturb_rows
from dpsql.policy import Policy, TablePolicy
from dpsql.session import Result
from dpsql.writes import write_oracles


def parse_insert(tree: exp.Expression, policy: Policy) -> tuple[TablePolicy, list[str], list[tuple[Any, ...]]]:
    """``INSERT INTO t (cols) VALUES (...)`` with constants, into a table with randomized-response columns.

    Analysts give values only for randomized-response columns and columns the policy marks
    ``writable: true``; identifiers (and every other column) are refused with 42501 before
    anything runs: whether a given respondent is already stored must never decide the outcome.
    """
    if not policy.writes.randomized_response:
        raise ReadOnlyViolation(
            "cannot execute INSERT in a read-only transaction",
            hint="dpsql is read-only unless the policy enables writes: {randomized_response: true}.",
        )
    schema, values = tree.this, tree.args.get("expression")
    if not isinstance(schema, exp.Schema) or not isinstance(values, exp.Values) or tree.args.get("returning"):
        raise FeatureNotSupported("only INSERT INTO <table> (<columns>) VALUES (...) is supported")
    name = schema.this.name
    table = policy.tables.get(name)
    if table is None:
        raise UndefinedTable(f'relation "{name}" does not exist')
    if not any(c.randomized_response for c in table.columns.values()):
        raise ReadOnlyViolation(
            "cannot execute INSERT in a read-only transaction",
            hint=f'Only tables with randomized-response columns accept writes; "{name}" has none.',
        )
    columns = [c.name for c in schema.expressions]
    for column in columns:
        if column not in table.columns:
            raise UndefinedColumn(f'column "{column}" of relation "{name}" does not exist')
    for column in columns:
        policy_column = table.columns[column]
        if policy_column.randomized_response is None and (policy_column.identifier or not policy_column.writable):
            raise InsufficientPrivilege(
                f'permission denied to write column "{column}" of relation "{name}"',
                hint=(
                    "Identifier columns are filled by the database, never by an INSERT: whether an identifier "
                    "is already stored would decide the outcome."
                    if policy_column.identifier
                    else "An INSERT may give only randomized-response columns and columns the policy marks "
                    "'writable: true'."
                ),
            )
    rows = []
    for row in values.expressions:
        cells = [_constant(v) for v in row.expressions]
        if len(cells) != len(columns):
            raise SyntaxError_("INSERT has more expressions than target columns")
        for column, value in zip(columns, cells, strict=True):
            mechanism = table.columns[column].local_mechanism()
            if mechanism is not None and value not in mechanism.domain:
                raise InvalidParameterValue(
                    f'invalid value for randomized-response column "{column}"',
                    hint=f"Answers must be one of: {', '.join(map(str, mechanism.domain))}.",
                )
        rows.append(tuple(cells))
    missing = [c for c, p in table.columns.items() if p.randomized_response and c not in columns]
    if missing:
        raise InvalidParameterValue(f'INSERT must give a value for randomized-response column "{missing[0]}"')
    return table, columns, rows


def _constant(node: exp.Expression) -> Any:
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
        return -_constant(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        return float(node.name) if any(ch in node.name for ch in ".eE") else int(node.name)
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        return node.this.name
    raise FeatureNotSupported("INSERT values must be constants")


def insert(backend: Backend, policy: Policy, tree: exp.Expression) -> Result:
    """The opt-in write path: store rows with their randomized-response columns perturbed.

    The outcome must not depend on stored data (else it is a membership oracle): the
    columns an analyst may give are checked by :func:`parse_insert`, the table's catalog
    by :func:`dpsql.writes.write_oracles` (no key, foreign key or trigger relating the new
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
