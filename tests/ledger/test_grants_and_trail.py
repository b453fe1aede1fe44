"""Issue #27, ledger side: grants are finite and capped, readers survive bad totals, every charge has its
audit row from the charge's own transaction (kill -9 included), free statements are folded instead of
growing the trail, and ``dpsql audit`` prints analysts' text escaped and refuses out-of-range dates.

Real SQLite files and a real PostgreSQL ledger (``pg_new_database``), real engines on the DuckDB demo,
real subprocesses for the CLI and for kill -9.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpsql.backends import open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error, InvalidParameterValue, PrivacyBudgetExhausted
from dpsql.ledger import GRANT_CEILING, AuditEntry, Cost, Ledger
from dpsql.ledger import audit as audit_module
from dpsql.ledger.audit import OTHER_SHAPES, AuditTrail
from dpsql.policy import Budget, load_policy
from dpsql.session import Session

from .conftest import dpsql_cli as _dpsql

ROOT = Path(__file__).resolve().parents[2]
HEALTH = demo_policy_path("health")
DATASET_BUDGET = Budget(epsilon=50.0, delta=1e-4)  # schemas/health.yaml's


def _reserve(ledger: Ledger, epsilon: float = 0.5, accounting: str = "pure") -> object:
    return ledger.reserve(
        dataset="health",
        analyst="alice",
        cost=Cost(epsilon),
        dataset_budget=DATASET_BUDGET,
        analyst_budget=Budget(epsilon=10.0, delta=1e-5),
        fingerprint="f",
        accounting=accounting,  # type: ignore[arg-type]
    )


# --- item 6: grants finite and capped, sums read defensively -------------------------------------------


def test_huge_grants_are_22023_and_grants_add_up_to_the_dataset_budget_at_most(any_ledger: Ledger) -> None:
    grant = {"dataset": "health", "analyst": "bob", "by": "c", "reason": "r"}
    for kwargs in ({}, {"dataset_budget": DATASET_BUDGET}):
        with pytest.raises(InvalidParameterValue) as refused:
            any_ledger.grant(epsilon=1e308, **grant, **kwargs)  # type: ignore[arg-type]
        assert refused.value.sqlstate == "22023"
        assert refused.value.message.startswith('invalid grant: analyst "bob"\'s grants would total ε=1e+308')
    any_ledger.grant(epsilon=30, dataset_budget=DATASET_BUDGET, **grant)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterValue) as refused:  # 30 + 30 > 50: checked against the rows
        any_ledger.grant(epsilon=30, dataset_budget=DATASET_BUDGET, **grant)  # type: ignore[arg-type]
    assert refused.value.message == (
        "invalid grant: analyst \"bob\"'s grants would total ε=60, more than the dataset's budget ε=50 "
        "(granted so far: ε=30)"
    )
    with pytest.raises(InvalidParameterValue):
        any_ledger.grant(epsilon=0, delta=2e-4, dataset_budget=DATASET_BUDGET, **grant)
    any_ledger.grant(epsilon=20, dataset_budget=DATASET_BUDGET, **grant)  # type: ignore[arg-type]
    assert [e.epsilon for e in any_ledger.lever_events("health", "bob")] == [20.0, 30.0]
    assert any_ledger.levers("health", "bob").limit(Budget(epsilon=10, delta=1e-5)).epsilon == 60.0


def test_cli_grant_of_1e308_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    for _ in range(2):  # the two grants: each refused, nothing written
        done = _dpsql(
            "budget", "grant", "--analyst", "bob", "--epsilon", "1e308", "--reason", "r", "--ledger", url, home=tmp_path
        )
        assert done.returncode == 1
        assert done.stderr.startswith('ERROR:  invalid grant: analyst "bob"\'s grants would total ε=1e+308'), (
            done.stderr
        )
    listed = json.loads(_dpsql("budget", "--json", "--ledger", url, home=tmp_path).stdout)
    bob = load_policy(HEALTH).analyst_budget("bob").epsilon
    assert {r["analyst"]: r["epsilon_total"] for r in listed}["bob"] == bob  # no grant


def test_stored_infinite_grants_and_totals_do_not_break_readers(
    any_ledger: Ledger, any_url: str, tmp_path: Path
) -> None:
    """Rows an older version (or a hand) wrote: two grants of 1e308 and an infinite one. The analyst's
    reservations, ``dpsql budget`` and the levers still work: the grants read as the ceiling."""
    insert = (
        "INSERT INTO dpsql_ledger_levers (at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
        "VALUES (?, 'health', 'alice', 'grant', ?, 0, 'old', 'old')"
    )
    with any_ledger._append() as execute:
        for epsilon in (1e308, 1e308, math.inf):
            execute(any_ledger._sql(insert), (any_ledger._timestamp(_now()), epsilon))
    levers = any_ledger.levers("health", "alice")
    assert math.isfinite(levers.grant.epsilon) and levers.grant.epsilon <= 3 * GRANT_CEILING.epsilon
    _reserve(any_ledger)  # the analyst is not broken
    assert any_ledger.remaining("health", "alice", budget=Budget(epsilon=10, delta=1e-5)).epsilon > 0
    listed = json.loads(_dpsql("budget", "--json", "--ledger", any_url, home=tmp_path).stdout)
    alice = {r["analyst"]: r for r in listed}["alice"]
    assert alice["epsilon_spent"] == 0.5 and math.isfinite(alice["epsilon_total"])


def test_infinite_totals_refuse_charges_as_53P01_and_readers_show_them(any_ledger: Ledger) -> None:
    _reserve(any_ledger, accounting="zcdp")
    with any_ledger._append() as execute:  # a corrupt total, as a hand could write it
        execute(any_ledger._sql("UPDATE dpsql_ledger_totals SET rho = ?, epsilon = ?"), (math.inf, math.inf))
    for accounting in ("pure", "zcdp"):
        with pytest.raises(PrivacyBudgetExhausted) as refused:
            _reserve(any_ledger, accounting=accounting)
        assert refused.value.sqlstate == "53P01"
    assert any_ledger.spent("health", "alice").rho == math.inf
    for accounting in ("pure", "zcdp"):
        left = any_ledger.remaining("health", "alice", budget=Budget(epsilon=10, delta=1e-5), accounting=accounting)  # type: ignore[arg-type]
        assert left.epsilon == 0.0


# --- item 8: the audit row of a charge is written with the charge --------------------------------------


def _engine(url: str) -> Engine:
    """The health demo in an in-memory DuckDB, charging the ledger at ``url``."""
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    return Engine(load_policy(HEALTH), backend, Ledger.open(url))


def test_every_charge_has_its_audit_row_even_if_the_writer_never_runs(
    any_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trail's writer is asynchronous; as if the process died before it ran (nothing it queues is
    ever written), every charge still has its row, written in the charge's transaction."""
    monkeypatch.setattr(AuditTrail, "_enqueue", lambda self, entry: None)
    engine = _engine(any_url)
    try:
        for age in (30, 40, 50):
            engine.execute(f"SELECT COUNT(*) FROM patients WHERE age > {age}", Session("alice", epsilon=0.5))
        charges = engine.ledger.charges("health", limit=100)
        rows = engine.ledger.audit("health", limit=100)
    finally:
        engine.close()
    assert len(charges) == 3
    assert sorted(r.charge_id for r in rows if r.charge_id is not None) == sorted(c.id for c in charges)
    assert {(r.outcome, r.analyst, r.epsilon) for r in rows} == {("charged", "alice", 0.5)}
    assert all("patients" in r.shape and "30" not in r.shape for r in rows)


