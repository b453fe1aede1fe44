"""A result cache entry as data: a signed JSON document of typed values, never an object graph.

An entry is a version tag, an HMAC-SHA256 under a key derived from the installation key and the JSON
document of a released :class:`~dpsql.session.Result` (its notices with their kinds,
:mod:`dpsql.notices`); reading one checks the MAC before a byte of JSON is parsed and builds values only.
Stored measurements (:func:`measurement_result`) are results of their own shape.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import hmac
import itertools
import json
import numbers
import uuid
from collections.abc import Callable
from typing import Any

from dpsql.notices import Notice, NoticeKind, Severity
from dpsql.pgtypes import PG_TYPE_OIDS
from dpsql.session import OutputColumn, Result

# -- entries as signed data ------------------------------------------------------------------------
#
# Whoever can write the cache table (anyone holding the cache's or ledger's database credentials)
# must not be able to run code in, or change the answers of, every ``dpsql serve`` process. So an
# entry is *data*, never an object graph: a JSON document of typed values (no class is ever looked up
# by a name found in it), preceded by a version tag and an HMAC-SHA256 under a key derived from the
# installation key (:func:`result_cache_key`). The MAC is checked in constant time before a byte of the
# JSON is parsed, and it covers the entry's cache key, so an entry is served only under the key it was
# written for (payloads swapped between keys fail). An entry that fails is a miss: the query is then
# charged and answered afresh, and the fresh answer replaces the bad entry. Older entries (pickles,
# before format 1) carry no tag and are misses the same way.
#
# What the MAC does not cover: a writer who can also read the installation key (``dpsql_ledger_meta``,
# the same database when the cache sits beside the ledger, its default) can forge entries; they are
# still only data, so the worst is a wrong answer served for free, no worse than what the same
# credentials already allow on the ledger. A separate cache database or a role without SELECT on
# ``dpsql_ledger_meta`` keeps the MAC's guarantee.

#: Leads every entry of this format; anything else (an old pickle, a foreign blob) is a miss.
ENTRY_TAG = b"dpsql result cache 1\n"
_MAC_SIZE = hashlib.sha256().digest_size


def result_cache_key(installation_key: bytes) -> bytes:
    """The key that signs result cache entries: derived from the installation key with its own label,
    so it signs nothing else and reveals nothing of the installation key or its other derived keys."""
    return hmac.new(installation_key, b"dpsql result cache v1", hashlib.sha256).digest()


class UnusableEntry(ValueError):
    """A stored entry that must not be served; ``reason`` names why without quoting the entry."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _corrupt() -> UnusableEntry:
    return UnusableEntry("malformed")


