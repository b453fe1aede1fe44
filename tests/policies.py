"""Policy variants tests derive from the demo policies (no YAML copies to keep in step)."""

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
