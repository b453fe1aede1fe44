"""The audit trail: one row per statement an analyst sends through the engine (read back by
:mod:`dpsql.ledger.audit_report`).

The privacy argument and design notes: docs/internals.md, section dpsql/ledger/audit.py.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Protocol

from dpsql.accountant import Cost
from dpsql.errors import Error
from dpsql.ledger.records import AuditEntry, Charge

log = logging.getLogger("dpsql.audit")

#: Longest shape stored (a 256 kB refused statement must not fill the ledger's disk).
MAX_SHAPE_CHARS = 2000
#: Rows waiting for the writer; beyond this, rows are dropped (and counted in the log).
MAX_PENDING = 10_000
_BATCH = 256

#: Free rows (no charge) one analyst may have open for folding between two charges (per process).
MAX_OPEN_SHAPES = 200
#: Open free rows remembered in all (oldest forgotten first: a forgotten key starts a new row).
MAX_OPEN_ROWS = 20_000
#: The shape of the row that folds an analyst's further shapes once :data:`MAX_OPEN_SHAPES` are open.
OTHER_SHAPES = "(other statements of this outcome: shapes not kept)"

#: (fingerprint, shape) of a statement's text: the engine's keyed fingerprint and its shape.
Shaper = Callable[[str], tuple[str, str]]


@dataclass
class Trace:
    """What the engine learns about one statement while answering it (filled in as it goes)."""

    sql: str
    analyst: str
    started: float
    charge: Charge | None = None
    cached: bool = False
    shaper: Shaper | None = None
    #: Every charge of the statement (a composite statement may reserve more than once).
    charges: list[Charge] = field(default_factory=list)
    shaped: tuple[str, str] | None = None

    def shape(self) -> tuple[str, str] | None:
        """(fingerprint, shape) of the statement, computed once; None without a shaper."""
        if self.shaped is None and self.shaper is not None:
            self.shaped = self.shaper(self.sql)
        return self.shaped


#: The statement being answered in this thread (set by :meth:`AuditTrail.recording`).
_CURRENT: ContextVar[Trace | None] = ContextVar("dpsql_audit_trace", default=None)


#: Per thread: the running statement's reservation gate (installed by the server's job).
_GATE = threading.local()

#: A gate: a context manager entered around a reservation, yielding a recorder of the ε charged.
Gate = Callable[[], AbstractContextManager[Callable[[float], None]]]


@contextmanager
def reservation_gate(gate: Gate) -> Iterator[None]:
    """Install ``gate`` for the reservations this thread makes (the server's per-statement job).

    Why: when a client stops waiting (statement timeout, cancel) the server must tell it what was
    charged, and the ledger agree with the log. The gate refuses a reservation once its statement
    was abandoned and otherwise holds the abandonment off until the reservation is recorded, so the
    server reads a final figure: charged or not, never 'in flight'."""
    previous = getattr(_GATE, "gate", None)
    _GATE.gate = gate
    try:
        yield
    finally:
        _GATE.gate = previous


@contextmanager
def gated() -> Iterator[Callable[[float], None]]:
    """Around one reservation: the current job's gate (see :func:`reservation_gate`), if any."""
    gate: Gate | None = getattr(_GATE, "gate", None)
    if gate is None:
        yield _ignore
        return
    with gate() as record:
        yield record


def _ignore(_epsilon: float) -> None:
    """The recorder outside a server job: nobody waits to be told."""


def note_charge(charge: Charge) -> Charge:
    """Record that the current statement was charged ``charge`` (returned, for chaining)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.charge = charge
        trace.charges.append(charge)
    return charge


def charged_entry(dataset: str, analyst: str, fingerprint: str, cost: Cost, at: dt.datetime) -> AuditEntry:
    """The row :meth:`dpsql.ledger.Ledger.reserve` writes with a charge, in its transaction: the current
    statement's shape when one is being recorded (else an empty shape and the charge's fingerprint)."""
    trace = _CURRENT.get()
    shape, latency_ms = "", 0.0
    if trace is not None:
        latency_ms = round((time.monotonic() - trace.started) * 1000, 1)
        try:
            shaped = trace.shape()
        except Exception:  # the shape is evidence; the charge must not fail for it
            log.warning("could not shape a charged statement", exc_info=True)
            shaped = None
        if shaped is not None:
            fingerprint, shape = shaped
    return AuditEntry(
        at=at,
        dataset=dataset,
        analyst=analyst,
        fingerprint=fingerprint,
        shape=shape[:MAX_SHAPE_CHARS],
        outcome="charged",
        sqlstate="00000",
        epsilon=cost.epsilon,
        delta=cost.delta,
        rho=cost.rho,
        latency_ms=latency_ms,
    )


def note_cache_hit() -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.cached = True


#: The writer thread exits after this long without rows (and restarts with the next one).
_IDLE_SECONDS = 2.0


#: What folds free rows together: analyst, fingerprint, outcome, SQLSTATE.
_Key = tuple[str, str, str, str]


class AuditLedger(Protocol):
    """What the trail needs of the ledger (:class:`dpsql.ledger.Ledger` is one)."""

    def write_audit(
        self,
        inserts: Sequence[AuditEntry],
        finals: Sequence[AuditEntry] = (),
        repeats: Sequence[tuple[int, int, dt.datetime]] = (),
    ) -> list[int]: ...

    def on_close(self, hook: Callable[[], None]) -> None: ...


class AuditTrail:
    """Queue of audit rows and the thread that appends them to the ledger (best effort, never raises)."""

    def __init__(self, ledger: AuditLedger, dataset: str, shaper: Shaper) -> None:
        self.ledger = ledger
        self.dataset = dataset
        self.shaper = shaper
        self._queue: queue.Queue[AuditEntry | None] = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._dropped = 0
        self._closed = False
        #: Free rows open for folding (key -> row id), and each analyst's open keys; the writer's only.
        self._open: OrderedDict[_Key, int] = OrderedDict()
        self._by_analyst: dict[str, set[_Key]] = {}
        ledger.on_close(self.close)

    @contextmanager
    def recording(self, sql: str, analyst: str) -> Iterator[Trace]:
        """Audit the statement run inside: one row when it ends, however it ends (the error propagates).

        The trace is current for the block (:func:`note_charge`, :func:`note_cache_hit` fill it in)."""
        trace = Trace(sql, analyst, time.monotonic(), shaper=self.shaper)
        token = _CURRENT.set(trace)
        try:
            yield trace
        except Error as exc:
            self.record(trace, exc.sqlstate)
            raise
        except BaseException:
            self.record(trace, "XX000")
            raise
        finally:
            _CURRENT.reset(token)
        self.record(trace, "00000")

    def record(self, trace: Trace, sqlstate: str) -> None:
        """Enqueue the statement's row (or the end of its charges' rows); never blocks on I/O, never raises."""
        try:
            for entry in self._entries(trace, sqlstate):
                self._enqueue(entry)
        except Exception:  # the audit must never become an analyst's error
            log.warning("could not record an audit row", exc_info=True)

    def _entries(self, trace: Trace, sqlstate: str) -> list[AuditEntry]:
        latency_ms = round((time.monotonic() - trace.started) * 1000, 1)
        charges = trace.charges or ([trace.charge] if trace.charge is not None else [])
        if sqlstate != "00000":
            outcome = "failed" if charges else "refused"
        else:
            outcome = "cache hit" if trace.cached and not charges else "answered"
        at = dt.datetime.now(dt.UTC)
        written = [c for c in charges if c.audit_id is not None]
        if written:  # the rows are in the ledger since the charges: set how the statement ended
            return [
                AuditEntry(
                    at=at,
                    dataset=self.dataset,
                    analyst=trace.analyst,
                    fingerprint=c.fingerprint,
                    shape="",
                    outcome=outcome,
                    sqlstate=sqlstate,
                    latency_ms=latency_ms,
                    charge_id=c.id,
                    id=c.audit_id,
                )
                for c in written
            ]
        shaped = trace.shape() or self.shaper(trace.sql)
        fingerprint, shape = shaped
        charge = charges[-1] if charges else None
        cost = charge.cost if charge is not None else None
        return [
            AuditEntry(
                at=at,
                dataset=self.dataset,
                analyst=trace.analyst,
                fingerprint=fingerprint,
                shape=shape[:MAX_SHAPE_CHARS],
                outcome=outcome,
                sqlstate=sqlstate,
                epsilon=cost.epsilon if cost else 0.0,
                delta=cost.delta if cost else 0.0,
                rho=cost.rho if cost else 0.0,
                latency_ms=latency_ms,
                charge_id=charge.id if charge is not None else None,
            )
        ]

    def _enqueue(self, entry: AuditEntry) -> None:
        with self._lock:  # put under the lock: the writer decides to exit idle under it too
            if self._closed:
                return
            if os.getpid() != self._pid:  # a forked worker: its own queue and writer
                self._pid = os.getpid()
                self._queue = queue.Queue(MAX_PENDING)
                self._thread = None
                self._open, self._by_analyst = OrderedDict(), {}
            try:
                self._queue.put_nowait(entry)
            except queue.Full:
                self._dropped += 1
                if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                    log.warning("audit queue full: %d audit rows dropped so far", self._dropped)
                return
            if self._thread is None:  # started on demand; it exits when idle (no thread per idle engine)
                self._thread = threading.Thread(target=self._write_loop, name="dpsql-audit", daemon=True)
                self._thread.start()

    def _write_loop(self) -> None:
        pending = self._queue
        while True:
            try:
                first = pending.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if pending.empty():
                        self._thread = None
                        return
                continue
            batch: list[AuditEntry] = []
            stop = first is None
            if first is not None:
                batch.append(first)
            while not stop and len(batch) < _BATCH:
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            try:
                self._write(batch)
            except Exception as exc:  # the ledger is down: the charges fail closed, the trail loses rows
                log.warning("could not write %d audit rows: %s", len(batch), exc)
            finally:
                for _ in range(len(batch) + (1 if stop else 0)):
                    pending.task_done()
            if stop:
                return

    def _write(self, batch: list[AuditEntry]) -> None:
        """One transaction: new rows, the ends of charged statements, and free statements folded into
        the open row of their key (see the module's docstring)."""
        inserts: list[AuditEntry] = []
        new: dict[_Key, int] = {}  # key -> index in inserts
        finals: list[AuditEntry] = []
        repeats: dict[int, tuple[int, dt.datetime]] = {}
        for entry in batch:
            if entry.charge_id is not None:  # a charged statement ends the analyst's folding
                if entry.id is not None:
                    finals.append(entry)
                else:  # charged through a ledger that wrote no row of its own
                    inserts.append(entry)
                for key in [k for k in new if k[0] == entry.analyst]:
                    del new[key]
                for key in self._by_analyst.pop(entry.analyst, set()):
                    self._open.pop(key, None)
                continue
            entry, key = self._fold_key(entry, new)
            if key in new:
                index = new[key]
                inserts[index] = replace(inserts[index], repeats=inserts[index].repeats + 1, last_at=entry.at)
            elif key in self._open:
                row_id = self._open[key]
                self._open.move_to_end(key)
                count, _ = repeats.get(row_id, (0, entry.at))
                repeats[row_id] = (count + 1, entry.at)
            else:
                new[key] = len(inserts)
                inserts.append(entry)
        ids = self.ledger.write_audit(inserts, finals, [(i, n, at) for i, (n, at) in repeats.items()])
        for key, index in new.items():
            self._open[key] = ids[index]
            self._by_analyst.setdefault(key[0], set()).add(key)
        while len(self._open) > MAX_OPEN_ROWS:
            old, _ = self._open.popitem(last=False)
            self._by_analyst.get(old[0], set()).discard(old)

    def _fold_key(self, entry: AuditEntry, new: dict[_Key, int]) -> tuple[AuditEntry, _Key]:
        """The entry's folding key; past :data:`MAX_OPEN_SHAPES` open shapes of its analyst, the entry
        becomes the analyst's row for other shapes of this outcome and SQLSTATE."""
        key = (entry.analyst, entry.fingerprint, entry.outcome, entry.sqlstate)
        if key in new or key in self._open:
            return entry, key
        open_now = len(self._by_analyst.get(entry.analyst, ())) + sum(1 for k in new if k[0] == entry.analyst)
        if open_now < MAX_OPEN_SHAPES:
            return entry, key
        entry = replace(entry, fingerprint="", shape=OTHER_SHAPES)
        return entry, (entry.analyst, "", entry.outcome, entry.sqlstate)

    def flush(self) -> None:
        """Wait until every enqueued row has been written (or given up on)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is pending and stop the writer (before the ledger closes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None and thread.is_alive() and os.getpid() == self._pid:
            self._queue.put(None)
            thread.join(timeout=10)
