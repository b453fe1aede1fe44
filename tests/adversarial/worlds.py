"""What the neighbouring-database suites share: a policy whose budget never runs out (the attack, not
the budget, decides every outcome), and one database per (backend kind, neighbour) built from a script."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from dpsql.backends import Backend, open_backend

KINDS = ("duckdb", "postgres")


def roomy_policy(dataset: str, tables: str) -> str:
    """A policy text for ``dataset`` (ε 1 per query, a budget of 1e9, analyst alice) over ``tables``
    (the YAML of its ``tables:`` block, indented by two)."""
    return (
        f"dataset: {dataset}\n"
        "defaults: {epsilon: 1.0, delta: 1.0e-6}\n"
        "budget:\n"
        "  dataset: {epsilon: 1.0e9, delta: 0.5}\n"
        "  analyst: {epsilon: 1.0e9, delta: 0.5}\n"
        "analysts: [{name: alice}]\n"
        f"tables:\n{tables.strip(chr(10))}\n"
    )


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
