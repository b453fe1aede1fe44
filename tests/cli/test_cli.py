"""The dpsql command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dpsql(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPSQL_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_query_prints_table_and_notice(tmp_path: Path) -> None:
    out = dpsql("query", "SELECT sex, COUNT(*) FROM patients GROUP BY sex", home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Female" in out.stdout and "(2 rows)" in out.stdout and "count ±95%" in out.stdout
    assert "NOTICE:  dpsql: charged ε=1" in out.stderr


def test_query_json_and_budget(tmp_path: Path) -> None:
    out = dpsql("query", "--json", "-U", "alice", "--epsilon", "0.25", "SELECT COUNT(*) FROM patients", home=tmp_path)
    payload = json.loads(out.stdout)
    assert payload["columns"] == [{"name": "count", "type": "bigint"}] and payload["epsilon_spent"] == 0.25
    budget = json.loads(dpsql("budget", "--json", "--policy", "schemas/health.yaml", home=tmp_path).stdout)
    alice = next(row for row in budget if row["analyst"] == "alice")
    assert alice["epsilon_spent"] == 0.25 and alice["epsilon_remaining"] == 9.75


def test_explain_spends_nothing(tmp_path: Path) -> None:
    out = dpsql("explain", "SELECT AVG(age) FROM patients", home=tmp_path)
    assert out.returncode == 0 and "Backend SQL" in out.stdout and "sensitivity" in out.stdout
    budget = json.loads(dpsql("budget", "--json", "--policy", "schemas/health.yaml", home=tmp_path).stdout)
    assert all(row["epsilon_spent"] == 0 for row in budget)


def test_explain_json_of_a_composite_statement(tmp_path: Path) -> None:
    """``--json`` of post-processing over a DP query: each sub-plan as an object, not its repr."""
    sql = "SELECT sex, n * 2 AS twice FROM (SELECT sex, COUNT(*) AS n FROM patients GROUP BY sex) AS s"
    out = dpsql("explain", "--json", sql, home=tmp_path)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    (sub,) = payload["subplans"]
    assert isinstance(sub["explanation"], dict) and sub["explanation"]["epsilon"] == payload["epsilon"] > 0
    assert "twice" in payload["outer_sql"]
    simple = json.loads(dpsql("explain", "--json", "SELECT COUNT(*) FROM patients", home=tmp_path).stdout)
    assert simple["epsilon"] > 0 and "sql" in simple


def test_refusal_is_postgres_style(tmp_path: Path) -> None:
    out = dpsql("query", "SELECT ssn FROM patients", home=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith('ERROR:  permission denied for column "ssn"')


def test_bad_policy_names_file_line_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "schemas" / "health.yaml").read_text().replace("upper: 110", "upper: -5")
    bad.write_text(text)
    out = dpsql("query", "--policy", str(bad), "SELECT COUNT(*) FROM patients", home=tmp_path)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "upper: -5" in s)
    assert out.returncode == 1
    assert f"{bad}:{line}: tables.patients.columns.age: 'lower' (0) is greater than 'upper' (-5)" in out.stderr


@pytest.mark.parametrize("runs", [50])
def test_demo_shows_attack_failing(tmp_path: Path, runs: int) -> None:
    out = dpsql("demo", "--runs", str(runs), home=tmp_path)
    assert out.returncode == 0 and "Raw SQL: Q1 - Q2 = 1" in out.stdout and "DP caps it" in out.stdout
