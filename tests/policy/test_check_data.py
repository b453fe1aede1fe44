"""``dpsql policy check`` on what the data contradicts, over whole tables (issue #28 item 2), DuckDB and PostgreSQL.

A unit that is a row id is an error naming the person column (not a warning ``dpsql serve`` accepts); a
``references`` whose values the referenced column does not hold is an error with counts and a "did you
mean"; NULLs and repeats are counted over every row, not the first 100,000. The person table itself (its
own key the unit, one row per person) still passes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy
from tests.kinds import loaded

from .test_draft_schema import TABLES, _schema

FK = "    references: {column: employee_id, table: employees, to: id}   # a foreign key; the person is employees.id\n"


@pytest.fixture(params=["duckdb", "postgres"])
def hr(request: pytest.FixtureRequest) -> Iterator[Backend]:
    with loaded(request.param, request, _schema(True)) as backend:
        yield backend


def _draft(backend: Backend) -> str:
    draft = draft_policy(backend, TABLES, "hr")
    assert draft.count(FK) == 2 and check_text(draft, "hr.yaml", backend).errors == []
    return draft


def test_row_id_as_unit_is_an_error_naming_the_person(hr: Backend) -> None:
    draft = _draft(hr)
    for cap in ("10", "1"):  # many rows per person declared, or not: employee_id's values are employees' ids
        text = draft.replace(FK + "    max_rows_per_unit: 10", f"    privacy_unit: id\n    max_rows_per_unit: {cap}", 1)
        report = check_text(text, "hr.yaml", hr)
        assert not report.ok
        assert any(
            e.startswith("hr.yaml:")
            and "tables.absences.privacy_unit: 'id' is unique per row (a row id, not a person) while 'employee_id' "
            "repeats"
            in e
            and "did you mean 'employee_id' (declare references: {column: employee_id, table: employees, to: id}" in e
            for e in report.errors
        ), report.errors


def test_person_table_with_a_repeating_identifier_passes(hr: Backend) -> None:
    """employees alone: its own id is the unit, dept_id (an identifier) repeats, nobody references it."""
    draft = _draft(hr)
    start, end = draft.index("  employees:\n"), draft.index("  reasons:\n")
    alone = draft[: draft.index("tables:\n")] + "tables:\n" + draft[start:end]
    report = check_text(alone, "hr.yaml", hr)
    assert report.errors == [], report.errors


def test_reference_to_values_the_target_does_not_hold(hr: Backend) -> None:
    draft = _draft(hr)
    text = draft.replace(FK, "    references: {column: id, table: employees, to: id}\n", 1)
    report = check_text(text, "hr.yaml", hr)
    # absences.id runs e*100+a: none of its 120 values is an employee id (1..40)
    assert any(
        "tables.absences.references.column: 120 of the 120 distinct values of 'id' are not in employees.id" in e
        and "did you mean 'employee_id' (all its values are in employees.id)?" in e
        for e in report.errors
    ), report.errors


def test_nulls_and_repeats_after_the_first_100000_rows(hr: Backend) -> None:
    hr.execute_script(
        "CREATE TABLE timesheets AS SELECT g.i AS id, 1 + g.i % 40 AS employee_id, "
        "CASE WHEN g.i > 100000 THEN NULL ELSE 8 END AS hours FROM generate_series(1, 100010) AS g(i);\n"
        "CREATE TABLE badges AS SELECT CASE WHEN g.i = 100010 THEN 1 ELSE g.i END AS badge_id, 1 AS active "
        "FROM generate_series(1, 100010) AS g(i);"
    )
    draft = _draft(hr)
    extra = """
  timesheets:
    references: {column: employee_id, table: employees, to: id}
    max_rows_per_unit: 5000
    columns:
      id: {type: int, identifier: true}
      employee_id: {type: int, identifier: true}
      hours: {type: int, nullable: false}
  badges:
    columns:
      badge_id: {type: int, identifier: true}
      active: {type: int, nullable: false}
"""
    report = check_text(draft + extra, "hr.yaml", hr)
    assert any(
        "tables.timesheets.columns.hours.nullable: 'hours' is declared 'nullable: false' but holds NULLs "
        "(10 of 100,010 rows)" in e
        for e in report.errors
    ), report.errors
    assert any(
        "tables.badges: no 'privacy_unit' (each row is one person), but identifier 'badge_id' repeats" in e
        for e in report.errors
    ), report.errors
