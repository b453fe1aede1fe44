"""Pure codec pieces: statement splitting, local statements, binary encodings checked by psycopg's loaders."""

from __future__ import annotations

import datetime as dt
import itertools
from decimal import Decimal

import pytest
from psycopg.adapt import Transformer
from psycopg.pq import Format

from dpsql.errors import DataError
from dpsql.fingerprint import fingerprint_key, keyed, statement_shape
from dpsql.server.answers import parse_session_command
from dpsql.server.protocol import WireViolation, parse_message, parse_startup
from dpsql.server.types import decode_param, encode_binary, encode_text
from dpsql.sqltext import _skip_block_comment, split_statements


def test_split_respects_quotes_comments_and_dollar_quotes() -> None:
    sql = "select 'a;b'; select \"x;\" -- c;\n; /* a; /* b; */ */ select $f$;$f$; ; select E'\\';'"
    assert split_statements(sql) == [
        "select 'a;b'",
        'select "x;" -- c;',
        "/* a; /* b; */ */ select $f$;$f$",
        "select E'\\';'",
    ]
    assert split_statements("-- ping") == [] and split_statements(" ; ;") == []


def test_block_comments_nest_and_end_where_postgresql_ends_them() -> None:
    """Nested block comments, found by jumping between ``/*`` and ``*/``: the same ends as reading one
    character at a time (overlaps such as ``/*/`` and ``*/*`` included), for every short mix."""

    def one_at_a_time(sql: str) -> int:
        depth, i = 0, 0
        while i < len(sql):
            if sql.startswith("/*", i):
                depth, i = depth + 1, i + 2
            elif sql.startswith("*/", i):
                depth, i = depth - 1, i + 2
                if depth == 0:
                    return i
            else:
                i += 1
        return len(sql)

    for size in range(9):
        for body in itertools.product("/*a", repeat=size):
            sql = "/*" + "".join(body)
            assert _skip_block_comment(sql, 0) == one_at_a_time(sql), sql
    assert split_statements("/* a /* b */ c; */ select 1; select 2") == ["/* a /* b */ c; */ select 1", "select 2"]


def test_fingerprint_ignores_comments_spacing_and_constants() -> None:
    key = fingerprint_key(b"k" * 32)
    a = keyed(key, statement_shape("SELECT  COUNT(*) FROM t WHERE a = 1 -- x"))
    assert a == keyed(key, statement_shape("select count(*) from T where a = 'zz';")) and len(a) == 16
    assert a != keyed(fingerprint_key(b"j" * 32), statement_shape("SELECT COUNT(*) FROM t WHERE a = 1"))


@pytest.mark.parametrize(
    ("sql", "tag"),
    [
        ("SET dpsql.epsilon TO 0.5", "SET"),
        ("BEGIN ISOLATION LEVEL READ COMMITTED", "BEGIN"),
        ("START TRANSACTION", "BEGIN"),
        ("end", "COMMIT"),
        ("ABORT", "ROLLBACK"),
        ("ROLLBACK TO SAVEPOINT s", "ROLLBACK"),
        ("DISCARD ALL", "DISCARD ALL"),
        ("CLOSE ALL", "CLOSE CURSOR ALL"),
        ("UNLISTEN *", "UNLISTEN"),
        ("RESET ALL", "RESET"),
        ("SHOW ALL", "SHOW"),
    ],
)
def test_session_statements(sql: str, tag: str) -> None:
    cmd = parse_session_command(sql)
    assert cmd is not None and cmd.tag == tag
    assert parse_session_command("SELECT 1") is None


@pytest.mark.parametrize(
    ("value", "oid"),
    [
        (123456789012, 20),
        (-1.5e300, 701),
        ("héllo", 25),
        (True, 16),
        (dt.date(1969, 7, 20), 1082),
        (dt.datetime(2024, 2, 29, 13, 14, 15, 123456), 1114),
        (Decimal("12345.678"), 1700),
        (Decimal("-0.00012"), 1700),
        (Decimal("100000000"), 1700),
        (Decimal("0"), 1700),
    ],
)
def test_binary_and_text_encodings_match_postgresql(value: object, oid: int) -> None:
    tx = Transformer()
    binary = tx.get_loader(oid, Format.BINARY).load(encode_binary(value, oid))  # type: ignore[arg-type]
    text = tx.get_loader(oid, Format.TEXT).load(encode_text(value))  # type: ignore[arg-type]
    assert binary == value and text == value
    assert decode_param(encode_binary(value, oid), oid, 1) == value


def test_bad_params_are_data_errors() -> None:
    with pytest.raises(DataError) as info:
        decode_param(b"abc", 20, 0)
    assert info.value.sqlstate == "22P02"
    with pytest.raises(DataError) as info:
        decode_param(b"\0\0", 20, 1)
    assert info.value.sqlstate == "22P03"


def test_strict_framing() -> None:
    with pytest.raises(WireViolation):
        parse_message("E", b"portal")  # missing terminator and row count
    with pytest.raises(WireViolation):
        parse_message("S", b"x")  # trailing bytes
    with pytest.raises(WireViolation):
        parse_startup(b"\x00\x03\x00\x00user\x00x")  # unterminated parameter


@pytest.mark.parametrize(
    ("sql", "route"),
    [
        ("SELECT COUNT(*) FROM patients", "engine"),
        ("SELECT relname FROM pg_catalog.pg_class", "catalog"),
        ("SELECT * FROM information_schema.columns WHERE table_name = 'patients'", "catalog"),
        ("SELECT c.relname FROM pg_class c WHERE c.relname OPERATOR(pg_catalog.~) '^(patients)$'", "catalog"),
        ("SELECT COUNT(*) FROM patients, pg_class", "mixed"),
        ("WITH t AS (SELECT 1) SELECT * FROM t", "tableless"),
        ("SELECT version()", "tableless"),
        ("SELECT * INTO x FROM pg_class", "engine"),
        ("DELETE FROM patients", "engine"),
        ("SELECT * FROM nowhere", "engine"),
    ],
)
def test_routing(sql: str, route: str) -> None:
    from dpsql.dev.demo import demo_policy_path
    from dpsql.policy import load_policy
    from dpsql.server.catalog import route_of

    assert route_of(sql, load_policy(demo_policy_path("health"))) == route
