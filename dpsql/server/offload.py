"""Routing long statements in a helper process, so one analyst's parsing never holds the server's GIL.

Splitting and routing a statement is CPU-bound Python (sqlglot): ~0.3 s for a 250 kB catalog
statement. Run on the server's worker threads, a few such statements keep the GIL busy and every
other analyst's statement waits for it at each step (issue #27 item 1: another analyst's DP COUNT
went from 11 ms to 167 ms while one analyst sent 250 kB catalog statements on 8 connections).
Statements longer than the inline threshold are therefore split and routed by one helper
process (``spawn``), which parses on its own core and GIL; the calling worker thread only waits.

Fair share: each analyst has at most one statement in the helper at a time (its others wait in
their own worker slots), so the helper's FIFO queue holds at most one statement per analyst.
A parse that outlives its statement's deadline is left to finish; one that runs past
:data:`HARD_LIMIT` seconds has its helper process killed (the next call starts a new one).
Until the helper has started (``spawn`` and importing sqlglot take a second or more), statements are
routed in the calling thread as before, so the helper's start never counts against a statement's
timeout. One helper serves every server of the process (:meth:`Offload.shared`).

The helper parses a long statement once (issue #39, "one parse per wire statement"): a statement the engine
runs comes back as its parsed tree (:meth:`sqlglot.exp.Expression.dump`: data, loaded with
:meth:`~sqlglot.exp.Expression.load`, never pickled code), or as the error the engine's parse gave it, and
goes to the engine's statement cache. Long IN lists of plain constants travel as (text, is-string) pairs and
are rebuilt as literals (loading them node by node would cost the server's GIL more than parsing them).

Privacy: only SQL text crosses to the helper, never data; its answer (a route, statement texts, the parsed
statement) depends on the text and the policy's table names only.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql import errors
from dpsql.analyze.statement import Failed, Kind, Statement, Statements, check, parse_kind
from dpsql.errors import Error, InternalError, QueryCanceled
from dpsql.fingerprint import statement_shape
from dpsql.sqltext import split_statements

from . import catalog
from .limits import Job
from .shadow_guard import Verdict, vet

log = logging.getLogger("dpsql.server")

#: A helper that has parsed one statement for this long is killed (sqlglot takes ~0.3 s for 256 kB).
HARD_LIMIT = 30.0
#: How often a waiting worker thread wakes up, so a cancel or timeout raised in it is delivered.
_POLL = 0.05


@dataclass(frozen=True)
class Routed:
    """A long statement as the helper read it: route, shape (:func:`~dpsql.fingerprint.statement_shape`)
    and guard verdict (:func:`~.shadow_guard.vet`, for statements the shadow may run); for the engine's
    statements, what :func:`~dpsql.analyze.statement.classify` made of it (:meth:`install`)."""

    route: catalog.Route
    shape: str | None
    verdict: Verdict | None
    #: The statement's kind, tree (:func:`_pack`) and EXPLAIN target; or the error its parse raised
    #: (class name, message, detail, hint, position).
    kind: str = ""
    tree: tuple[list[dict[str, Any]], list[list[tuple[str, bool]]]] | None = None
    target: str = ""
    refusal: tuple[str, str, str | None, str | None, int | None] | None = None

    def install(self, sql: str, statements: Statements) -> None:
        """Put the statement (or its refusal) into the engine's cache: the engine does not parse it again."""
        if self.refusal is not None:
            name, message, detail, hint, position = self.refusal
            error = _error(name, message, hint)
            error.detail, error.position = detail, position
            statements.fail(sql, error, None, self.shape or "")
        elif self.tree is not None:
            tree = _unpack(*self.tree)
            statements.put(Statement(sql, Kind(self.kind), tree, self.target, self.shape or ""))


#: IN lists of at least this many plain constants travel packed (:func:`_pack`).
_PACKED = 16


