"""Issue #27 item 5 and #28 item 6: the ledger against its own credentials, and grants that can be revoked.

* Spent budget is derived from the append-only charge rows (each carries its analyst's and its dataset's
  sums): an UPDATE that lowers a total gives nothing back, ``dpsql ledger verify`` names it.
* A charge row with a non-finite cost breaks no reader and exhausts the budget (53P01).
* The README's least-privilege recipe, run on a real PostgreSQL: the writer cannot change or delete a
  charge, touch a total or disable a trigger; ``dpsql serve`` warns about superuser and owner roles.
* ``dpsql audit prune`` deletes free refusals and cache hits only, audited; ``dpsql budget revoke``;
  a grant above the dataset's remaining budget warns; every "remaining" is min(analyst, dataset).

Real SQLite files and real PostgreSQL databases (``pg_new_database``), real subprocesses for the CLI.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import math
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from dpsql import budget_view
from dpsql.backends import open_backend
from dpsql.dashboard import views
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import InvalidParameterValue, LedgerUnavailable, PrivacyBudgetExhausted
from dpsql.ledger import AuditEntry, Cost, Ledger, serve_role_warnings
from dpsql.ledger import audit as audit_module
from dpsql.policy import Budget, load_policy
from dpsql.session import Session

from .conftest import dpsql_cli as _dpsql

ROOT = Path(__file__).resolve().parents[2]
HEALTH = demo_policy_path("health")
POLICY = load_policy(HEALTH)
DATASET_BUDGET = Budget(epsilon=50.0, delta=1e-4)  # schemas/health.yaml's
SMALL = Budget(epsilon=1.0, delta=1e-5)


def _reserve(
    ledger: Ledger, analyst: str = "alice", epsilon: float = 0.5, *, budget: Budget = SMALL, dataset: Budget = SMALL
) -> object:
    return ledger.reserve(
        dataset="health",
        analyst=analyst,
        cost=Cost(epsilon),
        dataset_budget=dataset,
        analyst_budget=budget,
        fingerprint="f",
    )


def _execute(ledger: Ledger, sql: str, params: tuple[object, ...] = ()) -> None:
    """Run ``sql`` as a hand with the ledger's own credentials would."""
    with ledger._append() as execute:
        execute(ledger._sql(sql), params)


# --- spent is derived from the append-only rows -----------------------------------------------------------


