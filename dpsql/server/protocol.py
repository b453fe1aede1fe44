"""PostgreSQL frontend/backend protocol v3: framing, frontend parsing, backend message building.

Everything here is pure (bytes in, dataclasses out; values in, bytes out) except the two
``read_*`` coroutines, so the codec can be tested without sockets. Lengths are validated
strictly: a frame whose declared length is negative, too small, larger than the configured
maximum, or whose payload does not parse exactly, raises :class:`WireViolation`, which
the connection turns into ``FATAL 08P01`` and a closed socket.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dpsql.version import DEFAULT_PORT as DEFAULT_PORT  # re-exported: the server's old name

PROTOCOL_V3 = 196608  # 3.0
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
DEFAULT_MAX_MESSAGE = 1 << 20  # 1 MiB
MAX_STARTUP_PACKET = 10_000  # PostgreSQL's own limit


class WireViolation(Exception):
    """The peer broke framing, message syntax or message order; the connection must be closed.

    Not :class:`dpsql.errors.ProtocolViolation` (08P01 too): that one is an ERROR the session
    survives (a Bind that does not match its statement), unless raised ``.fatal()``."""


class BadMessage(WireViolation):
    """A well-framed message whose content is wrong (an unknown Describe/Close kind): PostgreSQL
    answers ERROR and the session goes on (framing is intact), so the server does the same (see the
    message loop); :attr:`sqlstate` is PostgreSQL's for it."""

    sqlstate = "08P01"


class InvalidEncoding(BadMessage):
    """Text that is not UTF-8 (PostgreSQL's 22021)."""

    sqlstate = "22021"


# --- frontend messages --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SSLRequest:
    pass


@dataclass(frozen=True, slots=True)
class GSSEncRequest:
    pass


@dataclass(frozen=True, slots=True)
class CancelRequest:
    pid: int
    secret: int


@dataclass(frozen=True, slots=True)
class StartupMessage:
    major: int
    minor: int
    params: dict[str, str]


@dataclass(frozen=True, slots=True)
class Query:
    sql: str


@dataclass(frozen=True, slots=True)
class Parse:
    name: str
    sql: str
    param_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Bind:
    portal: str
    statement: str
    param_formats: tuple[int, ...]
    params: tuple[bytes | None, ...]
    result_formats: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Describe:
    target: str  # "S" (a prepared statement) or "P" (a portal)
    name: str


@dataclass(frozen=True, slots=True)
class Execute:
    portal: str
    max_rows: int


@dataclass(frozen=True, slots=True)
class Close:
    target: str  # "S" (a prepared statement) or "P" (a portal)
    name: str


@dataclass(frozen=True, slots=True)
class Sync:
    pass


@dataclass(frozen=True, slots=True)
class Flush:
    pass


@dataclass(frozen=True, slots=True)
class Terminate:
    pass


@dataclass(frozen=True, slots=True)
class PasswordData:
    """A 'p' message; its meaning (password, SASLInitialResponse, SASLResponse) depends on state."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A syntactically framed message we refuse (COPY data, FunctionCall)."""

    type: str


FrontendMessage = (
    Query | Parse | Bind | Describe | Execute | Close | Sync | Flush | Terminate | PasswordData | Unsupported
)


