"""A synopsis release is charged exactly once (issue #41 item 5), on SQLite and PostgreSQL ledgers.

Two ``dpsql synopsis build`` (or ``refresh``) processes started together: one charge to the dataset, one
stored release. A build killed between its charge and its store (its claim and charge are in the ledger,
no release): the next build repairs it with no new charge, the release naming the charge it was paid by.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dpsql.accountant import Cost
from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.curator.synopsis_cli import Built, _fingerprint, claim_key, ledger_identity, release
from dpsql.dev.demo import demo_identity, demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.ledger.base import Claimed
from dpsql.policy import load_policy, parse_policy
from dpsql.synopsis.store import declaration_hash, prefix
from tests.kinds import new_database_url

CLINIC = demo_policy_path("clinic")
NAME = "visits_dashboard"


def _start(command: str, ledger: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "dpsql.cli", "synopsis", command, NAME, "--policy", str(CLINIC), "--ledger", ledger]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _together(command: str, ledger: str) -> list[str]:
    processes = [_start(command, ledger) for _ in range(2)]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        outputs.append(out)
    return outputs


def _charges(ledger_url: str) -> list[str]:
    with Ledger.open(ledger_url) as ledger:
        return [c.fingerprint for c in ledger.charges("clinic", ledger_identity(NAME))]


def _releases(ledger_url: str) -> list[str]:
    with Ledger.open(ledger_url) as ledger:
        return ledger.synopsis_keys(prefix("clinic", NAME))


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return new_database_url(request.param, request, tmp_path, "ledger.db")


def test_concurrent_builds_and_refreshes_charge_once(ledger_url: str) -> None:
    built = _together("build", ledger_url)
    assert _charges(ledger_url) == [f"synopsis {NAME} g1"]
    assert _releases(ledger_url) == [prefix("clinic", NAME) + "g00000001"]
    assert sum("charged ε=1 once" in out for out in built) == 1  # the other: released by the first, or repaired
    assert all("release 1 " in out or "already released" in out for out in built), built
    # two refreshes of release 1 at once (each its own engine and ledger connection): one new release
    engines = [Engine(load_policy(CLINIC), _demo(), Ledger.open(ledger_url), ResultCache()) for _ in range(2)]
    barrier = threading.Barrier(2)
    done: list[Built] = []

    def refresh(engine: Engine) -> None:
        barrier.wait()
        done.append(release(engine, NAME, after=1))

    threads = [threading.Thread(target=refresh, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(_charges(ledger_url)) == [f"synopsis {NAME} g1", f"synopsis {NAME} g2"]
    assert len(_releases(ledger_url)) == 2 and sum(b.charged for b in done) == 1
    assert done[0].released == done[1].released and done[0].released.generation == 2
    for engine in engines:
        engine.close()


def test_a_build_killed_after_its_charge_is_repaired_without_a_new_charge(ledger_url: str) -> None:
    policy = load_policy(CLINIC)
    engine = Engine(policy, _demo(), Ledger.open(ledger_url), ResultCache())
    # what a build killed between reserve and store leaves: its claim and its charge, no release
    claim = {
        "name": NAME,
        "generation": 1,
        "declaration": declaration_hash(policy, NAME),
        "identity": engine.backend.identity(),
        "epsilon": 1.0,
    }
    engine.ledger.reserve(
        dataset="clinic",
        analyst=ledger_identity(NAME),
        cost=_cost(),
        dataset_budget=policy.budget.dataset,
        analyst_budget=policy.budget.dataset,
        fingerprint=_fingerprint(NAME, 1),
        claim=(claim_key("clinic", NAME, 1), json.dumps(claim)),
    )
    repaired = release(engine, NAME)  # `dpsql synopsis build`
    assert not repaired.charged and repaired.released.generation == 1
    assert repaired.released.charge == f"synopsis {NAME} g1"  # the charge it was paid by
    assert _charges(ledger_url) == [f"synopsis {NAME} g1"] and len(_releases(ledger_url)) == 1
    # the next build finds it released; a refresh is a new generation, charged once
    assert release(engine, NAME).released == repaired.released and not release(engine, NAME).charged
    again = release(engine, NAME, after=1)  # `dpsql synopsis refresh`
    assert again.released.generation == 2 and again.charged
    assert len(_charges(ledger_url)) == 2
    engine.close()


def test_an_orphan_of_another_declaration_is_not_repaired(ledger_url: str) -> None:
    """A claim paid for an earlier declaration (another ε, other keys) pays for nothing now."""
    engine = Engine(load_policy(CLINIC), _demo(), Ledger.open(ledger_url), ResultCache())
    claim = {"name": NAME, "generation": 1, "declaration": "an older one", "identity": "", "epsilon": 0.5}
    engine.ledger.reserve(
        dataset="clinic",
        analyst=ledger_identity(NAME),
        cost=_cost(0.5),
        dataset_budget=engine.policy.budget.dataset,
        analyst_budget=engine.policy.budget.dataset,
        fingerprint=_fingerprint(NAME, 1),
        claim=(claim_key("clinic", NAME, 1), json.dumps(claim)),
    )
    built = release(engine, NAME)
    assert built.charged and built.released.generation == 2 and len(_charges(ledger_url)) == 2
    engine.close()


def test_claims_are_refused_twice_in_the_charge_transaction(tmp_path: Path) -> None:
    """The ledger half: a second reservation with the same claim charges nothing (Claimed)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    policy = parse_policy(CLINIC.read_text(), str(CLINIC))
    with Ledger.open(url) as ledger:
        kwargs: dict[str, Any] = {
            "dataset": "clinic",
            "analyst": "synopsis:x",
            "cost": _cost(),
            "dataset_budget": policy.budget.dataset,
            "analyst_budget": policy.budget.dataset,
            "fingerprint": "synopsis x g1",
            "claim": ("synopsis-claim:clinic:x:g00000001", "{}"),
        }
        ledger.reserve(**kwargs)
        with pytest.raises(Claimed):
            ledger.reserve(**kwargs)
        assert ledger.spent("clinic", "synopsis:x").epsilon == 1.0


def _demo() -> Backend:
    """The clinic demo under its pinned identity (what every `dpsql` process of the demo reads)."""
    backend = open_backend("duckdb://")
    load_demo(backend, ["clinic"])
    backend.pin_identity(demo_identity(["clinic"]))
    return backend


def _cost(epsilon: float = 1.0) -> Cost:
    return Cost(epsilon=epsilon)
