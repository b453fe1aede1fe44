"""Statements the server answers itself: session settings, transaction control, table-free SELECTs.

These touch no data, so they never reach the engine or spend budget. dpsql is read-only, so
transactions are pure bookkeeping: the client sees the BEGIN/COMMIT/ROLLBACK tags and the
I/T/E transaction status it expects, nothing else changes.
"""

from __future__ import annotations

import functools
import re
import zoneinfo
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from typing import Any

import sqlglot
from sqlglot import exp

from dpsql.errors import (
    CantChangeRuntimeParam,
    ConfigurationLimitExceeded,
    FeatureNotSupported,
    InsufficientPrivilege,
    InvalidParameterValue,
    ProgramLimitExceeded,
    SyntaxError_,
    UndefinedObject,
)
from dpsql.pgtypes import parse_bool
from dpsql.session import DPSQL_SETTINGS, Session, parse_setting
from dpsql.sqltext import Lexeme, Token, first_word, strip_comments, tokenize
from dpsql.version import __version__

#: GUCs PostgreSQL reports to the client with ParameterStatus (canonical spelling).
REPORTED = (
    "application_name",
    "client_encoding",
    "DateStyle",
    "default_transaction_read_only",
    "in_hot_standby",
    "integer_datetimes",
    "IntervalStyle",
    "is_superuser",
    "server_encoding",
    "server_version",
    "session_authorization",
    "standard_conforming_strings",
    "TimeZone",
)

_STATIC_GUCS: dict[str, str] = {
    "server_encoding": "UTF8",
    "client_encoding": "UTF8",
    "DateStyle": "ISO, MDY",
    "integer_datetimes": "on",
    "standard_conforming_strings": "on",
    "TimeZone": "UTC",
    "IntervalStyle": "postgres",
    "application_name": "",
    "is_superuser": "off",
    "default_transaction_read_only": "on",
    "transaction_read_only": "on",
    "in_hot_standby": "off",
    "transaction_isolation": "read committed",
    "default_transaction_isolation": "read committed",
    "search_path": '"$user", public',
    "max_identifier_length": "63",
    "extra_float_digits": "1",
    "client_min_messages": "notice",
    "bytea_output": "hex",
    "statement_timeout": "0",
    "lock_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "lc_collate": "C",
    "lc_ctype": "C",
    "lc_messages": "C",
    "lc_monetary": "C",
    "lc_numeric": "C",
    "lc_time": "C",
    "block_size": "8192",
    "max_connections": "100",
}

_UTF8_NAMES = {"utf8", "utf-8", "unicode"}


# --- settings -----------------------------------------------------------------------------------


#: The largest timeout PostgreSQL accepts (its GUCs are C ints of milliseconds).
MAX_TIMEOUT_MS = 2**31 - 1


