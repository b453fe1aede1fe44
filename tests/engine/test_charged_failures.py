"""A statement that fails after its reservation says what it was charged (issue #28 item 4).

The budget is reserved before a statement runs and is not refunded when it then fails (whether it
fails can depend on the data or the noise). Before, such a failure charged ε silently and the server
logged ``epsilon=0`` while the ledger held 1: now DETAIL names the charge, and the log line carries it.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from dpsql.engine import Engine
from dpsql.errors import DivisionByZero, Error, FeatureNotSupported, NumericValueOutOfRange
from dpsql.session import Session
from tests.policy.serving import Served

CHARGED = "ε=1 was charged for this statement: the budget is reserved before it runs and is not refunded when it fails."


def _spent(engine: Engine, analyst: str) -> float:
    return sum(row.spent.epsilon for row in engine.ledger.summary(engine.policy.dataset) if row.analyst == analyst)


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        ("SELECT COUNT(*) / 0 FROM patients", DivisionByZero),  # post-processing of a noisy value
        (  # the post-processing sandbox: a noisy count of ~10,000 times 1000 overflows smallint
            "SELECT CAST(c AS SMALLINT) * CAST(1000 AS SMALLINT) FROM (SELECT COUNT(*) AS c FROM patients) t",
            NumericValueOutOfRange,
        ),
    ],
)
def test_failure_after_the_charge_names_it(engine: Engine, sql: str, error: type[Error]) -> None:
    with pytest.raises(error) as failed:
        engine.execute(sql, Session("alice", epsilon=1.0))
    assert failed.value.charged_epsilon == 1.0
    assert failed.value.detail == CHARGED
    assert _spent(engine, "alice") == pytest.approx(1.0)


def test_refusal_before_the_charge_names_none(engine: Engine) -> None:
    with pytest.raises(FeatureNotSupported) as refused:
        engine.execute("SELECT COUNT(*) FROM patients TABLESAMPLE SYSTEM (1)", Session("alice"))
    assert refused.value.charged_epsilon == 0.0 and "charged" not in (refused.value.detail or "")
    assert _spent(engine, "alice") == 0.0


def test_wire_detail_and_log_line_agree_with_the_ledger(tmp_path: Path) -> None:
    server = Served("--log-level", "info", home=tmp_path)
    try:
        server.wait_for("dpsql serving")
        dsn = f"postgresql://alice@127.0.0.1:{server.port}/health"
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("SET dpsql.epsilon = 1")
            with pytest.raises(psycopg.errors.DivisionByZero) as failed:
                conn.execute("SELECT COUNT(*) / 0 FROM patients")
            assert failed.value.diag.message_detail == CHARGED
        line = server.wait_for("outcome=22012")
        assert "epsilon=1 " in line
    finally:
        server.stop()
