"""``dpsql policy draft`` on DuckDB and PostgreSQL: a loadable starting point, nothing read silently."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from dpsql.backends import Backend
from dpsql.cli import main
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy


def test_draft(make_db: Callable[..., tuple[str, Backend]]) -> None:
    _, backend = make_db()
    text = draft_policy(backend, ["people"], "people")
    assert "      person_id: {type: int, identifier: true}   # looks like an identifier: never queryable" in text
    assert "      name: {type: text, identifier: true}   # looks like an identifier: never queryable" in text
    # a low-cardinality text column: its stored values proposed as a domain, marked for review
    review = text.index("# REVIEW domain")
    assert (
        "dept: {type: text, domain: [Cardiology, Neurology, Oncology, Pediatrics, Rare disease], nullable: false}"
        in text[review:]
    )  # no NOT NULL in the schema, no NULL stored: proposed for review
    assert "# TODO bounds" in text  # bounds are the curator's: none is read from the data
    assert all("lower:" not in line.split("#")[0] for line in text.splitlines())
    assert "privacy_unit: null" in text and "(one of: person_id?)" in text
    for number in ("199", "79", "298.5", "200"):  # max id, max age, max income, row count: never in the file
        assert not re.search(rf"\b{re.escape(number)}\b", text), number
    report = check_text(text, "draft.yaml", backend)  # loads as drafted
    assert report.ok and report.errors == []
    finished = text.replace("privacy_unit: null", "privacy_unit: person_id").replace(
        "      age: {type: int, nullable: false}", "      age: {type: int, lower: 0, upper: 110, nullable: false}"
    )
    report = check_text(finished, "draft.yaml", backend)
    assert report.ok and report.errors == []
    assert [w for w in report.warnings if "holds no NULL" not in w] == [
        "draft.yaml:14: analysts.0.name: warning: analyst 'analyst' has no password and auth.trust is false: they "
        "cannot log in (generate a verifier with `dpsql passwd`)"
    ]


def test_draft_cli(
    make_db: Callable[..., tuple[str, Backend]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = make_db()
    out = tmp_path / "draft.yaml"
    assert main(["policy", "draft", "--database", url, "--table", "people", "--out", str(out)]) == 0
    assert main(["policy", "check", "--policy", str(out), "--database", url]) == 0
    assert main(["policy", "draft", "--database", url, "--out", str(out)]) == 1  # never overwrites silently
    assert "exists (use --force to overwrite)" in capsys.readouterr().err
    assert main(["policy", "draft", "--database", url, "--table", "nope"]) == 1
    assert 'relation "nope" does not exist' in capsys.readouterr().err
