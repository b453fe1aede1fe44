"""``dpsql budget`` never falls back to the demo's dataset (#28 item 6): without ``--policy`` every form of
it (the listing, ``--json``, ``--analyst`` and each lever) prints nothing but the error ``dpsql audit`` gives,
and exits 1 before opening a ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpsql.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEALTH = str(ROOT / "schemas" / "health.yaml")
WHY = "needs --policy: curator commands act on the dataset a policy names"
HINT = "HINT:  For the demo, give --policy schemas/health.yaml."

FORMS = [
    ("budget", []),
    ("budget", ["--json"]),
    ("budget", ["--analyst", "alice"]),
    ("budget grant", ["grant", "--analyst", "bob", "--epsilon", "1", "--reason", "r"]),
    ("budget revoke", ["revoke", "--analyst", "bob", "--epsilon", "1", "--reason", "r"]),
    ("budget freeze", ["freeze", "--analyst", "bob"]),
    ("budget unfreeze", ["unfreeze", "--analyst", "bob"]),
]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DPSQL_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("command", "argv"), FORMS, ids=[" ".join(f[1][:1]) or "list" for f in FORMS])
def test_budget_without_policy_is_refused(
    command: str, argv: list[str], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["budget", *argv])
    assert stopped.value.code == 1
    out, err = capsys.readouterr()
    assert out == ""  # never the demo's "health" totals
    assert err.splitlines() == [f"ERROR:  dpsql {command} {WHY}", HINT]
    assert list(home.iterdir()) == []  # no ledger opened (nor created) for the demo's dataset


def test_same_wording_as_audit(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    errors = []
    for argv in (["audit"], ["budget"]):
        with pytest.raises(SystemExit):
            main(argv)
        errors.append(capsys.readouterr().err)
    assert errors[1] == errors[0].replace("dpsql audit ", "dpsql budget ")


def test_budget_with_policy_names_its_dataset(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = f"sqlite:///{home / 'ledger.sqlite'}"
    assert main(["budget", "--policy", HEALTH, "--ledger", ledger]) == 0
    assert capsys.readouterr().out.startswith('privacy budget of dataset "health"\n')
    assert main(["budget", "--json", "--policy", HEALTH, "--ledger", ledger, "--analyst", "alice"]) == 0
    (alice, dataset) = json.loads(capsys.readouterr().out)
    assert alice["analyst"] == "alice" and dataset["analyst"] == "(dataset)"
    # --policy before the lever is kept (the lever's own option is SUPPRESSed)
    assert main(["budget", "--policy", HEALTH, "--ledger", ledger, "freeze", "--analyst", "bob"]) == 0
    assert 'freeze: analyst "bob" of dataset "health"' in capsys.readouterr().out
