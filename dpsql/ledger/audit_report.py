"""The audit trail read back (``dpsql audit``, the dashboard): statements and curator actions as rows,
and those rows as JSON, CSV or an aligned table whose every text is escaped (:func:`printable`).
Reads the ledger only, never the data; the trail is the curator's (never sent over the wire)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import unicodedata
from collections.abc import Sequence
from typing import Any

from dpsql.errors import DatetimeFieldOverflow, InvalidDatetimeFormat
from dpsql.ledger.base import Ledger
from dpsql.ledger.records import LEVER_KINDS, AuditEntry, LeverEvent

AUDIT_COLUMNS = (
    "at",
    "analyst",
    "event",
    "sqlstate",
    "epsilon",
    "delta",
    "rho",
    "latency_ms",
    "fingerprint",
    "shape",
    "by",
    "reason",
    "repeats",
    "last_at",
)

#: Outcomes of statements that were answered or charged: read apart from free refusals, so that no
#: number of refusals can push one of them out of a page.
SPENT_OUTCOMES = ("answered", "cache hit", "charged", "failed")


def parse_since(text: str) -> dt.datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise) as an aware datetime in UTC.

    22007 when it is not one; 22008 when it is out of range once in UTC (``0001-01-01T00:00+05:00``
    is before year 1), so a reader never gets an ``OverflowError`` from an analyst-typed filter."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidDatetimeFormat(
            f'invalid input syntax for type timestamp: "{text}"', hint="Use ISO 8601, e.g. 2026-11-01."
        ) from None
    try:
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)
    except (OverflowError, ValueError):
        raise DatetimeFieldOverflow(
            f'date/time field value out of range: "{text}"',
            hint="Use a date between 0001-01-01 and 9999-12-31 (UTC).",
        ) from None


def audit_rows(
    ledger: Ledger,
    dataset: str,
    *,
    analyst: str | None = None,
    since: dt.datetime | None = None,
    limit: int = 100,
    outcomes: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Statements and curator actions on ``dataset``, newest first, at most ``limit`` of them (only
    statements of ``outcomes`` and the actions named in it, when given).

    Reads the ledger only — never the data."""
    kinds = None if outcomes is None else [o for o in outcomes if o in LEVER_KINDS]
    statements = None if outcomes is None else [o for o in outcomes if o not in LEVER_KINDS]
    rows = []
    if statements is None or statements:
        rows += [
            _statement_row(e) for e in ledger.audit(dataset, analyst, since=since, limit=limit, outcomes=statements)
        ]
    if kinds is None or kinds:
        events = ledger.lever_events(dataset, analyst, since=since, limit=limit)
        rows += [_lever_row(e) for e in events if kinds is None or e.kind in kinds]
    rows.sort(key=lambda r: r["at"], reverse=True)
    return rows[:limit]


def _statement_row(entry: AuditEntry) -> dict[str, Any]:
    return {
        "at": entry.at,
        "analyst": entry.analyst,
        "event": entry.outcome,
        "sqlstate": entry.sqlstate,
        "epsilon": entry.epsilon,
        "delta": entry.delta,
        "rho": entry.rho,
        "latency_ms": entry.latency_ms,
        "fingerprint": entry.fingerprint,
        "shape": entry.shape,
        "by": None,
        "reason": None,
        "repeats": entry.repeats,
        "last_at": entry.last_at,
    }


def _lever_row(event: LeverEvent) -> dict[str, Any]:
    return {
        "at": event.at,
        "analyst": event.analyst or None,  # a prune is for no one analyst
        "event": event.kind,
        "sqlstate": None,
        "epsilon": event.epsilon,
        "delta": event.delta,
        "rho": None,
        "latency_ms": None,
        "fingerprint": None,
        "shape": None,
        "by": event.by,
        "reason": event.reason,
        "repeats": 1,
        "last_at": None,
    }


def _cell(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat(timespec="milliseconds")
    return value


def as_json(rows: Sequence[dict[str, Any]]) -> str:
    return json.dumps([{k: _cell(v) for k, v in row.items()} for row in rows])


#: First characters a spreadsheet reads as a formula (CSV injection): such a text cell gets a leading ``'``.
_FORMULA_STARTS = ("=", "+", "-", "@")


def csv_cell(value: Any) -> Any:
    """One CSV cell: a text escaped as in the table (:func:`printable`: an analyst's name or query never
    reaches a terminal or a viewer as control or bidi characters), and one a spreadsheet would run as a
    formula (``=``, ``+``, ``-``, ``@`` first) prefixed with ``'``; numbers and times as they are."""
    value = _cell(value)
    if not isinstance(value, str):
        return value
    text = printable(value)
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def as_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV with a header line, every cell through :func:`csv_cell`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(AUDIT_COLUMNS)
    for row in rows:
        writer.writerow(["" if row[c] is None else csv_cell(row[c]) for c in AUDIT_COLUMNS])
    return out.getvalue()


def printable(text: Any) -> Any:
    """``text`` with every control, format (bidi override, zero-width) and line/paragraph separator
    character written as its escape (ESC as ``\\x1b``), and the backslash doubled: an analyst's name or
    query reaches a curator's terminal as visible text, never as a terminal command. Non-text is returned."""
    if not isinstance(text, str):
        return text
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def as_table_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows for the aligned text table (shape last, cut to 60 characters; every text escaped by
    :func:`printable`); a folded row shows its repeats (×N)."""
    table = []
    for row in rows:
        shape = printable(row["shape"] or row["reason"] or "")
        event = row["event"] if row.get("repeats", 1) == 1 else f"{row['event']} ×{row['repeats']}"
        table.append(
            (
                _cell(row["at"]),
                printable(row["analyst"]),
                event,
                row["sqlstate"],
                row["epsilon"],
                row["delta"],
                row["latency_ms"],
                printable(row["by"]),
                shape if len(shape) <= 60 else shape[:57] + "...",
            )
        )
    return table


TABLE_COLUMNS = ("at", "analyst", "event", "sqlstate", "epsilon", "delta", "latency_ms", "by", "shape / reason")
