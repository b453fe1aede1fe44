"""What a statement is, decided once on its parsed tree: a query, an EXPLAIN of one, or an INSERT.

Routing by text prefix misread statements behind comments (ORMs and sqlcommenter prepend
``/* … */``); sqlglot drops comments, so the tree says what the statement is. Each distinct text
is parsed once per engine (:class:`Statements`, an LRU): later executions of the same text reuse the
tree, which is shared (whoever rewrites it works on a copy).
"""

from __future__ import annotations

import copy
import enum
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn

from sqlglot import exp

from dpsql.analyze.checks import limit_case_branches
from dpsql.analyze.parse import parse_statement, skip_comments, too_complex
from dpsql.errors import Error, FeatureNotSupported, SyntaxError_
from dpsql.lru import LRU

#: The one EXPLAIN option accepted: ``(FORMAT TEXT)`` or ``(FORMAT JSON)`` (pgcli sends the latter).
EXPLAIN_OPTIONS = re.compile(r"\(\s*format\s+(text|json)\s*\)", re.IGNORECASE)


def explain_target(sql: str) -> str | None:
    """The query inside ``EXPLAIN <query>``; EXPLAIN ANALYZE is refused (it reveals timings and row counts)."""
    stripped = skip_comments(sql)
    if stripped[:7].upper() != "EXPLAIN" or stripped[7:8].isalnum() or stripped[7:8] == "_":
        return None
    rest = skip_comments(stripped[7:])
    if (options := EXPLAIN_OPTIONS.match(rest)) is not None:
        rest = rest[options.end() :]
        if not rest.strip().rstrip(";").strip():
            raise SyntaxError_("syntax error at end of input")
        return rest
    if not rest.strip().rstrip(";").strip():  # a bare EXPLAIN: PostgreSQL's 42601, never an IndexError
        raise SyntaxError_("syntax error at end of input")
    if rest[:1] == "(" or rest.split(None, 1)[0].upper() in ("ANALYZE", "ANALYSE", "VERBOSE"):
        raise FeatureNotSupported(
            "EXPLAIN options are not supported",
            hint="EXPLAIN ANALYZE would reveal exact row counts and timings; use plain EXPLAIN.",
        )
    return rest


class Kind(enum.Enum):
    QUERY = "query"
    EXPLAIN = "explain"
    INSERT = "insert"


@dataclass(frozen=True, slots=True)
class Statement:
    sql: str
    kind: Kind
    #: The parsed statement (for EXPLAIN: a bare ``EXPLAIN`` command).
    tree: exp.Expression
    #: For EXPLAIN: the text of the query it explains.
    target: str = ""
    #: :func:`dpsql.fingerprint.statement_shape` of ``sql``, read from the tree before anything rewrote it
    #: (the server's log line and the engine's fingerprint use it: no second parse).
    shape: str = ""


def classify(sql: str) -> Statement:
    """Parse ``sql`` (42601 on a syntax error, 54001 when too deep) and say what it is.

    EXPLAIN is recognised by its first keyword after any comments (sqlglot keeps it as an opaque
    command); the explained query is classified when it is run.
    """
    statement = parse_kind(sql)
    check(statement)
    return statement


def parse_kind(sql: str) -> Statement:
    """:func:`classify` up to the checks of the parsed tree (:func:`check`)."""
    target = explain_target(sql)
    if target is not None:
        return Statement(sql, Kind.EXPLAIN, exp.Command(this="EXPLAIN"), target)
    try:
        tree = parse_statement(sql)
    except RecursionError:
        raise too_complex() from None
    return Statement(sql, Kind.INSERT if isinstance(tree, exp.Insert) else Kind.QUERY, tree)


def check(statement: Statement) -> None:
    """The refusals read off a parsed query (54000: too many CASE branches), right after parsing: before
    the tree is copied, folded or routed."""
    if statement.kind is Kind.QUERY:
        limit_case_branches(statement.tree)


@dataclass(frozen=True, slots=True)
class Failed:
    """A text :func:`classify` refused: its error (raised again, as a copy, for every later use of the text,
    which the refusal depends on only), the fingerprint shape of its text, and the tree when the refusal came
    after parsing (the server still routes on it)."""

    sql: str
    error: Error
    shape: str
    tree: exp.Expression | None = None

    def raise_again(self) -> NoReturn:
        raise copy.copy(self.error)