#: Values JSON types by itself: written and read back as they are. Floats are JSON numbers (Python's
#: json writes NaN and ±Infinity as bare tokens and reads them back; a float's text always has a '.'
#: or an exponent, an int's never, so the two cannot be confused).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _encode_other(value: Any) -> Any:
    """A value JSON cannot type by itself, as a one-key object ``{tag: payload}``."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, decimal.Decimal):
        return {"n": str(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats and other reals
        return float(value)
    if isinstance(value, dt.datetime):
        return {"ts": dt.datetime.isoformat(value)}
    if isinstance(value, dt.date):
        return {"d": dt.date.isoformat(value)}
    if isinstance(value, dt.time):
        return {"t": dt.time.isoformat(value)}
    if isinstance(value, dt.timedelta):
        return {"iv": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"x": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, uuid.UUID):
        return {"u": str(value)}
    raise TypeError(type(value).__name__)


_ENCODERS: dict[type, Callable[[Any], Any]] = {
    decimal.Decimal: lambda v: {"n": str(v)},
    dt.datetime: lambda v: {"ts": v.isoformat()},
    dt.date: lambda v: {"d": v.isoformat()},
}


def _encode_rows(rows: list[tuple[Any, ...]]) -> list[Any]:
    """Rows for JSON (tuples are written as arrays): a row of plain values as it is, others tagged."""
    if _PLAIN.issuperset(map(type, itertools.chain.from_iterable(rows))):  # the common result: nothing to tag
        return rows
    return [
        row
        if _PLAIN.issuperset(map(type, row))
        else [value if type(value) in _PLAIN else _ENCODERS.get(type(value), _encode_other)(value) for value in row]
        for row in rows
    ]


def _encode_widths(rows: list[tuple[float | None, ...]]) -> list[list[Any]]:
    """Accuracy rows as ``[count, widths]`` runs of equal consecutive rows (they mostly repeat one tuple)."""
    runs: list[list[Any]] = []
    previous: Any = None
    for row in rows:
        if runs and (row is previous or row == previous):
            runs[-1][0] += 1
        else:
            runs.append([1, [None if w is None else float(w) for w in row]])
        previous = row
    return runs


def _text(payload: Any) -> str:
    if type(payload) is not str:
        raise _corrupt()
    return payload


def _interval(payload: Any) -> dt.timedelta:
    if type(payload) is not list or len(payload) != 3 or any(type(p) is not int for p in payload):
        raise _corrupt()
    return dt.timedelta(days=payload[0], seconds=payload[1], microseconds=payload[2])


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "n": lambda p: decimal.Decimal(_text(p)),
    "ts": lambda p: dt.datetime.fromisoformat(_text(p)),
    "d": lambda p: dt.date.fromisoformat(_text(p)),
    "t": lambda p: dt.time.fromisoformat(_text(p)),
    "iv": _interval,
    "x": lambda p: base64.b64decode(_text(p), validate=True),
    "u": lambda p: uuid.UUID(_text(p)),
}
#: Every type a released value may have once read back.
_VALUE_TYPES = _PLAIN | {decimal.Decimal, dt.datetime, dt.date, dt.time, dt.timedelta, bytes, uuid.UUID}

#: The fields of :class:`Result` an entry holds (every one: a test checks none is added unnoticed).
RESULT_FIELDS = (
    "columns",
    "rows",
    "accuracy",
    "epsilon_spent",
    "delta_spent",
    "remaining_epsilon",
    "notices",
    "command_tag",
)
_DOCUMENT_FIELDS = frozenset({"key", "created", *RESULT_FIELDS})
#: Fields an entry leaves out: quantiles' value intervals (the notes stating them are kept).
UNSTORED_FIELDS = ("intervals",)


def _object(pairs: dict[str, Any]) -> Any:
    """JSON objects while parsing: a tagged value is rebuilt by its tag's decoder (values only, never a
    class named by the entry), the document is kept as a dict, anything else is refused."""
    if len(pairs) == 1:
        ((tag, payload),) = pairs.items()
        decode = _DECODERS.get(tag)
        if decode is not None:
            return decode(payload)
    if pairs.keys() == _DOCUMENT_FIELDS:
        return pairs
    raise _corrupt()


def dump_result(key: str, result: Result, created: float) -> bytes:
    """The JSON document of a released result stored under ``key`` (TypeError or ValueError: a value
    an entry cannot hold; the result is then not cached)."""
    document = {
        "key": key,
        "created": float(created),
        "columns": [[c.name, c.type, c.noisy] for c in result.columns],
        "rows": _encode_rows(result.rows),
        "accuracy": _encode_widths(result.accuracy),
        "epsilon_spent": float(result.epsilon_spent),
        "delta_spent": float(result.delta_spent),
        "remaining_epsilon": None if result.remaining_epsilon is None else float(result.remaining_epsilon),
        "notices": [_encode_notice(Notice.of(n)) for n in result.notices],
        "command_tag": str(result.command_tag),
    }
    return json.dumps(document, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _list(item: Any) -> list[Any]:
    if type(item) is not list:
        raise _corrupt()
    return item


def _float(item: Any) -> float:
    if type(item) is not float:
        raise _corrupt()
    return item


def _encode_notice(notice: Notice) -> list[str]:
    """A notice with its kind, severity and SQLSTATE, as made (never recovered from its text)."""
    return [str(notice), notice.kind.value, notice.severity.value, notice.sqlstate]


_NOTICE_KINDS = {kind.value: kind for kind in NoticeKind}
_SEVERITIES = {severity.value: severity for severity in Severity}


def _decode_notice(item: Any) -> Notice:
    """A stored notice. Entries written before the kinds were stored (issue #39) hold its text alone: it is
    typed as it was then, by :meth:`Notice.of`."""
    if type(item) is str:
        return Notice.of(item)
    if type(item) is not list or len(item) != 4 or not all(type(part) is str for part in item):
        raise _corrupt()
    text, kind, severity, sqlstate = item
    if kind not in _NOTICE_KINDS or severity not in _SEVERITIES:
        raise _corrupt()
    return Notice(text, _NOTICE_KINDS[kind], _SEVERITIES[severity], sqlstate)


def load_result(key: str, document: bytes) -> tuple[Result, float]:
    """The result (and when it was first computed) in a document written by :func:`dump_result` under
    ``key``; UnusableEntry for anything else. Only values are built: no name in it selects code."""
    try:
        data = json.loads(document, object_hook=_object)
    except UnusableEntry:
        raise
    except (ValueError, RecursionError):
        raise _corrupt() from None
    if type(data) is not dict:
        raise _corrupt()
    if data["key"] != key:
        raise UnusableEntry("stored under another key")
    columns = []
    for column in _list(data["columns"]):
        if type(column) is not list or len(column) != 3:
            raise _corrupt()
        name, type_name, noisy = column
        if type(name) is not str or type_name not in PG_TYPE_OIDS or noisy not in (True, False, None):
            raise _corrupt()
        columns.append(OutputColumn(name, type_name, noisy))
    rows = []
    for row in _list(data["rows"]):
        if type(row) is not list or len(row) != len(columns) or not _VALUE_TYPES.issuperset(map(type, row)):
            raise _corrupt()
        rows.append(tuple(row))
    accuracy: list[tuple[float | None, ...]] = []
    for run in _list(data["accuracy"]):  # one width tuple per row at most: counts cannot make it allocate more
        if (
            type(run) is not list
            or len(run) != 2
            or type(run[0]) is not int
            or not 0 < run[0] <= len(rows) - len(accuracy)
        ):
            raise _corrupt()
        widths = _list(run[1])
        if not {float, type(None)}.issuperset(map(type, widths)):
            raise _corrupt()
        accuracy.extend([tuple(widths)] * run[0])
    notices = [_decode_notice(n) for n in _list(data["notices"])]
    if type(data["command_tag"]) is not str:
        raise _corrupt()
    remaining = data["remaining_epsilon"]
    result = Result(
        columns=columns,
        rows=rows,
        accuracy=accuracy,
        epsilon_spent=_float(data["epsilon_spent"]),
        delta_spent=_float(data["delta_spent"]),
        remaining_epsilon=None if remaining is None else _float(remaining),
        notices=list(notices),
        command_tag=data["command_tag"],
    )
    return result, _float(data["created"])


def seal(mac_key: bytes, document: bytes) -> bytes:
    """An entry: the format tag, the HMAC-SHA256 of tag and document, then the document."""
    return ENTRY_TAG + hmac.new(mac_key, ENTRY_TAG + document, hashlib.sha256).digest() + document


def unseal(mac_key: bytes, key: str, entry: Any) -> tuple[Result, float]:
    """The result in a stored entry, after its MAC has been checked (constant time) and before anything
    in it is parsed; UnusableEntry when it is of another format, altered, signed by another
    installation or stored under another key."""
    if not isinstance(entry, bytes | bytearray | memoryview):
        raise UnusableEntry("not an entry")
    entry = bytes(entry)
    if not entry.startswith(ENTRY_TAG):
        raise UnusableEntry("unknown format")
    mac = entry[len(ENTRY_TAG) : len(ENTRY_TAG) + _MAC_SIZE]
    document = entry[len(ENTRY_TAG) + _MAC_SIZE :]
    expected = hmac.new(mac_key, ENTRY_TAG + document, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise UnusableEntry("bad signature")
    return load_result(key, document)


#: The command tag of a stored measurement (a :class:`Result` holding released keys and noisy measures).
MEASUREMENT_TAG = "DPSQL MEASUREMENT"


def measurement_result(nkeys: int, keys: list[tuple[Any, ...]], columns: list[list[Any]]) -> Result:
    """Released measurements as a storable :class:`Result`: per released group its ``nkeys`` key values,
    then each measure's noisy value. Only released values: raw measures are never passed here."""
    names = [f"k{i}" for i in range(nkeys)] + [f"m{i}" for i in range(len(columns))]
    rows = [(*key[:nkeys], *(column[j] for column in columns)) for j, key in enumerate(keys)]
    return Result(
        columns=[OutputColumn(name, "text", None) for name in names],
        rows=rows,
        accuracy=[],
        epsilon_spent=0.0,
        delta_spent=0.0,
        command_tag=MEASUREMENT_TAG,
    )


def measurements(stored: Result, nkeys: int, nmeasures: int) -> tuple[list[tuple[Any, ...]], list[list[Any]]] | None:
    """The released keys and noisy measure columns in a stored measurement; None when it is not one of
    this shape (never served then)."""
    if stored.command_tag != MEASUREMENT_TAG or len(stored.columns) != nkeys + nmeasures:
        return None
    keys = [row[:nkeys] for row in stored.rows]
    return keys, [[row[nkeys + i] for row in stored.rows] for i in range(nmeasures)]
