"""Figures people read (#40 item 4): ε and δ to at most 4 significant digits wherever a person reads them
(a spent figure rounded up, what is left down, float noise never shown), full precision in ``--json``;
a synopsis's or DP bounds' charge listed as the dataset's, never as an analyst with an analyst's total."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpsql.accountant import Cost, fmt, shown
from dpsql.cli import main
from dpsql.dev.demo import demo_policy_path
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.step import Notice


def test_figures_have_at_most_four_significant_digits() -> None:
    assert fmt(3.6999999999999993) == "3.7" and fmt(7.161435262511551) == "7.161" and fmt(1 / 3) == "0.3333"
    assert fmt(0.99996, down=True) == "0.9999" and fmt(0.99996) == "1" and fmt(7.161435262511551, up=True) == "7.162"
    assert fmt(123456.7) == "123500" and fmt(1e-6) == "1e-06" and fmt(0.0) == "0"
    assert shown(0.1 + 0.2, down=True) == 0.3  # float noise is not "0.2999"
    notice = Notice.charged(Cost(epsilon=1 / 3, delta=1e-6), 3.6999999999999993, "alice")
    assert str(notice) == 'dpsql: charged ε=0.3333, δ=1e-06; remaining ε=3.7 for analyst "alice"'


def _charge(ledger: Ledger, who: str, epsilon: float) -> None:
    policy = load_policy(demo_policy_path("clinic"))
    ledger.reserve(
        dataset="clinic",
        analyst=who,
        cost=Cost(epsilon=epsilon),
        dataset_budget=policy.budget.dataset,
        analyst_budget=policy.analyst_budget(who),
        fingerprint="f",
        accounting="pure",
    )


def test_budget_lists_synopses_and_curators_as_the_datasets_charges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger.open(url) as ledger:
        for _ in range(3):
            _charge(ledger, "alice", 0.1)
        _charge(ledger, "synopsis:visits_dashboard", 1.0)
        _charge(ledger, "curator:root", 0.5)
    args = ["budget", "--policy", str(demo_policy_path("clinic")), "--ledger", url]
    assert main(args) == 0
    text = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in text.splitlines()[3:-1]}
    assert rows["alice"] == ["0.3", "20", "19.7", "3"]  # not 0.30000000000000004 / 19.699999999999999
    assert rows["(dataset)"] == ["1.8", "100", "98.2", "5"]
    assert rows["(dataset) synopsis:visits_dashboard"] == ["1", "", "", "1"]  # no analyst's total of its own
    assert rows["(dataset) curator:root"] == ["0.5", "", "", "1"]
    assert "synopsis:visits_dashboard" not in rows and "curator:root" not in rows
    assert main([*args, "--json"]) == 0
    listed = {r["analyst"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["alice"]["epsilon_spent"] == pytest.approx(0.3) and listed["alice"]["epsilon_spent"] != 0.3  # full
    assert listed["(dataset) curator:root"]["epsilon_total"] is None