def parse_timeout_ms(value: str, name: str = "statement_timeout") -> int:
    """PostgreSQL duration syntax for statement_timeout: ``5000``, ``'5s'``, ``'100ms'``, ``'1min'``.

    Raises ValueError for anything else and, as PostgreSQL, 22023 beyond 2147483647 ms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|min|h|d)?\s*", value)
    if not match:
        raise ValueError(value)
    number = float(match.group(1))  # 400 digits: inf, never an OverflowError from int()
    if number > MAX_TIMEOUT_MS:
        raise InvalidParameterValue(
            f'invalid value for parameter "{name}": "{value}"', hint="Value exceeds integer range."
        )
    scale = {"ms": 1, None: 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}[match.group(2)]
    ms = round(number * scale)
    if ms > MAX_TIMEOUT_MS:
        raise InvalidParameterValue(
            f'{ms} ms is outside the valid range for parameter "{name}" (0 .. {MAX_TIMEOUT_MS})'
        )
    return ms


def _known_zone(name: str) -> bool:
    """Whether a TimeZone value may stand: a region/city name must be in the time-zone database (as
    PostgreSQL refuses ``Mars/Olympus``, 22023); offsets, abbreviations and POSIX forms pass (PostgreSQL
    reads them itself), as does everything when this machine has no time-zone database."""
    if "/" not in name or name.lower().startswith(("etc/", "posix/")):
        return True
    zones = _zone_names()
    return not zones or name.lower() in zones


@functools.cache
def _zone_names() -> frozenset[str]:
    return frozenset(z.lower() for z in zoneinfo.available_timezones())


@dataclass
class Settings:
    """Per-connection GUCs plus the dpsql.* knobs, which are mirrored onto the engine Session."""

    session: Session
    defaults: dict[str, str]
    values: dict[str, str] = field(default_factory=dict)
    #: Custom (placeholder) parameters one session may set, and the longest value accepted.
    max_custom: int = 1000
    max_length: int = 8192
    _canon: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._canon = {k.lower(): k for k in self.defaults}
        self.values = dict(self.defaults)

    def canonical(self, name: str) -> str:
        return self._canon.get(name.lower(), name.lower())

    def get(self, name: str) -> str:
        key = self.canonical(name)
        if key in self.values:
            return self.values[key]
        if key.startswith("dpsql."):
            raise UndefinedObject(f'unrecognized configuration parameter "{name}"')
        if "." in key:
            return ""
        raise UndefinedObject(f'unrecognized configuration parameter "{name}"')

    def set(self, name: str, value: str | None) -> str | None:
        """Set (or reset with None); return the canonical name if it must be reported to the client."""
        key = self.canonical(name)
        if key in ("server_version", "server_encoding", "integer_datetimes", "is_superuser", "block_size"):
            raise CantChangeRuntimeParam(f'parameter "{key}" cannot be changed')
        if value is not None and len(value) > self.max_length:
            raise ProgramLimitExceeded(
                f'value for parameter "{key}" is too long ({len(value)} characters; at most {self.max_length})'
            )
        if (
            key in ("session_authorization", "role")
            and value is not None
            and (key == "role" or value.strip() != self.defaults.get("session_authorization"))
        ):
            raise InsufficientPrivilege(f'permission denied to set parameter "{key}"')
        if value is not None and key not in self.values and not key.startswith("dpsql."):
            custom = sum(1 for k in self.values if k not in self.defaults)
            if custom >= self.max_custom:
                raise ConfigurationLimitExceeded(
                    f"too many custom parameters in this session (at most {self.max_custom})",
                    hint="RESET ALL or DISCARD ALL drops them.",
                )
        if key.startswith("dpsql."):
            self._set_dpsql(key, value)
        elif value is None:
            if key in self.defaults:
                self.values[key] = self.defaults[key]
            else:
                self.values.pop(key, None)
        else:
            self.values[key] = self._check(key, value)
        return key if key in REPORTED else None

    def _check(self, key: str, value: str) -> str:
        if key == "client_encoding":
            if value.strip().strip("'\"").lower() not in _UTF8_NAMES:
                raise FeatureNotSupported(f"client_encoding {value!r} is not supported; dpsql speaks UTF8")
            return "UTF8"
        if key == "TimeZone" and not _known_zone(value.strip().strip("'\"")):
            raise InvalidParameterValue(f'invalid value for parameter "TimeZone": "{value}"')
        if key in ("statement_timeout", "idle_in_transaction_session_timeout"):
            try:
                return str(parse_timeout_ms(value, key))
            except ValueError:
                raise InvalidParameterValue(f'invalid value for parameter "{key}": "{value}"') from None
        return value

    def _set_dpsql(self, key: str, value: str | None) -> None:
        if value is None:
            if key not in DPSQL_SETTINGS:
                raise UndefinedObject(f'unrecognized configuration parameter "{key}"')
            parsed = None
            self.values[key] = self.defaults.get(key, "")
        else:
            parsed = parse_setting(key, value)
            self.values[key] = value.strip().lower() if isinstance(parsed, str | bool) else str(parsed)
        self.session.apply(key, parsed, self.values[key])

    def reset_all(self) -> list[str]:
        """RESET ALL; returns the reported parameters whose value changed."""
        changed = [k for k in REPORTED if self.values.get(k) != self.defaults.get(k)]
        for key in [k for k in self.values if k.startswith("dpsql.")]:
            self._set_dpsql(key, None)
        self.values = {
            **dict(self.defaults),
            **{k: v for k, v in self.values.items() if k.startswith("dpsql.")},
        }
        return changed

    @property
    def show_intervals(self) -> bool:
        return parse_bool(self.values.get("dpsql.show_intervals", "off"))

    @property
    def statement_timeout_ms(self) -> int:
        """The session's statement_timeout (0: none asked for; the server's cap still applies)."""
        return int(self.values.get("statement_timeout", "0") or 0)

    @property
    def idle_in_transaction_ms(self) -> int:
        return int(self.values.get("idle_in_transaction_session_timeout", "0") or 0)


def default_gucs(server_version: str, user: str, application_name: str, policy_defaults: Any) -> dict[str, str]:
    gucs = dict(_STATIC_GUCS)
    major_minor = server_version.split(" ", 1)[0]
    major, _, minor = major_minor.partition(".")
    gucs["server_version"] = server_version
    gucs["server_version_num"] = str(int(major) * 10000 + int(minor or 0))
    gucs["session_authorization"] = user
    gucs["application_name"] = application_name
    gucs["dpsql.epsilon"] = str(policy_defaults.epsilon)
    gucs["dpsql.delta"] = str(policy_defaults.delta)
    gucs["dpsql.mechanism"] = str(policy_defaults.mechanism)
    gucs["dpsql.confidence"] = str(policy_defaults.confidence)
    gucs["dpsql.accuracy"] = ""  # none: ε from dpsql.epsilon (accuracy-first when set)
    gucs["dpsql.show_intervals"] = "off"
    gucs["dpsql.round"] = "on"
    gucs["dpsql.trim_time"] = "off"
    return gucs


# --- command recognition ------------------------------------------------------------------------


class Action(StrEnum):
    """What a session statement does; :mod:`.commands` has one handler per action."""

    NOOP = "noop"
    SET = "set"
    RESET = "reset"
    RESET_ALL = "reset_all"
    SHOW = "show"
    SHOW_ALL = "show_all"
    DISCARD_ALL = "discard_all"
    BEGIN = "begin"
    COMMIT = "commit"
    ROLLBACK = "rollback"
    ROLLBACK_TO = "rollback_to"
    SAVEPOINT = "savepoint"
    RELEASE = "release"
    CLOSE = "close"
    DEALLOCATE = "deallocate"
    DECLARE = "declare"
    FETCH = "fetch"
    MOVE = "move"


@dataclass(frozen=True, slots=True)
class SessionCommand:
    """A recognised session/transaction statement. ``action`` is interpreted by :mod:`.commands`."""

    action: Action
    tag: str
    name: str = ""
    value: str | None = None
    #: DECLARE: the cursor's options; FETCH/MOVE: where to go.
    declare: DeclareOptions | None = None
    fetch: FetchSpec | None = None


@dataclass(frozen=True, slots=True)
class DeclareOptions:
    """``DECLARE name [BINARY] [[NO] SCROLL] CURSOR [WITH[OUT] HOLD] FOR query``; ``scroll`` None: unspecified."""

    binary: bool = False
    scroll: bool | None = None
    hold: bool = False


@dataclass(frozen=True, slots=True)
class FetchSpec:
    """A FETCH/MOVE direction: ``forward``/``backward`` ``count`` rows (None: ALL), or ``absolute``/``relative``
    to one row."""

    direction: str
    count: int | None


def _words(tokens: list[Token]) -> list[str]:
    return [t.word or t.text.lower() for t in tokens]


def _setting_value(tokens: list[Token]) -> str | None:
    """The value of ``SET x TO <value>``: DEFAULT → None; lists keep their commas."""
    if len(tokens) == 1 and tokens[0].word == "default":
        return None
    parts = [t.value for t in tokens if t.text != ","]
    return ", ".join(parts)


def _parse_set(tokens: list[Token]) -> SessionCommand:
    rest = tokens[1:]
    if rest and rest[0].word in ("session", "local"):
        rest = rest[1:]
    words = _words(rest)
    if not rest or words[0] in ("transaction", "characteristics"):
        return SessionCommand(Action.NOOP, "SET")
    if words[0] in ("role", "authorization") or words[:2] == ["session", "authorization"]:
        raise InsufficientPrivilege("permission denied to set role")
    if words[:2] == ["time", "zone"]:
        return SessionCommand(Action.SET, "SET", "TimeZone", _setting_value(rest[2:]) or "UTC")
    if words[0] == "names":
        return SessionCommand(Action.SET, "SET", "client_encoding", _setting_value(rest[1:]))
    if len(rest) < 3 or words[1] not in ("to", "="):
        raise SyntaxError_(f'syntax error at or near "{rest[-1].text}"')
    return SessionCommand(Action.SET, "SET", rest[0].value, _setting_value(rest[2:]))


def _parse_show(tokens: list[Token]) -> SessionCommand:
    words = _words(tokens[1:])
    if words == ["all"]:
        return SessionCommand(Action.SHOW_ALL, "SHOW")
    if words == ["transaction", "isolation", "level"]:
        return SessionCommand(Action.SHOW, "SHOW", "transaction_isolation")
    if words == ["time", "zone"]:
        return SessionCommand(Action.SHOW, "SHOW", "TimeZone")
    if words == ["session", "authorization"]:
        return SessionCommand(Action.SHOW, "SHOW", "session_authorization")
    if len(tokens) != 2:
        raise SyntaxError_("syntax error in SHOW")
    return SessionCommand(Action.SHOW, "SHOW", tokens[1].value)


def _parse_reset(tokens: list[Token]) -> SessionCommand:
    words = _words(tokens[1:])
    if words == ["all"]:
        return SessionCommand(Action.RESET_ALL, "RESET")
    if words in (["role"], ["session", "authorization"]):
        return SessionCommand(Action.NOOP, "RESET")
    if words == ["time", "zone"]:
        return SessionCommand(Action.RESET, "RESET", "TimeZone")
    if len(tokens) != 2:
        raise SyntaxError_("syntax error in RESET")
    return SessionCommand(Action.RESET, "RESET", tokens[1].value)


def _parse_transaction(tokens: list[Token]) -> SessionCommand | None:
    words = _words(tokens)
    head = words[0]
    if head in ("begin", "start"):
        if head == "start" and words[1:2] != ["transaction"]:
            return None
        return SessionCommand(Action.BEGIN, "BEGIN")
    if head in ("commit", "end"):
        if words[1:2] == ["prepared"]:
            return None
        return SessionCommand(Action.COMMIT, "COMMIT")
    if head in ("rollback", "abort"):
        if words[1:2] == ["prepared"]:
            return None
        if "to" in words:
            return SessionCommand(Action.ROLLBACK_TO, "ROLLBACK", words[-1])
        return SessionCommand(Action.ROLLBACK, "ROLLBACK")
    if head == "savepoint" and len(words) == 2:
        return SessionCommand(Action.SAVEPOINT, "SAVEPOINT", words[1])
    if head == "release" and len(words) in (2, 3):
        return SessionCommand(Action.RELEASE, "RELEASE", words[-1])
    return None


_DECLARE = re.compile(
    r"""declare\s+(?P<name>"(?:[^"]|"")*"|[A-Za-z_][A-Za-z0-9_$]*)
        (?P<options>(?:\s+[A-Za-z]+)*?)\s+cursor
        (?:\s+(?P<hold>with|without)\s+hold)?
        \s+for\s(?P<query>.*)""",
    re.IGNORECASE | re.DOTALL | re.VERBOSE,
)
_DECLARE_OPTIONS = {"binary", "insensitive", "asensitive", "no", "scroll"}
#: What may follow ``DECLARE … FOR``: a query (PostgreSQL's grammar: SelectStmt).
_QUERY_HEADS = {"select", "with", "values", "table"}


def _identifier(text: str) -> str:
    """A cursor name as PostgreSQL folds it: quoted as written, bare lower-cased."""
    return text[1:-1].replace('""', '"') if text.startswith('"') else text.lower()


def _parse_declare(sql: str) -> SessionCommand:
    text = strip_comments(sql).strip().rstrip(";").strip()
    match = _DECLARE.fullmatch(text)
    if match is None:
        raise SyntaxError_("syntax error in DECLARE")
    options = match.group("options").lower().split()
    for i, word in enumerate(options):
        if word not in _DECLARE_OPTIONS or (word == "no" and options[i + 1 : i + 2] != ["scroll"]):
            raise SyntaxError_(f'syntax error at or near "{word}"')
    scroll = None if "scroll" not in options else "no" not in options
    query = match.group("query").strip()
    if first_word(query.lstrip("(")) not in _QUERY_HEADS:
        raise SyntaxError_(f'syntax error at or near "{query.split(None, 1)[0] if query else "FOR"}"')
    declare = DeclareOptions("binary" in options, scroll, (match.group("hold") or "").lower() == "with")
    return SessionCommand(Action.DECLARE, "DECLARE CURSOR", _identifier(match.group("name")), query, declare=declare)


def _fetch_count(token: Token) -> int:
    if token.type is not Lexeme.NUMBER or not re.fullmatch(r"[-+]?\d+", token.text):
        raise SyntaxError_(f'syntax error at or near "{token.text}"')
    return int(token.text)


def _parse_fetch(tokens: list[Token]) -> SessionCommand:
    """``FETCH|MOVE [direction] [FROM|IN] name``, PostgreSQL's directions; FORWARD -n is BACKWARD n."""
    verb = tokens[0].word.upper()
    if len(tokens) < 2:
        raise SyntaxError_("syntax error at end of input")
    if tokens[-1].type not in (Lexeme.WORD, Lexeme.QUOTED_IDENT):
        raise SyntaxError_(f'syntax error at or near "{tokens[-1].text}"')
    name = tokens[-1].value if tokens[-1].type is Lexeme.QUOTED_IDENT else tokens[-1].word
    rest = tokens[1:-1]
    if rest and rest[-1].word in ("from", "in"):
        rest = rest[:-1]
    words = _words(rest)
    spec: FetchSpec
    if words in ([], ["next"], ["forward"]):
        spec = FetchSpec("forward", 1)
    elif words in (["prior"], ["backward"]):
        spec = FetchSpec("backward", 1)
    elif words == ["first"]:
        spec = FetchSpec("absolute", 1)
    elif words == ["last"]:
        spec = FetchSpec("absolute", -1)
    elif words in (["all"], ["forward", "all"]):
        spec = FetchSpec("forward", None)
    elif words == ["backward", "all"]:
        spec = FetchSpec("backward", None)
    elif len(rest) == 1:
        spec = FetchSpec("forward", _fetch_count(rest[0]))
    elif len(rest) == 2 and words[0] in ("forward", "backward", "absolute", "relative"):
        spec = FetchSpec(words[0], _fetch_count(rest[1]))
    else:
        raise SyntaxError_(f'syntax error at or near "{rest[0].text}"')
    if spec.direction in ("forward", "backward") and spec.count is not None and spec.count < 0:
        spec = FetchSpec("backward" if spec.direction == "forward" else "forward", -spec.count)
    return SessionCommand(Action.FETCH if verb == "FETCH" else Action.MOVE, verb, name, fetch=spec)


