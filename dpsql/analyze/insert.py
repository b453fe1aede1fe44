"""The opt-in write path's analysis: which INSERTs may run.

The outcome of a write must not depend on stored data (else it is a membership oracle):
the columns an analyst may give are checked here (:func:`parse_insert`), before anything runs.
The write itself — the table's catalog checked, randomized-response columns perturbed (ε-local
DP, :func:`dpsql.localdp.perturb_rows`), the rows stored — is :func:`dpsql.writes.insert`.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dpsql.errors import (
    FeatureNotSupported,
    InsufficientPrivilege,
    InvalidParameterValue,
    ReadOnlyViolation,
    SyntaxError_,
    UndefinedColumn,
    UndefinedTable,
)
from dpsql.policy import Policy, TablePolicy


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