def test_a_lowered_total_gives_no_budget_back(any_ledger: Ledger, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's attack: one UPDATE reset a budget. The totals are an index; the charge rows decide."""
    _reserve(any_ledger)
    _reserve(any_ledger)  # alice has spent her whole ε=1
    _execute(any_ledger, "UPDATE dpsql_ledger_totals SET epsilon = 0, rho = 0, queries = 0")
    assert any_ledger.verify("health") == [
        'totals of analyst "alice" on dataset "health" (ε=0, 0 queries) disagree with its charge rows (ε=1, 2 queries)'
    ]
    with caplog.at_level(logging.ERROR, logger="dpsql.ledger"), pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(any_ledger, dataset=DATASET_BUDGET)
    assert refused.value.sqlstate == "53P01"
    assert refused.value.message == 'privacy budget exhausted for analyst "alice"'
    assert refused.value.detail == "spent ε=1 of 1, this query needs ε=0.5"
    assert any(r.message.startswith("privacy ledger integrity: the totals of analyst") for r in caplog.records)
    assert any_ledger.spent("health", "alice").epsilon == 1.0
    assert [r.spent.epsilon for r in any_ledger.summary("health")] == [1.0]
    assert any_ledger.remaining("health", "alice", budget=SMALL).epsilon == 0.0


def test_hiding_another_analysts_spending_gives_the_dataset_nothing_back(any_ledger: Ledger) -> None:
    """Lowering (or deleting) bob's totals row must not give the *dataset's* budget back to alice."""
    for _ in range(2):
        _reserve(any_ledger, "bob", budget=Budget(epsilon=5.0, delta=1e-5))
    _execute(any_ledger, "DELETE FROM dpsql_ledger_totals WHERE analyst = 'bob'")
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        _reserve(any_ledger, "alice", budget=Budget(epsilon=5.0, delta=1e-5))  # the dataset's ε=1 is spent
    assert refused.value.message == 'privacy budget exhausted for dataset "health"'
    assert any_ledger.spent("health").epsilon == 1.0
    assert any_ledger.verify("health") == ['analyst "bob" on dataset "health" has charge rows but no totals row']


def test_verify_names_a_changed_charge_row(sqlite_url: str, tmp_path: Path) -> None:
    with Ledger.open(sqlite_url) as ledger:
        for _ in range(3):
            _reserve(ledger, epsilon=0.25)
        _execute(ledger, "DROP TRIGGER dpsql_ledger_no_update")  # a hand with the file can; verify still sees it
        _execute(ledger, "UPDATE dpsql_ledger SET epsilon = 0 WHERE id = 2")
        problems = ledger.verify("health")
    assert problems[0] == (
        'charge #2 on dataset "health": its sums for analyst "alice" (ε=0.5, 2 queries) disagree with the rows '
        "up to it (ε=0.25, 2 queries): a row was changed or deleted"
    )
    done = _dpsql("ledger", "verify", "--ledger", sqlite_url, home=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith('ERROR:  charge #2 on dataset "health"'), done.stderr
    with Ledger.open(sqlite_url) as ledger:
        _reserve(ledger, epsilon=0.25)  # charged from the sums on the last row: ε=1 in all now
        assert ledger.spent("health", "alice").epsilon == 1.0


def test_verify_passes_on_an_honest_ledger(any_url: str, tmp_path: Path) -> None:
    with Ledger.open(any_url) as ledger:
        for analyst in ("alice", "bob", "alice"):
            _reserve(ledger, analyst, 0.1, dataset=DATASET_BUDGET)
        assert ledger.verify() == []
    done = _dpsql("ledger", "verify", "--ledger", any_url, home=tmp_path)
    assert (done.returncode, done.stdout) == (0, "ledger verified: every total and charge row agrees\n")


# --- a non-finite charge row: readers survive, the budget is exhausted ------------------------------------


def _insert_bad_charge(ledger: Ledger, url: str) -> None:
    """A charge row with an infinite (SQLite) or NaN (PostgreSQL) ε and sums, its triggers bypassed."""
    if url.startswith("sqlite"):
        _execute(ledger, "DROP TRIGGER dpsql_ledger_finite")
        bad: object = math.inf
    else:
        _execute(ledger, "ALTER TABLE dpsql_ledger DISABLE TRIGGER USER")
        bad = math.nan
    _execute(
        ledger,
        "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, "
        "selection_delta, sum_epsilon, sum_delta, sum_rho, sum_selection_delta, sum_queries, ds_epsilon, ds_delta, "
        "ds_rho, ds_selection_delta, ds_queries) VALUES (?, 'health', 'alice', 'f', ?, 0, 0, 'pure', 0, ?, 0, 0, 0, "
        "2, ?, 0, 0, 0, 2)",
        (ledger._timestamp(dt.datetime.now(dt.UTC)), bad, bad, bad),
    )


def test_a_non_finite_charge_breaks_no_reader_and_exhausts_the_budget(any_url: str, tmp_path: Path) -> None:
    with Ledger.open(any_url) as ledger:
        _reserve(ledger, epsilon=0.1, dataset=DATASET_BUDGET)
        _insert_bad_charge(ledger, any_url)
        (bad, _) = ledger.charges("health")
        assert bad.corrupt and bad.cost == Cost(0.0)
        series = views.spend_series(ledger, POLICY)
        assert series["alice"][-1][1] == math.inf
        plot = views.spend_plot(series)
        assert "nan" not in plot.lower() and "alice (inf)" in plot
        rows, dataset = views.budget_rows(ledger, POLICY)
        alice = next(r for r in rows if r.name == "alice")
        assert (alice.spent, alice.remaining, dataset.remaining) == (math.inf, 0.0, 0.0)
        assert budget_view.own_budget(ledger, POLICY, "alice")[1:3] == (math.inf, 0.0)
        with pytest.raises(PrivacyBudgetExhausted) as refused:
            _reserve(ledger, epsilon=0.1, budget=Budget(epsilon=10, delta=1e-5), dataset=DATASET_BUDGET)
        assert refused.value.sqlstate == "53P01"
        assert refused.value.detail == "The ledger's recorded total for this analyst is not a finite number."
        assert ledger.verify("health")[0].startswith('charge #2 of analyst "alice" on dataset "health": a cost')
    listed = _dpsql("budget", "--json", "--ledger", any_url, home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    alice_row = {r["analyst"]: r for r in json.loads(listed.stdout)}["alice"]
    assert (alice_row["epsilon_spent"], alice_row["epsilon_remaining"]) == (None, 0.0)


def test_a_non_finite_charge_is_refused_on_insert(any_ledger: Ledger, any_url: str) -> None:
    message = "privacy ledger charges are finite numbers"
    with pytest.raises(Exception, match=message):
        _execute(
            any_ledger,
            "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting) "
            "VALUES ('2026-01-01', 'health', 'alice', 'f', ?, 0, 0, 'pure')",
            (math.inf,),
        )


# --- revoke, the grant warning, min(analyst, dataset) remaining ------------------------------------------


def test_revoke_takes_back_unspent_grants_only(any_ledger: Ledger) -> None:
    base = Budget(epsilon=1.0, delta=1e-5)
    any_ledger.grant(
        dataset="health", analyst="alice", epsilon=3.0, by="c", reason="study", dataset_budget=DATASET_BUDGET
    )
    for _ in range(5):
        _reserve(any_ledger, budget=base, dataset=DATASET_BUDGET)  # ε=2.5 of 4 spent
    revoke = {"dataset": "health", "analyst": "alice", "by": "c", "analyst_budget": base}
    with pytest.raises(InvalidParameterValue) as refused:
        any_ledger.revoke(epsilon=4.0, reason="too much", **revoke)  # type: ignore[arg-type]
    assert refused.value.sqlstate == "22023"
    assert (
        refused.value.message
        == 'invalid revoke: analyst "alice" holds grants of ε=3 in all, less than the ε=4 to revoke'
    )
    with pytest.raises(InvalidParameterValue) as refused:
        any_ledger.revoke(epsilon=2.0, reason="below spent", **revoke)  # type: ignore[arg-type]
    assert refused.value.message == (
        'invalid revoke: analyst "alice" has already spent ε=2.5; the limit would fall to ε=2, δ=1e-05'
    )
    assert refused.value.hint == "Spent budget is never taken back: revoke at most the unspent part."
    with pytest.raises(InvalidParameterValue, match="a revoke needs a --reason"):
        any_ledger.revoke(epsilon=1.0, reason=" ", **revoke)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterValue, match=r"invalid revoke: ε=inf"):
        any_ledger.revoke(epsilon=math.inf, reason="r", **revoke)  # type: ignore[arg-type]
    event = any_ledger.revoke(epsilon=1.5, reason="study ended", **revoke)  # type: ignore[arg-type]
    assert (event.kind, event.epsilon, event.reason) == ("revoke", 1.5, "study ended")
    assert any_ledger.levers("health", "alice").limit(base).epsilon == 2.5
    assert any_ledger.remaining("health", "alice", budget=base).epsilon == 0.0
    with pytest.raises(PrivacyBudgetExhausted):
        _reserve(any_ledger, budget=base, dataset=DATASET_BUDGET)
    assert [e.kind for e in any_ledger.lever_events("health", "alice")] == ["revoke", "grant"]


def test_cli_revoke_and_a_grant_above_the_dataset_remaining_warns(any_url: str, tmp_path: Path) -> None:
    with Ledger.open(any_url) as ledger:
        for _ in range(9):  # bob spends ε=45 of the dataset's 50
            _reserve(ledger, "bob", 5.0, budget=Budget(epsilon=50.0, delta=1e-5), dataset=DATASET_BUDGET)
    granted = _dpsql(
        "budget",
        "grant",
        "--analyst",
        "alice",
        "--epsilon",
        "10",
        "--reason",
        "study",
        "--ledger",
        any_url,
        "--json",
        home=tmp_path,
    )
    assert granted.returncode == 0, granted.stderr
    assert granted.stderr == (
        "WARNING:  the grant of ε=10, δ=0 is more than the dataset has left (ε=5, δ=0.0001, shared by all "
        'analysts): analyst "alice" can spend at most that\n'
    )
    state = json.loads(granted.stdout)
    assert state["epsilon_remaining"] == 5.0  # min(alice's 10 + policy's, the dataset's 5)
    listed = {
        r["analyst"]: r for r in json.loads(_dpsql("budget", "--json", "--ledger", any_url, home=tmp_path).stdout)
    }
    assert listed["alice"]["epsilon_remaining"] == 5.0
    assert listed["(dataset)"]["epsilon_remaining"] == 5.0
    revoked = _dpsql(
        "budget",
        "revoke",
        "--analyst",
        "alice",
        "--epsilon",
        "4",
        "--reason",
        "study ended",
        "--ledger",
        any_url,
        home=tmp_path,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.startswith('revoke: analyst "alice" of dataset "health" now has ε=')
    too_much = _dpsql(
        "budget", "revoke", "--analyst", "alice", "--epsilon", "7", "--reason", "r", "--ledger", any_url, home=tmp_path
    )
    assert too_much.returncode == 1
    assert too_much.stderr.startswith(
        'ERROR:  invalid revoke: analyst "alice" holds grants of ε=6 in all, less than the ε=7 to revoke'
    )
    audit = json.loads(_dpsql("audit", "--json", "--ledger", any_url, home=tmp_path).stdout)
    assert [(r["event"], r["epsilon"], r["reason"]) for r in audit if r["by"]][:2] == [
        ("revoke", 4.0, "study ended"),
        ("grant", 10.0, "study"),
    ]


def test_remaining_is_the_smaller_of_analyst_and_dataset_everywhere(any_url: str) -> None:
    """The NOTICE, SHOW dpsql.budget / dpsql_budget and the dashboard all quote what can really be spent."""
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    engine = Engine(POLICY, backend, Ledger.open(any_url))
    try:
        for _ in range(9):
            _reserve(engine.ledger, "bob", 5.0, budget=Budget(epsilon=50.0, delta=1e-5), dataset=DATASET_BUDGET)
        # bob spent 45: the dataset has 5 left, alice's own budget is larger
        alice_own = POLICY.analyst_budget("alice").epsilon
        assert alice_own > 5.5
        result = engine.execute("SELECT COUNT(*) FROM patients", Session("alice", epsilon=0.5))
        assert result.remaining_epsilon == pytest.approx(4.5)
        assert any('remaining ε=4.5 for analyst "alice"' in n for n in result.notices), result.notices
        row = budget_view.own_budget(engine.ledger, POLICY, "alice")
        assert row[2] == pytest.approx(4.5)  # epsilon_remaining
        shown = engine.execute("SELECT epsilon_remaining FROM dpsql_budget", Session("alice"))
        assert shown.rows[0][0] == pytest.approx(4.5)
        rows, dataset = views.budget_rows(engine.ledger, POLICY)
        assert next(r for r in rows if r.name == "alice").remaining == pytest.approx(4.5)
        assert dataset.remaining == pytest.approx(4.5)
    finally:
        engine.close()


# --- audit pruning ----------------------------------------------------------------------------------------


def _entry(outcome: str, at: dt.datetime, charge_id: int | None = None, sqlstate: str = "00000") -> AuditEntry:
    return AuditEntry(at, "health", "alice", "f", "SELECT ?", outcome, sqlstate, charge_id=charge_id)


def test_prune_deletes_old_free_refusals_and_cache_hits_only(any_url: str, tmp_path: Path) -> None:
    old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    with Ledger.open(any_url) as ledger:
        _reserve(ledger, epsilon=0.1, dataset=DATASET_BUDGET)  # a charged row (now)
        ledger.record_audit(
            [
                _entry("refused", old, sqlstate="42501"),
                _entry("cache hit", old),
                _entry("answered", old),  # a free answered statement: kept
                _entry("answered", old, charge_id=1),  # an answered charged one: kept
                _entry("refused", dt.datetime.now(dt.UTC), sqlstate="42501"),  # after the cut-off: kept
            ]
        )
        with pytest.raises(Exception, match="append-only"):  # no prune row later than it: refused
            _execute(ledger, "DELETE FROM dpsql_audit WHERE outcome = 'refused'")
        with pytest.raises(InvalidParameterValue) as refused:
            ledger.prune_audit(dataset="health", before=dt.datetime(2999, 1, 1, tzinfo=dt.UTC), by="c", reason="r")
        assert refused.value.message == "invalid prune: 2999-01-01T00:00:00.000000+00:00 is in the future"
    done = _dpsql(
        "audit",
        "prune",
        "--before",
        "2021-01-01",
        "--reason",
        "retention",
        "--by",
        "carol",
        "--ledger",
        any_url,
        home=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prune: 2 audit rows of free refusals and cache hits deleted; recorded as")
    with Ledger.open(any_url) as ledger:
        left = sorted(
            (e.outcome, e.charge_id is not None, e.at < dt.datetime(2021, 1, 1, tzinfo=dt.UTC))
            for e in ledger.audit("health")
        )
        assert left == [
            ("answered", False, True),
            ("answered", True, True),
            ("charged", True, False),
            ("refused", False, False),
        ]
        (event,) = ledger.lever_events("health")
        assert (event.kind, event.analyst, event.by) == ("prune", "", "carol")
        assert event.reason == (
            "retention (audit rows of free refusals and cache hits before 2021-01-01T00:00:00.000000+00:00: 2 deleted)"
        )
        with pytest.raises(Exception, match="append-only"):  # a charged row, even before a prune row
            _execute(ledger, "DELETE FROM dpsql_audit WHERE charge_id IS NOT NULL")
    audit = json.loads(_dpsql("audit", "--json", "--ledger", any_url, home=tmp_path).stdout)
    assert ("prune", "carol") in {(r["event"], r["by"]) for r in audit}


# --- the README's least-privilege roles, on a real PostgreSQL --------------------------------------------


def _readme_recipe() -> list[str]:
    """The SQL blocks of the README's "Least-privilege database roles" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Least-privilege database roles", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


ROLES = ("dpsql_ledger_owner", "dpsql_ledger_writer", "dpsql_ledger_reader", "dpsql_curator", "dpsql_data_reader")


def _as(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.netloc.rpartition('@')[2]}"))


@pytest.fixture
def roles(pg_new_database: Callable[[], str]) -> Iterator[tuple[dict[str, str], str, str]]:
    """The recipe run: each role's ledger URL, the superuser's ledger URL and the data database's URL."""
    suffix, password = secrets.token_hex(3), secrets.token_hex(12)
    names = {role: f"{role}_{suffix}" for role in ROLES}

    def local(sql: str) -> str:
        sql = sql.replace("'change-me'", f"'{password}'")
        return re.sub(r"\b(" + "|".join(ROLES) + r")\b", lambda m: names[m.group(1)], sql)

    superuser, data_url = pg_new_database(), pg_new_database()
    roles_sql, grants_sql, data_sql = (local(block) for block in _readme_recipe())
    with psycopg.connect(superuser, autocommit=True) as conn:
        conn.execute(roles_sql)
    owner = _as(superuser, names["dpsql_ledger_owner"], password)
    Ledger.open(owner).close()  # the tables, as the owner
    with psycopg.connect(owner, autocommit=True) as conn:
        conn.execute(grants_sql)
    with psycopg.connect(data_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE patients (age int)")
        conn.execute(data_sql)
    urls = {role: _as(superuser, names[role], password) for role in ROLES}
    urls["dpsql_data_reader"] = _as(data_url, names["dpsql_data_reader"], password)
    yield urls, superuser, data_url
    with psycopg.connect(superuser, autocommit=True) as conn:
        for role in names.values():
            conn.execute(f"DROP OWNED BY {role}")
    with psycopg.connect(data_url, autocommit=True) as conn:
        conn.execute(f"DROP OWNED BY {names['dpsql_data_reader']}")
    with psycopg.connect(superuser, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {urlsplit(data_url).path[1:]} WITH (FORCE)")
        for role in names.values():
            conn.execute(f"DROP ROLE IF EXISTS {role}")


def test_the_readme_roles_keep_the_writer_from_rewriting_the_ledger(
    roles: tuple[dict[str, str], str, str],
) -> None:
    urls, _, _ = roles
    with Ledger.open(urls["dpsql_ledger_writer"]) as writer:
        assert len(writer.installation_key()) == 32
        _reserve(writer)
        _reserve(writer)  # alice's ε=1 spent
        refused_sql = (
            "UPDATE dpsql_ledger_totals SET epsilon = 0",
            "DELETE FROM dpsql_ledger_totals",
            "UPDATE dpsql_ledger SET epsilon = 0",
            "DELETE FROM dpsql_ledger",
            "TRUNCATE dpsql_ledger",
            "ALTER TABLE dpsql_ledger DISABLE TRIGGER ALL",
            "ALTER TABLE dpsql_ledger DISABLE TRIGGER dpsql_ledger_charge",
            "ALTER TABLE dpsql_audit DISABLE TRIGGER USER",
            "DROP TRIGGER dpsql_ledger_append_only ON dpsql_ledger",
            "DELETE FROM dpsql_audit",
            "INSERT INTO dpsql_ledger_levers (at, dataset, analyst, kind, epsilon, delta, by_user, reason) "
            "VALUES (now(), 'health', 'alice', 'grant', 10, 0, 'me', 'me')",
            "UPDATE dpsql_ledger_meta SET value = 'x'",
        )
        for sql in refused_sql:
            with pytest.raises(psycopg.errors.InsufficientPrivilege), psycopg.connect(urls["dpsql_ledger_writer"]) as c:
                c.execute(sql)
        # a forged charge row with zero sums: the trigger computes them itself, the totals follow the rows
        with psycopg.connect(urls["dpsql_ledger_writer"], autocommit=True) as c:
            c.execute(
                "INSERT INTO dpsql_ledger (at, dataset, analyst, fingerprint, epsilon, delta, rho, accounting, "
                "selection_delta, sum_epsilon, sum_queries, ds_epsilon, ds_queries) "
                "VALUES (now(), 'health', 'alice', 'forged', 0, 0, 0, 'pure', 0, 0, 0, 0, 0)"
            )
        assert writer.spent("health", "alice").epsilon == 1.0
        with pytest.raises(PrivacyBudgetExhausted):
            _reserve(writer)
        assert serve_role_warnings(_FakeEngine(writer)) == []
    with Ledger.open(urls["dpsql_ledger_reader"]) as reader:
        assert [r.spent.epsilon for r in reader.summary("health")] == [1.0]
        assert reader.verify() == []
        with pytest.raises(psycopg.errors.InsufficientPrivilege), psycopg.connect(urls["dpsql_ledger_reader"]) as c:
            c.execute("SELECT value FROM dpsql_ledger_meta")
        with pytest.raises(LedgerUnavailable, match="permission denied for table dpsql_ledger_levers"):
            reader.grant(dataset="health", analyst="alice", epsilon=1, by="r", reason="r")
    with Ledger.open(urls["dpsql_curator"]) as curator:
        curator.grant(dataset="health", analyst="alice", epsilon=1, by="c", reason="study", dataset_budget=SMALL)
        event, count = curator.prune_audit(dataset="health", before=dt.datetime.now(dt.UTC), by="c", reason="retention")
        assert count == 0 and event.kind == "prune"
        with pytest.raises(Exception, match="append-only"):  # charged rows: never
            _execute(curator, "DELETE FROM dpsql_audit")


class _FakeEngine:
    """What :func:`serve_role_warnings` reads of an engine: its ledger, backend and policy."""

    def __init__(self, ledger: Ledger, backend: object = None) -> None:
        self.ledger, self.backend, self.policy = ledger, backend, POLICY


def test_serve_warns_about_superuser_and_owner_roles(roles: tuple[dict[str, str], str, str]) -> None:
    urls, superuser, data_url = roles
    owner_name, root = urlsplit(urls["dpsql_ledger_owner"]).username, urlsplit(superuser).username
    with Ledger.open(superuser) as ledger:
        (warning,) = serve_role_warnings(_FakeEngine(ledger))
        assert warning.startswith(f'the privacy ledger connects as role "{root}", a superuser: it can disable')
        assert warning.endswith(
            "connect as a ledger-writer role such as dpsql_ledger_writer (INSERT on the charges and the audit trail "
            'only) (README "Least-privilege database roles")'
        )
    with Ledger.open(urls["dpsql_ledger_owner"]) as ledger:
        (warning,) = serve_role_warnings(_FakeEngine(ledger))
        assert warning.startswith(
            f'the privacy ledger connects as role "{owner_name}", owner of dpsql_ledger, dpsql_ledger_totals, '
            "dpsql_ledger_levers, dpsql_audit, dpsql_ledger_meta, dpsql_ledger_pld, dpsql_result_cache: "
            "an owner can disable triggers"
        )
    data_owner = open_backend(data_url)  # the superuser: owns patients too
    data_reader = open_backend(urls["dpsql_data_reader"])
    try:
        with Ledger.open(urls["dpsql_ledger_writer"]) as ledger:
            assert serve_role_warnings(_FakeEngine(ledger, data_reader)) == []
            (warning,) = serve_role_warnings(_FakeEngine(ledger, data_owner))
            assert warning.startswith(f'the data database connects as role "{root}", a superuser')
            assert "dpsql_data_reader (SELECT on the served tables only)" in warning
    finally:
        data_owner.close()
        data_reader.close()


def test_serve_start_logs_the_role_warning(sqlite_url: str, pg_new_database: Callable[[], str]) -> None:
    """``dpsql serve``'s start-up check (``check_at_start``) logs it: as the superuser on a PostgreSQL data
    database, one WARNING line naming the role."""
    from dpsql.curator.serve import check_at_start

    data_url = pg_new_database()
    backend = open_backend(data_url)
    load_demo(backend, ["health"])  # the policy's check passes: only the role is wrong
    engine = _FakeEngine(Ledger.open(sqlite_url), backend)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign,assignment]
    logging.getLogger("dpsql.ledger").addHandler(handler)
    try:
        check_at_start(HEALTH, cast(Engine, engine))  # reads only what _FakeEngine has
    finally:
        logging.getLogger("dpsql.ledger").removeHandler(handler)
        engine.ledger.close()
        backend.close()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    root = urlsplit(data_url).username
    assert len(warnings) == 1 and warnings[0].startswith(f'the data database connects as role "{root}", a superuser')


# --- a schema-4 ledger is migrated ------------------------------------------------------------------------


def test_a_schema_4_ledger_is_migrated(any_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger written by the previous release (its module, from git): its charges keep counting, its levers
    table takes revokes, new charges carry sums, and verify finds it consistent."""
    monkeypatch.setitem(sys.modules, "dpsql.audit", audit_module)  # where that release found charged_entry
    source = subprocess.run(
        ["git", "show", "a7a5005:dpsql/ledger.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(os.environ["DPSQL_HOME"]) / f"ledger_schema4_{secrets.token_hex(3)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    try:
        spec.loader.exec_module(old)
    finally:
        del sys.modules[spec.name]
    with old.Ledger.open(any_url) as before:
        for _ in range(2):
            before.reserve(
                dataset="health",
                analyst="alice",
                cost=old.Cost(0.25),
                dataset_budget=SMALL,
                analyst_budget=SMALL,
                fingerprint="f",
            )
        before.grant(dataset="health", analyst="alice", epsilon=1.0, by="c", reason="r", dataset_budget=SMALL)
    with Ledger.open(any_url) as after:
        assert after.spent("health", "alice").epsilon == 0.5
        after.revoke(dataset="health", analyst="alice", epsilon=0.5, by="c", reason="r", analyst_budget=SMALL)
        assert after.levers("health", "alice").limit(SMALL).epsilon == 1.5
        _reserve(after, epsilon=0.25)
        assert after.spent("health", "alice").epsilon == 0.75
        assert after.verify() == []
