"""What the neighbouring-database suites share: a policy whose budget never runs out (the attack, not
the budget, decides every outcome), and one database per (backend kind, neighbour) built from a script."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from dpsql.backends import Backend, open_backend
from dpsql.cache import ResultCache
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from tests.policies import DEFAULTS, block_budget, policy_yaml

Case = TypeVar("Case")
#: (case, backend kind, neighbour) → what the case gave there.
Outcomes = dict[tuple[str, str, str], tuple[Any, ...]]

KINDS = ("duckdb", "postgres")


def roomy_policy(dataset: str, tables: str) -> str:
    """A policy text for ``dataset`` (ε 1 per query, a budget of 1e9, analyst alice) over ``tables``
    (the YAML of its ``tables:`` block, indented by two)."""
    roomy = "{epsilon: 1.0e9, delta: 0.5}"
    return policy_yaml(dataset, tables.strip("\n") + "\n", defaults=DEFAULTS, budget=block_budget(roomy, roomy))


@contextmanager
def neighbour_worlds(
    pg_new_database: Callable[[], str], names: Iterable[str], script: Callable[[str], str]
) -> Iterator[dict[tuple[str, str], Backend]]:
    """One backend per (kind, neighbour name) of :data:`KINDS` × ``names``, each loaded by ``script(name)``;
    all closed on exit."""
    backends: dict[tuple[str, str], Backend] = {}
    try:
        for name in names:
            for kind in KINDS:
                backend = open_backend("duckdb://" if kind == "duckdb" else pg_new_database())
                backends[(kind, name)] = backend
                backend.execute_script(script(name))
        yield backends
    finally:
        for backend in backends.values():
            backend.close()


@contextmanager
def kind_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    """An empty DuckDB and an empty PostgreSQL database by kind name (one each, loaded in turn by the
    caller); closed on exit."""
    backends = {"duckdb": open_backend("duckdb://"), "postgres": open_backend(pg_new_database())}
    try:
        yield backends
    finally:
        for backend in backends.values():
            backend.close()


def outcomes_on(
    backends: Mapping[str, Backend],
    scripts: Mapping[str, str],
    cases: Iterable[tuple[str, Case]],
    outcome: Callable[[Engine, Case], tuple[Any, ...]],
    policy: Policy,
    *,
    cache: bool = False,
    after: str | None = None,
) -> Outcomes:
    """Every case's ``outcome`` on every backend loaded with every neighbour's script (then ``after``),
    each case with a fresh engine and an empty ledger (and a result cache when ``cache``)."""
    found: Outcomes = {}
    for variant, script in scripts.items():
        for name, backend in backends.items():
            backend.execute_script(script)
            if after is not None:
                backend.execute_script(after)
            for case, item in cases:
                engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache() if cache else None)
                found[case, name, variant] = outcome(engine, item)
    return found
