"""The seeds' differencing attack on Igor, replayed against raw SQL and against dpsql.

Two neighbouring hospitals differ only in Igor's problem (Obesity or Hypertension).
The attacker asks the obesity count and the obesity count of everyone-but-Igor, and
guesses "obese" when the difference exceeds ½. With raw SQL the guess is always right;
through dpsql (ε per query) no attacker can beat e^ε/(1+e^ε) on a fair coin prior.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from dpsql.backends import open_backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session

Q_ALL = "SELECT COUNT(*) FROM patients WHERE problem = 'Obesity'"
Q_ALL_BUT_IGOR = (
    "SELECT COUNT(*) FROM patients WHERE problem = 'Obesity' AND "
    "(ethnicity <> 'White' OR marital_status <> 'Single' OR sex <> 'Male' OR zip <> 2138)"
)
IGOR = "name = 'Igor'"


def _world(igor_obese: bool) -> Any:
    backend = open_backend("duckdb://")
    load_demo(backend, ["health"])
    if not igor_obese:
        backend.execute_script(f"UPDATE patients SET problem = 'Hypertension' WHERE {IGOR}")
    return backend


def differencing_attack(runs: int = 1000, epsilon: float = 1.0) -> dict[str, Any]:
    """Run the attack ``runs`` times, each against a fresh ledger and a random world."""
    policy = load_policy(demo_policy_path("health"))
    worlds = {True: _world(True), False: _world(False)}
    _, raw_all = worlds[True].execute(Q_ALL)
    _, raw_rest = worlds[True].execute(Q_ALL_BUT_IGOR)
    session = Session(analyst="analyst", epsilon=epsilon)
    engines = {obese: Engine(policy, backend, Ledger.open("sqlite:///:memory:")) for obese, backend in worlds.items()}
    correct = 0
    samples: list[float] = []
    for _ in range(runs):
        obese = secrets.randbelow(2) == 1
        engine = engines[obese]
        engine.ledger = Ledger.open("sqlite:///:memory:")  # a fresh budget for every attack
        first = engine.execute(Q_ALL, session).rows[0][0]
        second = engine.execute(Q_ALL_BUT_IGOR, session).rows[0][0]
        difference = first - second
        correct += (difference > 0.5) == obese
        if len(samples) < 10:
            samples.append(difference)
    for engine in engines.values():
        engine.close()
    return {
        "runs": runs,
        "epsilon": epsilon,
        "raw_difference": raw_all[0][0] - raw_rest[0][0],
        "success_rate": correct / runs,
        "bound": math.exp(epsilon) / (1 + math.exp(epsilon)),
        "sample_differences": samples,
    }