def _pack(tree: exp.Expression) -> tuple[list[dict[str, Any]], list[list[tuple[str, bool]]]]:
    """``tree`` as data: its dump, with each long IN list of plain literals taken out (in place: the
    helper's own tree) as (text, is-string) pairs, and its node marked with the list's index."""
    lists: list[list[tuple[str, bool]]] = []
    for node in tree.find_all(exp.In):
        values = node.expressions
        if len(values) >= _PACKED and all(type(v) is exp.Literal and not v.comments for v in values):
            node.meta["dpsql_packed"] = len(lists)
            lists.append([(str(v.this), bool(v.args.get("is_string"))) for v in values])
            node.set("expressions", [])
    return tree.dump(), lists


def _unpack(dump: list[dict[str, Any]], lists: list[list[tuple[str, bool]]]) -> exp.Expression:
    """The tree :func:`_pack` packed, with its IN lists' literals rebuilt as the parser builds them."""
    tree = exp.Expression.load(dump)
    assert isinstance(tree, exp.Expression)
    if lists:
        for node in tree.find_all(exp.In):
            index = node.meta.pop("dpsql_packed", None) if node._meta else None
            if index is not None:
                node.set("expressions", [exp.Literal(this=text, is_string=quoted) for text, quoted in lists[index]])
    return tree


class _Names:
    """What :func:`~dpsql.server.catalog.route_of` asks of a policy, for the helper: its table names."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def table(self, name: str) -> object | None:
        return True if name.lower() in self.names or name in self.names else None


def _route_of(sql: str, names: frozenset[str]) -> tuple[str, Any]:
    """The route, and what the server would otherwise scan the long text for on its own threads: the
    statement's shape (its logged fingerprint), for the shadow catalog the guard's verdict, and for the
    engine the statement as parsed (or refused): the one parse of the statement."""
    if not split_statements(sql):
        return "ok", Routed("empty", None, None)
    policy: Any = _Names(names)  # what routing asks of a policy
    shape = statement_shape(sql)  # lexical for a long text: no parse
    tree = None
    try:
        try:
            statement = parse_kind(sql)
            tree = statement.tree
            check(statement)
        except Error as exc:
            route = catalog.route_of_refused(Failed(sql, exc, shape, tree), policy)
            refusal = (type(exc).__name__, exc.message, exc.detail, exc.hint, exc.position)
            return "ok", Routed(route, shape, _verdict(sql, route), refusal=refusal if route == "engine" else None)
        route = catalog.route_of_statement(statement, policy)
    except Error as exc:
        return "error", (type(exc).__name__, exc.message, exc.hint)
    if route != "engine":
        return "ok", Routed(route, shape, _verdict(sql, route))
    packed = None if statement.kind is Kind.EXPLAIN else _pack(statement.tree)
    return "ok", Routed(route, shape, None, statement.kind.value, packed, statement.target)


def _verdict(sql: str, route: catalog.Route) -> Verdict | None:
    return vet(sql) if route in ("catalog", "tableless") else None


def _error(name: str, message: str, hint: str | None) -> Error:
    """The error the helper reported, as its class (an unknown name: an internal error)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Error):
        return cls(message, hint=hint)
    return InternalError(message)


def _split(sql: str) -> tuple[str, Any]:
    return "ok", split_statements(sql)


def _timed(fn: Callable[..., tuple[str, Any]], *args: Any) -> tuple[tuple[str, Any], float]:
    """In the helper: ``fn``'s answer and the CPU time it took there (charged to the analyst's share)."""
    started = time.process_time()
    answer = fn(*args)
    return answer, time.process_time() - started


#: The helper's CPU priority (``nice``): one analyst's long statements, parsed there, yield the
#: cores to the server's event loop and to every analyst's queries (a 250 kB IN list takes ~1 s).
HELPER_NICE = 10


#: How often the helper checks that the server that started it is still its parent.
_ORPHAN_POLL = 0.5


def _lower_priority() -> None:
    """Initializer of the helper process: lower its CPU priority (best effort), and end it as soon as its
    server process is gone, however that ended (``kill -9``, a shutdown deadline): a parse in progress
    would otherwise keep an orphaned helper running (issue #41: two stayed for 50 minutes)."""
    with contextlib.suppress(OSError):
        os.nice(HELPER_NICE)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_POLL)
        os._exit(0)

    threading.Thread(target=watch, name="dpsql-helper-orphan-watch", daemon=True).start()


