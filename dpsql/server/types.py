"""Text and binary encodings of the few PostgreSQL types dpsql sends and receives.

Results only ever carry dpsql's output types (bigint, double precision, numeric, text, boolean,
date, timestamp, plus int4/name for local answers); parameters may arrive in any of the common
scalar types, as text or binary, and are decoded to plain Python values for the engine.
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from dpsql.errors import (
    DataError,
    DatetimeFieldOverflow,
    FeatureNotSupported,
    InvalidBinaryRepresentation,
    InvalidTextRepresentation,
)
from dpsql.pgtypes import OIDS, TYPE_SIZES, oid_for, parse_bool, type_size

__all__ = ["OIDS", "TYPE_SIZES", "decode_param", "encode_value", "oid_for", "type_size"]  # OIDs: dpsql.pgtypes

PG_EPOCH_DATE = dt.date(2000, 1, 1)
PG_EPOCH = dt.datetime(2000, 1, 1)
_NUMERIC_POS, _NUMERIC_NEG, _NUMERIC_NAN = 0x0000, 0x4000, 0xC000


def _float_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def encode_text(value: Any) -> bytes | None:
    """PostgreSQL text output of a Python value."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, float):
        return _float_text(value).encode()
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ").encode()
    if isinstance(value, bytes):
        return b"\\x" + value.hex().encode()
    return str(value).encode("utf-8")


def _as_int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise DataError("cannot send a fractional value as an integer")
    return int(value)


def _encode_numeric(value: Any) -> bytes:
    d = Decimal(str(value)) if not isinstance(value, Decimal) else value
    if d.is_nan():
        return struct.pack("!hhHh", 0, 0, _NUMERIC_NAN, 0)
    if d.is_infinite():
        raise DataError("cannot send an infinite numeric in binary")
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    dscale = max(0, -exponent)
    # Pad the decimal digit string so the point falls on a base-10000 boundary.
    int_digits = "".join(map(str, digits))
    point = len(int_digits) + exponent  # position of the decimal point in int_digits
    left_pad = (4 - point % 4) % 4
    int_digits = "0" * left_pad + int_digits
    point += left_pad
    if point < 0:
        int_digits = "0" * -point + int_digits
        point = 0
    if len(int_digits) < point:
        int_digits += "0" * (point - len(int_digits))
    int_digits += "0" * ((4 - len(int_digits) % 4) % 4)
    groups = [int(int_digits[i : i + 4]) for i in range(0, len(int_digits), 4)]
    weight = point // 4 - 1
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    if not groups:
        weight = 0
    header = struct.pack("!hhHh", len(groups), weight, _NUMERIC_NEG if sign else _NUMERIC_POS, dscale)
    return header + b"".join(struct.pack("!H", g) for g in groups)


def _encode_date(value: Any) -> bytes:
    if isinstance(value, dt.datetime):
        value = value.date()
    return struct.pack("!i", (value - PG_EPOCH_DATE).days)


def _encode_timestamp(value: Any) -> bytes:
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    delta = value - PG_EPOCH
    return struct.pack("!q", (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds)


_BINARY_ENCODERS: dict[int, Callable[[Any], bytes]] = {
    16: lambda v: b"\x01" if v else b"\x00",
    20: lambda v: struct.pack("!q", _as_int(v)),
    21: lambda v: struct.pack("!h", _as_int(v)),
    23: lambda v: struct.pack("!i", _as_int(v)),
    26: lambda v: struct.pack("!I", _as_int(v)),
    700: lambda v: struct.pack("!f", float(v)),
    701: lambda v: struct.pack("!d", float(v)),
    1082: _encode_date,
    1114: _encode_timestamp,
    1184: _encode_timestamp,
    1700: _encode_numeric,
}


def encode_binary(value: Any, oid: int) -> bytes | None:
    """PostgreSQL binary send format of a Python value for a column of type ``oid``."""
    if value is None:
        return None
    encoder = _BINARY_ENCODERS.get(oid)
    if encoder is not None:
        return encoder(value)
    if oid in (25, 19, 705, 1042, 1043):
        return encode_text(value)
    raise FeatureNotSupported(f"binary output is not supported for type oid {oid}")


def encode_value(value: Any, oid: int, fmt: int) -> bytes | None:
    if fmt == 0 and oid == 1184 and isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.isoformat(sep=" ").encode() + b"+00"  # timestamptz keys: UTC instants (the session is UTC)
    return encode_binary(value, oid) if fmt == 1 else encode_text(value)


# --- input (Bind parameters) --------------------------------------------------------------------


def _parse_timestamp(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.strip())


_TEXT_DECODERS: dict[int, Callable[[str], Any]] = {
    16: parse_bool,
    20: int,
    21: int,
    23: int,
    26: int,
    700: float,
    701: float,
    1700: Decimal,
    1082: lambda t: dt.date.fromisoformat(t.strip()),
    1114: _parse_timestamp,
    1184: _parse_timestamp,
}


def _decode_numeric_binary(data: bytes) -> Decimal:
    ndigits, weight, sign, dscale = struct.unpack("!hhHh", data[:8])
    if sign == _NUMERIC_NAN:
        return Decimal("NaN")
    groups = struct.unpack(f"!{ndigits}H", data[8 : 8 + 2 * ndigits])
    if len(data) != 8 + 2 * ndigits:
        raise ValueError("numeric length")
    value = Decimal(0)
    for i, g in enumerate(groups):
        value += Decimal(g).scaleb(4 * (weight - i))
    value = value.quantize(Decimal(1).scaleb(-dscale)) if dscale else value.quantize(Decimal(1))
    return -value if sign == _NUMERIC_NEG else value


def _fixed(fmt: str) -> Callable[[bytes], Any]:
    size = struct.calcsize(fmt)

    def decode(data: bytes) -> Any:
        if len(data) != size:
            raise ValueError("wrong length")
        return struct.unpack(fmt, data)[0]

    return decode


_BINARY_DECODERS: dict[int, Callable[[bytes], Any]] = {
    16: lambda b: _fixed("!?")(b),
    20: _fixed("!q"),
    21: _fixed("!h"),
    23: _fixed("!i"),
    26: _fixed("!I"),
    700: _fixed("!f"),
    701: _fixed("!d"),
    1082: lambda b: PG_EPOCH_DATE + dt.timedelta(days=_fixed("!i")(b)),
    1114: lambda b: PG_EPOCH + dt.timedelta(microseconds=_fixed("!q")(b)),
    1700: _decode_numeric_binary,
}


def decode_param(data: bytes | None, oid: int, fmt: int) -> Any:
    """A Bind parameter as a Python value; raises :class:`DataError` (22P02/22P03) when malformed."""
    if data is None:
        return None
    try:
        if fmt == 1:
            decoder = _BINARY_DECODERS.get(oid)
            if decoder is not None:
                return decoder(data)
            if oid in (0, 25, 19, 705, 1042, 1043):
                return data.decode("utf-8")
            raise FeatureNotSupported(f"binary input is not supported for type oid {oid}")
        text = data.decode("utf-8")
        text_decoder = _TEXT_DECODERS.get(oid)
        return text_decoder(text) if text_decoder else text
    except OverflowError:
        raise DatetimeFieldOverflow("bind parameter out of range") from None
    except (ValueError, struct.error, InvalidOperation, UnicodeDecodeError):
        if fmt == 1:
            raise InvalidBinaryRepresentation("incorrect binary data format in bind parameter") from None
        raise InvalidTextRepresentation("invalid input syntax in bind parameter") from None
