"""``dpsql policy draft`` on an HR-like schema an audit drafted wrongly (issue #28 item 1), DuckDB and PostgreSQL.

- ``reviews(employee_id, reviewer_id)``, both foreign keys to ``employees``: the unit is the column named
  after the person table (not whichever key came last), and the other is named for review.
- ``handovers(approver_id, receiver_id)``: neither named after it, so the first in column order.
- ``departments(id, name, city)``, 12 rows, pointed at by ``employees.department_id``: proposed public, its
  ``name`` not an identifier (GROUP BY d.name through a join must be answered), and its rare city not
  called "fewer than 5 people" (its rows are no people).
- ``guests(id, name, city)``: small but pointed at by nothing, so its ``name`` is a person's: not public.
- The dataset name is the database's name, never the URL's query string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from dpsql.backends import Backend, open_backend
from dpsql.cli import main
from dpsql.curator.check import check_text
from dpsql.curator.draft import dataset_name, draft_policy
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session

TABLES = ["absences", "departments", "employees", "guests", "handovers", "reviews"]
DEPARTMENTS = ["Engineering", "Facilities", "Finance", "HR", "IT", "Legal"]
DEPARTMENTS += ["Marketing", "Operations", "Procurement", "Research", "Sales", "Support"]


def _schema(foreign_keys: bool) -> str:
    fk = (lambda table: f" REFERENCES {table}(id)") if foreign_keys else (lambda table: "")
    rows = [
        f"INSERT INTO departments VALUES ({i + 1}, '{name}', '{'Lyon' if i == 0 else 'Paris'}');"
        for i, name in enumerate(DEPARTMENTS)
    ]
    rows += [f"INSERT INTO guests VALUES ({g}, 'Guest {g}', '{'Lyon' if g == 1 else 'Paris'}');" for g in range(1, 21)]
    rows += [f"INSERT INTO employees VALUES ({e}, 'emp{e}', {1 + e % 12});" for e in range(1, 61)]
    for e in range(1, 61):
        for a in range(e % 4):
            kind = "sabbatical" if e == 5 else ["sick", "vacation"][a % 2]
            rows.append(f"INSERT INTO absences VALUES ({e * 10 + a}, {e}, '{kind}', {1 + a});")
        rows.append(f"INSERT INTO reviews VALUES ({e}, {e}, 2024, {e % 5 + 1}, {1 + (e + 7) % 60});")
        rows.append(f"INSERT INTO handovers VALUES ({e}, {1 + (e + 3) % 60}, {e});")
    return f"""
CREATE TABLE departments (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL, city VARCHAR(20) NOT NULL);
CREATE TABLE guests (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL, city VARCHAR(20) NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, login VARCHAR(40) NOT NULL,
                        department_id INTEGER NOT NULL{fk("departments")});
CREATE TABLE absences (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL{fk("employees")},
                       kind VARCHAR(20) NOT NULL, days INTEGER NOT NULL);
CREATE TABLE reviews (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL{fk("employees")}, year INTEGER NOT NULL,
                      score INTEGER NOT NULL, reviewer_id INTEGER{fk("employees")});
