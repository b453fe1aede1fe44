"""One pooled connection to the shadow catalog, every exchange on it bounded in time and size.

The connection is non-blocking (as psycopg makes it) and every wait is a ``select`` with a
deadline, so a shadow that stops reading or answering is given up on (cancelled, its connection
dropped) and can never hold a worker slot or a pooled connection for good. Results are read one
row at a time and capped (:data:`MAX_CATALOG_RESULT_ROWS`, :data:`MAX_CATALOG_RESULT_BYTES`, the
session's memory), so a cross join of catalog tables is cut before it is held.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dpsql.errors import ConnectionFailure, Error, FeatureNotSupported, ProgramLimitExceeded, QueryCanceled, relay

from .protocol import FieldDescription
from .shadow_guard import Verdict, check_catalog_sql, replay
from .shadow_schema import DEFAULT_STATEMENT_TIMEOUT_MS

log = logging.getLogger("dpsql.server.catalog")

#: How much longer than its statement timeout the shadow may take to answer before dpsql gives up
#: on the exchange (cancel, then drop the connection): sending, queueing, reading the result.
EXCHANGE_SLACK = 5.0


@dataclass(slots=True)
class ShadowResult:
    fields: list[FieldDescription] | None
    rows: list[tuple[bytes | None, ...]]
    tag: str


def connection_lost() -> Error:
    return ConnectionFailure(
        "connection to the catalog server was lost",
        hint="Retry the statement: dpsql reconnects to its catalog server (restarting it if needed).",
    )


def _shadow_error(res: Any) -> Error:
    from psycopg.pq import DiagnosticField as F

    def field(code: Any) -> str | None:
        value = res.error_field(code)
        return value.decode("utf-8", "replace") if value else None

    position = field(F.STATEMENT_POSITION)
    return relay(
        field(F.SQLSTATE) or "58000",  # a client-side libpq failure: never XX000
        field(F.MESSAGE_PRIMARY) or "catalog query failed",
        detail=field(F.MESSAGE_DETAIL),
        hint=field(F.MESSAGE_HINT),
        position=int(position) if position and position.isdigit() else None,
    )


def _SQLSTATE_FIELD() -> Any:
    from psycopg.pq import DiagnosticField

    return DiagnosticField.SQLSTATE


def _fields(res: Any, formats: Sequence[int]) -> list[FieldDescription]:
    out = []
    for i in range(res.nfields):
        out.append(
            FieldDescription(
                name=(res.fname(i) or b"").decode("utf-8"),
                type_oid=res.ftype(i),
                type_size=res.fsize(i),
                type_mod=res.fmod(i),
                table_oid=res.ftable(i),
                column_attr=res.ftablecol(i),
                format=formats[i] if i < len(formats) else 0,
            )
        )
    return out


class _GiveUp(Exception):
    """The exchange in progress is abandoned: ``expired`` at its deadline, else cancelled."""

    def __init__(self, expired: bool) -> None:
        super().__init__()
        self.expired = expired


class ShadowSession:
    """One pooled connection to the shadow; blocking calls (run them in a thread).

    Every statement passes :func:`~dpsql.server.shadow_guard.check_catalog_sql` first. A lost
    connection (shadow killed or restarted) is reported as 08006 and re-established on next use.

    The connection is non-blocking (as psycopg makes it): a statement larger than the socket's
    buffer is only sent as the shadow reads it, so it is flushed here, and every wait (sending, the
    result) is a ``select`` with a deadline: ``timeout`` seconds for the whole exchange (the shadow's
    own statement timeout plus some slack), sooner when :meth:`cancel` is called. A shadow that
    does not answer is sent a cancel and given :data:`CANCEL_GRACE` seconds; then the connection is
    closed (the pool discards it) and the call fails with 57014, so the worker and the pooled
    connection always come back.
    """

    def __init__(
        self, connect: Callable[[], Any], timeout: float = DEFAULT_STATEMENT_TIMEOUT_MS / 1000 + EXCHANGE_SLACK
    ) -> None:
        self._connect = connect
        self._conn: Any = None
        self.timeout = timeout
        # libpq connections are not thread-safe; an abandoned (timed-out) call may still be running.
        self._lock = threading.Lock()
        #: Set by :meth:`cancel` (any thread): the exchange in progress stops waiting.
        self._stop = threading.Event()
        self._running = False

    def reconnect(self) -> None:
        with self._lock:
            self._ensure()

    def _ensure(self) -> Any:
        from psycopg.pq import ConnStatus

        conn = self._conn
        if conn is None or conn.closed or conn.pgconn.status != ConnStatus.OK:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            self._conn = None
            self._conn = self._connect()
        return self._conn

    def close(self) -> None:
        self.cancel()
        with self._lock, contextlib.suppress(Exception):
            if self._conn is not None:
                self._conn.close()

    def arm(self) -> None:
        """Before a call that :meth:`cancel` may stop (a cancel before this one is forgotten)."""
        self._stop.clear()

    def cancel(self) -> None:
        """Stop the exchange in progress (safe from any thread): the shadow is asked to cancel it and
        the thread running it stops waiting (see the class docstring)."""
        self._stop.set()
        if self._running:
            _cancel_request(self._conn)

    def _check(self, res: Any) -> Any:
        from psycopg.pq import ConnStatus, ExecStatus

        if res.status in (ExecStatus.FATAL_ERROR, ExecStatus.NONFATAL_ERROR, ExecStatus.BAD_RESPONSE):
            if self._conn.pgconn.status != ConnStatus.OK:
                code = res.error_field(_SQLSTATE_FIELD())
                if not code or code.startswith((b"57P", b"08", b"XX")):
                    raise connection_lost()
            raise _shadow_error(res)
        if res.status not in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK, ExecStatus.EMPTY_QUERY):
            raise FeatureNotSupported("this statement is not supported on the catalog")
        return res

    # -- one exchange, always bounded ----------------------------------------------------------------

    def _exchange(self, body: Callable[[Any, float], _T]) -> _T:
        """Run ``body(pgconn, deadline)`` on the connection; give up at the deadline or on cancel."""
        conn = self._ensure()
        self._running = True
        try:
            return body(conn.pgconn, time.monotonic() + self.timeout)
        except _GiveUp as why:
            self._give_up(conn, why.expired)
            if why.expired:
                raise QueryCanceled(
                    "canceling statement due to statement timeout",
                    hint=f"The catalog server did not answer within {self.timeout:g} s.",
                ) from None
            raise QueryCanceled("canceling statement due to user request") from None
        finally:
            self._running = False

    def _give_up(self, conn: Any, expired: bool) -> None:
        """After a cancel: keep the connection if the shadow ends the statement within the grace, else
        close it (half a statement sent, or a shadow that does not answer, cannot be reused)."""
        if expired:
            _cancel_request(conn)
        pgconn = conn.pgconn
        grace = time.monotonic() + CANCEL_GRACE
        with contextlib.suppress(Exception):
            if pgconn.flush() == 0:
                while self._next_result(pgconn, grace, stoppable=False) is not None:
                    pass
                return
        log.warning("catalog connection dropped: the catalog server did not finish a cancelled statement in time")
        with contextlib.suppress(Exception):
            conn.close()

    def _wait(self, pgconn: Any, deadline: float, write: bool = False, stoppable: bool = True) -> None:
        """Until the socket is readable (or writable, with ``write``): never past ``deadline``, and no
        longer once :meth:`cancel` was called (``select`` releases the GIL, so other threads run)."""
        sock = pgconn.socket
        while True:
            if stoppable and self._stop.is_set():
                raise _GiveUp(expired=False)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _GiveUp(expired=stoppable)
            readable, writable, _ = select.select([sock], [sock] if write else [], [], min(left, _POLL))
            if readable or writable:
                return

    def _flush(self, pgconn: Any, deadline: float) -> None:
        """Send what libpq still holds of the statement (it is larger than the socket's buffer)."""
        while pgconn.flush() != 0:
            self._wait(pgconn, deadline, write=True)
            pgconn.consume_input()  # libpq: input that arrives meanwhile must be read to make progress

    def _next_result(self, pgconn: Any, deadline: float, stoppable: bool = True) -> Any:
        """``PQgetResult`` once it will not block (psycopg's ``get_result`` would hold the GIL while
        libpq waits, and wait without a deadline)."""
        while pgconn.is_busy():
            self._wait(pgconn, deadline, stoppable=stoppable)
            pgconn.consume_input()
        return pgconn.get_result()

    def _last_result(self, pgconn: Any, deadline: float) -> Any:
        result = None
        while (res := self._next_result(pgconn, deadline)) is not None:
            if result is None:
                result = res
        return result

    # -- the calls -------------------------------------------------------------------------------------

    def describe(
        self, sql: str, param_oids: Sequence[int], *, verdict: Verdict | None = None
    ) -> tuple[list[int], list[FieldDescription] | None]:
        """Parameter types and result columns, via an unnamed prepared statement on the shadow.
        ``verdict``: the guard's, already computed for this very text (see :func:`.shadow_guard.vet`)."""
        check_catalog_sql(sql) if verdict is None else replay(verdict)
        with self._lock:
            return self._exchange(lambda pgconn, deadline: self._describe(pgconn, deadline, sql, param_oids))

    def _describe(
        self, pgconn: Any, deadline: float, sql: str, param_oids: Sequence[int]
    ) -> tuple[list[int], list[FieldDescription] | None]:
        pgconn.send_prepare(b"", sql.encode("utf-8"), list(param_oids) or None)
        self._flush(pgconn, deadline)
        self._check(self._last_result(pgconn, deadline))
        pgconn.send_describe_prepared(b"")
        self._flush(pgconn, deadline)
        res = self._check(self._last_result(pgconn, deadline))
        params = [res.param_type(i) for i in range(res.nparams)]
        return params, (_fields(res, []) if res.nfields else None)

    def execute(
        self,
        sql: str,
        params: Sequence[bytes | None] = (),
        param_oids: Sequence[int] = (),
        param_formats: Sequence[int] = (),
        result_formats: Sequence[int] = (),
        *,
        reserve: Callable[[int], None] | None = None,
        verdict: Verdict | None = None,
    ) -> ShadowResult:
        """Run one statement; values come back already encoded in the requested per-column formats.

        ``reserve`` is called with the bytes of the rows as they are read (in steps of 1 MiB, then
        the rest); when it raises, the statement is cancelled and its rows dropped (see
        :mod:`.memory`: the session's, the analyst's or the server's memory is full)."""
        sets = check_catalog_sql(sql) if verdict is None else replay(verdict)
        with self._lock:
            try:
                return self._exchange(
                    lambda pgconn, deadline: self._execute(
                        pgconn, deadline, sql, params, param_oids, param_formats, result_formats, reserve
                    )
                )
            finally:
                if sets:
                    self._reset()

    def _reset(self) -> None:
        """``RESET ALL`` after a statement that called ``set_config``: the connection is pooled, so
        one analyst's settings (search_path, application_name…) must not reach the next one's
        statements. A connection that cannot be reset is closed (the pool discards it)."""

        def reset(pgconn: Any, deadline: float) -> None:
            pgconn.send_query(b"RESET ALL")
            self._flush(pgconn, deadline)
            self._check(self._last_result(pgconn, deadline))

        if self._conn is None or self._conn.closed:
            return  # a new connection starts with the defaults
        try:
            self.arm()  # even after a cancel: the reset itself is short and bounded
            self._exchange(reset)
        except Exception as exc:
            log.warning("catalog connection dropped: its settings could not be reset: %s", exc)
            with contextlib.suppress(Exception):
                self._conn.close()

    def _execute(
        self,
        pgconn: Any,
        deadline: float,
        sql: str,
        params: Sequence[bytes | None],
        param_oids: Sequence[int],
        param_formats: Sequence[int],
        result_formats: Sequence[int],
        reserve: Callable[[int], None] | None = None,
    ) -> ShadowResult:
        wanted = set(result_formats) or {0}
        param_formats = _expand_formats(param_formats, len(params)) if params else []

        def run(fmt: int) -> tuple[Any, list[tuple[bytes | None, ...]]]:
            pgconn.send_query_params(
                sql.encode("utf-8"),
                list(params),
                list(param_oids[: len(params)]) or None,
                param_formats or None,
                result_format=fmt,
            )
            self._flush(pgconn, deadline)
            return self._fetch_capped(pgconn, deadline, reserve)

        by_format = {fmt: run(fmt) for fmt in sorted(wanted)}
        first, first_rows = next(iter(by_format.values()))
        tag = (first.command_status or b"").decode("ascii")
        if first.nfields == 0:
            return ShadowResult(None, [], tag)
        formats = _expand_formats(result_formats, first.nfields)
        rows = [tuple(by_format[formats[c]][1][r][c] for c in range(first.nfields)) for r in range(len(first_rows))]
        return ShadowResult(_fields(first, formats), rows, tag)

    def _fetch_capped(
        self, pgconn: Any, deadline: float, reserve: Callable[[int], None] | None = None
    ) -> tuple[Any, list[tuple[bytes | None, ...]]]:
        """The sent statement's rows, read one at a time (libpq single-row mode) so a result larger
        than :data:`MAX_CATALOG_RESULT_ROWS` rows or :data:`MAX_CATALOG_RESULT_BYTES`, or one that
        ``reserve`` refuses, is cancelled before it is held in memory (a cross join of catalog
        tables can produce gigabytes in the shadow's 5 s). Returns the final result (status,
        fields, command tag) and the rows."""
        from psycopg.pq import ExecStatus

        pgconn.set_single_row_mode()
        rows: list[tuple[bytes | None, ...]] = []
        size, reserved, final, failure = 0, 0, None, None
        refusal: Error | None = None
        while (res := self._next_result(pgconn, deadline)) is not None:
            if res.status == ExecStatus.SINGLE_TUPLE:
                if refusal is not None:
                    continue  # draining after the cancel
                row = tuple(res.get_value(0, c) for c in range(res.nfields))
                # what the row costs in Python (as :func:`.memory.row_size`, inlined: this loop is hot):
                # each value a bytes object (33 bytes + its data), the tuple, its slot in the list
                size += sum(len(v) + 40 for v in row if v is not None) + 8 * len(row) + 56
                rows.append(row)
                if len(rows) > MAX_CATALOG_RESULT_ROWS or size > MAX_CATALOG_RESULT_BYTES:
                    refusal = ProgramLimitExceeded(
                        f"catalog result exceeds {MAX_CATALOG_RESULT_ROWS} rows or {MAX_CATALOG_RESULT_BYTES >> 20} MB",
                        hint="Catalog queries return the schema of the exposed tables; narrow the query.",
                    )
                elif reserve is not None and size - reserved >= _RESERVE_STEP:
                    try:
                        reserve(size - reserved)
                        reserved = size
                    except Error as exc:
                        refusal = exc
                if refusal is not None:
                    rows.clear()
                    _cancel_request(self._conn)
            elif final is None and failure is None:
                try:
                    final = self._check(res)
                except Error as exc:
                    failure = exc
        if refusal is not None:
            raise refusal
        if failure is not None:
            raise failure
        assert final is not None
        if reserve is not None:
            reserve(size - reserved)
        return final, rows


_T = TypeVar("_T")
#: How often a wait on the shadow looks whether it was cancelled (seconds).
_POLL = 0.1
#: After a cancel, how long the shadow has to end the statement before its connection is dropped.
CANCEL_GRACE = 1.0


def _cancel_request(conn: Any) -> None:
    """Ask the shadow to cancel ``conn``'s statement, waiting at most a few seconds for it to listen."""
    if conn is None:
        return
    with contextlib.suppress(Exception):
        if hasattr(conn, "cancel_safe"):
            conn.cancel_safe(timeout=2 * CANCEL_GRACE)
        else:  # pragma: no cover - psycopg < 3.2
            conn.cancel()


#: Largest catalog result one statement may return (the shadow holds empty tables: real metadata
#: queries return far less; a cross join of catalog tables would otherwise fill the server's memory).
MAX_CATALOG_RESULT_ROWS = 100_000
MAX_CATALOG_RESULT_BYTES = 32 << 20  # as held in Python (values and tuples), not just the data
#: A catalog result's bytes are reserved (see :mod:`.memory`) in steps of this while it is read.
_RESERVE_STEP = 1 << 20


def _expand_formats(formats: Sequence[int], n: int) -> list[int]:
    if not formats:
        return [0] * n
    if len(formats) == 1:
        return [formats[0]] * n
    return list(formats)