_DISCARD_TAGS = {"all": "DISCARD ALL", "plans": "DISCARD PLANS", "sequences": "DISCARD SEQUENCES"}


#: First words of the statements :func:`parse_session_command` recognises (any other is not a session statement).
_SESSION_HEADS = frozenset(
    {
        *("set", "show", "reset", "discard", "close", "declare", "fetch", "move", "listen", "unlisten"),
        *("deallocate", "copy", "begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release"),
    }
)


def parse_session_command(sql: str) -> SessionCommand | None:
    """Recognise a statement the server answers itself; None means "not a session statement"."""
    if first_word(sql) not in _SESSION_HEADS:
        return None  # without tokenizing all of a long SELECT
    tokens = tokenize(sql)
    if not tokens or not tokens[0].word:
        return None
    head = tokens[0].word
    words = _words(tokens)
    if head == "set":
        return _parse_set(tokens)
    if head == "show":
        return _parse_show(tokens)
    if head == "reset":
        return _parse_reset(tokens)
    if head == "discard" and len(words) == 2:
        tag = _DISCARD_TAGS.get(words[1], "DISCARD TEMP")
        return SessionCommand(Action.DISCARD_ALL if words[1] == "all" else Action.NOOP, tag)
    if head == "close":
        if len(tokens) != 2 or tokens[1].type not in (Lexeme.WORD, Lexeme.QUOTED_IDENT):
            raise SyntaxError_("syntax error in CLOSE")
        if words[1:] == ["all"]:
            return SessionCommand(Action.CLOSE, "CLOSE CURSOR ALL")
        name = tokens[1].value if tokens[1].type is Lexeme.QUOTED_IDENT else tokens[1].word
        return SessionCommand(Action.CLOSE, "CLOSE CURSOR", name)
    if head == "declare":
        return _parse_declare(sql)
    if head in ("fetch", "move"):
        return _parse_fetch(tokens)
    if head in ("listen", "unlisten"):
        return SessionCommand(Action.NOOP, head.upper())
    if head == "deallocate":
        name = words[-1] if len(words) > 1 else ""
        if name in ("prepare", ""):
            raise SyntaxError_("syntax error in DEALLOCATE")
        return SessionCommand(Action.DEALLOCATE, "DEALLOCATE ALL" if name == "all" else "DEALLOCATE", tokens[-1].value)
    if head == "copy":
        raise FeatureNotSupported("COPY is not supported by dpsql", hint="Only differentially private SELECTs.")
    return _parse_transaction(tokens)


