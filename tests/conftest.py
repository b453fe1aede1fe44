"""Shared pytest configuration; PostgreSQL fixtures live in tests/pg.py."""

import fcntl
import os
import tempfile
from collections.abc import Iterator
from typing import IO

import pytest

from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.session import Session
from tests.demos import demo_fixture

pytest_plugins = ["tests.pg"]

# Default ledgers (dpsql.connect / Engine.open / the CLI without a ledger) live under $DPSQL_HOME:
# point it at a throwaway directory so no test ever charges the real ~/.local/share/dpsql.
os.environ["DPSQL_HOME"] = tempfile.mkdtemp(prefix="dpsql-test-home-")

#: The fast tier (``pytest -m unit``, well under 30 s): pure analysis, rewrite golden files, release
#: arithmetic, errors and settings — no database server, no subprocess, no statistical sampling.
UNIT_PATHS = (
    "tests/rewrite/test_fixtures.py",
    "tests/test_errors.py",
    "tests/test_session.py",
    "tests/analyze/test_refusals.py",
    "tests/aggregates/test_expressions.py",
    "tests/rewrite/test_passes.py",
    "tests/noise/test_mechanisms.py",
    "tests/release/test_accuracy.py",
)


#: The files that take longest (a full run's --durations, summed per file), scheduled first: pytest-xdist's
#: ``--dist loadfile`` hands out files in collection order, so a long file collected last (tests/trust/ sorts
#: near the end) kept one core busy while the other idled (#37 item 5: longest first balances the two).
LONG_FILES = (
    "tests/backends/test_spark.py",
    "tests/adversarial/test_quantile_cut_neighbours.py",
    "tests/adversarial/test_quantile_neighbours.py",
    "tests/noise/test_quantile_interval.py",
    "tests/adversarial/test_sensitivity_fuzzer.py",
    "tests/adversarial/test_error_oracles.py",
    "tests/noise/test_extreme_aims.py",
    "tests/noise/test_quantile_cut.py",
    "tests/policy/test_serve.py",
    "tests/aggregates/test_quantiles.py",
    "tests/trust/test_scale_out.py",
    "tests/trust/test_empirical_dp.py",
    "tests/cli/test_cli.py",
    "tests/curator/test_curator.py",
    "tests/release/test_quantile.py",
    "tests/synopsis/test_build_once.py",
    "tests/synopsis/test_synopsis.py",
    "tests/noise/test_samplers.py",
    "tests/adversarial/test_multihop_neighbours.py",
    "tests/trust/test_crash.py",
    "tests/trust/test_wire_dp.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow = item.get_closest_marker("postgres") or item.get_closest_marker("heavy") or "heavy" in item.name
        if path.startswith(UNIT_PATHS) and not slow:
            item.add_marker(pytest.mark.unit)
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONG_FILES)))  # stable: others keep order


def _exclusive(item: pytest.Item) -> bool:
    """A test that times things against what else runs (another analyst's latency, login slow-downs, timing
    side channels, a timeout racing the work, throughput) carries ``@pytest.mark.exclusive``: under
    pytest-xdist it runs with no other test of the run beside it, so a second worker's load is not noise in
    its measurement. Only such tests: the other worker idles meanwhile (it was whole files, ~15 % of the run's
    wall time; tests with a loose bound, or whose bound load can only help, run beside others)."""
    return item.get_closest_marker("exclusive") is not None


#: The exclusive turn this worker still holds (turnstile and lock files), kept while exclusive tests follow
#: one another: released between them, each would wait again for the other worker's current (maybe long) test.
_HELD: list[tuple[IO[str], IO[str]]] = []


def _take(exclusive: bool) -> tuple[IO[str], IO[str]] | None:
    """Under pytest-xdist, a readers-writer lock shared by the run's workers (files under the temporary
    directory named by the run's id): ordinary tests hold it shared, exclusive ones alone. A turnstile
    keeps an exclusive test from waiting behind a stream of ordinary ones."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    if _HELD:
        return _HELD.pop()  # the previous test was exclusive and kept the turn for this one
    base = os.path.join(tempfile.gettempdir(), f"dpsql-pytest-{run}")
    turnstile, lock = open(base + ".turnstile", "a"), open(base + ".lock", "a")  # noqa: SIM115 - held across tests
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    return turnstile, lock


def _give(files: tuple[IO[str], IO[str]]) -> None:
    for f in reversed(files):  # the lock, then the turnstile (closing a file drops its flock)
        f.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    exclusive = _exclusive(item)
    files = _take(exclusive)
    try:
        yield
    finally:
        if files is not None:
            if exclusive and nextitem is not None and _exclusive(nextitem):
                _HELD.append(files)
            else:
                _give(files)


# The health demo engine most engine-level tests use (tests/engine, tests/aggregates, tests/analyze,
# tests/cache, tests/cli, tests/release, tests/rewrite, tests/synopsis); a directory may override them.


@pytest.fixture(scope="session")
def health_policy() -> Policy:
    return load_policy(demo_policy_path("health"))


health_duckdb = demo_fixture("health")
health_pg = demo_fixture("health", kind="postgres")


@pytest.fixture
def engine(health_policy: Policy, health_duckdb: Backend) -> Engine:
    """The health engine over DuckDB with a fresh in-memory ledger."""
    return Engine(health_policy, health_duckdb, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def alice() -> Session:
    return Session(analyst="alice")
