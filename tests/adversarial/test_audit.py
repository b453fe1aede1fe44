"""The audit trail on neighbouring databases: the row a statement leaves must not depend on one person.

Each statement runs on DuckDB and PostgreSQL over the error-oracle neighbours (one person absent,
ordinary, out of bounds, NaN); every audit row must be equal apart from its time and latency.
Latency is data-dependent (a bigger table takes longer) and is kept on purpose: the trail is read
by the curator only (``dpsql audit``; never over the wire), who holds the data anyway, and the
analyst can time their own queries — recording it opens no channel to the analyst.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session
from tests.adversarial.test_error_oracles import POLICY, _script
from tests.adversarial.worlds import kind_backends

NEIGHBOURS = ("absent", "ordinary", "out-of-bounds", "nan")
STATEMENTS = (
    "SELECT COUNT(*), SUM(cost) FROM t WHERE problem = 'obesity' AND visits > 2",  # answered, charged
    "SELECT problem, AVG(x) FROM t GROUP BY problem",  # answered with partition selection
    "SELECT COUNT(*) FROM t WHERE lower(problem) LIKE 'obesit\\'",  # 22025, free
    "SELECT cost FROM t WHERE problem = 'obesity'",  # 42803 raw column, free
    "SELECT COUNT(*) FROM nowhere",  # 42P01
    "SELECT SUM(1.0 / (cost - 4999)) FROM t",  # answered (clamped first)
)


@pytest.fixture(scope="module")
def audit_backends(pg_new_database: Callable[[], str]) -> Iterator[dict[str, Backend]]:
    with kind_backends(pg_new_database) as backends:
        yield backends


def _comparable(row: Any) -> tuple[Any, ...]:
    return (row.analyst, row.fingerprint, row.shape, row.outcome, row.sqlstate, row.epsilon, row.delta, row.rho)


def test_audit_rows_do_not_depend_on_one_person(audit_backends: dict[str, Backend], tmp_path: Path) -> None:
    policy = parse_policy(POLICY)
    # One ledger for every run: one installation key, so fingerprints are comparable too.
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    runs: list[tuple[str, str]] = []
    for variant in NEIGHBOURS:
        for name, backend in audit_backends.items():
            backend.execute_script(_script(variant))
            engine = Engine(policy, backend, ledger)
            for sql in STATEMENTS:
                with contextlib.suppress(Error):
                    engine.execute(sql, Session("alice", epsilon=1.0, delta=1e-6))
            engine.audit.close()  # drains the trail (the ledger and backend stay open)
            runs.append((name, variant))
    rows = list(reversed(ledger.audit(policy.dataset, limit=10_000)))
    ledger.close()
    assert len(rows) == len(runs) * len(STATEMENTS)
    per_run = {run: [_comparable(r) for r in rows[i * 6 : (i + 1) * 6]] for i, run in enumerate(runs)}
    distinct = {tuple(v) for v in per_run.values()}
    assert len(distinct) == 1, f"an audit row depends on the data or the backend: {per_run}"
    (trail,) = distinct
    assert [r[3] for r in trail] == ["answered", "answered", "refused", "refused", "refused", "answered"]
    assert [r[4] for r in trail] == ["00000", "00000", "22025", "42803", "42P01", "00000"]
    for row in trail:
        assert "obesit" not in row[2] and "4999" not in row[2] and "2" not in row[2].split("visits")[-1]
