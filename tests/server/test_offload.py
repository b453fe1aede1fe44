"""Long statements are split and routed in a helper process (issue #27 item 1: one analyst's parsing
held the GIL and slowed every other analyst 15x); the helper's answers are the in-process ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpsql.dev.demo import demo_policy_path
from dpsql.errors import InsufficientPrivilege, InternalError, StatementTooComplex
from dpsql.fingerprint import statement_shape
from dpsql.policy import load_policy
from dpsql.server.catalog import route_of
from dpsql.server.offload import Offload
from dpsql.server.shadow_guard import check_catalog_sql, replay, vet
from dpsql.sqltext import split_statements

POLICY = load_policy(demo_policy_path("health"))
PAD = "/*" + "x" * 5000 + "*/ "
IN_LIST = ",".join(f"'r{i:05d}'" for i in range(2000))
LONG = [
    PAD + "SELECT count(*) FROM pg_catalog.pg_class",  # catalog
    f"SELECT count(*) FROM pg_class WHERE relname IN ({IN_LIST})",  # catalog, no schema
    PAD + "SELECT COUNT(*) FROM patients",  # engine
    PAD + "SELECT COUNT(*) FROM Patients p JOIN pg_class c ON true",  # mixed
    PAD + "SELECT 1",  # tableless
    PAD + "SELECT * FROM somewhere_else",  # engine (refused there)
    PAD + "SELECT OPERATOR(pg_catalog.~) FROM pg_class",  # sqlglot cannot parse: token fallback
    PAD + "INSERT INTO patients VALUES (1)",  # writes: engine
]


@pytest.fixture(scope="module")
def offload() -> Iterator[Offload]:
    helper = Offload()
    assert helper.start(timeout=120)  # before it is ready, calls are answered in the calling thread
    yield helper
    helper.close()


def test_routes_match_in_process(offload: Offload) -> None:
    tables = frozenset(POLICY.tables)
    for sql in LONG:
        routed = offload.route_of("alice", sql, tables)
        assert routed.route == route_of(sql, POLICY), sql[-60:]
        assert routed.shape == statement_shape(sql)  # the fingerprint the server logs, not recomputed
        assert routed.verdict == (vet(sql) if routed.route in ("catalog", "tableless") else None)
    assert offload.route_of("alice", PAD + " -- only comments\n ;", tables).route == "empty"


def test_a_refused_function_is_vetted_in_the_helper_and_replayed(offload: Offload) -> None:
    """The shadow guard's lexical scan of a long statement runs in the helper (it held the server's
    GIL ~0.3 s per 250 kB); its verdict replays as the same 42501, message and hint."""
    sql = PAD + "SELECT pg_read_file('/etc/passwd') FROM pg_class"
    routed = offload.route_of("alice", sql, frozenset(POLICY.tables))
    assert routed.route == "catalog" and routed.verdict is not None
    with pytest.raises(InsufficientPrivilege) as replayed:
        replay(routed.verdict)
    with pytest.raises(InsufficientPrivilege) as direct:
        check_catalog_sql(sql)
    assert (replayed.value.message, replayed.value.detail, replayed.value.hint) == (
        direct.value.message,
        direct.value.detail,
        direct.value.hint,
    )
    assert replay(offload.route_of("alice", LONG[0], frozenset(POLICY.tables)).verdict or ("ok", True)) is False


def test_split_matches_in_process(offload: Offload) -> None:
    sql = ";".join(LONG) + "; ;" + PAD
    assert offload.split("alice", sql) == split_statements(sql)


def test_too_complex_keeps_its_sqlstate(offload: Offload) -> None:
    deep = "SELECT " + "(" * 5000 + "1" + ")" * 5000 + " FROM pg_class"
    with pytest.raises(StatementTooComplex) as info:
        offload.route_of("alice", deep, frozenset(POLICY.tables))
    assert info.value.sqlstate == "54001"


def test_a_killed_helper_is_replaced(offload: Offload) -> None:
    tables = frozenset(POLICY.tables)
    assert offload.route_of("alice", LONG[0], tables).route == "catalog"
    pool = offload._pool
    assert pool is not None
    for proc in list(pool._processes.values()):
        proc.kill()
    with pytest.raises(InternalError, match="statement parser process stopped"):
        for _ in range(3):  # the pool notices the dead process on the next call
            offload.route_of("alice", LONG[0], tables)
    assert offload.route_of("alice", LONG[0], tables).route == "catalog"  # in this thread while a new one starts
    assert offload.start(timeout=120) and offload._pool is not pool
    assert offload.route_of("alice", LONG[0], tables).route == "catalog"


def test_calls_are_answered_here_until_the_helper_is_ready() -> None:
    """The helper's start (spawn, imports) never counts against a statement: until it is ready the
    calling thread routes the statement itself."""
    helper = Offload()
    try:
        assert helper.route_of("alice", LONG[0], frozenset(POLICY.tables)).route == "catalog"
        assert helper.split("alice", LONG[0] + ";" + LONG[2]) == split_statements(LONG[0] + ";" + LONG[2])
    finally:
        helper.close()
