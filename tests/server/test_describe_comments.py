"""``\\d+`` shows what the policy declares: each column's bounds or domain, each table's unit and caps.

A real server with its shadow catalog (a throwaway local PostgreSQL), asked by psql and by psycopg
(``col_description``/``obj_description``). Curator text with quotes and backslashes reaches the
comments intact, as text: it cannot end the literal it is quoted in.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.policy import Policy, load_policy
from dpsql.server import ThreadedServer
from dpsql.server.shadow_schema import column_comment, table_comment

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (shadow catalog or cluster)

PSQL = shutil.which("psql")
#: A curator's description that would end a naively quoted literal and run a statement.
HOSTILE = "O'Brien's visits'; DROP TABLE visits; -- \\ back\\slash"


def _policy() -> Policy:
    base = load_policy(demo_policy_path("clinic"))
    visits = base.tables["visits"]
    cost = visits.columns["cost"].model_copy(update={"description": "what it cost (EUR); it's billed"})
    visits = visits.model_copy(update={"description": HOSTILE, "columns": {**visits.columns, "cost": cost}})
    return base.model_copy(update={"tables": {**base.tables, "visits": visits}})


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    engine = Engine.open(_policy(), "duckdb://", ledger="memory")
    running = ThreadedServer(engine, statement_timeout=None)
    try:
        yield running
    finally:
        running.stop()
        engine.close()


def test_comments_from_the_policy() -> None:
    policy = _policy()
    visits = policy.tables["visits"]
    assert table_comment("visits", visits, policy) == (
        f"{HOSTILE}; privacy unit: patients.id (through patient_id); max_rows_per_unit 20; max_groups_per_unit 5"
    )
    assert column_comment(visits.columns["cost"]) == "what it cost (EUR); it's billed; bounds [0, 2000]; not null"
    assert column_comment(policy.tables["patients"].columns["sex"]) == "domain: Female, Male; not null"
    assert table_comment("departments", policy.tables["departments"], policy) == "public: read without noise"
    many = visits.columns["department"].model_copy(update={"domain": tuple(f"d{i}" for i in range(12))})
    assert column_comment(many) == "domain: 12 values; not null"


def test_col_description_through_the_server(server: ThreadedServer) -> None:
    dsn = f"host={server.host} port={server.port} user=analyst dbname=clinic connect_timeout=10"
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.attname, pg_catalog.col_description(a.attrelid, a.attnum) FROM pg_catalog.pg_attribute a "
            "WHERE a.attrelid = 'public.visits'::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"
        ).fetchall()
        table = conn.execute("SELECT pg_catalog.obj_description('public.visits'::regclass, 'pg_class')").fetchone()
        tables = conn.execute("SELECT relname FROM pg_catalog.pg_class WHERE relname = 'visits'").fetchall()
    assert dict(rows) == {
        "department": "domain: Cardiology, Oncology, Pediatrics, Emergency, Dermatology, Neurology; not null",
        "visit_date": "bounds [2020-01-01, 2024-12-31]; not null",
        "cost": "what it cost (EUR); it's billed; bounds [0, 2000]; not null",
        "urgent": "not null",
    }
    assert table is not None and table[0].startswith(HOSTILE) and "max_rows_per_unit 20" in table[0]
    assert tables == [("visits",)]  # the description's DROP TABLE was text, never a statement


@pytest.mark.skipif(PSQL is None, reason="psql not installed")
def test_psql_describe_plus(server: ThreadedServer) -> None:
    assert PSQL is not None

    def psql(command: str) -> str:
        out = subprocess.run(
            [PSQL, "-X", "-h", server.host, "-p", str(server.port), "-U", "analyst", "-d", "clinic", "-c", command],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PGCONNECT_TIMEOUT": "10", "PATH": "/usr/bin:/bin", "COLUMNS": "400"},
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    described = psql(r"\d+ patients")
    assert "bounds [0, 110]; not null" in described and "domain: Female, Male; not null" in described
    assert "bounds [2100, 2199]; not null" in described and "ssn" not in described and "household" not in described
    listed = psql(r"\dt+")
    assert "privacy unit: patients.id; max_rows_per_unit 1" in listed
    assert "privacy unit: patients.id (through patient_id); max_rows_per_unit 10" in listed  # prescriptions
    assert "public: read without noise" in listed
    assert "O'Brien's visits'; DROP TABLE visits;" in listed
