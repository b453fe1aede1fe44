"""Curator levers and the audit trail through a real ``dpsql serve``, psycopg and psql, on both ledger stores.

alice answers three queries, bob is refused once; ``dpsql audit --json`` lists the four rows with
shapes free of constants; ``dpsql budget grant`` raises bob's remaining by exactly the grant on the
running server; ``freeze`` refuses his next query (42501, before anything runs), ``unfreeze`` lets
it through; the levers show in the audit; ``SHOW dpsql.budget`` and ``dpsql_budget`` return the
caller's own row only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.kinds import new_database_url
from tests.listening import port_of, serving_line, start_serve

ROOT = Path(__file__).resolve().parents[2]
PSQL = shutil.which("psql")
FROZEN = 'the data curator froze the privacy budget of analyst "bob"'


def _policy(args: tuple[str, ...]) -> list[str]:
    """Curator commands need --policy (they never fall back to the demo): the demo's, unless given."""
    return [] if "--policy" in args else ["--policy", str(ROOT / "schemas" / "health.yaml")]


def _dpsql(*args: str, ledger: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpsql.cli", *args, "--ledger", ledger, *_policy(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        timeout=120,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return new_database_url(request.param, request, tmp_path)


@pytest.fixture
def serve(ledger_url: str, tmp_path: Path) -> Iterator[int]:
    server = start_serve("--catalog-dsn", "", "--ledger", ledger_url, home=tmp_path)
    try:
        yield port_of(serving_line(server, time.monotonic() + 90))  # it bound port 0 and says which port it got
    finally:
        server.terminate()
        server.wait(30)


def _connect(port: int, user: str) -> psycopg.Connection[Any]:
    return psycopg.connect(f"postgresql://{user}@127.0.0.1:{port}/health", autocommit=True, connect_timeout=5)


def _budget(port: int, user: str) -> dict[str, Any]:
    with _connect(port, user) as conn:
        cur = conn.execute("SHOW dpsql.budget")
        names = [d.name for d in cur.description or ()]
        rows = cur.fetchall()
    assert len(rows) == 1
    return dict(zip(names, rows[0], strict=True))


def _audit(ledger: str, until: Callable[[list[dict[str, Any]]], bool], *args: str) -> list[dict[str, Any]]:
    """``dpsql audit --json``, waiting (briefly) until the rows ``until`` looks for are there: the server's
    writer thread catches up behind the answers. (A row count to wait for that the trail never reaches --
    refusals fold, levers are rows of their own -- made every such call sleep out its whole deadline.)"""
    deadline = time.monotonic() + 20
    while True:
        rows: list[dict[str, Any]] = json.loads(_dpsql("audit", "--json", *args, ledger=ledger).stdout)
        if until(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _at_least(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda rows: len(rows) >= count


def _refusals(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda rows: sum(1 for r in rows if r["event"] == "refused" and r["sqlstate"] == "42501") >= count


def _levers(rows: list[dict[str, Any]]) -> bool:
    return {"grant", "freeze", "unfreeze"} <= {r["event"] for r in rows}


def test_audit_grant_freeze_through_a_running_server(serve: int, ledger_url: str) -> None:
    port = serve
    with _connect(port, "alice") as conn:
        for sql in (
            "SELECT COUNT(*) FROM patients WHERE age > 40",
            "SELECT COUNT(*) FROM patients WHERE age > 57",
            "SELECT AVG(age) FROM patients WHERE problem = 'Obesity'",
        ):
            conn.execute(sql).fetchall()
    with _connect(port, "bob") as conn, pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT name FROM patients WHERE zip = 2138")
    assert refused.value.sqlstate == "42501"

    rows = _audit(ledger_url, _at_least(4))
    assert len(rows) == 4
    alice = [r for r in rows if r["analyst"] == "alice"]
    bob = [r for r in rows if r["analyst"] == "bob"]
    assert len(alice) == 3 and len(bob) == 1
    assert {r["event"] for r in alice} == {"answered"} and all(r["epsilon"] == 1.0 for r in alice)
    assert bob[0]["event"] == "refused" and bob[0]["sqlstate"] == "42501" and bob[0]["epsilon"] == 0
    for row in rows:  # shapes without constants; equal shapes, equal fingerprints
        assert not any(c in row["shape"] for c in ("40", "57", "Obesity", "2138")), row["shape"]
    counts = [r for r in alice if "age >" in r["shape"]]
    assert len(counts) == 2 and counts[0]["shape"] == counts[1]["shape"]
    assert counts[0]["fingerprint"] == counts[1]["fingerprint"]

    # grant on the running server: bob's remaining rises by exactly 2
    before = _budget(port, "bob")
    assert before["analyst"] == "bob" and before["frozen"] is False
    out = _dpsql("budget", "grant", "--analyst", "bob", "--epsilon", "2", "--reason", "test", ledger=ledger_url)
    assert 'analyst "bob"' in out.stdout
    after = _budget(port, "bob")
    assert after["epsilon_remaining"] == before["epsilon_remaining"] + 2
    assert after["epsilon_total"] == before["epsilon_total"] + 2
    listed = {r["analyst"]: r for r in json.loads(_dpsql("budget", "--json", ledger=ledger_url).stdout)}
    assert listed["bob"]["epsilon_total"] == after["epsilon_total"]

    # freeze: every statement of bob refused before anything runs, valid or not
    _dpsql("budget", "freeze", "--analyst", "bob", "--reason", "probing", "--by", "carol", ledger=ledger_url)
    with _connect(port, "bob") as conn:
        for sql in ("SELECT COUNT(*) FROM patients", "SELECT name FROM patients", "SELECT COUNT(*) FROM nowhere"):
            with pytest.raises(psycopg.Error) as frozen:
                conn.execute(sql)
            assert frozen.value.sqlstate == "42501"
            assert frozen.value.diag.message_primary == FROZEN
        own = conn.execute("SELECT analyst, frozen, epsilon_remaining FROM dpsql_budget").fetchall()
        assert own == [("bob", True, after["epsilon_remaining"])]  # self-service still answers
    with _connect(port, "alice") as conn:  # others unaffected
        conn.execute("SELECT COUNT(*) FROM patients WHERE age > 41").fetchall()
    _dpsql("budget", "unfreeze", "--analyst", "bob", ledger=ledger_url)
    with _connect(port, "bob") as conn:
        conn.execute("SELECT COUNT(*) FROM patients WHERE age > 30").fetchall()
    assert _budget(port, "bob")["epsilon_remaining"] == after["epsilon_remaining"] - 1

    levers = [
        r for r in _audit(ledger_url, _levers, "--analyst", "bob") if r["event"] in ("grant", "freeze", "unfreeze")
    ]
    assert [(r["event"], r["epsilon"], r["reason"]) for r in reversed(levers)] == [
        ("grant", 2.0, "test"),
        ("freeze", 0.0, "probing"),
        ("unfreeze", 0.0, ""),
    ]
    assert levers[1]["by"] == "carol" and levers[0]["by"]  # the OS user by default
    bob_rows = _audit(ledger_url, _refusals(4), "--analyst", "bob")
    assert sum(1 for r in bob_rows if r["event"] == "refused" and r["sqlstate"] == "42501") == 4
    assert all(r["analyst"] == "bob" for r in bob_rows)

    # SHOW dpsql.budget: the caller's own row, never anyone else's
    mine = _budget(port, "alice")
    assert mine["analyst"] == "alice" and mine["queries"] == 4 and mine["epsilon_spent"] == 4.0
    assert mine["epsilon_remaining"] == mine["epsilon_total"] - 4.0
    if PSQL is not None:
        shown = subprocess.run(
            [PSQL, "-X", "-A", "-t", "-h", "127.0.0.1", "-p", str(port), "-U", "bob", "-d", "health"],
            input="SHOW dpsql.budget;\nSELECT epsilon_remaining FROM dpsql_budget;\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()
        assert shown[0].startswith("bob|") and "alice" not in shown[0]
        assert float(shown[1]) == after["epsilon_remaining"] - 1


def test_curator_refusals(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    cases = [
        (("grant", "--analyst", "nobody", "--epsilon", "1", "--reason", "r"), 'analyst "nobody" is not in the policy'),
        (("grant", "--analyst", "bob", "--epsilon", "-1", "--reason", "r"), "invalid grant: ε=-1, δ=0"),
        (("grant", "--analyst", "bob", "--epsilon", "nan", "--reason", "r"), "invalid grant: ε=nan, δ=0"),
        (("grant", "--analyst", "bob", "--epsilon", "0", "--reason", "r"), "a grant must add some ε or δ"),
        (("grant", "--analyst", "bob", "--epsilon", "1", "--reason", " "), "a grant needs a --reason"),
        (("grant", "--analyst", "bob", "--epsilon", "1", "--delta", "1", "--reason", "r"), "invalid grant: δ would"),
        (("freeze", "--analyst", "nobody"), 'analyst "nobody" is not in the policy'),
    ]
    for args, message in cases:
        done = _dpsql("budget", *args, ledger=ledger, check=False)
        assert done.returncode == 1, done
        assert done.stderr.startswith(f"ERROR:  {message}"), done.stderr
    assert json.loads(_dpsql("audit", "--json", ledger=ledger).stdout) == []  # nothing recorded
    bad = _dpsql("audit", "--since", "yesterday", ledger=ledger, check=False)
    assert bad.returncode == 2 and "invalid date 'yesterday'" in bad.stderr
