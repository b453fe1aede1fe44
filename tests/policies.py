"""Policy variants tests derive from the demo policies (no YAML copies to keep in step), and the
header and table head every one-off test policy repeats, written once (the YAML they make is what
the tests wrote out by hand)."""

from __future__ import annotations

from dpsql.dev.demo import demo_policy_path
from dpsql.policy import Policy, load_policy


def without_domain(policy: Policy, table: str, column: str) -> Policy:
    """``policy`` with ``table.column``'s domain removed: grouping by it needs partition selection."""
    source = policy.tables[table]
    columns = {**source.columns, column: source.columns[column].model_copy(update={"domain": None})}
    tables = {**policy.tables, table: source.model_copy(update={"columns": columns})}
    return policy.model_copy(update={"tables": tables})


def clinic_selection_policy(max_rows_per_unit: int | None = None) -> Policy:
    """The clinic with ``visits.department`` undeclared (as before it borrowed the departments'
    domain), optionally with another ``visits.max_rows_per_unit``."""
    policy = without_domain(load_policy(demo_policy_path("clinic")), "visits", "department")
    if max_rows_per_unit is None:
        return policy
    visits = policy.tables["visits"].model_copy(update={"max_rows_per_unit": max_rows_per_unit})
    return policy.model_copy(update={"tables": {**policy.tables, "visits": visits}})


#: The usual budget of a one-off policy: 10 for the dataset and for each analyst.
BUDGET_10 = "{dataset: {epsilon: 10}, analyst: {epsilon: 10}}"
#: A budget that never runs out (the attack or the data, not the budget, decides every outcome).
ROOMY_BUDGET = "{dataset: {epsilon: 1.0e9, delta: 0.5}, analyst: {epsilon: 1.0e9, delta: 0.5}}"
#: ε 1 and δ 1e-6 per query.
DEFAULTS = "{epsilon: 1.0, delta: 1.0e-6}"
#: ε 1 and δ 1e-6 per query, Laplace noise, 95 % intervals.
LAPLACE_95 = "{epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}"


def block_budget(dataset: str, analyst: str) -> str:
    """A ``budget:`` written as a block, a line for the dataset's and one for each analyst's."""
    return f"\n  dataset: {dataset}\n  analyst: {analyst}"


def policy_yaml(
    dataset: str,
    tables: str,
    *,
    budget: str = BUDGET_10,
    defaults: str | None = None,
    trust: bool = False,
    analysts: str | None = "[{name: alice}]",
) -> str:
    """A policy's YAML: the header lines, then ``tables`` (its entries indented by two spaces). A
    ``budget`` that starts with a newline is a block (:func:`block_budget`)."""
    head = [f"dataset: {dataset}"]
    if defaults is not None:
        head.append(f"defaults: {defaults}")
    head.append("budget:" + ("" if budget.startswith("\n") else " ") + budget)
    if trust:
        head.append("auth: {trust: true}")
    if analysts is not None:
        head.append(f"analysts: {analysts}")
    head.append("tables:")
    return "\n".join(head) + "\n" + tables.lstrip("\n")


def table_yaml(
    name: str,
    columns: str = "",
    *,
    unit: str | None = None,
    refs: str | None = None,
    rows: int | str | None = None,
    ids: tuple[str, ...] = (),
    **more: object,
) -> str:
    """One table's YAML entry: ``references`` (``refs="patient_id patients.id"``: this table's column,
    the table and column it points at), ``privacy_unit``, ``max_rows_per_unit``, further settings
    (``max_groups_per_unit=3``: keyword names are the policy's keys), then the ``columns``: ``ids`` as
    integer identifiers first, then ``columns`` (one column a line, at any indentation; blank lines skipped)."""
    lines = [f"  {name}:"]
    if refs is not None:
        column, target = refs.split()
        table, to = target.split(".")
        lines.append(f"    references: {{column: {column}, table: {table}, to: {to}}}")
    if unit is not None:
        lines.append(f"    privacy_unit: {unit}")
    if rows is not None:
        lines.append(f"    max_rows_per_unit: {rows}")
    lines += [f"    {key}: {value}" for key, value in more.items()]
    lines.append("    columns:")
    lines += [f"      {column}: {{type: int, identifier: true}}" for column in ids]
    lines += ["      " + line.strip() for line in columns.splitlines() if line.strip()]
    return "\n".join(lines) + "\n"


def one_table(
    dataset: str, table: str, unit: str | None, rows: int | None, columns: str, groups: int | str | None = None
) -> str:
    """A one-table policy with the usual header (:func:`policy_yaml`'s defaults); ``groups`` is the
    table's ``max_groups_per_unit``."""
    if groups is None:
        return policy_yaml(dataset, table_yaml(table, columns, unit=unit, rows=rows))
    return policy_yaml(dataset, table_yaml(table, columns, unit=unit, rows=rows, max_groups_per_unit=groups))


def report_policy(dataset: str, tables: str) -> str:
    """The header the policy-report and DP-bounds tests share: ε 1 and Laplace noise per query, a small
    budget (ε 3, δ 1e-5 for the dataset, ε 2 for each analyst), trusted connections."""
    return policy_yaml(
        dataset,
        tables,
        defaults="{epsilon: 1.0, delta: 1.0e-6, mechanism: laplace}",
        budget=block_budget("{epsilon: 3, delta: 1.0e-5}", "{epsilon: 2}"),
        trust=True,
    )
