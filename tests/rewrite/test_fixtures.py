"""Golden files, one per rewrite pass (sqlglot's ``tests/fixtures/optimizer/<rule>.sql`` style).

Each ``fixtures/<pass>.sql`` holds cases: optional ``-- key: value`` option lines (``policy``,
``hash``, ``top_rows``, ``proven``, ``histogram``), the analyst's query, then the query the rewrite has
built once that pass has run (every earlier pass applied too, in ``REWRITE_PASSES`` order), in
PostgreSQL's dialect with the row-selection salt fixed to ``salt``. Cases are separated by a blank
line; each statement ends with ``;``. ``histogram.sql`` holds a selection measure's histogram
query (``-- histogram: <measure index>``) instead.

Regenerate after an intended change with ``python -m tests.rewrite.test_fixtures`` and read the diff.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import pytest
from sqlglot import exp

from dpsql.analyze import analyze
from dpsql.backends import RowHash, TopRows
from dpsql.dev.demo import demo_policy_path
from dpsql.plan import Physical, Plan
from dpsql.policy import Policy, load_policy
from dpsql.rewrite import REWRITE_PASSES, histogram_query

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True)
class Case:
    file: str
    options: dict[str, str]
    query: str
    expected: str


@functools.cache
def _policy(name: str) -> Policy:
    return load_policy(demo_policy_path(name))


def _plan(options: dict[str, str], query: str) -> Plan:
    plan = analyze(query, _policy(options.get("policy", "health")))
    proven = frozenset(int(i) for i in options.get("proven", "").split(",") if i.strip())
    hash_ = options.get("hash", "md5")
    top_rows = options.get("top_rows")
    assert hash_ in ("md5", "duckdb", "postgres") and top_rows in (None, "min_by", "row_number"), options
    return replace(plan, physical=Physical("salt", proven, cast(RowHash, hash_), cast(TopRows, top_rows)))


def render(name: str, options: dict[str, str], query: str) -> str:
    """The query as built once pass ``name`` has run (or the histogram query of ``histogram.sql``)."""
    plan = _plan(options, query)
    if name == "histogram":
        return histogram_query(plan, int(options.get("histogram", "0"))).sql(dialect="postgres")
    select = exp.Select()
    for rewrite_pass in REWRITE_PASSES:
        select = rewrite_pass(select, plan)
        if rewrite_pass.__name__ == name:
            return select.sql(dialect="postgres")
    raise AssertionError(f"no rewrite pass named {name!r}")


def load(path: Path) -> list[Case]:
    cases = []
    for block in path.read_text().strip().split("\n\n"):
        options: dict[str, str] = {}
        statements: list[str] = []
        for line in block.splitlines():
            if line.startswith("-- ") and ":" in line and not statements:
                key, value = line[3:].split(":", 1)
                options[key.strip()] = value.strip()
            elif not line.startswith("--"):
                statements.append(line)
        query, expected = (s.strip() for s in " ".join(statements).split(";")[:2])
        cases.append(Case(path.stem, options, query, expected))
    return cases


CASES = [case for path in sorted(FIXTURES.glob("*.sql")) for case in load(path)]


def test_every_pass_has_a_fixture_file() -> None:
    names = {p.__name__ for p in REWRITE_PASSES} | {"histogram"}
    assert names == {p.stem for p in FIXTURES.glob("*.sql")}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.file}:{c.query[:60]}" for c in CASES])
def test_fixture(case: Case) -> None:
    assert render(case.file, case.options, case.query) == case.expected


def _regenerate() -> None:
    for path in sorted(FIXTURES.glob("*.sql")):
        blocks = []
        for case in load(path):
            options = "".join(f"-- {k}: {v}\n" for k, v in case.options.items())
            blocks.append(f"{options}{case.query};\n{render(case.file, case.options, case.query)};\n")
        path.write_text("\n".join(blocks))


if __name__ == "__main__":
    _regenerate()