@dataclass(slots=True)
class Cursor:
    """Strict reader over one message payload."""

    data: bytes
    pos: int = 0

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise WireViolation("invalid message format")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int16(self) -> int:
        return int(struct.unpack("!h", self._take(2))[0])

    def uint16(self) -> int:
        """A count (PostgreSQL's ``pq_getmsgint(msg, 2)``: unsigned, up to 65535)."""
        return int(struct.unpack("!H", self._take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack("!i", self._take(4))[0])

    def byte(self) -> str:
        return self._take(1).decode("latin-1")

    def cstring(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise WireViolation("invalid string in message")
        raw = self.data[self.pos : end]
        self.pos = end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidEncoding('invalid byte sequence for encoding "UTF8"') from None

    def bytes_(self, n: int) -> bytes:
        return self._take(n)

    def rest(self) -> bytes:
        return self._take(len(self.data) - self.pos)

    def finish(self) -> None:
        if self.pos != len(self.data):
            raise WireViolation("invalid message format")


def _count(c: Cursor, limit: int = 65535) -> int:
    n = c.uint16()
    if n > limit:
        raise WireViolation("invalid message format")
    return n


def parse_startup(payload: bytes) -> SSLRequest | GSSEncRequest | CancelRequest | StartupMessage:
    """Decode a length-stripped startup-phase packet."""
    c = Cursor(payload)
    code = c.int32()
    if code == SSL_REQUEST:
        c.finish()
        return SSLRequest()
    if code == GSSENC_REQUEST:
        c.finish()
        return GSSEncRequest()
    if code == CANCEL_REQUEST:
        msg = CancelRequest(c.int32(), c.int32())
        c.finish()
        return msg
    params: dict[str, str] = {}
    while True:
        key = c.cstring()
        if not key:
            break
        params[key] = c.cstring()
    c.finish()
    return StartupMessage(code >> 16, code & 0xFFFF, params)


def _parse_bind(c: Cursor) -> Bind:
    portal, statement = c.cstring(), c.cstring()
    param_formats = tuple(c.int16() for _ in range(_count(c)))
    values: list[bytes | None] = []
    for _ in range(_count(c)):
        n = c.int32()
        if n < -1:
            raise WireViolation("invalid message format")
        values.append(None if n == -1 else c.bytes_(n))
    result_formats = tuple(c.int16() for _ in range(_count(c)))
    return Bind(portal, statement, param_formats, tuple(values), result_formats)


def _parse_target_name(c: Cursor) -> tuple[str, str]:
    target = c.byte()
    if target not in ("S", "P"):
        raise BadMessage(f"invalid DESCRIBE/CLOSE message subtype {ord(target)}")
    return target, c.cstring()


def parse_message(type_: str, payload: bytes) -> FrontendMessage:
    """Decode one typed frontend message (after startup)."""
    c = Cursor(payload)
    msg: FrontendMessage
    if type_ == "Q":
        msg = Query(c.cstring())
    elif type_ == "P":
        name, sql = c.cstring(), c.cstring()
        msg = Parse(name, sql, tuple(c.int32() & 0xFFFFFFFF for _ in range(_count(c))))
    elif type_ == "B":
        msg = _parse_bind(c)
    elif type_ == "D":
        msg = Describe(*_parse_target_name(c))
    elif type_ == "E":
        msg = Execute(c.cstring(), c.int32())
    elif type_ == "C":
        msg = Close(*_parse_target_name(c))
    elif type_ == "S":
        msg = Sync()
    elif type_ == "H":
        msg = Flush()
    elif type_ == "X":
        msg = Terminate()
    elif type_ == "p":
        msg = PasswordData(c.rest())
    elif type_ in ("d", "c", "f", "F"):
        return Unsupported(type_)
    else:
        raise WireViolation(f"invalid frontend message type {ord(type_)}")
    c.finish()
    return msg


async def read_startup(reader: asyncio.StreamReader) -> bytes:
    """Read one untyped startup-phase packet and return its payload (without the length)."""
    header = await reader.readexactly(4)
    (length,) = struct.unpack("!i", header)
    if length < 8 or length > MAX_STARTUP_PACKET:
        raise WireViolation("invalid length of startup packet")
    return await reader.readexactly(length - 4)


async def read_message(reader: asyncio.StreamReader, max_size: int = DEFAULT_MAX_MESSAGE) -> tuple[str, bytes]:
    """Read one typed message; refuse lengths that are impossible or above ``max_size``."""
    header = await reader.readexactly(5)
    type_ = chr(header[0])
    (length,) = struct.unpack("!i", header[1:])
    if length < 4:
        raise WireViolation(f"invalid message length {length}")
    if length > max_size:
        raise WireViolation(f"message of {length} bytes exceeds the {max_size}-byte limit")
    return type_, await reader.readexactly(length - 4)


# --- backend messages ----------------------------------------------------------------------------


def message(type_: str, payload: bytes = b"") -> bytes:
    return type_.encode("ascii") + struct.pack("!i", len(payload) + 4) + payload


def cstr(value: str) -> bytes:
    return value.encode("utf-8") + b"\0"


def auth_ok() -> bytes:
    return message("R", struct.pack("!i", 0))


def auth_sasl(mechanisms: Iterable[str]) -> bytes:
    return message("R", struct.pack("!i", 10) + b"".join(cstr(m) for m in mechanisms) + b"\0")


def auth_sasl_continue(data: bytes) -> bytes:
    return message("R", struct.pack("!i", 11) + data)


def auth_sasl_final(data: bytes) -> bytes:
    return message("R", struct.pack("!i", 12) + data)


def parameter_status(name: str, value: str) -> bytes:
    return message("S", cstr(name) + cstr(value))


def backend_key_data(pid: int, secret: int) -> bytes:
    return message("K", struct.pack("!ii", pid, secret))


def negotiate_protocol_version(minor: int, unrecognized: Sequence[str]) -> bytes:
    body = struct.pack("!ii", minor, len(unrecognized)) + b"".join(cstr(o) for o in unrecognized)
    return message("v", body)


def ready_for_query(status: str) -> bytes:
    return message("Z", status.encode("ascii"))


@dataclass(frozen=True, slots=True)
class FieldDescription:
    """One RowDescription entry."""

    name: str
    type_oid: int
    type_size: int = -1
    type_mod: int = -1
    table_oid: int = 0
    column_attr: int = 0
    format: int = 0


def row_description(fields: Sequence[FieldDescription]) -> bytes:
    parts = [struct.pack("!H", len(fields))]
    for f in fields:
        parts.append(cstr(f.name))
        parts.append(struct.pack("!ihihih", f.table_oid, f.column_attr, f.type_oid, f.type_size, f.type_mod, f.format))
    return message("T", b"".join(parts))


def data_row(values: Sequence[bytes | None]) -> bytes:
    parts = [struct.pack("!H", len(values))]
    for v in values:
        parts.append(struct.pack("!i", -1) if v is None else struct.pack("!i", len(v)) + v)
    return message("D", b"".join(parts))


def parameter_description(oids: Sequence[int]) -> bytes:
    return message("t", struct.pack("!H", len(oids)) + b"".join(struct.pack("!I", o) for o in oids))


def command_complete(tag: str) -> bytes:
    return message("C", cstr(tag))


def empty_query_response() -> bytes:
    return message("I")


def parse_complete() -> bytes:
    return message("1")


def bind_complete() -> bytes:
    return message("2")


def close_complete() -> bytes:
    return message("3")


def no_data() -> bytes:
    return message("n")


def portal_suspended() -> bytes:
    return message("s")


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """Fields of an ErrorResponse / NoticeResponse."""

    severity: str
    sqlstate: str
    message: str
    detail: str | None = None
    hint: str | None = None
    position: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        fields: list[tuple[str, str]] = [
            ("S", self.severity),
            ("V", self.severity),
            ("C", self.sqlstate),
            ("M", self.message),
        ]
        if self.detail:
            fields.append(("D", self.detail))
        if self.hint:
            fields.append(("H", self.hint))
        if self.position is not None:
            fields.append(("P", str(self.position)))
        fields.extend(self.extra.items())
        return b"".join(k.encode("ascii") + cstr(v) for k, v in fields) + b"\0"


def error_response(diag: Diagnostic) -> bytes:
    return message("E", diag.encode())


def notice_response(diag: Diagnostic) -> bytes:
    return message("N", diag.encode())
