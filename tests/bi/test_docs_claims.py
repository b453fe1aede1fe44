"""docs/bi.md's claims that no other test checks (issue #38 item 7): where ``dpsql serve`` listens, the BI
corpus's figures, and how Tableau's temporary tables are refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
import yaml

from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.server import ThreadedServer

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "bi.md").read_text()


@contextmanager
def serving(*args: str, home: Path) -> Iterator[tuple[str, int]]:
    """``dpsql serve`` on the clinic demo with ``args``; the address and port it says it serves on."""
    command = [sys.executable, "-m", "dpsql.cli", "serve", "--policy", "schemas/clinic.yaml", "--port", "0", *args]
    env = {**os.environ, "DPSQL_HOME": str(home)}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    try:
        assert server.stderr is not None
        deadline = time.monotonic() + 120
        while not log or "dpsql serving" not in log[-1]:
            log.append(server.stderr.readline())
            assert log[-1] or server.poll() is None, "dpsql serve exited:\n" + "".join(log)
            assert time.monotonic() < deadline, "dpsql serve did not start within 120 s"
        threading.Thread(target=lambda: log.extend(server.stderr or ()), daemon=True).start()
        found = re.search(r" on (\S+):(\d+) ", log[-1])
        assert found is not None, log[-1]
        yield found.group(1), int(found.group(2))
    finally:
        server.terminate()
        server.wait(30)


def test_serve_listens_on_localhost_unless_told_otherwise(tmp_path: Path) -> None:
    with serving(home=tmp_path) as (host, port):
        assert host == "127.0.0.1"
        with psycopg.connect(host="127.0.0.1", port=port, user="alice", dbname="clinic", autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    with serving("--host", "0.0.0.0", home=tmp_path) as (host, port):  # noqa: S104 - what the doc tells curators
        assert host == "0.0.0.0"  # noqa: S104
        with psycopg.connect(host="127.0.0.1", port=port, user="alice", dbname="clinic", autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_corpus_figures_are_the_docs() -> None:
    shapes = yaml.safe_load((ROOT / "tests" / "bi" / "corpus.yaml").read_text())
    answered = sum(1 for shape in shapes if "answered" in shape)
    claim = f"{len(shapes)} statements written"
    assert claim in DOC and f"Today {answered} of the\n{len(shapes)} are answered" in DOC
    assert f"({answered} of {len(shapes)} shapes answered)" in (ROOT / "README.md").read_text()


def test_temporary_tables_are_refused_as_the_docs_say() -> None:
    engine = Engine.open(demo_policy_path("clinic"), "duckdb://", ledger="memory")
    load_demo(engine.backend, ["clinic"])
    server = ThreadedServer(engine, catalog_dsn="")
    try:
        with psycopg.connect(host="127.0.0.1", port=server.port, user="alice", dbname="clinic", autocommit=True) as c:
            for sql, state in (
                ("CREATE TEMPORARY TABLE t AS SELECT 1", "25006"),
                ('CREATE LOCAL TEMPORARY TABLE "#Tableau_5_1_Filter" ("X" TEXT) ON COMMIT PRESERVE ROWS', "0A000"),
            ):
                with pytest.raises(psycopg.Error) as refused:
                    c.execute(sql)
                assert refused.value.sqlstate == state, sql
            assert engine.ledger.spent("clinic").epsilon == 0
    finally:
        server.stop()
    assert "Tableau's own `CREATE LOCAL TEMPORARY TABLE" in DOC and "with 0A000" in DOC
