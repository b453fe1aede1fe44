"""``dpsql policy check``: findings with file:line on DuckDB and PostgreSQL, exit codes, δ inheritance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dpsql.backends import Backend
from dpsql.cli import main
from dpsql.curator.check import check_text
from dpsql.policy import parse_policy

GOOD = """\
dataset: people
budget:
  dataset: {epsilon: 10, delta: 1.0e-5}
  analyst: {epsilon: 5}
auth: {trust: true}
analysts:
  - name: alice
    budget: {epsilon: 2}
tables:
  people:
    privacy_unit: person_id
    columns:
      person_id: {type: int, identifier: true}
      name: {type: text, identifier: true}
      dept: {type: text, nullable: false}
      age: {type: int, lower: 0, upper: 110, nullable: false}
      income: {type: float, lower: 0, upper: 1000, nullable: false}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def test_budget_without_delta_inherits() -> None:
    """`budget: {epsilon: 5}` (as schemas/README shows) inherits the enclosing δ, not 0 (which refused every
    partition-selection query as exhausted)."""
    policy = parse_policy(GOOD)
    assert policy.budget.analyst.delta == 1.0e-5
    assert policy.analyst_budget("alice").delta == 1.0e-5 and policy.analyst_budget("alice").epsilon == 2
    explicit = parse_policy(GOOD.replace("analyst: {epsilon: 5}", "analyst: {epsilon: 5, delta: 1.0e-7}"))
    assert explicit.budget.analyst.delta == 1.0e-7 and explicit.analyst_budget("alice").delta == 1.0e-7
    bare = parse_policy(GOOD.replace("dataset: {epsilon: 10, delta: 1.0e-5}", "dataset: {epsilon: 10}"))
    assert bare.budget.dataset.delta == 0 and bare.budget.analyst.delta == 0
    report = check_text(GOOD.replace("dataset: {epsilon: 10, delta: 1.0e-5}", "dataset: {epsilon: 10}"), "p.yaml")
    assert report.ok and report.warnings == [
        "p.yaml:3: budget.dataset: warning: no δ budget (delta: 0): every GROUP BY on a key without a 'domain' "
        "(partition selection) and every Gaussian query will be refused as exhausted (53P01); "
        "declare e.g. 'delta: 1.0e-5'"
    ]


def test_good_policy_passes(make_db: Callable[..., tuple[str, Backend]]) -> None:
    _, backend = make_db()
    report = check_text(GOOD, "p.yaml", backend)
    assert report.ok and report.errors == [] and report.warnings == []


def test_errors_with_file_line(make_db: Callable[..., tuple[str, Backend]]) -> None:
    _, backend = make_db()
    bad = (
        GOOD.replace("privacy_unit: person_id", "privacy_unit: dept")
        .replace("age: {type: int, lower: 0, upper: 110, nullable: false}", "age: {type: int, domain: [young, old]}")
        .replace(
            "income: {type: float, lower: 0, upper: 1000, nullable: false}",
            "income: {type: int}\n      gone: {type: int}",
        )
        + "  ghost:\n    columns:\n      x: {type: int}\n"
    )
    report = check_text(bad, "p.yaml", backend)
    assert not report.ok
    assert report.errors == [
        "p.yaml:16: tables.people.columns.age.domain.0: domain value 'young' is not of type int "
        "(the column's type); GROUP BY would release a key that can never match",
        "p.yaml:16: tables.people.columns.age.domain.1: domain value 'old' is not of type int "
        "(the column's type); GROUP BY would release a key that can never match",
        "p.yaml:11: tables.people.privacy_unit: privacy unit 'dept' must be declared 'identifier: true' "
        "(else analysts could group or filter on it and single people out)",
        f"p.yaml:17: tables.people.columns.income.type: the database stores "
        f"{'FLOAT' if backend.dialect == 'duckdb' else 'double precision'} but the policy declares int",
        'p.yaml:18: tables.people.columns.gone: column "gone" does not exist in table "people"',
        "p.yaml:11: tables.people.privacy_unit: 'dept' has fewer than 10 distinct values: it cannot be who a "
        "person is (each unit would be a whole group, and DP answers would be noise)",
        'p.yaml:19: tables.ghost: table "ghost" does not exist in the database',
    ]


def test_few_units_warning(make_db: Callable[..., tuple[str, Backend]]) -> None:
    """A unit with 10–99 values is a warning; the exact number is never read (DISTINCT … LIMIT 100)."""
    _, backend = make_db()
    text = GOOD.replace("privacy_unit: person_id", "privacy_unit: age").replace(
        "age: {type: int, lower: 0, upper: 110, nullable: false}", "age: {type: int, identifier: true}"
    )
    report = check_text(text, "p.yaml", backend)
    assert report.ok
    assert report.warnings == [
        "p.yaml:11: tables.people.privacy_unit: warning: 'age' has fewer than 100 distinct values: "
        "is it really who a person is?"
    ]


def test_cli_exit_codes(
    make_db: Callable[..., tuple[str, Backend]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = make_db()
    good = _write(tmp_path, GOOD)
    assert main(["policy", "check", "--policy", str(good), "--database", url]) == 0
    assert capsys.readouterr().out == f'{good}: dataset "people": ok (0 warnings)\n'
    bad = _write(
        tmp_path,
        GOOD.replace(
            "dept: {type: text, nullable: false}", "dept: {type: text, nullable: false}\n      zzz: {type: int}"
        ),
    )
    assert main(["policy", "check", "--policy", str(bad), "--database", url]) == 1
    missing = 'column "zzz" does not exist in table "people"'
    assert capsys.readouterr().err == f"{bad}:16: tables.people.columns.zzz: {missing}\n"
    unloadable = _write(tmp_path, GOOD.replace("epsilon: 10,", "epsilon: -1,"))
    assert main(["policy", "check", "--policy", str(unloadable), "--database", url]) == 1
    assert capsys.readouterr().err.startswith(f"{unloadable}:3: budget.dataset.epsilon: must be greater than 0")


def test_cli_missing_database_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, GOOD)
    missing = tmp_path / "nope.duckdb"
    assert main(["policy", "check", "--policy", str(good), "--database", f"duckdb://{missing}"]) == 1
    assert capsys.readouterr().err == f'ERROR:  database file "{missing}" does not exist\n'
    assert not missing.exists()


def test_shipped_policies_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """Every schemas/*.yaml checks clean against the demo data (what dpsql serve --policy … serves)."""
    root = Path(__file__).resolve().parents[2] / "schemas"
    for path in sorted(root.glob("*.yaml")):
        assert main(["policy", "check", "--policy", str(path)]) == 0, capsys.readouterr().err


def test_curator_commands_never_fall_back_to_the_demo(
    make_db: Callable[..., tuple[str, Backend]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --policy a curator command refuses (it used to check or clear the demo's dataset);
    a non-demo dataset needs its --database."""
    for argv, command in ((["policy", "check"], "policy check"), (["cache", "clear"], "cache clear")):
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            f"ERROR:  dpsql {command} needs --policy: curator commands act on the dataset a policy names\n"
            "HINT:  For the demo, give --policy schemas/health.yaml.\n"
        )
    other = _write(tmp_path, GOOD.replace("dataset: people", "dataset: hr"))
    assert main(["policy", "check", "--policy", str(other)]) == 1
    assert capsys.readouterr().err.startswith('ERROR:  dpsql policy check needs --database for dataset "hr"\n')