def test_the_charged_row_gets_its_outcome_and_the_trigger_allows_nothing_else(any_url: str) -> None:
    engine = _engine(any_url)
    try:
        engine.execute("SELECT COUNT(*) FROM patients", Session("alice", epsilon=0.5))
        engine.audit.flush()
        (row,) = engine.ledger.audit("health")
        assert (row.outcome, row.sqlstate, row.charge_id is not None) == ("answered", "00000", True)
        ledger = engine.ledger
        for sql in (
            "UPDATE dpsql_audit SET epsilon = 0",
            "UPDATE dpsql_audit SET outcome = 'failed'",  # finalised once only
            "UPDATE dpsql_audit SET repeats = repeats + 1",  # a charged row is never folded
            "DELETE FROM dpsql_audit",
        ):
            with pytest.raises(Exception, match=r"append-only|never"), ledger._append() as execute:
                execute(sql, ())
    finally:
        engine.close()


KILL_WORKER = """
import os, signal, sys
from tests.ledger.test_grants_and_trail import _engine
from dpsql.session import Session
engine = _engine(sys.argv[1])
for i in range(40):
    engine.execute(f"SELECT COUNT(*) FROM patients WHERE age > {i}", Session("alice", epsilon=1e-4))
    print(i, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # right after an answer: the trail's writer has had no time
"""


