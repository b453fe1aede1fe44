"""Policy load errors in our words, with file:line and a "did you mean" (issue #28 item 2): pydantic's
"Extra inputs are not permitted", "Field required", "Input should be …" never reach the curator."""

from __future__ import annotations

import pytest

from dpsql.curator.check import check_text
from tests.policies import block_budget, policy_yaml, table_yaml

ABSENCES = "days: {type: int, lower: 0, upper: 30, nullable: false}"
POLICY = policy_yaml(
    "hr",
    table_yaml("employees", unit="id", ids=("id",))
    + table_yaml(
        "absences", ABSENCES, refs="employee_id employees.id", rows=20, ids=("id", "employee_id"), max_groups_per_unit=3
    ),
    budget=block_budget("{epsilon: 10.0, delta: 1.0e-5}", "{epsilon: 5.0}"),
    analysts=None,
)

ONE_VALUE = "one value (a number, text, true/false or a date)"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "max_groups_per_unit: 3",
            "max_group_per_unit: 3",
            'x.yaml:13: tables.absences: unknown setting "max_group_per_unit" (did you mean "max_groups_per_unit"?)',
        ),
        (
            "upper: 30",
            "uper: 30",
            'x.yaml:17: tables.absences.columns.days: unknown setting "uper" (did you mean "upper"?)',
        ),
        (
            "{column: employee_id, table",
            "{column: employe_id, table",
            "x.yaml:11: tables.absences.references.column: 'employe_id' is not a declared column "
            '(did you mean "employee_id"?)',
        ),
        (
            "table: employees, to",
            "table: employes, to",
            "x.yaml:11: tables.absences.references.table: table 'employes' is not declared "
            '(did you mean "employees"?)',
        ),
        ("epsilon: 10.0", "epsilon: -1.0", "x.yaml:3: budget.dataset.epsilon: must be greater than 0, not -1.0"),
        (
            "max_rows_per_unit: 20",
            "max_rows_per_unit: twenty",
            "x.yaml:12: tables.absences.max_rows_per_unit: must be a whole number, not 'twenty'",
        ),
        (
            "max_rows_per_unit: 20",
            "max_rows_per_unit: 0",
            "x.yaml:12: tables.absences.max_rows_per_unit: must be at least 1, not 0",
        ),
        (
            "{type: int, lower",
            "{type: integr, lower",
            "x.yaml:17: tables.absences.columns.days.type: must be one of int, float, text, date, timestamp, "
            "boolean, not 'integr' (did you mean \"int\"?)",
        ),
        (
            "nullable: false}",
            "nullable: maybe}",
            "x.yaml:17: tables.absences.columns.days.nullable: must be true or false, not 'maybe'",
        ),
        (
            "lower: 0,",
            "lower: [0],",
            f"x.yaml:17: tables.absences.columns.days.lower: must be {ONE_VALUE}, not [0]",
        ),
        (  # a date column with a bound YAML reads as text: was a TypeError out of the loader
            "days: {type: int, lower: 0, upper: 30,",
            "days: {type: date, lower: 2020-12-01x, upper: 2021-01-01,",
            "x.yaml:17: tables.absences.columns.days: 'lower' must be a date (YYYY-MM-DD), not '2020-12-01x'",
        ),
        (
            "budget:\n  dataset: {epsilon: 10.0, delta: 1.0e-5}\n  analyst: {epsilon: 5.0}\n",
            "",
            'x.yaml:1: <top>: missing required setting "budget"',
        ),
    ],
)
def test_load_errors_in_our_words(old: str, new: str, expected: str) -> None:
    assert check_text(POLICY, "x.yaml").ok
    assert POLICY.count(old) == 1
    report = check_text(POLICY.replace(old, new), "x.yaml")
    assert report.policy is None
    assert report.errors[0] == expected, report.errors
    pydantic = ("Extra inputs", "Field required", "Input should", "unable to parse", "Value error")
    assert not any(word in e for e in report.errors for word in pydantic), report.errors