#: What a parsed or planned statement holds per node of its tree (tracemalloc: 500 to 1,000 bytes).
NODE_BYTES = 1024
#: The most the parsed statements of one engine may hold (and, apart, its plans): ~64k nodes.
CACHE_BYTES = 64 << 20


def tree_bytes(sql: str, tree: exp.Expression) -> int:
    """The bytes a statement's text and tree hold, estimated from its node count (a walk costs
    microseconds per node; parsing it cost far more)."""
    return sys.getsizeof(sql) + NODE_BYTES * sum(1 for _ in tree.walk())


class Statements:
    """Classified statements by text, least recently used evicted first, within :data:`CACHE_BYTES`;
    thread-safe."""

    def __init__(
        self,
        size: int = 1024,
        shrink: Callable[[exp.Expression], None] | None = None,
        shape: Callable[[str, exp.Expression | None], str] | None = None,
    ) -> None:
        self._items: LRU[str, Statement] = LRU(size, CACHE_BYTES)
        #: Applied to each new query's tree in place, before it is cached or copied (the engine's: IN lists
        #: shrunk by :func:`dpsql.analyze.in_lists.shrink_in_lists`).
        self._shrink = shrink
        #: The statement's fingerprint shape, read from its tree before :attr:`_shrink` changes it (the
        #: engine's: :func:`dpsql.fingerprint.tree_shape`).
        self._shape = shape
        #: Texts known to be plain single queries (neither composite nor a schema probe, whatever their
        #: parameters): a repeat skips :func:`dpsql.outer.route`'s copy of the tree. Decided from the text
        #: and the engine's (fixed) policy only.
        self._plain: LRU[str, bool] = LRU(size, CACHE_BYTES)
        #: Texts :func:`classify` refused, by text: a failing statement is parsed once too (its route, its
        #: fingerprint, the engine's refusal and its audit row read this). Within an eighth of the bytes: a
        #: refusal keeps a tree only when it came after parsing.
        self._failed: LRU[str, Failed] = LRU(size, CACHE_BYTES // 8)

    def get(self, sql: str) -> Statement:
        """The statement for ``sql``, shared: copy its tree before rewriting it. Raises what :func:`classify`
        raised for it (every time: parsed once)."""
        cached = self._items.get(sql)
        if cached is not None:
            return cached
        if (failed := self._failed.get(sql)) is not None:
            failed.raise_again()
        tree = None
        try:
            statement = parse_kind(sql)
            tree = statement.tree
            check(statement)
        except Error as exc:
            self.fail(sql, exc, tree).raise_again()
        return self.put(statement)

    def put(self, statement: Statement) -> Statement:
        """Cache ``statement`` as parsed (by :func:`classify`, here or in the server's helper process): its
        shape read from the tree unless it has one, then its IN lists shrunk."""
        sql = statement.sql
        if self._shape is not None and not statement.shape:
            statement = replace(
                statement, shape=self._shape(sql, None if statement.kind is Kind.EXPLAIN else statement.tree)
            )
        if self._shrink is not None and statement.kind is Kind.QUERY:
            self._shrink(statement.tree)
        return self._items.put(sql, statement, tree_bytes(sql, statement.tree))

    def fail(self, sql: str, error: Error, tree: exp.Expression | None, shape: str = "") -> Failed:
        """Remember that :func:`classify` refused ``sql`` with ``error`` (``tree``: if it parsed)."""
        if not shape and self._shape is not None:
            shape = self._shape(sql, tree)
        failed = Failed(sql, copy.copy(error), shape, tree)
        size = sys.getsizeof(sql) + (0 if tree is None else tree_bytes("", tree))
        return self._failed.put(sql, failed, size)

    def cached(self, sql: str) -> Statement | None:
        """The statement for ``sql`` if it was classified already (never parses)."""
        return self._items.get(sql)

    def failure(self, sql: str) -> Failed | None:
        """How :func:`classify` refused ``sql``, if it did already (never parses)."""
        return self._failed.get(sql)

    def shape(self, sql: str) -> str | None:
        """The fingerprint shape of ``sql`` if it was classified (or refused) already."""
        found = self._items.get(sql) or self._failed.get(sql)
        return found.shape if found is not None and found.shape else None

    def plain(self, sql: str) -> bool:
        """Whether ``sql`` was found to be a plain single query (a dict lookup)."""
        return self._plain.get(sql) is not None

    def mark_plain(self, sql: str) -> None:
        self._plain.put(sql, True, sys.getsizeof(sql))
