"""What one connection writes to its client: messages, errors and rows, with back-pressure.

A client that does not read must stop the server producing more for it, whatever the size of
its rows: replies are drained every :data:`DRAIN_BYTES` (and after each message's replies, by
the connection), and a single message larger than that, a second copy of its row until the
client reads it, is held in the session's memory (:mod:`.memory`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from dpsql.errors import Error

from . import protocol as pq
from .memory import SessionMemory
from .protocol import Diagnostic, WireViolation
from .results import Outcome
from .types import encode_value

log = logging.getLogger("dpsql.server")

#: Reply bytes written between two drains of the socket (backpressure from slow clients): a client
#: that does not read stops the server producing more, whatever the size of its rows.
DRAIN_BYTES = 256 * 1024


def diagnostic(exc: BaseException, severity: str | None = None) -> Diagnostic:
    """The ErrorResponse for ``exc``: its SQLSTATE and texts, or XX000 with nothing internal shown."""
    if isinstance(exc, WireViolation):
        return Diagnostic("FATAL", "08P01", str(exc))
    if isinstance(exc, Error) and exc.sqlstate != "XX000":
        sev = severity or str(getattr(exc, "severity", "ERROR"))
        return Diagnostic(sev, exc.sqlstate, exc.message, exc.detail, exc.hint, exc.position)
    # anything unexpected: the details (and the traceback) go to the operator's log only
    log.error("internal error", exc_info=exc)
    return Diagnostic(severity or "ERROR", "XX000", "internal error")


class Replies:
    """The output side of one connection's socket."""

    def __init__(self, writer: asyncio.StreamWriter, memory: SessionMemory) -> None:
        self.writer = writer
        #: A large reply not yet drained (its bytes held in the session's memory).
        self._wire = memory.hold("reply")
        self._unflushed = 0

    def send(self, data: bytes) -> None:
        self.writer.write(data)
        self._unflushed += len(data)

    async def flush(self) -> None:
        """Wait until the socket buffer has drained below asyncio's high-water mark (at once when it
        is below already): until the client reads, nothing more is produced for it."""
        await self.writer.drain()
        self._unflushed = 0
        if self._wire.nbytes:
            self._wire.give_back()

    def send_error(self, exc: BaseException, severity: str | None = None) -> Diagnostic:
        diag = diagnostic(exc, severity)
        self.send(pq.error_response(diag))
        return diag

    async def send_rows(self, outcome: Outcome, rows: Sequence[tuple[Any, ...]], formats: Sequence[int]) -> None:
        """DataRow messages, drained every :data:`DRAIN_BYTES`: a large result streams to the client with
        backpressure instead of piling up, encoded, in the socket buffer. A single message larger
        than that is a second copy of its row until the client reads it: its bytes are held
        (53200 when the session cannot, the reply then ends with the error)."""
        assert outcome.fields is not None
        oids = [f.type_oid for f in outcome.fields]
        for row in rows:
            cells = (
                row if outcome.encoded else [encode_value(v, o, f) for v, o, f in zip(row, oids, formats, strict=True)]
            )
            message = pq.data_row(cells)
            del cells
            if len(message) > DRAIN_BYTES:
                self._wire.grow(len(message))
            self.send(message)
            del message  # the socket buffer's copy is the only one while we wait for the client
            if self._unflushed >= DRAIN_BYTES:
                await self.flush()

    def send_side_effects(self, outcome: Outcome) -> None:
        for name, value in outcome.status:
            self.send(pq.parameter_status(name, value))
        for notice in outcome.notices:
            self.send(pq.notice_response(notice))
