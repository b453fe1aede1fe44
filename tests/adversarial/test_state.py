"""Attacks on dpsql's state: the result cache, the default ledger, the write path (see README)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dpsql
from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.session import Session

SQL = "SELECT COUNT(*) FROM patients"


def _engine(policy: Policy, backend: Backend, ledger_file: Path) -> Engine:
    url = f"sqlite:///{ledger_file}"
    return Engine(policy, backend, Ledger.open(url), ResultCache.open(url))


def _health_file(path: Path, rows: int | None) -> str:
    url = f"duckdb:///{path}"
    backend = open_backend(url)
    load_demo(backend, ["health"])
    if rows is not None:
        backend.execute_script(f"DELETE FROM patients WHERE rowid >= {rows}")
    backend.close()
    return url


def test_cache_keyed_on_database(tmp_path: Path) -> None:
    """cache-other-database: 10,000- then 100-row database, one cache file -> own answer, charged."""
    policy, ledger = load_policy(demo_policy_path("health")), tmp_path / "ledger.sqlite"
    big = open_backend(_health_file(tmp_path / "big.duckdb", None))
    small = open_backend(_health_file(tmp_path / "small.duckdb", 100))
    first = _engine(policy, big, ledger).execute(SQL, Session("alice"))
    second = _engine(policy, small, ledger).execute(SQL, Session("alice"))
    assert first.rows[0][0] > 9000 and second.rows[0][0] < 1000 and second.epsilon_spent == 1.0
    memory_big, memory_small = open_backend("duckdb://"), open_backend("duckdb://")
    load_demo(memory_big, ["health"])
    load_demo(memory_small, ["health"])
    memory_small.execute_script("DELETE FROM patients WHERE rowid >= 100")
    _engine(policy, memory_big, ledger).execute(SQL, Session("bob"))
    assert _engine(policy, memory_small, ledger).execute(SQL, Session("bob")).rows[0][0] < 1000


def test_cache_keyed_on_file_content_at_same_path(tmp_path: Path) -> None:
    """cache-same-path-new-data: the file at one URL replaced by a 100-row one, after a restart -> recomputed."""
    policy, ledger, path = load_policy(demo_policy_path("health")), tmp_path / "ledger.sqlite", tmp_path / "db.duckdb"
    url = _health_file(path, None)
    backend = open_backend(url)
    engine = _engine(policy, backend, ledger)
    assert engine.execute(SQL, Session("alice")).rows[0][0] > 9000
    assert engine.execute(SQL, Session("alice")).epsilon_spent == 0  # the same data: served
    engine.ledger.close()
    backend.close()
    path.unlink()
    _health_file(path, 100)
    restarted = _engine(policy, open_backend(url), ledger)
    answer = restarted.execute(SQL, Session("alice"))
    assert answer.rows[0][0] < 1000 and answer.epsilon_spent == 1.0


def test_cache_keyed_on_data_version(tmp_path: Path) -> None:
    """cache-after-write: a write through the backend between two runs -> recomputed, charged."""
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    engine = _engine(load_policy(demo_policy_path("health")), backend, tmp_path / "ledger.sqlite")
    engine.execute(SQL, Session("alice"))
    backend.execute_script("DELETE FROM patients WHERE rowid >= 100")
    again = engine.execute(SQL, Session("alice"))
    assert again.rows[0][0] < 1000 and again.epsilon_spent == 1.0


def test_cache_keyed_on_policy(health_policy_backend: tuple[Policy, Backend], tmp_path: Path) -> None:
    """cache-changed-policy: same query after the policy's bounds change -> not served from the cache."""
    policy, backend = health_policy_backend
    sql = "SELECT AVG(age) FROM patients"
    first = _engine(policy, backend, tmp_path / "ledger.sqlite").execute(sql, Session("alice"))
    columns = dict(policy.tables["patients"].columns)
    columns["age"] = columns["age"].model_copy(update={"upper": 200})
    tables = dict(policy.tables)
    tables["patients"] = policy.tables["patients"].model_copy(update={"columns": columns})
    changed = policy.model_copy(update={"tables": tables})
    engine = _engine(changed, backend, tmp_path / "ledger.sqlite")
    second = engine.execute(sql, Session("alice"))
    assert second.epsilon_spent == 1.0 and not any("result cache" in n for n in second.notices)
    assert second.accuracy[0][0] != first.accuracy[0][0]
    assert engine.ledger.spent("health", "alice").epsilon == 2.0


