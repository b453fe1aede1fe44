"""The shadow catalog as an attacker sees it: another local user, a hostile analyst, a crash.

Real processes throughout: a server with its own shadow (a throwaway PostgreSQL), direct libpq
connections to that shadow, and a ``dpsql serve`` subprocess killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dpsql.server import ThreadedServer
from dpsql.server.catalog import CatalogShadow
from dpsql.server.shadow_guard import check_catalog_sql
from dpsql.server.shadow_schema import shadow_role
from tests.trust.serverproc import DPSQL, ROOT, write_policy

from .conftest import open_engine

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (shadow catalog or cluster)


@dataclass
class Shadowed:
    server: ThreadedServer
    shadow: CatalogShadow

    def connect(self, user: str = "analyst") -> psycopg.Connection:
        return psycopg.connect(
            f"host={self.server.host} port={self.server.port} user={user} dbname=health connect_timeout=10",
            autocommit=True,
        )

    def direct(self, analyst: str = "analyst", password: str | None = None) -> psycopg.Connection:
        """Straight to the shadow's socket as ``analyst``'s role (by default with the password dpsql uses)."""
        local = self.shadow.local
        role = shadow_role(analyst)
        secret = self.shadow._passwords[role] if password is None else password
        return psycopg.connect(local.dsn_for("health", user=role, password=secret), autocommit=True)


@pytest.fixture(scope="module")
def shadowed() -> Iterator[Shadowed]:
    engine = open_engine(trust=True)
    server = ThreadedServer(engine, statement_timeout=None)
    try:
        shadow = server.server.ctx.shadow
        assert shadow is not None and shadow.local is not None
        yield Shadowed(server, shadow)
    finally:
        server.stop()
        engine.close()


def _sqlstate(conn: psycopg.Connection, sql: str) -> str | None:
    try:
        conn.execute(sql)
    except psycopg.Error as exc:
        return exc.diag.sqlstate
    return None


# --- another local user -----------------------------------------------------------------------


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":
                    inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                found.add(target[8:-1])
    return found


def test_no_tcp_listener_no_trust_private_socket(shadowed: Shadowed) -> None:
    local = shadowed.shadow.local
    assert not _socket_inodes(local.process.pid) & _listening_tcp_inodes()
    with psycopg.connect(local.dsn) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        rules = conn.execute("SELECT type, auth_method FROM pg_hba_file_rules").fetchall()
    assert rules == [("local", "scram-sha-256")]
    mode = local.socket_dir.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700
    assert mode.st_uid == (local.run_as.pw_uid if local.run_as else os.getuid())
    assert stat.S_IMODE(local.socket_path.stat().st_mode) == 0o700


@pytest.mark.parametrize("role", ["postgres", "analyst", "alice"])
def test_socket_without_the_secret_is_refused(shadowed: Shadowed, role: str) -> None:
    local = shadowed.shadow.local
    for password in ("", "guess"):
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(local.dsn_for("health", user=role, password=password)).close()


def test_role_is_unprivileged_even_directly(shadowed: Shadowed) -> None:
    with shadowed.direct() as conn:
        row = conn.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls FROM pg_roles "
            "WHERE rolname = current_user"
        ).fetchone()
        assert row == (False, False, False, False, False)
        for role in ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program", "pg_monitor"):
            assert conn.execute("SELECT pg_has_role(current_user, %s, 'MEMBER')", (role,)).fetchone() == (False,)
        assert conn.execute("SELECT count(*) FROM pg_class WHERE relowner = current_user::regrole").fetchone() == (0,)
        assert conn.execute("SHOW statement_timeout").fetchone() == ("5s",)
        assert conn.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        assert _sqlstate(conn, "COPY patients FROM PROGRAM 'id'") in ("42501", "25006")
        assert _sqlstate(conn, "SELECT pg_read_file('/etc/passwd')") == "42501"
        assert _sqlstate(conn, "SELECT pg_ls_dir('.')") == "42501"
        # even after lifting its read-only default, no large objects, locks or DDL
        conn.execute("SET default_transaction_read_only = off")
        assert _sqlstate(conn, "SELECT lo_create(0)") == "42501"
        assert _sqlstate(conn, "SELECT lo_from_bytea(0, 'x')") == "42501"
        assert _sqlstate(conn, "SELECT pg_advisory_lock(1)") == "42501"
        assert _sqlstate(conn, "CREATE TABLE public.mine (x int)") == "42501"
        assert _sqlstate(conn, "CREATE TEMP TABLE mine (x int)") == "42501"
        assert _sqlstate(conn, "SELECT pg_notify('c', 'x')") == "42501"


def test_other_sessions_are_invisible_directly(shadowed: Shadowed) -> None:
    with shadowed.direct("alice") as other, shadowed.direct() as conn:
        other.execute("SELECT 1")
        assert _sqlstate(conn, "SELECT count(*) FROM pg_stat_activity") == "42501"
        assert _sqlstate(conn, "SELECT count(*) FROM pg_locks") == "42501"
        assert _sqlstate(conn, "SELECT * FROM pg_stat_get_activity(NULL)") == "42501"
        assert _sqlstate(conn, "SELECT numbackends FROM pg_stat_database") == "42501"
        with pytest.raises(psycopg.OperationalError):
            role = shadow_role("analyst")
            psycopg.connect(shadowed.shadow.local.dsn_for("postgres", role, shadowed.shadow._passwords[role]))


# --- a hostile analyst through dpsql --------------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT pg_read_file('/etc/passwd')",
        "SELECT lo_create(0)",
        "SELECT lo_from_bytea(0, 'x'::bytea)",
        "SELECT pg_catalog.lo_import('/etc/passwd')",
        'SELECT "lo_create"(0)',
        "SELECT lo_create /* x */ (0)",
        'SELECT U&"\\006Co_create"(0)',
        "SELECT pg_advisory_lock(1)",
        "SELECT pg_try_advisory_lock(1)",
        "SELECT * FROM pg_stat_activity",
        "SELECT pid FROM pg_catalog.pg_locks",
        "SELECT * FROM pg_ls_dir('.')",
        "SELECT query_to_xml('select 1', true, true, '')",
        "SELECT set_config('default_transaction_read_only', 'off', false)",
        "SELECT set_config('statement_timeout', '0', false)",
        "SELECT pg_sleep_for('10 minutes')",
        "SELECT public.whatever()",
        "WITH x AS (SELECT 1) SELECT pg_terminate_backend(pg_backend_pid()) FROM x",
        "SELECT relname FROM pg_class WHERE pg_sleep_until('infinity') IS NULL",
    ],
)
def test_refused_through_dpsql(shadowed: Shadowed, sql: str) -> None:
    with shadowed.connect() as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute(sql)
        assert info.value.diag.sqlstate == "42501", info.value
        assert info.value.diag.message_hint
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_copy_from_program_refused_through_dpsql(shadowed: Shadowed) -> None:
    with shadowed.connect() as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute("COPY patients FROM PROGRAM 'id'")
        assert info.value.diag.sqlstate not in (None, "XX000")


#: Grafana's PostgreSQL data source lists a table's columns with this query (parse_ident splits a
#: possibly schema-qualified name); it was refused 42501 when parse_ident left the allow-list.
GRAFANA_COLUMNS = (
    'SELECT quote_ident(column_name) AS "column", data_type AS "type" FROM information_schema.columns '
    "WHERE CASE WHEN array_length(parse_ident('patients'),1) = 2 "
    "THEN quote_ident(table_schema) = (parse_ident('patients'))[1] "
    "AND quote_ident(table_name) = (parse_ident('patients'))[2] "
    "ELSE quote_ident(table_name) = 'patients' AND table_schema IN ("
    "SELECT CASE WHEN trim(s[i]) = '\"$user\"' THEN user ELSE trim(s[i]) END FROM generate_series("
    "array_lower(string_to_array(current_setting('search_path'),','),1), "
    "array_upper(string_to_array(current_setting('search_path'),','),1)) as i, "
    "string_to_array(current_setting('search_path'),',') s) END"
)


def test_grafana_column_list_is_answered(shadowed: Shadowed) -> None:
    with shadowed.connect() as conn:
        columns = [row[0] for row in conn.execute(GRAFANA_COLUMNS).fetchall()]
    assert "problem" in columns and "zip" in columns


def test_pg_sleep_is_cut_by_the_shadow_timeout(shadowed: Shadowed) -> None:
    with shadowed.connect() as conn:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(600)")
        elapsed = time.monotonic() - started
        print(f"pg_sleep(600) cut after {elapsed:.2f}s")
        assert elapsed < shadowed.shadow.statement_timeout_ms / 1000 + 2
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_clients_metadata_still_allowed() -> None:
    for sql in [
        "SELECT c.oid, n.nspname, c.relname FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE c.relname OPERATOR(pg_catalog.~) '^(patients)$' COLLATE pg_catalog.default "
        "AND pg_catalog.pg_table_is_visible(c.oid) ORDER BY 2, 3",
        "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), CAST(a.attnum AS numeric(10, 0)), "
        "x::varchar(10) FROM pg_catalog.pg_attribute a",
        "WITH RECURSIVE t(a, b) AS (SELECT 1, 2) SELECT a FROM t",
        "SELECT (information_schema._pg_expandarray(i.indkey)).n FROM pg_catalog.pg_index i",
        "SELECT * FROM unnest(ARRAY[1, 2]) WITH ORDINALITY u(x, n)",
        "SELECT set_config('search_path', 'public', false), current_setting('server_version_num')",
    ]:
        check_catalog_sql(sql)


# --- the shadow dies while the server lives ---------------------------------------------------------


def test_shadow_killed_is_restarted_with_clean_errors(shadowed: Shadowed) -> None:
    shadow = shadowed.shadow
    old = shadow.local
    restarts = shadow.restarts
    with shadowed.connect() as conn:
        assert conn.execute("SELECT count(*) FROM pg_class").fetchone()[0] > 0  # type: ignore[index]
        old.process.kill()
        killed = time.monotonic()
        states: list[str | None] = []
        while time.monotonic() - killed < 20:
            state = _sqlstate(conn, "SELECT relname FROM pg_class WHERE relname = 'patients'")
            states.append(state)
            if state is None and shadow.restarts > restarts:
                break
            time.sleep(0.1)
        print(f"catalog answered again {time.monotonic() - killed:.2f}s after SIGKILL; errors {states[:-1]}")
        assert states[-1] is None  # answered by the new shadow
        assert set(states) <= {None, "08006", "57P03"}  # the old backend may answer once before it notices
        assert conn.execute("SELECT relname FROM pg_class WHERE relname = 'patients'").fetchone() == ("patients",)
    assert shadow.restarts == restarts + 1 and shadow.local is not old
    assert not old.datadir.exists()


# --- kill -9 of dpsql serve -----------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))):
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out[1:]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_kill_9_of_dpsql_serve_takes_the_shadow_along(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    log = (tmp_path / "server.log").open("ab")
    argv = [
        str(DPSQL),
        "serve",
        "--policy",
        str(write_policy(tmp_path)),
        "--ledger",
        f"sqlite://{tmp_path / 'ledger.sqlite'}",
        "--port",
        "0",
        "--log-level",
        "info",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    try:
        port = _wait_listening(proc, tmp_path / "server.log")
        dsn = f"host=127.0.0.1 port={port} user=analyst dbname=health connect_timeout=10"
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM information_schema.tables").fetchone()[0] > 0  # type: ignore[index]
            postmasters = [p for p in _descendants(proc.pid) if "-D" in _cmdline(p)]
            assert len(postmasters) == 1
            cmd = _cmdline(postmasters[0])
            datadir = Path(cmd[cmd.index("-D") + 1])
            shadow_procs = [postmasters[0], *_descendants(postmasters[0])]
            assert len(shadow_procs) > 3 and datadir.exists()
            proc.kill()
            proc.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and (datadir.exists() or any(_alive(p) for p in shadow_procs)):
            time.sleep(0.02)
        gone_after = time.monotonic() - killed
        print(f"shadow gone {gone_after:.2f}s after kill -9 of dpsql serve")
        assert not [p for p in shadow_procs if _alive(p)]
        assert not datadir.exists()
        assert gone_after < 5
    finally:
        proc.kill()


def _wait_listening(proc: subprocess.Popen[Any], log: Path) -> int:
    import re

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"dpsql listening on [^:\s]+:(\d+)", log.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(log.read_text())
