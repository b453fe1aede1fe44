"""Lexical helpers over raw SQL text: statement splitting, comment stripping.

A hand-written scanner rather than a parser: it must never fail (garbage still splits into
something the engine can refuse) and it must respect every PostgreSQL quoting form —
'strings' (with '' escapes), E'strings' (with backslash escapes), "identifiers", -- line
comments, nested /* block comments */ and $tag$ dollar quotes $tag$.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass

_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\x80-\uffff][A-Za-z0-9_\x80-\uffff]*)?\$")


def _skip_quoted(sql: str, i: int, quote: str, backslash: bool) -> int:
    """Index just past the closing quote of a literal starting at ``sql[i] == quote``."""
    n = len(sql)
    i += 1
    while i < n:
        ch = sql[i]
        if backslash and ch == "\\":
            i += 2
            continue
        if ch == quote:
            if i + 1 < n and sql[i + 1] == quote:
                i += 2
                continue
            return i + 1
        i += 1
    return n


#: What nests a block comment: its openings and closings, read left to right without overlap (``/*/`` opens,
#: ``*/*`` closes), as PostgreSQL's scanner reads them.
_COMMENT_MARK = re.compile(r"/\*|\*/")


def _skip_block_comment(sql: str, i: int) -> int:
    """Index just past the (nested) block comment starting at ``sql[i:i+2] == "/*"``. The marks are found by
    the regular expression engine, so a megabyte-long comment costs a millisecond, not a Python step per
    character."""
    depth = 0
    for mark in _COMMENT_MARK.finditer(sql, i):
        if mark.group() == "/*":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return mark.end()
    return len(sql)


class Span(enum.Enum):
    """What a stretch of SQL text is, for :func:`scan`."""

    COMMENT = "comment"
    SEMICOLON = "semicolon"
    #: One character of code, or one whole quoted literal/identifier/dollar-quoted string.
    CODE = "code"


class Lexeme(enum.Enum):
    """A token's class (:class:`Token`)."""

    WORD = "word"
    STRING = "string"
    QUOTED_IDENT = "quoted identifier"
    NUMBER = "number"
    SYMBOL = "symbol"


def scan(sql: str) -> Iterator[tuple[Span, int, int]]:
    """Yield (span, start, end) over the whole text."""
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            end = n if end < 0 else end + 1
            yield Span.COMMENT, i, end
        elif sql.startswith("/*", i):
            end = _skip_block_comment(sql, i)
            yield Span.COMMENT, i, end
        elif ch == ";":
            end = i + 1
            yield Span.SEMICOLON, i, end
        elif ch in "'\"":
            escape = ch == "'" and i > 0 and sql[i - 1] in "eE" and not _is_ident_char(sql, i - 2)
            end = _skip_quoted(sql, i, ch, escape)
            yield Span.CODE, i, end
        elif ch == "$" and not _is_ident_char(sql, i - 1) and (m := _DOLLAR_TAG.match(sql, i)):
            close = sql.find(m.group(0), m.end())
            end = n if close < 0 else close + len(m.group(0))
            yield Span.CODE, i, end
        else:
            end = i + 1
            yield Span.CODE, i, end
        i = end


def _is_ident_char(sql: str, i: int) -> bool:
    return i >= 0 and (sql[i].isalnum() or sql[i] in "_$")


def split_statements(sql: str) -> list[str]:
    """Split on top-level semicolons; drop statements that are empty or only comments."""
    statements: list[str] = []
    start, has_code = 0, False
    for span, s, e in scan(sql):
        if span is Span.SEMICOLON:
            if has_code:
                statements.append(sql[start:s].strip())
            start, has_code = e, False
        elif span is Span.CODE and not sql[s:e].isspace():
            has_code = True
    if has_code:
        statements.append(sql[start:].strip())
    return statements


def strip_comments(sql: str) -> str:
    """The SQL with comments replaced by a space (quoted text untouched)."""
    return "".join(" " if span is Span.COMMENT else sql[s:e] for span, s, e in scan(sql))


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


def identifiers(sql: str) -> list[str]:
    """Lower-cased bare words and "quoted identifiers" outside string literals and comments (unordered)."""
    quoted: list[str] = []
    bare: list[str] = []
    for span, s, e in scan(sql):
        chunk = sql[s:e]
        if span is Span.CODE and len(chunk) == 1:
            bare.append(chunk)
            continue
        bare.append(" ")
        if span is Span.CODE and chunk.startswith('"'):
            quoted.append(chunk[1:-1].replace('""', '"').lower())
    return [w.lower() for w in _WORD.findall("".join(bare))] + quoted


