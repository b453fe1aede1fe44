"""What a statement is, decided once on its parsed tree: a query, an EXPLAIN of one, or an INSERT.

Routing by text prefix misread statements behind comments (ORMs and sqlcommenter prepend
``/* … */``); sqlglot drops comments, so the tree says what the statement is. Each distinct text
is parsed once per engine (:class:`Statements`, an LRU): later executions of the same text reuse the
tree, which is shared (whoever rewrites it works on a copy).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sqlglot import exp

from dpsql.analyze.checks import limit_case_branches
from dpsql.analyze.parse import parse_statement, too_complex
from dpsql.explain import explain_target
from dpsql.lru import LRU


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


def classify(sql: str) -> Statement:
    """Parse ``sql`` (42601 on a syntax error, 54001 when too deep) and say what it is.

    EXPLAIN is recognised by its first keyword after any comments (sqlglot keeps it as an opaque
    command); the explained query is classified when it is run.
    """
    target = explain_target(sql)
    if target is not None:
        return Statement(sql, Kind.EXPLAIN, exp.Command(this="EXPLAIN"), target)
    try:
        tree = parse_statement(sql)
    except RecursionError:
        raise too_complex() from None
    if isinstance(tree, exp.Insert):
        return Statement(sql, Kind.INSERT, tree)
    limit_case_branches(tree)  # 54000 right after parsing: before the tree is copied, folded or routed
    return Statement(sql, Kind.QUERY, tree)


class Statements:
    """Classified statements by text, least recently used evicted first; thread-safe."""

    def __init__(self, size: int = 1024) -> None:
        self._items: LRU[str, Statement] = LRU(size)
        #: Texts known to be plain single queries (neither composite nor a schema probe, whatever their
        #: parameters): a repeat skips :func:`dpsql.outer.route`'s copy of the tree. Decided from the text
        #: and the engine's (fixed) policy only.
        self._plain: LRU[str, bool] = LRU(size)

    def get(self, sql: str) -> Statement:
        """The statement for ``sql``, shared: copy its tree before rewriting it."""
        return self._items.get(sql) or self._items.put(sql, classify(sql))

    def plain(self, sql: str) -> bool:
        """Whether ``sql`` was found to be a plain single query (a dict lookup)."""
        return self._plain.get(sql) is not None

    def mark_plain(self, sql: str) -> None:
        self._plain.put(sql, True)
