"""A stored release names its noise mechanism and measure kinds; the registered classes answer for them
(issue #39 item 2). Releases written before kept a ``laplace`` flag: they still load, as the mechanism
the flag meant; a name or kind this dpsql does not register is a loud error, never a default."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dpsql.errors import InternalError
from dpsql.ledger import Ledger
from dpsql.synopsis.answer import half_width_factor
from dpsql.synopsis.solve import Marginal
from dpsql.synopsis.store import Released, SynopsisKey, SynopsisMeasure, _mac, prefix, seal, unseal


def _released(mechanism: str = "gaussian") -> Released:
    return Released(
        name="visits",
        dataset="health",
        table="patients",
        declaration="d",
        identity="i",
        built_at=time.time(),
        epsilon=1.0,
        delta=1e-6,
        keys=(SynopsisKey("problem", "plain", "problem", None, "text", ("a", "b")),),
        measures=(SynopsisMeasure("count_star", None), SynopsisMeasure("sum", "age", 40.0)),
        marginals=(((Marginal((0,), [3.0, 4.0], 2.0)),), ((Marginal((0,), [90.0, 80.0], 5.0)),)),
        mechanism=mechanism,
    )


def _sealed(doc: dict[str, Any], key: bytes) -> str:
    """``doc`` sealed as :func:`dpsql.synopsis.store.seal` does, whatever its format."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return json.dumps({"mac": _mac(key, body.encode()), "body": body})


def _old_format(released: Released, laplace: bool | None) -> dict[str, Any]:
    """The document the store wrote before the mechanism was stored by name."""
    doc = released.document()
    del doc["mechanism"]
    if laplace is not None:
        doc["laplace"] = laplace
    return doc


def test_the_mechanism_is_stored_by_name_and_read_back() -> None:
    released = _released("gaussian")
    assert released.document()["mechanism"] == "gaussian"
    assert "laplace" not in released.document()
    back = unseal(seal(released, b"k" * 32), b"k" * 32)
    assert back is not None and back.mechanism == "gaussian" and back.mechanisms == {"gaussian"}


@pytest.mark.parametrize(("flag", "mechanism"), [(True, "laplace"), (False, "gaussian"), (None, "laplace")])
def test_a_release_of_the_earlier_format_still_loads(tmp_path: Path, flag: bool | None, mechanism: str) -> None:
    """Written to a real ledger in the old format (a ``laplace`` flag, or none before the flag), read back."""
    with Ledger.open(f"sqlite://{tmp_path / 'ledger.sqlite'}") as ledger:
        key = prefix("health", "visits") + "00000000000000000001"
        assert ledger.add_synopsis(key, _sealed(_old_format(_released(), flag), ledger.signing_key()))
        text = ledger.synopsis_document(key)
        assert text is not None
        back = unseal(text, ledger.signing_key())
    assert back is not None
    assert back.mechanism == mechanism
    assert [m.aggregate.counts_rows for m in back.measures] == [True, False]
    assert [m.aggregate.clamped_sum for m in back.measures] == [False, True]


def test_an_unknown_mechanism_is_a_loud_error() -> None:
    doc = _released().document()
    doc["mechanism"] = "staircase"
    with pytest.raises(InternalError, match="unknown mechanism 'staircase'"):
        unseal(_sealed(doc, b"k" * 32), b"k" * 32)
    with pytest.raises(ValueError, match="unknown mechanism 'staircase'"):
        half_width_factor(0.95, ["staircase"])


def test_an_unknown_measure_kind_is_a_loud_error() -> None:
    doc = _released().document()
    doc["measures"][1]["kind"] = "geometric_mean"
    with pytest.raises(InternalError, match="'geometric_mean', which this dpsql does not register"):
        unseal(_sealed(doc, b"k" * 32), b"k" * 32)


def test_intervals_ask_the_widest_mechanism() -> None:
    """Laplace's quantile per σ is above the normal one at 95%; a mix uses the wider, never the narrower."""
    laplace, gaussian = half_width_factor(0.95, ["laplace"]), half_width_factor(0.95, ["gaussian"])
    assert gaussian == pytest.approx(1.959964, abs=1e-6)
    assert laplace == pytest.approx(2.118303, abs=1e-6)  # ln(20)/√2
    assert half_width_factor(0.95, ["gaussian", "laplace"]) == laplace