def test_cache_hit_says_so_and_is_free(health_policy_backend: tuple[Policy, Backend], tmp_path: Path) -> None:
    """cache-hit-notice: an exact repeat -> same rows, NOTICE naming the cache and when, ε not charged."""
    policy, backend = health_policy_backend
    engine = _engine(policy, backend, tmp_path / "ledger.sqlite")
    first = engine.execute(SQL, Session("alice"))
    again = engine.execute(SQL, Session("alice"))
    assert again.rows == first.rows and again.epsilon_spent == 0
    assert again.notices[0].startswith("dpsql: answered from the result cache (first computed at ")
    assert "no budget charged" in again.notices[0]
    assert engine.ledger.spent("health", "alice").epsilon == 1.0


def test_connections_share_the_default_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """connections-share-budget: bob over 10 connect() calls without ledger= -> 5 answers at ε=1, then 53P01."""
    monkeypatch.setenv("DPSQL_HOME", str(tmp_path / "home"))
    url = _health_file(tmp_path / "db.duckdb", None)
    outcomes = []
    for i in range(10):
        with dpsql.connect(policy=demo_policy_path("health"), database=url, analyst="bob", epsilon=1.0) as conn:
            try:
                conn.cursor().execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}")
                outcomes.append("answered")
            except dpsql.Error as exc:
                outcomes.append(exc.sqlstate)
    assert outcomes == ["answered"] * 5 + ["53P01"] * 5


@pytest.mark.parametrize("with_igor", [False, True])
def test_insert_is_no_membership_oracle(with_igor: bool) -> None:
    """rr-insert-membership: INSERT of a respondent into a table with a PRIMARY KEY on it -> 42501 either way."""
    backend = open_backend("duckdb://")
    backend.execute_script(
        "CREATE TABLE survey (respondent TEXT PRIMARY KEY, region TEXT, age INT, smoker BOOLEAN, drug_use TEXT)"
    )
    if with_igor:
        backend.execute_script("INSERT INTO survey VALUES ('igor', 'East', 40, true, 'past')")
    engine = Engine(load_policy(demo_policy_path("survey")), backend, Ledger.open("memory"))
    with pytest.raises(Error) as info:
        engine.execute(
            "INSERT INTO survey (respondent, region, age, smoker, drug_use) VALUES ('igor', 'East', 40, true, 'past')",
            Session("alice"),
        )
    assert (info.value.sqlstate, info.value.message) == (
        "42501",
        'permission denied to write column "respondent" of relation "survey"',
    )


@pytest.fixture
def health_policy_backend(adv_health_backend: Backend) -> tuple[Policy, Backend]:
    return load_policy(demo_policy_path("health")), adv_health_backend


def test_cache_keyed_on_postgres_database_and_writes(tmp_path: Path, pg_new_database) -> None:
    """cache-postgres: two PostgreSQL databases (10,000 and 100 rows) and one cache file -> each its own
    answer; a repeat on unchanged data is served free; after a write the next run is recomputed."""
    policy, ledger = load_policy(demo_policy_path("health")), tmp_path / "ledger.sqlite"
    big, small = open_backend(pg_new_database()), open_backend(pg_new_database())
    try:
        for backend in (big, small):
            load_demo(backend, ["health"])
        small.execute_script(
            "DELETE FROM patients WHERE ctid IN (SELECT ctid FROM patients OFFSET 100);"
            "ALTER TABLE patients SET (autovacuum_enabled = false); ANALYZE patients"  # no background writes
        )
        first = _engine(policy, big, ledger).execute(SQL, Session("alice"))
        engine = _engine(policy, small, ledger)
        second = engine.execute(SQL, Session("alice"))
        assert first.rows[0][0] > 9000 and second.rows[0][0] < 1000 and second.epsilon_spent == 1.0
        repeat = engine.execute(SQL, Session("alice"))
        assert repeat.rows == second.rows and repeat.epsilon_spent == 0
        assert any("answered from the result cache" in n for n in repeat.notices)
        small.execute_script("DELETE FROM patients WHERE ctid IN (SELECT ctid FROM patients OFFSET 50)")
        assert engine.execute(SQL, Session("alice")).epsilon_spent == 1.0
    finally:
        big.close()
        small.close()
