"""The seeds' attacks replayed against dpsql."""

from __future__ import annotations

import math

from dpsql.dev.attack import differencing_attack


def test_differencing_attack_on_igor_is_capped_by_epsilon() -> None:
    """1,000 attacks at ε=1 per query, fresh ledger each: success ≤ e^ε/(1+e^ε) + 0.03."""
    report = differencing_attack(runs=1000, epsilon=1.0)
    assert report["raw_difference"] == 1  # without dpsql the attack always works
    assert report["success_rate"] <= math.e / (1 + math.e) + 0.03
    assert report["success_rate"] >= 0.5 - 0.05  # and the attack is run for real
