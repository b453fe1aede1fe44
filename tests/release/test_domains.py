"""``domain: {table, column}``: a column borrows a public table column's declared domain.

Resolved at load from the policy alone (nothing is read from any table), so the released key set
is data-independent. Every bad reference is a PolicyError (F0000) naming file, line and key path.
"""

from __future__ import annotations

import pytest

from dpsql.dev.demo import demo_policy_path
from dpsql.errors import PolicyError
from dpsql.policy import Policy, load_policy, parse_policy

DEPARTMENTS = ("Cardiology", "Oncology", "Pediatrics", "Emergency", "Dermatology", "Neurology")

POLICY = """\
dataset: refs
budget:
  dataset: {epsilon: 10.0, delta: 1.0e-4}
  analyst: {epsilon: 1.0, delta: 1.0e-5}
tables:
  visits:
    privacy_unit: patient_id
    max_rows_per_unit: 20
    columns:
      patient_id: {type: int, identifier: true}
      department: {type: text, domain: REF}
  departments:
    public: true
    columns:
      name: {type: text, domain: [Cardiology, Oncology]}
      code: {type: text, identifier: true}
      floor: {type: int, lower: 0, upper: 10}
      wing: {type: text}
  staff:
    privacy_unit: id
    columns:
      id: {type: int, identifier: true}
      role: {type: text, domain: [Nurse, Doctor]}
"""


def _parse(ref: str) -> Policy:
    return parse_policy(POLICY.replace("REF", ref), "refs.yaml")


def test_clinic_departments_borrowed() -> None:
    column = load_policy(demo_policy_path("clinic")).tables["visits"].columns["department"]
    assert column.domain == DEPARTMENTS
    assert column.release_domain() == DEPARTMENTS  # nullable: false, so no NULL key


def test_reference_resolves_and_adds_null_when_nullable() -> None:
    policy = _parse("{table: departments, column: name}")
    column = policy.tables["visits"].columns["department"]
    assert column.domain == ("Cardiology", "Oncology")
    assert column.release_domain() == ("Cardiology", "Oncology", None)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            "{table: wards, column: name}",
            "refs.yaml:11: tables.visits.columns.department.domain.table: table 'wards' is not declared",
        ),
        (
            "{table: staff, column: role}",
            "refs.yaml:11: tables.visits.columns.department.domain.table: "
            "table 'staff' is not public: only a public table's values may be a domain",
        ),
        (
            "{table: departments, column: label}",
            "refs.yaml:11: tables.visits.columns.department.domain.column: 'label' is not a column of 'departments'",
        ),
        (
            "{table: departments, column: floor}",
            "refs.yaml:11: tables.visits.columns.department.domain.column: "
            "'departments.floor' is int but 'visits.department' is text",
        ),
        (
            "{table: departments, column: code}",
            "refs.yaml:11: tables.visits.columns.department.domain.column: 'departments.code' is an identifier",
        ),
        (
            "{table: departments}",
            'refs.yaml:11: tables.visits.columns.department.domain: missing required setting "column"',
        ),
    ],
)
def test_bad_reference_is_reported_with_file_line_and_key_path(ref: str, message: str) -> None:
    with pytest.raises(PolicyError) as raised:
        _parse(ref)
    assert raised.value.sqlstate == "F0000"
    assert raised.value.message == message


def test_a_public_column_without_a_list_lends_its_stored_values() -> None:
    """``{table: departments, column: wing}`` where wing lists no values: the engine reads the public
    table's stored values when a query groups by the column (public data; the key set TPC-H's
    ``l_suppkey`` takes from ``supplier.s_suppkey``)."""
    policy = _parse("{table: departments, column: wing}")
    column = policy.tables["visits"].columns["department"]
    assert column.domain is None and column.stored_domain is not None
    assert (column.stored_domain.table, column.stored_domain.column) == ("departments", "wing")


def test_no_chained_references() -> None:
    text = POLICY.replace("REF", "{table: departments, column: name}").replace(
        "name: {type: text, domain: [Cardiology, Oncology]}", "name: {type: text, domain: {table: x, column: y}}"
    )
    with pytest.raises(PolicyError) as raised:
        parse_policy(text, "refs.yaml")
    assert raised.value.sqlstate == "F0000"
    assert raised.value.message == (
        "refs.yaml:11: tables.visits.columns.department.domain.column: "
        "'departments.name' declares no list of values ('domain: [...]')"
    )
