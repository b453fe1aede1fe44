"""pytest plugin: a real PostgreSQL server for the test session, and dpsql backends on it.

``pg_dsn`` is resolved in this order: env ``DPSQL_TEST_PG_DSN`` (a ``postgresql://`` URL; when
set it is the only candidate), a testcontainers ``PostgresContainer`` when a Docker engine
answers within 2 s, then a throwaway local cluster from
:func:`dpsql.backends.local_postgres.start_local_postgres`. When none works the PostgreSQL tests are
skipped locally, but under ``CI`` they *fail*: CI must never go green without having run them.
Tests using these fixtures get the ``postgres`` marker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import warnings
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from dpsql.backends import Backend, open_backend

log = logging.getLogger(__name__)

PG_FIXTURES = {"pg_dsn", "pg_new_database", "pg_backend"}


#: Fixtures of other conftests that start a PostgreSQL of their own (the server's shadow catalog).
SHADOW_FIXTURES = {"dp_server", "catalog_server", "shadow_server", "data_pg"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        # a backend parameter (``[postgres]``, ``[postgresql-…]``) reaches the PostgreSQL fixtures through
        # request.getfixturevalue, which collection cannot see
        on_postgres = callspec is not None and "postgres" in callspec.id
        if on_postgres or (PG_FIXTURES | SHADOW_FIXTURES).intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


def _children(pid: int) -> list[int] | None:
    """Direct children of ``pid`` from ``/proc/<pid>/task/*/children`` (None: not readable here)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    kids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as children:
                kids.extend(int(k) for k in children.read().split())
        except OSError:
            if pid == os.getpid():
                return None  # no children files on this kernel: scan /proc instead
    return kids


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return ""
    return text[text.index("(") + 1 : text.rindex(")")]


def _postmasters() -> set[int]:
    """PIDs of PostgreSQL postmasters (a ``postgres`` process whose parent is not one) started under this
    process: its descendants only, found through the children lists (~0.1 ms; scanning every process of a
    shared machine took ~20 ms, four times per test), else through a scan of /proc."""
    me = os.getpid()
    parent: dict[int, int] = {}
    todo = [me]
    while todo:
        pid = todo.pop()
        kids = _children(pid)
        if kids is None:
            if pid == me:
                return _postmasters_scan()
            continue
        for kid in kids:
            if kid not in parent:
                parent[kid] = pid
                todo.append(kid)
    names = {pid: _comm(pid) for pid in parent}
    names[me] = ""
    return {
        pid for pid, name in names.items() if name == "postgres" and names.get(parent.get(pid, 0), "") != "postgres"
    }


def _postmasters_scan() -> set[int]:
    """:func:`_postmasters` by a scan of every process (kernels without children lists)."""
    names: dict[int, tuple[str, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        names[int(entry.name)] = (comm, int(text[text.rindex(")") + 2 :].split()[1]))
    me = os.getpid()

    def ours(pid: int) -> bool:  # a descendant of this test process: other runs on the machine do not count
        for _ in range(64):
            pid = names.get(pid, ("", 0))[1]
            if pid in (me, 0):
                return pid == me
        return False

    parent = {pid: names.get(ppid, ("", 0))[0] for pid, (_, ppid) in names.items()}
    return {pid for pid, (comm, _) in names.items() if comm == "postgres" and parent[pid] != "postgres" and ours(pid)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _no_unmarked_postgres(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _no_unmarked_postgres(item)


def _no_unmarked_postgres(item: pytest.Item) -> Iterator[None]:
    """A test that starts a PostgreSQL (its own, or a server's shadow catalog) must carry the ``postgres``
    marker, so ``-m 'not postgres'`` really runs without one: checked on every run, not listed by hand."""
    if not os.path.isdir("/proc") or item.get_closest_marker("postgres"):
        yield
        return
    before = _postmasters()
    yield
    started = _postmasters() - before
    if started:
        pytest.fail(f"{item.nodeid} started PostgreSQL (pid {sorted(started)}) without the postgres marker")


def _check(dsn: str) -> str:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        conn.execute("SELECT 1")
    return dsn


def _docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)  # type: ignore[attr-defined]  # mypy reads the repo's docker/ folder
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@contextlib.contextmanager
def _container() -> Iterator[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from testcontainers.postgres import PostgresContainer
        except ImportError:  # pragma: no cover - newer testcontainers layout
            from testcontainers.community.postgres import PostgresContainer
    container = PostgresContainer("postgres:16-alpine", driver=None)
    container.start()
    try:
        yield container.get_connection_url()
    finally:
        container.stop()


@contextlib.contextmanager
def _local() -> Iterator[str]:
    from dpsql.backends.local_postgres import start_local_postgres

    with start_local_postgres() as pg:
        yield pg.dsn


def _sources() -> Iterator[tuple[str, Callable[[], contextlib.AbstractContextManager[str]]]]:
    env = os.environ.get("DPSQL_TEST_PG_DSN")
    if env:  # explicit choice: no silent fallback to another server
        yield "DPSQL_TEST_PG_DSN", lambda: contextlib.nullcontext(env)
        return
    if _docker_answers():
        yield "testcontainers", _container
    yield "local PostgreSQL", _local


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """Superuser URL of a PostgreSQL server that lives for the whole session."""
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        dsn = None
        for name, source in _sources():
            try:
                dsn = _check(stack.enter_context(source()))
            except Exception as exc:
                failures.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:2000]}")
                stack.close()
                continue
            log.info("PostgreSQL for tests from %s", name)
            break
        if dsn is None:
            reason = "no PostgreSQL server for the tests:\n  " + "\n  ".join(failures)
            if os.environ.get("CI"):
                pytest.fail(reason + "\n(CI is set: PostgreSQL tests must run, not be skipped)", pytrace=False)
            pytest.skip(reason)
        yield dsn


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("DPSQL_TEST_PG_DSN must be a postgresql:// URL")
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
def pg_new_database(pg_dsn: str) -> Iterator[Callable[[], str]]:
    """Factory: ``pg_new_database()`` creates an empty database and returns its URL (dropped at the end)."""
    created: list[str] = []

    def make() -> str:
        name = "dpsql_test_" + secrets.token_hex(4)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _with_database(pg_dsn, name)

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_backend(pg_new_database: Callable[[], str]) -> Iterator[Backend]:
    """A dpsql PostgreSQL backend on a fresh database shared by the session (use distinct table names)."""
    backend = open_backend(pg_new_database())
    yield backend
    backend.close()


@pytest.fixture
def duckdb_backend() -> Iterator[Backend]:
    """A fresh in-memory DuckDB backend per test."""
    backend = open_backend("duckdb://")
    yield backend
    backend.close()


def open_demo_backend(request: pytest.FixtureRequest, *datasets: str) -> Backend:
    """The demo's ``datasets`` loaded into a fresh in-memory DuckDB or a fresh PostgreSQL database, as
    the requesting fixture's param says (``"duckdb"`` or ``"postgres"``); the caller closes it. For
    module-scoped fixtures parametrized over both backends."""
    from dpsql.dev.demo import load_demo

    if request.param == "duckdb":
        backend = open_backend("duckdb://")
    else:
        backend = open_backend(request.getfixturevalue("pg_new_database")())
    load_demo(backend, list(datasets))
    return backend
