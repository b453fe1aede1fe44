"""`dpsql serve` as a user starts it: the "serving" line comes only once the port accepts connections."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from dpsql.dev.demo import demo_policy_path
from dpsql.policy import Analyst, load_policy
from dpsql.server.cli import banner_login
from tests.listening import port_of, serving_line, start_serve

pytestmark = pytest.mark.postgres  # starts a local PostgreSQL (shadow catalog or cluster)


def test_serving_line_means_listening(tmp_path: Path) -> None:
    server = start_serve(home=tmp_path)
    try:
        deadline = time.monotonic() + 90
        line = serving_line(server, deadline)
        port = port_of(line)  # it bound port 0 and says which port it got
        assert f"127.0.0.1:{port}" in line and "ledger sqlite:///" in line
        # no retry: the line is printed only once the socket is up
        with psycopg.connect(f"postgresql://analyst@127.0.0.1:{port}/health", connect_timeout=5) as conn:
            assert conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0] > 9000  # type: ignore[index]
            # the shadow catalog starts in the background (issue #37): a catalog query waits for it, and
            # gets 57P03 (the database system is starting up) only past 15 s of waiting, as from PostgreSQL
            while True:
                try:
                    tables = conn.execute("SELECT relname FROM pg_catalog.pg_class WHERE relname = 'patients'")
                    assert tables.fetchall() == [("patients",)]
                    break
                except psycopg.errors.CannotConnectNow:
                    assert time.monotonic() < deadline
    finally:
        server.terminate()
        server.wait(30)


def test_banner_names_a_declared_analyst() -> None:
    """#40 item 4: the banner's ``psql -U`` names someone who can log in (``analyst`` when declared)."""
    clinic = load_policy(demo_policy_path("clinic"))
    assert banner_login(clinic, "127.0.0.1", 6543) == "try: psql -h 127.0.0.1 -p 6543 -U analyst clinic"
    others = clinic.model_copy(update={"analysts": (Analyst(name="bob"), Analyst(name="carol smith"))})
    assert banner_login(others, "::1", 7) == "try: psql -h ::1 -p 7 -U bob clinic"
    alone = clinic.model_copy(update={"analysts": (Analyst(name="carol smith"),)})
    assert banner_login(alone, "h", 7) == "try: psql -h h -p 7 -U 'carol smith' clinic"
    assert banner_login(clinic.model_copy(update={"analysts": ()}), "h", 7) == "no analyst declared: nobody can log in"