def _warm() -> None:
    """Nothing: the helper imports this module (so the router and sqlglot) to run it, once, before
    the first real call."""


class Offload:
    """One helper process, started on first use; shared by all connections of a server."""

    _shared: Offload | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._ready = threading.Event()
        self._analysts: dict[str, threading.Semaphore] = {}
        self._closed = False

    @classmethod
    def shared(cls) -> Offload:
        """The process's helper (started on first use, stopped at exit)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
                atexit.register(cls._shared.close)
            return cls._shared

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise InternalError("server is shutting down")
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=ctx, initializer=_lower_priority
                )
                self._ready.clear()
                warm = self._pool.submit(_warm)
                warm.add_done_callback(self._warmed)
            return self._pool

    def _warmed(self, future: concurrent.futures.Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._ready.set()

    def start(self, timeout: float | None = None) -> bool:
        """Start the helper now; True once it is ready (within ``timeout`` seconds)."""
        self._executor()
        return self._ready.wait(timeout)

    def _share(self, analyst: str) -> threading.Semaphore:
        with self._lock:
            sem = self._analysts.get(analyst)
            if sem is None:
                sem = self._analysts[analyst] = threading.Semaphore(1)
            return sem

    def route_of(self, analyst: str, sql: str, tables: frozenset[str]) -> Routed:
        """:func:`~dpsql.server.catalog.route_of` in the helper ("empty" for no statement), with the
        statement's shape and guard verdict."""
        status, value = self._call(analyst, _route_of, sql, tables)
        if status == "error":
            raise _error(*value)
        assert isinstance(value, Routed)
        return value

    def split(self, analyst: str, sql: str) -> list[str]:
        return list(self._call(analyst, _split, sql)[1])

    def _call(self, analyst: str, fn: Callable[..., tuple[str, Any]], *args: Any) -> tuple[str, Any]:
        """Run ``fn`` in the helper from a worker thread; a cancel raised in this thread stops the wait."""
        self._executor()  # starts the helper if needed
        if not self._ready.is_set():
            return fn(*args)  # still starting: here, as before the helper existed
        share = self._share(analyst)
        while not share.acquire(timeout=_POLL):
            pass
        started = time.monotonic()
        used = 0.0
        try:
            future = self._executor().submit(_timed, fn, *args)
            try:
                while True:
                    try:
                        result, used = future.result(timeout=_POLL)
                        return result
                    except concurrent.futures.TimeoutError:
                        if time.monotonic() - started > HARD_LIMIT:
                            self._kill(future)
                            raise QueryCanceled("canceling statement: parsing took too long") from None
            except BrokenProcessPool:
                self._reset()
                raise InternalError("the statement parser process stopped") from None
            except BaseException:
                if not future.cancel() and not future.done():
                    self._watch(future, started)
                raise
        finally:
            share.release()
            if (job := Job.current()) is not None:  # the helper's CPU counts against the analyst's share
                job.add_cpu(used if used else time.monotonic() - started)

    def _watch(self, future: concurrent.futures.Future[Any], started: float) -> None:
        """Nobody waits for ``future`` any more: kill the helper if it is still busy at the hard limit."""
        delay = max(0.0, HARD_LIMIT - (time.monotonic() - started))

        def check() -> None:
            if not future.done():
                self._kill(future)

        timer = threading.Timer(delay, check)
        timer.daemon = True
        timer.start()

    def _kill(self, future: concurrent.futures.Future[Any]) -> None:
        log.warning("statement parser process busy for over %.0f s: restarting it", HARD_LIMIT)
        with self._lock:
            pool, self._pool = self._pool, None
            self._ready.clear()
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    proc.kill()
            with contextlib.suppress(Exception):
                pool.shutdown(wait=False, cancel_futures=True)

    def _reset(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._ready.clear()
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the helper now (at exit): a parse in progress is abandoned, the helper holds no state."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    proc.kill()
            with contextlib.suppress(Exception):
                pool.shutdown(wait=False, cancel_futures=True)
