"""Issue #41 item 8: the PostgreSQL ledger-writer role (what ``dpsql serve`` connects as) against the rows
it may write: the composed PLD state of ``pld`` accounting and released synopses.

The writer may read the installation key (``dpsql_ledger_meta``), update the PLD state rows (every
reservation does) and, for ``dpsql synopsis build``, insert synopsis rows. What it writes by hand must
never give budget back or be served: both are signed with the signing key kept outside the database
(``$DPSQL_SIGNING_KEY_FILE``), so a state or a synopsis it signs with the installation key is a forgery.
The README's least-privilege recipe is run as written (``roles``, from test_integrity.py).
"""

from __future__ import annotations

import json
import logging
import time

import psycopg
import pytest

from dpsql.accountant import Allowance, Cost
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger import Ledger
from dpsql.ledger import loss_state as states
from dpsql.ledger.loss_state import Kept
from dpsql.pld_state import Composed, LossState
from dpsql.synopsis.store import Released, SynopsisMeasure, prefix, seal, unseal

from .test_integrity import POLICY, roles  # noqa: F401  (the README recipe, as a fixture)

pytestmark = pytest.mark.postgres

BUDGET = Allowance(1.0, 1e-6)


def _reserve(ledger: Ledger) -> None:
    ledger.reserve(
        dataset="health",
        analyst="alice",
        cost=Cost(0.03),
        dataset_budget=Allowance(50.0, 1e-4),
        analyst_budget=BUDGET,
        fingerprint="q",
        accounting="pld",
    )


def test_the_writer_cannot_forge_a_pld_state(
    roles: tuple[dict[str, str], str, str],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    urls, _, _ = roles
    with Ledger.open(urls["dpsql_ledger_writer"]) as writer:
        for _ in range(65):
            _reserve(writer)
        installation_key = writer.installation_key()  # the writer may read it
        row = next(r for r in writer._read(states.STATES_SQL, ("health", "alice")) if r[0] == states.ANALYST)
        forged = Kept(Composed(LossState.identity(), Composed.empty().add_all([Cost(0.03)] * 65).spent), int(row[1]))
        params = states.row(installation_key, "health", states.ANALYST, "alice", forged)
        with psycopg.connect(urls["dpsql_ledger_writer"], autocommit=True) as conn:  # by hand, as the writer role
            conn.execute(
                "UPDATE dpsql_ledger_pld SET through = %s, queries = %s, epsilon = %s, delta = %s, "
                "selection_delta = %s, state = %s, mac = %s "
                "WHERE dataset = 'health' AND scope = 'analyst' AND analyst = 'alice'",
                params[3:],
            )
        states._KNOWN.clear()
        with caplog.at_level(logging.ERROR, logger="dpsql.ledger"), pytest.raises(PrivacyBudgetExhausted):
            _reserve(writer)  # the 66th: refused as on an honest ledger
        assert "not signed by this installation's signing key" in caplog.text
    with Ledger.open(urls["dpsql_ledger_reader"]) as reader:
        problems = reader.verify("health")
        assert any('composed PLD state of analyst "alice"' in p for p in problems)


def test_the_writer_cannot_forge_a_synopsis(roles: tuple[dict[str, str], str, str]) -> None:  # noqa: F811
    """A release the writer signs with the installation key (all it can read) is never served."""
    urls, superuser, _ = roles
    with psycopg.connect(superuser, autocommit=True) as conn:  # as README: synopsis builds run as the writer
        writer_role = urls["dpsql_ledger_writer"].split("//", 1)[1].split(":", 1)[0]
        conn.execute(f"GRANT INSERT ON dpsql_ledger_meta TO {writer_role}")
    with Ledger.open(urls["dpsql_ledger_writer"]) as writer:
        released = Released(
            name="visits",
            dataset="health",
            table="patients",
            declaration="d",
            identity="i",
            built_at=time.time(),
            epsilon=1.0,
            delta=0.0,
            keys=(),
            measures=(SynopsisMeasure("count_star", None),),
            marginals=((),),
            mechanism="laplace",
        )
        forged = seal(released, writer.installation_key())
        key = prefix("health", "visits") + "00000000000000000001"
        assert writer.add_synopsis(key, forged)  # the row is there…
        assert json.loads(writer.synopsis_document(key) or "{}")["mac"]
        assert unseal(forged, writer.signing_key()) is None  # …but not signed with the signing key
        assert writer.signing_key() != writer.installation_key()
        honest = seal(released, writer.signing_key())
        assert unseal(honest, writer.signing_key()) is not None
    assert POLICY.dataset == "health"
