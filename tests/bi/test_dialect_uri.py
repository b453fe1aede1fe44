"""The ``dpsql://`` SQLAlchemy dialect (contrib/superset) without Superset: URI parameters become dpsql
session settings at connection start (issue #38 item 4: ``?accuracy=10`` was HTTP 400 in Superset), each a
checked number or switch that cannot smuggle other options into the startup packet; and the settings they
send are the ones the server accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy.engine.url import make_url

from dpsql.session import parse_setting

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "contrib" / "superset"))

from dpsql_superset.dialect import DpsqlDialect

pytestmark = pytest.mark.unit


def options(uri: str) -> str | None:
    options: str | None = DpsqlDialect().create_connect_args(make_url(uri))[1].get("options")
    return options


def test_settings_in_the_uri_become_startup_options() -> None:
    sent = options("dpsql://alice@h:6543/clinic?accuracy=10&max_widening=2&max_share=0.5&confirm_epsilon=3")
    assert sent == (
        "-c dpsql.accuracy=10.0 -c dpsql.max_widening=2.0 -c dpsql.max_share=0.5 -c dpsql.confirm_epsilon=3.0"
    )
    for option in sent.split(" -c "):
        name, _, value = option.removeprefix("-c ").partition("=")
        parse_setting(name, value)  # what `dpsql serve` does with them: accepted
    assert options("dpsql://alice@h:6543/clinic?epsilon=0.5&show_intervals=on") == (
        "-c dpsql.epsilon=0.5 -c dpsql.show_intervals=on"
    )


@pytest.mark.parametrize("query", ["accuracy=abc", "accuracy=-1", "max_widening=inf", "accuracy=1%20-c%20x%3D1"])
def test_bad_values_are_refused_before_connecting(query: str) -> None:
    with pytest.raises(ValueError, match="dpsql URI parameter"):
        options(f"dpsql://alice@h:6543/clinic?{query}")