def test_kill_9_leaves_no_charge_without_its_audit_row(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    worker = subprocess.run(
        [sys.executable, "-c", KILL_WORKER, url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr
    assert len(worker.stdout.split()) == 40
    with Ledger.open(url) as ledger:
        charges = ledger.charges("health", limit=100_000)
        rows = ledger.audit("health", limit=100_000)
    assert len(charges) == 40
    audited = {r.charge_id for r in rows}
    assert [c.id for c in charges if c.id not in audited] == []


# --- item 8: free statements are folded -----------------------------------------------------------------


def test_repeated_refusals_fold_into_one_row_until_the_next_charge(any_url: str) -> None:
    engine = _engine(any_url)
    alice = Session("alice", epsilon=0.5)
    try:
        for _ in range(50):
            with contextlib.suppress(Error):
                engine.execute("SELECT name FROM patients WHERE zip = 2138", alice)
        engine.audit.flush()
        (folded,) = engine.ledger.audit("health")
        assert (folded.outcome, folded.sqlstate, folded.repeats) == ("refused", "42501", 50)
        assert folded.last_at is not None and folded.last_at >= folded.at
        engine.execute("SELECT COUNT(*) FROM patients", alice)  # a charge: the next refusal starts a row
        for _ in range(3):
            with contextlib.suppress(Error):
                engine.execute("SELECT name FROM patients WHERE zip = 1", alice)
        with contextlib.suppress(Error):
            engine.execute("SELECT name FROM patients", Session("bob", epsilon=0.5))  # bob's own row
        engine.audit.flush()
        rows = engine.ledger.audit("health")
    finally:
        engine.close()
    assert [(r.analyst, r.outcome, r.repeats) for r in rows] == [
        ("bob", "refused", 1),
        ("alice", "refused", 3),
        ("alice", "answered", 1),
        ("alice", "refused", 50),
    ]


def test_distinct_shapes_past_the_cap_fold_into_one_row(any_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_module, "MAX_OPEN_SHAPES", 3)
    engine = _engine(any_url)
    try:
        for i in range(40):  # 40 shapes (unknown columns), 42703 each
            with contextlib.suppress(Error):
                engine.execute(f"SELECT COUNT(*) FROM patients WHERE col{i} = 1", Session("alice", epsilon=0.5))
        engine.audit.flush()
        rows = engine.ledger.audit("health", limit=1000)
    finally:
        engine.close()
    assert len(rows) == 4 and sum(r.repeats for r in rows) == 40
    assert rows[0].shape == OTHER_SHAPES and rows[0].repeats == 37 and rows[0].fingerprint == ""


def test_a_schema_3_ledger_is_migrated(tmp_path: Path, any_url: str) -> None:
    """A ledger written by the previous release (its module, from git) opens: the audit's new columns
    are added, its old rows read with one repeat, and its update guard replaces the blanket one."""
    source = subprocess.run(
        ["git", "show", "da84ca1:dpsql/ledger.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = tmp_path / "ledger_schema3.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ledger_schema3", path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up
    try:
        spec.loader.exec_module(old)
    finally:
        del sys.modules[spec.name]
    with old.Ledger.open(any_url) as before:
        before.record_audit([old.AuditEntry(_now(), "health", "alice", "f", "SELECT ?", "refused", "42601")])
    with Ledger.open(any_url) as after:
        (row,) = after.audit("health")
        assert (row.outcome, row.repeats, row.last_at) == ("refused", 1, None)
        after.write_audit([], [], [(row.id or 0, 2, _now())])  # a free row may be folded now
        assert after.audit("health")[0].repeats == 3


# --- item 11: dpsql audit's text and dates -------------------------------------------------------------


def test_audit_text_output_escapes_control_characters(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    with Ledger.open(url) as ledger:
        ledger.record_audit(
            [
                AuditEntry(_now(), "health", "e\x1b[2Jvil\u202e", "f", "SELECT \x07 FROM t\r\n", "refused", "28000"),
            ]
        )
    done = _dpsql("audit", "--ledger", url, home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\u202e" not in done.stdout
    assert "\r" not in done.stdout
    assert "e\\x1b[2Jvil\\u202e" in done.stdout and "SELECT \\x07 FROM t\\x0d\\x0a" in done.stdout
    assert json.loads(_dpsql("audit", "--json", "--ledger", url, home=tmp_path).stdout)[0]["analyst"] == (
        "e\x1b[2Jvil\u202e"  # JSON keeps the value (escaped by JSON itself)
    )


@pytest.mark.parametrize(
    ("since", "message"),
    [
        ("0001-01-01T00:00:00+05:00", "out of range"),
        ("9999-12-31T23:00:00-05:00", "out of range"),
        ("99999-01-01", "invalid date '99999-01-01'"),
    ],
)
def test_audit_since_out_of_range_is_a_usage_error(tmp_path: Path, since: str, message: str) -> None:
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    done = _dpsql("audit", "--since", since, "--ledger", url, home=tmp_path)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert _dpsql("audit", "--since", "0001-01-01", "--ledger", url, home=tmp_path).returncode == 0


def _now() -> datetime.datetime:
    import datetime as dt

    return dt.datetime.now(dt.UTC)


def test_policy_budget_is_the_cap_used_by_the_levers() -> None:
    assert load_policy(HEALTH).budget.dataset.epsilon == DATASET_BUDGET.epsilon
