"""Hints that list what dpsql supports are generated from the registries (issue #39 item 2): a newly
registered aggregate or mechanism is named in them without editing a hint."""

from __future__ import annotations

import pytest

from dpsql.aggregates import OUTPUTS, supported_functions
from dpsql.analyze import analyze
from dpsql.dev.demo import demo_policy_path
from dpsql.errors import Error
from dpsql.noise.mechanisms import MECHANISMS
from dpsql.policy import load_policy
from dpsql.session import parse_setting

pytestmark = pytest.mark.unit

POLICY = load_policy(demo_policy_path("health"))


def _hint(sql: str) -> str:
    with pytest.raises(Error) as caught:
        analyze(sql, POLICY)
    return caught.value.hint or ""


def test_every_registered_aggregate_function_is_named() -> None:
    assert all(aggregate.recognises for aggregate in OUTPUTS.values() if aggregate.kind not in ("key", "expr"))
    for name in ("COUNT", "SUM", "AVG", "VAR_POP", "STDDEV_SAMP", "CORR", "PERCENTILE_CONT", "MIN", "MODE"):
        assert name in supported_functions()


@pytest.mark.parametrize(
    ("sql", "prefix"),
    [
        ("SELECT string_agg(problem, ',') FROM patients", "Supported aggregates: "),
        ("SELECT foo(COUNT(*)) FROM patients", "Allowed here: the aggregates "),
    ],
)
def test_unsupported_aggregate_hints_list_the_registry(sql: str, prefix: str) -> None:
    hint = _hint(sql)
    assert hint.startswith(prefix + ", ".join(supported_functions())), hint


def test_the_mechanism_hint_names_every_registered_mechanism() -> None:
    with pytest.raises(Error) as caught:
        parse_setting("dpsql.mechanism", "staircase")
    hint = caught.value.hint or ""
    assert caught.value.sqlstate == "22023" and all(f"'{name}'" in hint for name in MECHANISMS), hint
    assert hint == "dpsql.mechanism is 'laplace' or 'gaussian'."  # as before it was generated
