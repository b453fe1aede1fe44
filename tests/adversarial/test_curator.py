"""Curator tools on neighbouring databases (DuckDB and PostgreSQL): what depends on one person is shown.

``dpsql policy check`` and the serve-start check must give the same findings whether or not one person
is in the data; ``dpsql policy draft`` may read stored values only into domains marked for review.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.curator.check import check_text
from dpsql.curator.draft import draft_policy
from tests.policies import policy_yaml, table_yaml
from tests.policy.people import fill

PEOPLE = """
name: {type: text, identifier: true}
dept: {type: text}
age: {type: int, identifier: true}
income: {type: float, lower: 0, upper: 1000}
"""
POLICY = policy_yaml(
    "people",
    table_yaml("people", PEOPLE, unit="UNIT", ids=("person_id",)),
    budget="{dataset: {epsilon: 10, delta: 1.0e-5}, analyst: {epsilon: 5}}",
    trust=True,
)

#: Person 7 alone holds the rare department; person 0 is ordinary.
NEIGHBOURS = (None, 7, 0)


@pytest.fixture(params=["duckdb", "postgres"])
def neighbours(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Backend]]:
    backends = []
    for without in NEIGHBOURS:
        if request.param == "duckdb":
            url = f"duckdb://{tmp_path_factory.mktemp('n')}/db.duckdb"
        else:
            make: Callable[[], str] = request.getfixturevalue("pg_new_database")
            url = make()
        backends.append(fill(open_backend(url), without=without))
    yield backends
    for backend in backends:
        backend.close()


@pytest.mark.parametrize("unit", ["person_id", "age"])
def test_check_same_on_neighbours(neighbours: list[Backend], unit: str) -> None:
    """curator-check-neighbours: the findings (errors and warnings) are the same with or without one person."""
    reports = [check_text(POLICY.replace("UNIT", unit), "p.yaml", backend) for backend in neighbours]
    assert all((r.errors, r.warnings) == (reports[0].errors, reports[0].warnings) for r in reports)
    assert reports[0].ok


def test_draft_differs_only_in_reviewed_domains(neighbours: list[Backend]) -> None:
    """curator-draft-neighbours: a draft reads stored values only into domains under a REVIEW comment, so
    a rare value (one person's) is something the curator is told to look at, never silent."""
    drafts = [draft_policy(backend, ["people"], "people").splitlines() for backend in neighbours]
    full, without_rare, without_ordinary = drafts
    assert without_ordinary == full  # an ordinary person changes nothing
    changed = [line for line in difflib.unified_diff(full, without_rare, lineterm="", n=0) if line[:1] in "+-"]
    changed = [line for line in changed if not line.startswith(("+++", "---"))]
    assert changed and all("domain: [" in line for line in changed)
    for line in full:
        if "domain: [" in line:
            assert "# REVIEW domain" in full[full.index(line) - 3], line
    assert "Rare disease" in "\n".join(full) and "Rare disease" not in "\n".join(without_rare)
