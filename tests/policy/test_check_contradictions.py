"""``dpsql policy check`` reports what the data contradicts (issue #28 item 2), DuckDB and PostgreSQL.

On an HR-like database (tests/policy/test_draft_schema.py): a draft that checks clean, then one edit at a
time, each a contradiction a new curator made and nothing reported before.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy
from tests.kinds import loaded

from .test_draft_schema import TABLES, _schema

EXTRA = """
CREATE TABLE notes (id INTEGER, employee_id INTEGER, mood VARCHAR(10), badge VARCHAR(10));
INSERT INTO notes VALUES (1, 1, 'ok', 'A'), (2, 1, NULL, 'B'), (3, 2, 'fine', 'C'), (4, 3, 'ok', 'D');
"""


@pytest.fixture(params=["duckdb", "postgres"])
def hr(request: pytest.FixtureRequest) -> Iterator[Backend]:
    with loaded(request.param, request, _schema(True) + EXTRA) as backend:
        yield backend


NOTES = """
  notes:
    privacy_unit: null
    columns:
      id: {type: int, identifier: true}
      employee_id: {type: int, identifier: true}
      mood: {type: text}
      badge: {type: text}
"""


def _check(backend: Backend, text: str) -> tuple[list[str], list[str]]:
    report = check_text(text, "hr.yaml", backend)
    return report.errors, report.warnings


def test_each_contradiction_is_reported(hr: Backend) -> None:
    draft = draft_policy(hr, TABLES, "hr")
    errors, _ = _check(hr, draft)
    assert errors == []
    # 1. a table declared one row per person whose person identifier repeats
    errors, _ = _check(hr, draft + NOTES)
    assert any(
        "tables.notes: no 'privacy_unit' (each row is one person), but identifier 'employee_id' repeats" in e
        for e in errors
    ), errors
    # 2. a unit that is a row id (unique per row) while the person's id repeats
    as_row_id = draft.replace(
        "    references: {column: employee_id, table: employees, to: id}   "
        "# a foreign key; the person is employees.id\n    max_rows_per_unit: 10",
        "    privacy_unit: id\n    max_rows_per_unit: 10",
        1,
    )
    errors, _ = _check(hr, as_row_id)
    assert any(
        "tables.absences.privacy_unit: 'id' is unique per row (a row id, not a person) while 'employee_id' repeats" in e
        for e in errors
    ), errors
    # 3. references between columns of different types (mood is text, employees.id an integer)
    typed = NOTES.replace("privacy_unit: null", "references: {column: mood, table: employees, to: id}")
    errors, _ = _check(hr, draft + typed.replace("mood: {type: text}", "mood: {type: text, identifier: true}"))
    assert any("'mood' is stored as" in e and "employees.id as" in e for e in errors), errors
    # 4. nullable: false on a column holding NULLs
    errors, _ = _check(hr, draft.replace("      score: {type: int}", "      score: {type: int, nullable: false}"))
    assert errors == [] or not any("score" in e for e in errors)  # scores hold no NULL: fine
    with_null = draft + NOTES.replace(
        "privacy_unit: null", "references: {column: employee_id, table: employees, to: id}"
    )
    errors, _ = _check(hr, with_null.replace("mood: {type: text}", "mood: {type: text, nullable: false}"))
    assert any("'mood' is declared 'nullable: false' but holds NULLs" in e for e in errors), errors
    # 5. nullable left true on a column with no NULLs
    _, warnings = _check(hr, with_null)
    assert any("'badge' holds no NULL: declare 'nullable: false'" in w for w in warnings), warnings
    # a close name gets a "did you mean"
    errors, _ = _check(hr, draft.replace("      salary:", "      salry:"))
    assert any('column "salry" does not exist in table "employees" (did you mean "salary"?)' in e for e in errors)
