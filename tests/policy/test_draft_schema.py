"""``dpsql policy draft`` reads who is one person from the schema (issue #28 item 1), DuckDB and PostgreSQL.

An HR-like database: ``employees`` (the people; PRIMARY KEY id), ``departments`` (referenced by
employees), ``absences`` and ``reviews`` (many rows per employee, FOREIGN KEY employee_id), and a small
lookup table ``reasons`` naming no person. The draft must, with no edits, pass ``policy check`` with
person-level units on every table that references the person table, ``nullable: false`` from NOT NULL,
and the lookup table proposed public. Without foreign keys (the same tables), the references are
proposed from identifier columns whose values all are employee ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.backends import Backend
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy
from dpsql.policy import parse_policy
from tests.kinds import open_empty

TABLES = ["absences", "departments", "employees", "reasons", "reviews"]


def _schema(foreign_keys: bool) -> str:
    fk = (lambda table, column: f" REFERENCES {table}({column})") if foreign_keys else (lambda table, column: "")
    rows = ["INSERT INTO departments VALUES (1, 'Sales'), (2, 'Ops'), (3, 'R&D');"]
    rows += ["INSERT INTO reasons VALUES ('sick'), ('holiday'), ('training');"]
    for e in range(1, 41):
        rows.append(f"INSERT INTO employees VALUES ({e}, 'Emp {e}', {1 + e % 3}, {30000 + 500 * e});")
        for a in range(e % 7):
            rows.append(
                f"INSERT INTO absences VALUES ({e * 100 + a}, {e}, {1 + a % 3}, '{['sick', 'holiday'][a % 2]}');"
            )
        rows.append(f"INSERT INTO reviews VALUES ({e}, {e}, {e % 5 + 1});")
    return f"""
CREATE TABLE departments (id INTEGER PRIMARY KEY, dname VARCHAR(20) NOT NULL);
CREATE TABLE reasons (reason VARCHAR(20) PRIMARY KEY);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL,
                        dept_id INTEGER NOT NULL{fk("departments", "id")}, salary DOUBLE PRECISION NOT NULL);
CREATE TABLE absences (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL{fk("employees", "id")},
                       days INTEGER NOT NULL, reason VARCHAR(20));
CREATE TABLE reviews (id INTEGER PRIMARY KEY, employee_id INTEGER{fk("employees", "id")}, score INTEGER);
{chr(10).join(rows)}
"""


@pytest.fixture(params=["duckdb", "postgres"])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _open(dialect: str, request: pytest.FixtureRequest, foreign_keys: bool) -> Backend:
    backend = open_empty(dialect, request)
    backend.execute_script(_schema(foreign_keys))
    return backend


@pytest.fixture(params=[True, False], ids=["foreign-keys", "no-foreign-keys"])
def hr(request: pytest.FixtureRequest, dialect: str) -> Iterator[tuple[Backend, bool]]:
    backend = _open(dialect, request, request.param)
    yield backend, request.param
    backend.close()


def test_draft_finds_the_people_and_checks_clean(hr: tuple[Backend, bool]) -> None:
    backend, foreign_keys = hr
    text = draft_policy(backend, TABLES, "hr")
    report = check_text(text, "hr.yaml", backend)  # no edits
    assert report.ok and report.errors == [], report.errors
    policy = parse_policy(text, "hr.yaml")
    assert policy.tables["employees"].privacy_unit == "id"
    for table in ("absences", "reviews"):
        reference = policy.tables[table].references
        assert reference is not None and (reference.column, reference.table, reference.to) == (
            "employee_id",
            "employees",
            "id",
        )
        assert policy.tables[table].max_rows_per_unit > 1
    assert policy.tables["reasons"].public  # small, names no person
    assert policy.tables["employees"].columns["salary"].nullable is False  # NOT NULL
    assert policy.tables["absences"].columns["days"].nullable is False
    # no NOT NULL on score, but no NULL stored: proposed nullable: false, marked for review
    assert policy.tables["reviews"].columns["score"].nullable is False
    assert "score: {type: int, nullable: false}   # REVIEW nullable: no NULL stored today" in text
    marker = "# a foreign key" if foreign_keys else "# REVIEW: every employee_id is an employees.id"
    assert marker in text
    # the lookup table's key names no person, and its one-row values are not "rare people"
    assert "      reason: {type: text, domain: [holiday, sick, training], nullable: false}\n" in text