# --- table-free SELECTs -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnswerContext:
    """What a table-free SELECT may ask about the session."""

    user: str
    database: str
    version: str
    pid: int
    setting: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class Value:
    name: str
    type_oid: int
    value: Any


_NAME, _TEXT, _INT4, _BOOL, _NUMERIC, _VOID = 19, 25, 23, 16, 1700, 2278


def _call_name(node: exp.Expression) -> str | None:
    """Lower-cased function name of a call, with any pg_catalog qualification removed."""
    if isinstance(node, exp.Dot):
        if isinstance(node.this, exp.Identifier | exp.Column) and node.this.name.lower() == "pg_catalog":
            return _call_name(node.expression)
        return None
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    if isinstance(node, exp.CurrentVersion):
        return "version"
    if isinstance(node, exp.Func):
        return node.sql_name().lower()
    return None


def _first_arg(node: exp.Expression) -> exp.Expression | None:
    target = node.expression if isinstance(node, exp.Dot) else node
    args = target.expressions if isinstance(target, exp.Anonymous) else [target.this]
    return args[0] if args else None


def _evaluate(node: exp.Expression, ctx: AnswerContext) -> Value | None:
    if isinstance(node, exp.Literal):
        if node.is_string:
            return Value("?column?", _TEXT, node.this)
        text = node.this
        if re.fullmatch(r"-?\d+", text) and abs(int(text)) < 2**31:
            return Value("?column?", _INT4, int(text))
        return Value("?column?", _NUMERIC, Decimal(text))
    if isinstance(node, exp.Boolean):
        return Value("bool", _BOOL, bool(node.this))
    if isinstance(node, exp.Null):
        return Value("?column?", _TEXT, None)
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal) and not node.this.is_string:
        inner = _evaluate(node.this, ctx)
        return Value(inner.name, inner.type_oid, -inner.value) if inner else None
    if isinstance(node, exp.CurrentUser | exp.SessionUser):
        return Value(node.sql_name().lower(), _NAME, ctx.user)
    if isinstance(node, exp.Column) and not node.table and node.name.lower() in _USER_WORDS:
        value = ctx.database if node.name.lower() == "current_catalog" else ctx.user
        return Value(node.name.lower(), _NAME, value)
    if isinstance(node, exp.Column) and not node.table and node.name.lower() == "current_schema":
        return Value("current_schema", _NAME, "public")
    return _evaluate_call(node, ctx)


