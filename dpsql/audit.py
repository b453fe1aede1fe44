"""The audit trail: one row per statement an analyst sends through the engine, and reading it back.

Every statement the engine sees — answered, answered from the cache, refused before any charge,
or failed after its charge — leaves one row in the ledger's own database (``dpsql_audit``,
append-only): time, analyst, dataset, the keyed fingerprint and the *shape* of the statement
(:func:`dpsql.fingerprint.statement_shape`: every constant, ``IN`` list and sign replaced by
``?``, so no constant an analyst filtered on and no data value is ever written), the ε, δ and ρ
charged, the outcome with its SQLSTATE, and the latency. Free refusals are recorded too: an
analyst probing for error oracles shows up in the trail although they spend nothing.

Privacy and availability argument:

* Nothing in a row depends on the data except the latency (and ``failed`` after a charge, which
  the analyst saw anyway as their error). The trail is read by the curator only (``dpsql audit``,
  never over the wire), who holds the data already; the analyst learns nothing from it, and the
  latency they could measure themselves. So recording it opens no channel (tested on neighbouring
  databases: equal rows apart from ``latency_ms`` and ``at``).
* Recording never reaches the analyst: :meth:`AuditTrail.record` only enqueues (no I/O, no
  exception); a writer thread appends batches in short transactions. If the ledger cannot take
  them, or the queue is full (a flood of statements), rows are dropped and the operator's log says
  how many — the *charge* is still in the ledger, written durably before any release; the trail is
  evidence, not the accountant. :meth:`AuditTrail.flush` and ``close`` drain it.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsql.errors import Error

if TYPE_CHECKING:
    from dpsql.ledger import AuditEntry, Charge, Ledger, LeverEvent

log = logging.getLogger("dpsql.audit")

#: Longest shape stored (a 256 kB refused statement must not fill the ledger's disk).
MAX_SHAPE_CHARS = 2000
#: Rows waiting for the writer; beyond this, rows are dropped (and counted in the log).
MAX_PENDING = 10_000
_BATCH = 256

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


#: The statement being answered in this thread (set by :meth:`AuditTrail.recording`).
_CURRENT: ContextVar[Trace | None] = ContextVar("dpsql_audit_trace", default=None)


def note_charge(charge: Charge) -> Charge:
    """Record that the current statement was charged ``charge`` (returned, for chaining)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.charge = charge
    return charge


def note_cache_hit() -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.cached = True


#: The writer thread exits after this long without rows (and restarts with the next one).
_IDLE_SECONDS = 2.0


class AuditTrail:
    """Queue of audit rows and the thread that appends them to the ledger (best effort, never raises)."""

    def __init__(self, ledger: Ledger, dataset: str, shaper: Shaper) -> None:
        self.ledger = ledger
        self.dataset = dataset
        self.shaper = shaper
        self._queue: queue.Queue[AuditEntry | None] = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._dropped = 0
        self._closed = False
        ledger.on_close(self.close)

    @contextmanager
    def recording(self, sql: str, analyst: str) -> Iterator[Trace]:
        """Audit the statement run inside: one row when it ends, however it ends (the error propagates).

        The trace is current for the block (:func:`note_charge`, :func:`note_cache_hit` fill it in)."""
        trace = Trace(sql, analyst, time.monotonic())
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
        """Enqueue one row; never blocks on I/O and never raises."""
        try:
            self._enqueue(self._entry(trace, sqlstate))
        except Exception:  # the audit must never become an analyst's error
            log.warning("could not record an audit row", exc_info=True)

    def _entry(self, trace: Trace, sqlstate: str) -> AuditEntry:
        from dpsql.ledger import AuditEntry

        latency_ms = round((time.monotonic() - trace.started) * 1000, 1)
        fingerprint, shape = self.shaper(trace.sql)
        charge = trace.charge
        if sqlstate != "00000":
            outcome = "failed" if charge is not None else "refused"
        else:
            outcome = "cache hit" if trace.cached else "answered"
        cost = charge.cost if charge is not None else None
        return AuditEntry(
            at=dt.datetime.now(dt.UTC),
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

    def _enqueue(self, entry: AuditEntry) -> None:
        with self._lock:  # put under the lock: the writer decides to exit idle under it too
            if self._closed:
                return
            if os.getpid() != self._pid:  # a forked worker: its own queue and writer
                self._pid = os.getpid()
                self._queue = queue.Queue(MAX_PENDING)
                self._thread = None
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
                self.ledger.record_audit(batch)
            except Exception as exc:  # the ledger is down: the charges fail closed, the trail loses rows
                log.warning("could not write %d audit rows: %s", len(batch), exc)
            finally:
                for _ in range(len(batch) + (1 if stop else 0)):
                    pending.task_done()
            if stop:
                return

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


# --- reading it back (``dpsql audit``) -----------------------------------------------------------

AUDIT_COLUMNS = (
    "at",
    "analyst",
    "event",
    "sqlstate",
    "epsilon",
    "delta",
    "rho",
    "latency_ms",
    "fingerprint",
    "shape",
    "by",
    "reason",
)


def audit_rows(
    ledger: Ledger, dataset: str, *, analyst: str | None = None, since: dt.datetime | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Statements and curator actions on ``dataset``, newest first, at most ``limit`` of them.

    Reads the ledger only — never the data."""
    rows = [_statement_row(e) for e in ledger.audit(dataset, analyst, since=since, limit=limit)]
    rows += [_lever_row(e) for e in ledger.lever_events(dataset, analyst, since=since, limit=limit)]
    rows.sort(key=lambda r: r["at"], reverse=True)
    return rows[:limit]


def _statement_row(entry: AuditEntry) -> dict[str, Any]:
    return {
        "at": entry.at,
        "analyst": entry.analyst,
        "event": entry.outcome,
        "sqlstate": entry.sqlstate,
        "epsilon": entry.epsilon,
        "delta": entry.delta,
        "rho": entry.rho,
        "latency_ms": entry.latency_ms,
        "fingerprint": entry.fingerprint,
        "shape": entry.shape,
        "by": None,
        "reason": None,
    }


def _lever_row(event: LeverEvent) -> dict[str, Any]:
    return {
        "at": event.at,
        "analyst": event.analyst,
        "event": event.kind,
        "sqlstate": None,
        "epsilon": event.epsilon,
        "delta": event.delta,
        "rho": None,
        "latency_ms": None,
        "fingerprint": None,
        "shape": None,
        "by": event.by,
        "reason": event.reason,
    }


def _cell(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat(timespec="milliseconds")
    return value


def as_json(rows: Sequence[dict[str, Any]]) -> str:
    return json.dumps([{k: _cell(v) for k, v in row.items()} for row in rows])


def as_csv(rows: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(AUDIT_COLUMNS)
    for row in rows:
        writer.writerow(["" if row[c] is None else _cell(row[c]) for c in AUDIT_COLUMNS])
    return out.getvalue()


def as_table_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows for the aligned text table (shape last, cut to 60 characters)."""
    table = []
    for row in rows:
        shape = row["shape"] or row["reason"] or ""
        table.append(
            (
                _cell(row["at"]),
                row["analyst"],
                row["event"],
                row["sqlstate"],
                row["epsilon"],
                row["delta"],
                row["latency_ms"],
                row["by"],
                shape if len(shape) <= 60 else shape[:57] + "...",
            )
        )
    return table


TABLE_COLUMNS = ("at", "analyst", "event", "sqlstate", "epsilon", "delta", "latency_ms", "by", "shape / reason")
