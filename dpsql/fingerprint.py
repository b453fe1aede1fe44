"""Query fingerprints: a keyed hash of a statement's *shape*, never of its constants.

A fingerprint groups the queries of one shape (curators read them in the server log and in the
ledger's ``fingerprint`` column), so it must not let anyone recover what a query filtered on: an
unkeyed hash of the text could be brute-forced constant by constant. So:

* the statement is normalised to its shape: every constant (number, string, boolean, NULL, bound
  parameter, a sign in front of one) becomes ``?``, an ``IN`` list becomes ``IN (?)`` whatever its
  length, comments are dropped, and sqlglot's canonical SQL removes spacing and keyword/identifier
  case. Text that sqlglot cannot parse (catalog queries, session commands) is normalised lexically
  the same way: literals and numbers become ``?``;
* that shape is hashed with HMAC-SHA256 under a key derived from the installation's secret
  (:meth:`dpsql.ledger.Ledger.installation_key`, kept in the ledger's own database), so equal shapes
  give equal fingerprints within one installation and unrelated ones across installations.

The result cache is keyed differently (on the full statement with its constants: see
:mod:`dpsql.cache`); the fingerprint plays no part in it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re

from sqlglot import exp

from dpsql.analyze.parse import parse_statement

#: Hex digits kept (64 bits: ample to group queries, far too few to invert a shape).
FINGERPRINT_HEX = 16

_CONSTANTS: tuple[type[exp.Expression], ...] = (
    exp.Literal,
    exp.Boolean,
    exp.Null,
    exp.Placeholder,
    exp.Parameter,
    exp.RawString,  # $$…$$ and $tag$…$tag$
    exp.ByteString,  # E'…'
    exp.HexString,
    exp.BitString,
    exp.National,
    exp.UnicodeString,
)


def fingerprint_key(installation_key: bytes) -> bytes:
    """The fingerprinting key derived from an installation's secret (one secret, one use per key)."""
    return hmac.new(installation_key, b"dpsql query fingerprint v1", hashlib.sha256).digest()


def shape(tree: exp.Expression) -> str:
    """The statement with every constant replaced by ``?`` (the tree itself is left untouched)."""
    tree = tree.copy()
    for node in list(tree.find_all(*_CONSTANTS)):
        if node is not tree:
            node.replace(exp.Placeholder())
    for node in list(tree.find_all(exp.In)):
        if node.args.get("expressions"):
            node.set("expressions", [exp.Placeholder()])
    for node in list(tree.find_all(exp.Neg)):  # -5 and 5 alike: the sign is part of the constant
        if isinstance(node.this, exp.Placeholder):
            node.replace(exp.Placeholder())
    return tree.sql(dialect="postgres", normalize=True, comments=False)


_LEXICAL = re.compile(
    r"""(?P<comment>--[^\n]*|/\*.*?\*/)
      | (?P<string>[EeBbXxNn]?'(?:[^']|'')*'|\$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$)
      | (?P<ident>"(?:[^"]|"")*")
      | (?P<number>(?<![\w$])(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)""",
    re.VERBOSE | re.DOTALL,
)


def lexical_shape(sql: str) -> str:
    """Shape of text sqlglot cannot parse: comments dropped, literals and numbers as ``?``."""

    def replace(match: re.Match[str]) -> str:
        if match.group("comment") is not None:
            return " "
        if match.group("ident") is not None:
            return match.group("ident")
        return "?"

    text = _LEXICAL.sub(replace, sql)
    text = re.sub(r"\bin\s*\(\s*\?(?:\s*,\s*\?)*\s*\)", "in (?)", text, flags=re.IGNORECASE)
    return " ".join(text.split()).rstrip("; ").lower()


#: Statements longer than this get the lexical shape: the server logs every statement from its event
#: loop, where parsing a 256 kB statement would stall every client for a second; and the cache of
#: parsed shapes stays small (2,048 × 4 kB).
PARSED_SHAPE_MAX_CHARS = 4096


def statement_shape(sql: str) -> str:
    """The shape of one statement's text: sqlglot's (as the engine parses it) for statements up to
    :data:`PARSED_SHAPE_MAX_CHARS`, else (and for text sqlglot cannot parse) the lexical one."""
    if len(sql) > PARSED_SHAPE_MAX_CHARS:
        return "lexical:" + lexical_shape(sql)
    return _parsed_shape(sql)


@functools.lru_cache(maxsize=2048)
def _parsed_shape(sql: str) -> str:
    try:
        tree = parse_statement(sql)
    except Exception:  # any text at all gets a fingerprint; unparsable text its lexical shape
        return "lexical:" + lexical_shape(sql)
    return tree_shape(sql, tree)


def tree_shape(sql: str, tree: exp.Expression | None) -> str:
    """:func:`statement_shape` of ``sql`` read from its tree as :func:`parse_statement` gave it (the
    engine's :class:`~dpsql.analyze.statement.Statements` read it once, before anything rewrites the
    tree); ``None`` for text that did not parse."""
    if len(sql) > PARSED_SHAPE_MAX_CHARS or tree is None:
        return "lexical:" + lexical_shape(sql)
    try:
        if not isinstance(tree, exp.Command):  # sqlglot keeps an unknown command's text as one literal
            return shape(tree)
    except Exception:
        pass
    return "lexical:" + lexical_shape(sql)


def keyed(key: bytes, shape_text: str) -> str:
    """HMAC-SHA256 of a shape under ``key``, truncated to :data:`FINGERPRINT_HEX` hex digits."""
    return hmac.new(key, shape_text.encode("utf-8"), hashlib.sha256).hexdigest()[:FINGERPRINT_HEX]


def row_selection_salt(installation_key: bytes) -> str:
    """The salt of the per-row hash that picks which rows of a heavy unit are kept, derived from the
    installation key: the same in every process sharing a ledger (a repeated query sees the same
    sample whichever worker answers it), different across installations."""
    return hmac.new(installation_key, b"dpsql row selection salt v1", hashlib.sha256).hexdigest()[:32]
