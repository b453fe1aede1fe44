"""A connection's work in the server's worker pool: fair share, statement timeout, cancel.

Engine statements, long parses and shadow catalog calls block, so they run on the server's
threads while the event loop keeps serving other clients. Each runs under the analyst's fair
share of worker slots (:class:`~.limits.WorkSlots`); the statement timeout covers the wait for a
slot and the run; a CancelRequest, the timeout or the client going away stops the waiting at
once and interrupts the work where the backend allows it, while its slot stays taken until the
work has really stopped (so abandoned work still counts against the analyst's share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dpsql.errors import CatalogUnavailable, ConnectionFailure, Error, QueryCanceled, charged_on_failure

from .limits import Job, is_broken

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger("dpsql.server")

#: After a timeout or cancel, how long the interrupted work may take to end with its own outcome
#: (which then answers: a charged failure says so itself); later it is abandoned (logged when it ends).
STOP_GRACE = 0.1
#: At most this long to learn what an interrupted statement reserved (a reservation in progress).
SETTLE_WAIT = 10.0


def _own_outcome(future: asyncio.Future[Any]) -> bool:
    """Whether interrupted work that ended in the grace period answers for itself: its result, or a
    dpsql error of its own (a budget refusal, a charged failure with its DETAIL) — not an internal
    error the interruption itself may have caused in code that was not expecting it."""
    if future.cancelled():
        return False
    exc = future.exception()
    return exc is None or (isinstance(exc, Error) and exc.sqlstate != "XX000")


class WorkRunner:
    """The work one connection runs in the pool, and what is needed to stop it."""

    def __init__(self, ctx: ServerContext, analyst: Callable[[], str]) -> None:
        self.ctx = ctx
        #: The connected analyst's name ("" before authentication): whose share a run takes.
        self._analyst = analyst
        self._cancel = asyncio.Event()
        #: Work of this connection still running in the pool (abandoned or not), interrupted on close.
        self._jobs: set[Job] = set()
        #: Set when the statement being executed was abandoned and will be logged when it ends.
        self.late = False
        #: When the current message's statement timeout expires (loop time), None: no timeout.
        self.deadline: float | None = None

    def cancel(self) -> None:
        """A CancelRequest for this connection: the statement being waited for stops now."""
        self._cancel.set()

    def interrupt_all(self) -> None:
        """The client is gone: its statements need not finish."""
        loop = asyncio.get_running_loop()
        for job in list(self._jobs):
            loop.run_in_executor(None, job.interrupt)

    async def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_ms: int = 0,
        on_done: Callable[[Any], None] | None = None,
        on_late: Callable[[Any, float], None] | None = None,
        pure: bool = False,
        checkout: Callable[[], Awaitable[object]] | None = None,
    ) -> Any:
        """Run ``fn`` in the pool under this analyst's fair share of worker slots.

        The statement timeout covers the wait for a slot and the run. A CancelRequest, the
        timeout or the client going away interrupts the backend statement when the backend
        allows it; the slot stays taken until the work has really stopped. ``on_done`` runs
        (on the loop) exactly once: when the work finishes, whoever still waits for it, or with
        None when it never started. ``on_late`` runs only if nobody waits for the work any more, with
        the ε the work reserved (what the ledger holds, for the log line).
        ``checkout`` is awaited once the slot is held, before ``fn`` starts (a shared resource such
        as a catalog connection is then held for the run only, never while waiting for a slot);
        ``on_done`` gives it back.
        """
        loop = asyncio.get_running_loop()
        self._cancel.clear()
        deadline = loop.time() + timeout_ms / 1000 if timeout_ms > 0 else None
        if self.deadline is not None:  # the statement timeout runs from the message's arrival
            deadline = self.deadline if deadline is None else min(deadline, self.deadline)

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        user = self._analyst() or "?"
        waiter: asyncio.Future[Any] = asyncio.ensure_future(self._cancel.wait())
        try:
            job, future = await self._start(fn, args, user, waiter, remaining, pure, checkout, on_done)
            return await self._outcome(job, future, waiter, remaining, on_late)
        finally:
            waiter.cancel()

    async def _start(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        user: str,
        waiter: asyncio.Future[Any],
        remaining: Callable[[], float | None],
        pure: bool,
        checkout: Callable[[], Awaitable[object]] | None,
        on_done: Callable[[Any], None] | None,
    ) -> tuple[Job, asyncio.Future[Any]]:
        """Admit the work (the CPU share, a worker slot, the ``checkout``) and start it in the pool. Whatever
        stops it before it starts gives back what was taken and calls ``on_done(None)``; once started, the
        slot, the CPU share and the serial lock are given back when the work really ends."""
        loop = asyncio.get_running_loop()
        slots, share = self.ctx.slots, self.ctx.cpu_share
        serial: asyncio.Lock | None = None
        started = False
        try:
            serial = await self._cpu_admit(user, waiter, remaining)
            share.started(user)
            started = True
            admission = asyncio.ensure_future(slots.acquire(user))
            try:
                done, _ = await asyncio.wait(
                    {admission, waiter}, timeout=remaining(), return_when=asyncio.FIRST_COMPLETED
                )
            except BaseException:
                _drop_admission(admission, slots, user)
                raise
            if admission not in done:
                _drop_admission(admission, slots, user)
                raise self._canceled()
            admission.result()  # 53400 when the queue is full
            if checkout is not None:
                await self._checkout(checkout, waiter, remaining(), slots, user)
            job = Job(pure)
            self._jobs.add(job)
            try:
                future = loop.run_in_executor(self.ctx.executor, job.run, fn, *args)
            except BaseException:
                self._jobs.discard(job)
                slots.release(user)
                raise
        except BaseException:
            if serial is not None:
                serial.release()
            if started:
                share.finished(user, 0.0)
            if on_done is not None:
                on_done(None)
            raise

        def finished(f: asyncio.Future[Any]) -> None:
            slots.release(user)
            share.finished(user, job.cpu)  # its analyst's CPU share: what it used, charged or not
            if serial is not None:
                serial.release()
            self._jobs.discard(job)
            self.ctx.inflight.discard(f)
            if on_done is not None:
                on_done(f)

        self.ctx.inflight.add(future)
        future.add_done_callback(finished)
        return job, future

    async def _outcome(
        self,
        job: Job,
        future: asyncio.Future[Any],
        waiter: asyncio.Future[Any],
        remaining: Callable[[], float | None],
        on_late: Callable[[Any, float], None] | None,
    ) -> Any:
        """Wait for the started work: its result, or, on a cancel or the timeout, the work stopped and either
        its own outcome (when it ends within the grace period) or 57014 saying what it reserved."""
        loop = asyncio.get_running_loop()
        try:
            waiting: set[asyncio.Future[Any]] = {future, waiter}
            done, _ = await asyncio.wait(waiting, timeout=remaining(), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._abandon(job, future, on_late)
            raise
        if future in done:
            return future.result()
        # Stop it and learn what it reserved (final: no reservation can follow); if it then ends
        # within the grace period its own outcome is the answer (an error says what was charged).
        try:
            charged = await asyncio.wait_for(loop.run_in_executor(None, job.settle), SETTLE_WAIT)
        except TimeoutError:
            charged = job.charged
        await asyncio.wait({future}, timeout=STOP_GRACE)  # never raises the work's own error
        if future.done() and _own_outcome(future):
            if isinstance(stopped := future.exception(), QueryCanceled):
                raise self._stopped(stopped)  # the backend only knows it was interrupted
            return future.result()
        self._abandon(job, future, on_late)
        with charged_on_failure(charged):
            raise self._canceled()

    async def _cpu_admit(
        self, user: str, waiter: asyncio.Future[Any], remaining: Callable[[], float | None]
    ) -> asyncio.Lock | None:
        """Wait while ``user`` must yield the CPU to others (:class:`~.cpu_share.CpuShare`); a cancel stops the
        wait. The lock returned (held) makes its statements run one at a time meanwhile."""
        share = self.ctx.cpu_share
        if not share.must_wait(user):
            return None
        admit = asyncio.ensure_future(share.admit(user, remaining))
        try:
            done, _ = await asyncio.wait({admit, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            _drop_serial(admit)
            raise
        if admit not in done:
            _drop_serial(admit)
            raise self._canceled()
        return admit.result()

    async def _checkout(
        self,
        checkout: Callable[[], Awaitable[object]],
        waiter: asyncio.Future[Any],
        timeout: float | None,
        slots: Any,
        user: str,
    ) -> None:
        """Await ``checkout`` while holding a worker slot; on failure, cancel or timeout give the slot back."""
        got = asyncio.ensure_future(checkout())
        try:
            done, _ = await asyncio.wait({got, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if got not in done:
                raise self._canceled()
            got.result()
        except BaseException:
            got.cancel()  # its own cleanup gives back whatever it had not handed over yet
            slots.release(user)
            raise

    def _canceled(self) -> QueryCanceled:
        if self._cancel.is_set():
            return QueryCanceled("canceling statement due to user request")
        return QueryCanceled("canceling statement due to statement timeout")

    def _stopped(self, interrupted: QueryCanceled) -> QueryCanceled:
        """The 57014 of work this runner interrupted, saying why it did (the client's cancel, or the
        statement timeout), with what the work's own error says it was charged."""
        said = self._canceled()
        said.detail, said.charged_epsilon = interrupted.detail, interrupted.charged_epsilon
        said.hint = None if self._cancel.is_set() else interrupted.hint
        return said

    def _abandon(self, job: Job, future: asyncio.Future[Any], on_late: Callable[[Any, float], None] | None) -> None:
        """Nobody waits for ``future`` any more: stop its backend statement if possible, log its end."""
        if not future.done():
            asyncio.get_running_loop().run_in_executor(None, job.interrupt)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # silence late failures
        if on_late is not None:
            self.late = True
            future.add_done_callback(lambda f: on_late(f, job.charged))  # final: the work has ended

    async def shadow_call(self, method: str, *args: Any, timeout_ms: int = 0, **kwargs: Any) -> Any:
        """Run one call on a pooled shadow connection; it returns to the pool when the call has ended."""
        if not self.ctx.catalog_available:
            raise CatalogUnavailable()
        pool = self.ctx.pool()
        user = self._analyst()
        held: list[Any] = []

        async def checkout() -> None:
            """A pooled connection, taken only once the worker slot is held."""
            try:
                held.append(await pool.acquire(user))
            except Error:
                raise
            except Exception as exc:
                log.warning("cannot connect to the catalog server: %s", exc)
                raise ConnectionFailure(
                    "could not connect to the catalog server",
                    hint="DP queries still work; retry catalog queries later.",
                ) from None

        def checkin(_f: Any) -> None:
            if held:
                pool.release(user, held.pop())

        def call() -> Any:
            session = held[0]
            job = Job.current()
            session.arm()
            try:
                with job.stoppable(session.cancel) if job else contextlib.nullcontext():
                    return getattr(session, method)(*args, **kwargs)
            except Exception as exc:
                if is_broken(session):
                    log.warning("catalog server connection lost: %s", exc)
                    raise ConnectionFailure(
                        "the connection to the catalog server was lost",
                        hint="DP queries still work; retry catalog queries later.",
                    ) from None
                raise

        return await self.run(call, timeout_ms=timeout_ms, on_done=checkin, checkout=checkout)


def _drop_serial(admit: asyncio.Future[asyncio.Lock]) -> None:
    """Give back the serial turn a CPU admission got (or stop waiting for it)."""
    if not admit.done():
        admit.cancel()  # the admission releases the lock it may hold
    elif not admit.cancelled() and admit.exception() is None:
        admit.result().release()


def _drop_admission(admission: asyncio.Future[None], slots: Any, user: str) -> None:
    """Give back a worker slot whose statement will not run (or stop waiting for it)."""
    if not admission.done():
        admission.cancel()  # the acquire coroutine releases whatever it already holds
    elif not admission.cancelled() and admission.exception() is None:
        slots.release(user)
