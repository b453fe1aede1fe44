"""The composed PLD of ``pld`` accounting, kept in the ledger beside the totals (``dpsql_ledger_pld``).

One row per analyst (scope ``analyst``) and one per dataset (scope ``dataset``, analyst ``''``): the
:class:`~dpsql.pld_state.LossState` of every charge up to charge id ``through``, with the sums it composed,
signed (HMAC-SHA-256) under the ledger's signing key (:mod:`dpsql.ledger.signing`: out of the writer role's
reach on PostgreSQL). A reservation reads the two rows, composes the charges recorded after ``through``
(none, when every writer keeps the state: O(1)), checks, and writes both rows back with the new charge,
in the reservation's transaction. So its cost depends on the spread of the composed loss, never on how
many charges came before (issue #41: composing 10,000 distinct ε took seconds per reservation).

What can go wrong is never in the analyst's favour: a missing row, or one whose signature does not check
(written by hand, by another installation, by a writer role with the installation key), is rebuilt from
the append-only charge rows (logged at ERROR once per process when it was forged); the reconciled sums
(:mod:`dpsql.ledger.integrity`) exceed a lagging state by what it misses, which is composed as one more
charge (:meth:`~dpsql.pld_state.Composed.covering`). ``dpsql ledger verify`` recomposes every state from
the rows and names any that disagree.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dpsql.accountant import Cost, Spent
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger.records import number
from dpsql.lru import LRU
from dpsql.pld_state import Composed, LossState

log = logging.getLogger("dpsql.ledger")

#: The two scopes: one analyst's charges, and every analyst's on the dataset (analyst ``''``).
ANALYST, DATASET = "analyst", "dataset"
_MAC_PERSON = b"dpsql pld v1"

_OWN = "WHERE dataset = ? AND ((scope = 'analyst' AND analyst = ?) OR (scope = 'dataset' AND analyst = ''))"
#: The two rows' progress: a row no further than the state this process holds need not be read.
HEADS_SQL = "SELECT scope, through FROM dpsql_ledger_pld " + _OWN
STATES_SQL = "SELECT scope, through, queries, epsilon, delta, selection_delta, state, mac FROM dpsql_ledger_pld " + _OWN
#: The charges after a state's ``through``, in order: kind 0 one analyst's (dataset, analyst, id), kind 1 the dataset's.
_AFTER_SQL = "SELECT id, epsilon, delta, selection_delta FROM dpsql_ledger WHERE dataset = ?"
AFTER_SQL = (_AFTER_SQL + " AND analyst = ? AND id > ? ORDER BY id", _AFTER_SQL + " AND id > ? ORDER BY id")
_UP_TO_SQL = (_AFTER_SQL + " AND analyst = ? AND id <= ? ORDER BY id", _AFTER_SQL + " AND id <= ? ORDER BY id")
UPSERT_SQL = (
    "INSERT INTO dpsql_ledger_pld (dataset, scope, analyst, through, queries, epsilon, delta, selection_delta, "
    "state, mac) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (dataset, scope, analyst) DO UPDATE SET "
    "through = excluded.through, queries = excluded.queries, epsilon = excluded.epsilon, delta = excluded.delta, "
    "selection_delta = excluded.selection_delta, state = excluded.state, mac = excluded.mac"
)
_ALL_STATES_SQL = (
    "SELECT dataset, scope, analyst, through, queries, epsilon, delta, selection_delta, state, mac "
    "FROM dpsql_ledger_pld"
)
#: (ledger, dataset, scope, analyst) whose forged state was already logged by this process.
_REPORTED: set[tuple[str, str, str, str]] = set()
#: The newest state this process composed (after its own committed reservations) or read and checked, by
#: (ledger, dataset, scope, analyst), with the charge id of the last state it stored. Charge rows are
#: append-only and inserted one reservation at a time under the dataset's lock, so a state composed up to
#: charge ``through`` stays right: only the rows after it are read and composed. A stored row no further
#: than it is not read at all (a row replayed from earlier is only a state that lags).
_KNOWN: LRU[tuple[str, str, str, str], tuple[int, Kept]] = LRU(4096, 64 << 20)
#: A reservation stores the states only every this many charges (or when they are small): in between the
#: rows lag and whoever reads them composes the few charges after them, which costs less than writing
#: tens of kilobytes into the ledger's transaction each time.
STORE_EVERY = 16
#: States this small are stored with every charge anyway.
SMALL_STATE = 4096

#: ``execute(sql, params)``: a cursor (in the reservation's transaction) or the rows of a read.
Fetch = Callable[[str, tuple[Any, ...]], Sequence[Any]]


@dataclass(frozen=True, eq=False)
class Kept:
    """A composed state and the last charge id it covers."""

    composed: Composed
    through: int = 0


def mac(key: bytes, dataset: str, scope: str, analyst: str, through: int, spent: Spent, state: bytes) -> str:
    """The signature of one state row: every column but the signature itself (keyed BLAKE2b, a MAC by
    construction and about twice as fast as HMAC-SHA-256 on the state's tens of kilobytes)."""
    head = "\0".join((dataset, scope, analyst)).encode() + b"\0"
    sums = struct.pack("<qqddd", through, spent.queries, spent.epsilon, spent.delta, spent.selection_delta)
    digest = hashlib.blake2b(key=key[:64], digest_size=32, person=_MAC_PERSON)
    for part in (head, sums, state):
        digest.update(part)
    return digest.hexdigest()


def _charge(row: Sequence[Any]) -> Cost:
    """A charge row ``(id, ε, δ, δ_sel)`` as a cost (a row before schema 2 counts its δ as selection δ);
    ValueError when no cost can hold its figures."""
    delta = number(row[2])
    return Cost(number(row[1]), delta, 0.0, delta if row[3] is None else number(row[3]))


def _kept(url: str, key: bytes, dataset: str, scope: str, analyst: str, row: Sequence[Any] | None) -> Kept:
    """The state a row holds when its signature checks; else the empty state (rebuilt from every charge)."""
    if row is None:
        return Kept(Composed.empty())
    through, queries, epsilon, delta, selection, blob, signature = row[1:8]
    blob = bytes(blob)
    try:
        spent = Spent(number(epsilon), number(delta), 0.0, int(queries), number(selection))
        expected = mac(key, dataset, scope, analyst, int(through), spent, blob)
        if not hmac.compare_digest(str(signature), expected):
            raise ValueError("signature")
        kept = Kept(Composed(LossState.from_bytes(blob), spent), int(through))
        _KNOWN.put((url, dataset, scope, analyst), (kept.through, kept), kept.composed.state.probs.nbytes)
        return kept
    except (ValueError, TypeError):
        marker = (url, dataset, scope, analyst)
        if marker not in _REPORTED:
            _REPORTED.add(marker)
            whose = f'analyst "{analyst}"' if scope == ANALYST else "the dataset"
            log.error(
                "privacy ledger integrity: the composed PLD state of %s on dataset %r is not signed by this "
                "installation's signing key; recomposing it from the charge rows. Someone with write access to "
                "the ledger may have changed it (or the servers do not share one signing key): run `dpsql ledger "
                "verify --ledger …`",
                whose,
                dataset,
            )
        return Kept(Composed.empty())


def load(fetch: Fetch, url: str, key: bytes, dataset: str, analyst: str, who: tuple[str, str]) -> tuple[Kept, Kept]:
    """(analyst's, dataset's) state, brought up to the last charge row: each the newer of what this process
    holds and the stored row (read and its signature checked only when it is further), then the charges
    after its ``through`` composed in. A charge row no cost can hold refuses (53P01), like a non-finite total."""
    names = {ANALYST: analyst, DATASET: ""}
    heads = {str(r[0]): int(r[1]) for r in fetch(HEADS_SQL, (dataset, analyst))}
    kept: dict[str, Kept] = {}
    for scope, name in names.items():
        known = _KNOWN.get((url, dataset, scope, name))
        if known is not None and heads.get(scope, 0) <= known[1].through:
            kept[scope] = known[1]
    if any(scope not in kept for scope in heads):
        for r in fetch(STATES_SQL, (dataset, analyst)):
            scope = str(r[0])
            if scope not in kept:
                kept[scope] = _kept(url, key, dataset, scope, names[scope], r)
    mine, everyone = kept.get(ANALYST, Kept(Composed.empty())), kept.get(DATASET, Kept(Composed.empty()))
    return (
        _caught_up(mine, fetch(AFTER_SQL[0], (dataset, analyst, mine.through)), who[0], who[1]),
        _caught_up(everyone, fetch(AFTER_SQL[1], (dataset, everyone.through)), "dataset", dataset),
    )


def stored_through(url: str, dataset: str, scope: str, analyst: str) -> int:
    """The charge id of the last state this process stored or read for the key (0: none)."""
    known = _KNOWN.get((url, dataset, scope, analyst))
    return 0 if known is None else known[0]


def remember(url: str, dataset: str, scope: str, analyst: str, kept: Kept, stored: bool) -> None:
    """Hold ``kept`` (composed in a reservation that committed) as this process's newest state; ``stored``:
    its row was written too."""
    last = kept.through if stored else stored_through(url, dataset, scope, analyst)
    _KNOWN.put((url, dataset, scope, analyst), (last, kept), kept.composed.state.probs.nbytes)


def due(url: str, dataset: str, scope: str, analyst: str, kept: Kept) -> bool:
    """Whether a reservation stores ``kept`` now (see :data:`STORE_EVERY`)."""
    if len(kept.composed.state.probs) * 8 <= SMALL_STATE:
        return True
    return kept.through - stored_through(url, dataset, scope, analyst) >= STORE_EVERY


def _caught_up(kept: Kept, rows: Sequence[Any], who: str, name: str) -> Kept:
    if not rows:
        return kept
    try:
        composed = kept.composed.add_all([_charge(row) for row in rows])
    except ValueError:
        raise PrivacyBudgetExhausted(
            f'privacy budget exhausted for {who} "{name}"',
            detail=f"The ledger's recorded charges for this {who} are not valid figures.",
            hint="Ask the data curator: the ledger's totals need to be checked.",
        ) from None
    return Kept(composed, int(rows[-1][0]))


def row(key: bytes, dataset: str, scope: str, analyst: str, kept: Kept) -> tuple[Any, ...]:
    """The parameters of :data:`UPSERT_SQL` for ``kept``, signed."""
    spent, blob = kept.composed.spent, kept.composed.state.to_bytes()
    signature = mac(key, dataset, scope, analyst, kept.through, spent, blob)
    return (
        dataset,
        scope,
        analyst,
        kept.through,
        spent.queries,
        spent.epsilon,
        spent.delta,
        spent.selection_delta,
        blob,
        signature,
    )


def verify_states(read: Fetch, dataset: str | None = None) -> list[str]:
    """``dpsql ledger verify``'s check of the stored states: each equal to the charge rows up to its ``through``
    recomposed (O(charges × spread): never on a query's path). Its signature is not needed for that (a reader
    role holds no signing key): a state that recomposes from the rows is right whoever signed it, and one
    signed with another key is rebuilt by the server anyway."""
    problems: list[str] = []
    where, params = ("", ()) if dataset is None else (" WHERE dataset = ?", (dataset,))
    for r in read(_ALL_STATES_SQL + where, params):
        ds, scope, analyst, through = str(r[0]), str(r[1]), str(r[2]), int(r[3])
        whose = f'analyst "{analyst}"' if scope == ANALYST else "the dataset"
        label = f'composed PLD state of {whose} on dataset "{ds}"'
        blob = bytes(r[8])
        try:
            spent = Spent(number(r[5]), number(r[6]), 0.0, int(r[4]), number(r[7]))
            stored = LossState.from_bytes(blob)
        except (ValueError, TypeError):
            problems.append(f"{label}: not a readable state")
            continue
        if scope == ANALYST:
            charges = read(_UP_TO_SQL[0], (ds, analyst, through))
        else:
            charges = read(_UP_TO_SQL[1], (ds, through))
        try:
            rebuilt = _caught_up(Kept(Composed.empty()), charges, "dataset", ds).composed
        except PrivacyBudgetExhausted:
            problems.append(f"{label}: its charge rows are not valid figures")
            continue
        if rebuilt.spent.queries != spent.queries or not _same(rebuilt.state, stored):
            problems.append(
                f"{label}: it composes {spent.queries} charges up to charge #{through}, which disagrees with the "
                f"{rebuilt.spent.queries} charge rows up to it recomposed: a row or the state was changed"
            )
    return problems


def _same(a: LossState, b: LossState) -> bool:
    """Equal up to float rounding (the same charges composed in the same order)."""
    import numpy as np  # only when states are compared (a heavy stack `dpsql budget` does not load)

    if a.offset != b.offset or len(a.probs) != len(b.probs):
        return False
    close = math.isclose(a.infinity, b.infinity, rel_tol=1e-9, abs_tol=1e-15)
    return close and bool(np.allclose(a.probs, b.probs, rtol=1e-9, atol=1e-15))