def first_word(sql: str) -> str:
    """The first word of ``strip_comments(sql)``, lower-cased, scanning only as far as it needs:
    routing a 256 kB statement must not cost a pass over all of it (the GIL is shared)."""
    parts: list[str] = []
    started = False
    for span, s, e in scan(sql):
        piece = " " if span is Span.COMMENT else sql[s:e]
        parts.append(piece)
        if not started:
            started = _WORD.search(piece) is not None
        elif not (len(piece) == 1 and (piece.isalnum() or piece in "_$")):
            text = "".join(parts)
            match = _WORD.search(text)
            if match and match.end() < len(text):
                return match.group(0).lower()
    match = _WORD.search("".join(parts))
    return match.group(0).lower() if match else ""


def after_keyword(sql: str, keyword: str) -> str | None:
    """The text after a leading ``keyword`` (case-insensitive; comments before it skipped), else None.

    ``after_keyword("/* app */ EXPLAIN SELECT 1", "explain")`` is ``" SELECT 1"``.
    """
    for span, s, e in scan(sql):
        if span is Span.COMMENT or sql[s:e].isspace():
            continue
        match = _WORD.match(sql, s)
        if match is not None and match.group(0).lower() == keyword.lower():
            return sql[match.end() :]
        return None
    return None


# --- tokens of session statements (SET, SHOW, BEGIN, …: see server/answers.py) ----------------------

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>[eE]?'(?:[^']|'')*')
    | (?P<qid>"(?:[^"]|"")*")
    | (?P<word>[A-Za-z_][A-Za-z0-9_$.]*)
    | (?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<sym>\S)
    )""",
    re.VERBOSE,
)


_GROUPS = {
    "str": Lexeme.STRING,
    "qid": Lexeme.QUOTED_IDENT,
    "word": Lexeme.WORD,
    "num": Lexeme.NUMBER,
    "sym": Lexeme.SYMBOL,
}


@dataclass(frozen=True, slots=True)
class Token:
    """A token: its class and its text as written (see :func:`tokenize` and :func:`catalog_tokens`)."""

    type: Lexeme
    text: str

    @property
    def word(self) -> str:
        return self.text.lower() if self.type is Lexeme.WORD else ""

    @property
    def value(self) -> str:
        if self.type is Lexeme.STRING:
            body = self.text[1:] if self.text[0] in "eE" else self.text
            return body[1:-1].replace("''", "'")
        if self.type is Lexeme.QUOTED_IDENT:
            return self.text[1:-1].replace('""', '"')
        return self.text

    def symbol(self, text: str) -> bool:
        return self.type is Lexeme.SYMBOL and self.text == text


def tokenize(sql: str) -> list[Token]:
    """Tokens of one comment-free statement (trailing semicolon dropped); stops at the first non-token."""
    text = strip_comments(sql).strip().rstrip(";").strip()
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            break
        group = m.lastgroup or "sym"
        tokens.append(Token(_GROUPS[group], m.group(group)))
        pos = m.end()
    return tokens


_WORD_CHAR = re.compile(r"[A-Za-z0-9_$\x80-\uffff]")


def catalog_tokens(sql: str) -> list[Token]:
    """Tokens of any statement for the catalog guard: words lower-cased, quoted identifiers and strings
    as written (E'…', B'…' prefixes dropped; ``.value`` unquotes), every other non-space character a
    SYMBOL; comments dropped. Never fails."""
    out: list[Token] = []
    word: list[str] = []

    def flush() -> None:
        if word:
            out.append(Token(Lexeme.WORD, "".join(word).lower()))
            word.clear()

    for span, s, e in scan(sql):
        chunk = sql[s:e]
        if span is not Span.CODE:
            flush()
            continue
        if len(chunk) == 1 and _WORD_CHAR.match(chunk):
            word.append(chunk)
            continue
        flush()
        if chunk.startswith('"'):
            out.append(Token(Lexeme.QUOTED_IDENT, chunk))
        elif chunk.startswith(("'", "$")) and len(chunk) > 1:
            if out and out[-1].type is Lexeme.WORD and out[-1].text in ("e", "b", "x", "n", "u"):
                out.pop()  # E'…', B'…', X'…', N'…' prefixes
            out.append(Token(Lexeme.STRING, chunk))
        elif not chunk.isspace():
            out.append(Token(Lexeme.SYMBOL, chunk))
    flush()
    return out
