"""Measurement reuse (issue #29): the same DP measurement asked with other outputs costs ε once.

Another LIMIT, other aliases, no ORDER BY, a HAVING on the count or another confidence level only
post-process the released measurements again: free and consistent with the first answer. Another
WHERE constant, another ε or a write to the data is a new measurement: charged again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.commands import open_engine
from dpsql.dev.demo import demo_identity, demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.session import Result, Session

ROOT = Path(__file__).resolve().parents[2]
BASE = "SELECT problem, COUNT(*) FROM patients GROUP BY problem"
VARIANTS = [
    BASE + " ORDER BY 2 DESC LIMIT 10",
    BASE + " ORDER BY 2 DESC LIMIT 3",
    "SELECT problem AS p, COUNT(*) AS n FROM patients GROUP BY problem ORDER BY n DESC LIMIT 3",
    "select problem as diagnosis, count(*) as how_many from patients group by 1",
    BASE,
]
REUSED = "answered from an earlier release"


def _engine(policy: Policy, backend: Backend) -> Engine:
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache())


def _spent(engine: Engine) -> float:
    return engine.ledger.spent("health", "alice").epsilon


def _free(result: Result) -> bool:
    return result.epsilon_spent == 0 and any(REUSED in n for n in result.notices)


@pytest.fixture(params=["duckdb", "postgresql"])
def backend(request: pytest.FixtureRequest) -> Backend:
    name = "health_duckdb" if request.param == "duckdb" else "health_pg"
    found: Backend = request.getfixturevalue(name)
    return found


def test_other_limits_aliases_and_no_order_cost_once(health_policy: Policy, backend: Backend) -> None:
    engine = _engine(health_policy, backend)
    first = engine.execute(BASE + " ORDER BY 2 DESC LIMIT 100", Session("alice"))
    assert first.epsilon_spent == 1.0 and len(first.rows) == 7
    answers = [engine.execute(sql, Session("alice")) for sql in VARIANTS]
    assert all(_free(a) for a in answers) and _spent(engine) == 1.0
    assert answers[0].rows == first.rows  # LIMIT 10 of 7 groups: all of them, same order
    assert answers[1].rows == first.rows[:3] == answers[2].rows  # the top 3 of the LIMIT 100 answer
    assert [c.name for c in answers[2].columns] == ["p", "n"]
    assert [c.name for c in answers[3].columns] == ["diagnosis", "how_many"]
    assert sorted(answers[3].rows) == sorted(first.rows) == sorted(answers[4].rows)
    assert answers[1].accuracy == first.accuracy[:3]
    assert not any("charged ε" in n for a in answers for n in a.notices)


def test_having_on_the_count_is_free_and_consistent(health_policy: Policy, backend: Backend) -> None:
    engine = _engine(health_policy, backend)
    full = engine.execute(BASE, Session("alice"))
    threshold = sorted(count for _, count in full.rows)[3]
    having = engine.execute(BASE + f" HAVING COUNT(*) >= {threshold} ORDER BY 1", Session("alice"))
    assert _free(having) and _spent(engine) == 1.0
    assert having.rows == sorted(row for row in full.rows if row[1] >= threshold)


def test_private_keys_top_10_of_top_100(health_policy: Policy, health_duckdb: Backend) -> None:
    """Keys without a public domain (partition selection): the stored release is after selection."""
    engine = _engine(health_policy, health_duckdb)
    sql = "SELECT zip, COUNT(*) AS n FROM patients GROUP BY zip ORDER BY n DESC, zip LIMIT {}"
    hundred = engine.execute(sql.format(100), Session("alice"))
    ten = engine.execute(sql.format(10), Session("alice"))
    assert hundred.epsilon_spent == 1.0 and len(hundred.rows) > 10
    assert _free(ten) and ten.rows == hundred.rows[:10] and _spent(engine) == 1.0


def test_other_confidence_reuses_and_recomputes_intervals(health_policy: Policy, health_duckdb: Backend) -> None:
    engine = _engine(health_policy, health_duckdb)
    first = engine.execute(BASE, Session("alice"))
    wider = engine.execute(BASE + " ORDER BY 1", Session("alice", confidence=0.99))
    assert _free(wider) and sorted(first.rows) == wider.rows
    assert all((w[1] or 0) > (f[1] or 0) > 0 for w, f in zip(wider.accuracy, first.accuracy, strict=True))
    again = engine.execute(BASE + " ORDER BY 1 LIMIT 50", Session("alice"))  # back at 95%: same widths
    assert again.accuracy == sorted(first.accuracy)


def test_other_where_epsilon_or_data_is_charged(health_policy: Policy) -> None:
    backend = open_backend("duckdb://")
    try:
        load_demo(backend, ["health"])
        engine = _engine(health_policy, backend)
        engine.execute(BASE + " ORDER BY 2 DESC LIMIT 100", Session("alice"))
        other_where = "SELECT problem, COUNT(*) FROM patients WHERE age > 30 GROUP BY problem"
        assert engine.execute(other_where, Session("alice")).epsilon_spent == 1.0
        assert engine.execute(other_where.replace("30", "40") + " LIMIT 3", Session("alice")).epsilon_spent == 1.0
        # at a smaller ε: a new measurement, though the ε=1 release answers it (its cells, free: at least as
        # accurate; dpsql.synopsis.reuse, tests/synopsis/test_coarsening.py)
        half = engine.execute(BASE + " LIMIT 3", Session("alice", epsilon=0.5))
        assert half.epsilon_spent == 0 and any("finer release" in n for n in half.notices)
        assert engine.execute(BASE + " LIMIT 3", Session("alice", epsilon=2.0)).epsilon_spent == 2.0
        assert engine.execute(BASE + " LIMIT 5", Session("alice", epsilon=2.0)).epsilon_spent == 0  # its own release
        assert _spent(engine) == 5.0
        backend.execute_script("DELETE FROM patients WHERE age > 100")
        assert engine.execute(BASE + " LIMIT 3", Session("alice")).epsilon_spent == 1.0
        assert _spent(engine) == 6.0
    finally:
        backend.close()


@pytest.mark.parametrize("database", ["file", "demo"])
def test_cli_same_group_by_costs_once(tmp_path: Path, health_policy: Policy, database: str) -> None:
    """The issue's bar through ``dpsql query`` (separate processes sharing the ledger): on a DuckDB file,
    and on the default in-memory demo, whose seeded rows every process names alike (``pin_identity``)."""
    path = tmp_path / "health.duckdb"
    where: list[str] = []
    if database == "file":
        writer = open_backend(f"duckdb:///{path}")
        load_demo(writer, ["health"])
        writer.close()
        where = ["--database", f"duckdb:///{path}"]
    env = {**os.environ, "DPSQL_HOME": str(tmp_path / "home")}

    def query(sql: str) -> Any:
        argv = [sys.executable, "-m", "dpsql.cli", "query", "--json", *where, sql]
        return json.loads(subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout)

    hundred = query(BASE + " ORDER BY 2 DESC LIMIT 100")
    answers = [query(sql) for sql in (VARIANTS[1], VARIANTS[2], BASE)]
    assert hundred["epsilon_spent"] == 1.0 and [a["epsilon_spent"] for a in answers] == [0.0, 0.0, 0.0]
    rows = hundred["rows"]
    assert answers[0]["rows"] == rows[:3] == answers[1]["rows"]
    assert sorted(answers[2]["rows"]) == sorted(rows)
    budget = subprocess.run(
        [sys.executable, "-m", "dpsql.cli", "budget", "--json", "--policy", "schemas/health.yaml"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    spent = {row["analyst"]: row["epsilon_spent"] for row in json.loads(budget.stdout)}
    assert spent["analyst"] == 1.0


def test_a_tampered_measurement_is_a_charged_miss(health_policy: Policy, health_duckdb: Backend) -> None:
    """Stored measurements are signed entries like answers: an altered one is never finished again."""
    cache = ResultCache()
    engine = Engine(health_policy, health_duckdb, Ledger.open("sqlite:///:memory:"), cache)
    engine.execute(BASE, Session("alice"))
    rows = cache._conn.execute("SELECT key, result FROM dpsql_result_cache").fetchall()
    for key, blob in rows:
        flipped = bytearray(blob)
        flipped[-5] ^= 0x01
        cache._conn.execute("UPDATE dpsql_result_cache SET result = ? WHERE key = ?", (bytes(flipped), key))
    assert len(rows) == 4  # the answer, its measurement, and its signature and cells in the release index
    assert engine.execute(BASE + " LIMIT 3", Session("alice")).epsilon_spent == 1.0


def test_demo_identity_is_pinned_only_for_unwritable_demo_data() -> None:
    """Two processes' demos share answers only when their rows are equal: seeded, and never written."""
    a, b = open_backend("duckdb://"), open_backend("duckdb://")
    assert a.identity() != b.identity()  # a private database is its own, by default
    for backend in (a, b):
        backend.pin_identity(demo_identity(["health"]))
    assert a.identity() == b.identity() == demo_identity(["health"])
    assert demo_identity(["health"]) != demo_identity(["clinic"])
    # what `dpsql query` opens: the health demo is pinned; the survey demo takes randomized-response
    # INSERTs (its rows differ between processes once written), so it keeps a private identity
    for dataset, pinned in (("health", True), ("survey", False)):
        args = argparse.Namespace(
            policy=str(demo_policy_path(dataset)), database=None, statement_timeout=30.0, ledger="memory"
        )
        engine = open_engine(args)
        assert (engine.backend.identity() == demo_identity([dataset])) is pinned
        engine.close()