_USER_WORDS = {"current_user", "session_user", "user", "current_role", "current_catalog"}


def _evaluate_call(node: exp.Expression, ctx: AnswerContext) -> Value | None:
    name = _call_name(node)
    if name is None:
        return None
    arg = _first_arg(node)
    simple: dict[str, Value] = {
        "version": Value("version", _TEXT, f"PostgreSQL {ctx.version} on x86_64-pc-linux-gnu, dpsql {__version__}"),
        "current_database": Value("current_database", _NAME, ctx.database),
        "current_schema": Value("current_schema", _NAME, "public"),
        "pg_backend_pid": Value("pg_backend_pid", _INT4, ctx.pid),
        "pg_advisory_unlock_all": Value("pg_advisory_unlock_all", _VOID, ""),
        "current_user": Value("current_user", _NAME, ctx.user),
        "session_user": Value("session_user", _NAME, ctx.user),
        "pg_is_in_recovery": Value("pg_is_in_recovery", _BOOL, False),
    }
    if name in simple and (arg is None or name == "current_user"):
        return simple[name]
    if name == "current_setting" and isinstance(arg, exp.Literal) and arg.is_string:
        return Value("current_setting", _TEXT, ctx.setting(arg.this))
    return None


def evaluate_select(sql: str, ctx: AnswerContext, tree: exp.Expr | None = None) -> list[Value] | None:
    """Answer ``SELECT <constant or session function>, ...`` (no FROM); None when it is anything else.
    ``tree``: ``sql`` as the engine parsed it (only read here), else it is parsed."""
    if tree is None:
        try:
            tree = sqlglot.parse_one(sql, read="postgres")
        except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
            return None
    if not isinstance(tree, exp.Select) or any(
        tree.args.get(k) for k in ("from", "from_", "joins", "where", "group", "having", "with", "order", "limit")
    ):
        return None
    if tree.find(exp.Placeholder, exp.Parameter):
        return None
    values: list[Value] = []
    for projection in tree.expressions:
        alias = projection.alias if isinstance(projection, exp.Alias) else None
        node = projection.this if isinstance(projection, exp.Alias) else projection
        value = _evaluate(node, ctx)
        if value is None:
            return None
        values.append(Value(alias, value.type_oid, value.value) if alias else value)
    return values or None