CREATE TABLE handovers (id INTEGER PRIMARY KEY, approver_id INTEGER NOT NULL{fk("employees")},
                        receiver_id INTEGER NOT NULL{fk("employees")});
{chr(10).join(rows)}
"""


@pytest.fixture(params=["duckdb", "postgres"])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _url(dialect: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if dialect == "duckdb":
        return f"duckdb:///{tmp_path}/hr.duckdb"
    make: Callable[[], str] = request.getfixturevalue("pg_new_database")
    return make()


@pytest.fixture(params=[True, False], ids=["foreign-keys", "no-foreign-keys"])
def hr(request: pytest.FixtureRequest, dialect: str, tmp_path: Path) -> Iterator[tuple[str, Backend, bool]]:
    url = _url(dialect, request, tmp_path)
    backend = open_backend(url)
    backend.execute_script(_schema(request.param))
    yield url, backend, request.param
    backend.close()


def _table(text: str, name: str) -> str:
    """The draft's lines for one table."""
    start = text.index(f"\n  {name}:\n")
    end = text.find("\n\n", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_two_keys_to_the_person_table(hr: tuple[str, Backend, bool]) -> None:
    """The unit is the column named after the person table, else the first; the others are named for review."""
    _, backend, foreign_keys = hr
    text = draft_policy(backend, TABLES, "hr")
    policy = parse_policy(text, "hr.yaml")
    reviews = policy.tables["reviews"].references
    assert reviews is not None and (reviews.column, reviews.table, reviews.to) == ("employee_id", "employees", "id")
    assert policy.tables["reviews"].columns["reviewer_id"].identifier
    if foreign_keys:
        assert "    # REVIEW: reviewer_id also points at employees.id: whose data is a row?\n" in _table(
            text, "reviews"
        )
        handovers = policy.tables["handovers"].references
        assert handovers is not None and handovers.column == "approver_id"  # first in column order
        assert "# REVIEW: receiver_id also points at employees.id" in _table(text, "handovers")
    else:  # only employee_id is named after employees: nothing else to confirm
        assert "also point" not in text
    assert "also point" not in _table(text, "absences")  # one key to employees: nothing to confirm
    assert check_text(text, "hr.yaml", backend).ok


def test_small_lookup_table_is_public(hr: tuple[str, Backend, bool]) -> None:
    """departments: small, its only identifier its own key, pointed at by employees: public, its name
    queryable through a join; guests, pointed at by nothing, keeps its name an identifier."""
    _, backend, _ = hr
    text = draft_policy(backend, TABLES, "hr")
    report = check_text(text, "hr.yaml", backend)  # no edits
    assert report.ok and report.errors == [], report.errors
    policy = parse_policy(text, "hr.yaml")
    departments = policy.tables["departments"]
    assert departments.public
    assert not departments.columns["name"].identifier
    assert not departments.columns["id"].identifier  # a lookup key names a department, no person
    assert not policy.tables["guests"].public
    assert policy.tables["guests"].columns["name"].identifier
    engine = Engine(policy, backend, Ledger.open("memory"))
    result = engine.execute(
        "SELECT d.name, COUNT(*) AS n FROM employees e JOIN departments d ON e.department_id = d.id GROUP BY d.name",
        Session(analyst="analyst"),
    )
    assert sorted(str(row[0]) for row in result.rows) == sorted(DEPARTMENTS)


def test_rare_values_speak_of_people_only_on_person_tables(hr: tuple[str, Backend, bool]) -> None:
    _, backend, _ = hr
    text = draft_policy(backend, TABLES, "hr")
    assert "RARE" not in _table(text, "departments")  # public: its rows are no people
    assert "# RARE (fewer than 5 people): sabbatical" in _table(text, "absences")  # person-linked
    guests = _table(text, "guests")  # no unit: a rare value counted in rows, not people
    assert "# RARE (fewer than 5 rows): Lyon" in guests and "people" not in guests


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("postgresql://u:secret@db.example:5432/hr?host=%2Ftmp%2Fpg&port=55433", "hr"),
        ("postgresql:///hr?host=/tmp&port=55433&password=secret", "hr"),
        ("postgresql:///?dbname=hr&host=/tmp", "hr"),
        ("postgres://h/my-db.prod?sslmode=require", "my_db_prod"),
        ("duckdb:////tmp/audit/hr.duckdb", "hr"),
        ("duckdb:///2024 data.duckdb", "db_2024_data"),
        ("duckdb://", "dataset"),
        ("postgresql://h", "dataset"),
    ],
)
def test_dataset_name(url: str, name: str) -> None:
    """The database's name only: a URL's query string carries hosts, ports and passwords."""
    assert dataset_name(url) == name


def test_cli_dataset_name(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _url(dialect, request, tmp_path)
    backend = open_backend(url)
    backend.execute_script(_schema(True))
    backend.close()
    out = tmp_path / "draft.yaml"
    assert main(["policy", "draft", "--database", url, "--out", str(out)]) == 0
    dataset = yaml.safe_load(out.read_text())["dataset"]
    expected = "hr" if dialect == "duckdb" else url.split("?")[0].rsplit("/", 1)[-1]
    assert dataset == expected and dataset.isidentifier(), dataset
    assert main(["policy", "check", "--policy", str(out), "--database", url]) == 0
    capsys.readouterr()


def test_a_small_table_of_people_pointed_at_is_not_proposed_public(tmp_path: Path) -> None:
    """``managers(id, name)``, 5 rows, pointed at by employees.manager_id: small and pointed at like a
    lookup table, but its name says its rows are people, so its ``name`` stays an identifier and the
    table is not proposed public (its names would otherwise become a published domain)."""
    backend = open_backend(f"duckdb:///{tmp_path}/m.duckdb")
    rows = [f"INSERT INTO managers VALUES ({m}, 'Manager {m}');" for m in range(1, 6)]
    rows += [f"INSERT INTO employees VALUES ({e}, {1 + e % 5});" for e in range(1, 41)]
    rows += [f"INSERT INTO absences VALUES ({e}, {e}, 2);" for e in range(1, 41)]
    rows += [f"INSERT INTO reviews VALUES ({e}, {e}, 3);" for e in range(1, 41)]
    backend.execute_script(
        f"""
CREATE TABLE managers (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, manager_id INTEGER NOT NULL REFERENCES managers(id));
CREATE TABLE absences (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL REFERENCES employees(id),
                       days INTEGER NOT NULL);
CREATE TABLE reviews (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL REFERENCES employees(id),
                      score INTEGER NOT NULL);
{chr(10).join(rows)}
"""
    )
    try:
        text = draft_policy(backend, ["absences", "employees", "managers", "reviews"], "hr")
        policy = parse_policy(text, "hr.yaml")
        assert policy.tables["employees"].privacy_unit == "id"  # the person table: two tables point at it
        assert not policy.tables["managers"].public
        assert policy.tables["managers"].columns["name"].identifier
    finally:
        backend.close()
