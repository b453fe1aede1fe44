"""Statements refused before the engine runs them — by the catalog guard, or at Parse in the extended
protocol drivers use — are in the audit trail too (free refusals are how a curator spots an analyst
probing), once each, with no constant recorded. Identical refusals share one row (its ``repeats``
count them: see dpsql/ledger/audit.py), so statements are counted as the sum of repeats."""

from __future__ import annotations

import psycopg

from .conftest import Running


def _refused(running: Running, sql: str, *, prepare: bool) -> str:
    with psycopg.connect(running.dsn("alice"), autocommit=True) as conn:
        try:
            conn.execute(sql, prepare=prepare)
        except psycopg.Error as exc:
            return exc.sqlstate or ""
    raise AssertionError(f"answered: {sql}")


def _audited(running: Running, needle: str) -> list:
    engine = running.engine
    engine.audit.flush()
    return [r for r in engine.ledger.audit(engine.policy.dataset, "alice", limit=1000) if needle in r.shape.upper()]


def _statements(rows: list) -> int:
    return sum(r.repeats for r in rows)


def test_catalog_guard_refusals_are_audited(dp_server: Running) -> None:
    before = _statements(_audited(dp_server, "PG_READ_FILE"))
    assert _refused(dp_server, "SELECT pg_read_file('/etc/passwd')", prepare=False) == "42501"  # simple protocol
    assert _refused(dp_server, "SELECT pg_read_file('/etc/shadow')", prepare=True) == "42501"  # refused at Parse
    rows = _audited(dp_server, "PG_READ_FILE")
    assert _statements(rows) == before + 2
    assert {(r.outcome, r.sqlstate, r.epsilon) for r in rows[:1]} == {("refused", "42501", 0.0)}
    assert not any("/etc/" in r.shape for r in rows)  # shapes never carry constants


def test_engine_refusal_at_parse_is_audited_once(dp_server: Running) -> None:
    before = _statements(_audited(dp_server, "SSN"))
    assert _refused(dp_server, "SELECT ssn, COUNT(*) FROM patients GROUP BY ssn", prepare=True) == "42501"
    assert _refused(dp_server, "SELECT ssn, COUNT(*) FROM patients GROUP BY ssn", prepare=False) == "42501"
    rows = _audited(dp_server, "SSN")
    assert _statements(rows) == before + 2, rows  # once per statement, whichever protocol refused it
    assert {r.sqlstate for r in rows[:1]} == {"42501"}
