"""Shaping engine results for the wire: extra confidence-interval columns and NOTICE texts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpsql.accountant import fmt
from dpsql.notices import Notice, NoticeKind
from dpsql.pgtypes import FLOAT8, type_size
from dpsql.session import OutputColumn, Result, ci_label

from .protocol import Diagnostic, FieldDescription

if TYPE_CHECKING:
    from .memory import Hold

_NUMERIC_TYPES = {"bigint", "double precision", "numeric"}


@dataclass(slots=True)
class Outcome:
    """What one statement produced, ready to be sent: optional columns, rows, tag, notices.

    ``encoded`` rows already hold wire bytes in each field's format (catalog results);
    otherwise they hold Python values encoded at send time.
    """

    fields: list[FieldDescription] | None
    rows: list[tuple[Any, ...]]
    tag: str
    encoded: bool = False
    notices: list[Diagnostic] = field(default_factory=list)
    status: list[tuple[str, str]] = field(default_factory=list)
    epsilon: float = 0.0
    #: The bytes its rows hold (catalog and engine results), given back once they are sent or
    #: handed to the portal or cursor that keeps them.
    hold: Hold | None = None

    def release(self) -> None:
        if self.hold is not None:
            self.hold.release()
            self.hold = None

    def take_hold(self) -> Hold | None:
        """The hold, now the caller's (a portal or cursor keeping the rows)."""
        hold, self.hold = self.hold, None
        return hold


def noisy_flags(columns: Sequence[OutputColumn]) -> list[bool]:
    """Which output columns are noisy (get a ``_ci`` column), the same at Describe and Execute:
    from the plan (``OutputColumn.noisy``, set from ``OutputItem.noisy``), never a re-parse."""
    return [bool(c.noisy) for c in columns]


def ci_suffix(confidence: float) -> str:
    return f"_ci{ci_label(confidence)}"


def engine_fields(
    columns: Sequence[OutputColumn], flags: Sequence[bool] | None, confidence: float
) -> list[FieldDescription]:
    """RowDescription for engine output, with ``<name>_ci95`` after each noisy column when asked."""
    out: list[FieldDescription] = []
    for i, col in enumerate(columns):
        out.append(FieldDescription(col.name, col.type_oid, type_size(col.type_oid)))
        if flags is not None and flags[i]:
            out.append(FieldDescription(col.name + ci_suffix(confidence), FLOAT8, 8))
    return out


def engine_rows(result: Result, flags: Sequence[bool] | None) -> list[tuple[Any, ...]]:
    if flags is None:
        return [tuple(r) for r in result.rows]
    rows = []
    for values, accuracy in zip(result.rows, result.accuracy, strict=False):
        row: list[Any] = []
        for i, value in enumerate(values):
            row.append(value)
            if flags[i]:
                row.append(accuracy[i] if i < len(accuracy) else None)
        rows.append(tuple(row))
    return rows


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _value(x: Any) -> str:
    """A released value as the per-row detail shows it (NULL spelled out)."""
    if x is None:
        return "NULL"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


#: At most this many rows are listed in the per-row DETAIL of the interval NOTICE.
DETAIL_ROWS = 20


def _widths(result: Result, i: int) -> list[float | None]:
    """Column ``i``'s finite half-widths per row (None where the cell has none: a key, a NULL)."""
    return [
        float(w) if i < len(acc) and isinstance(w := acc[i], int | float) and math.isfinite(w) else None
        for acc in result.accuracy
    ]


def interval_summary(result: Result, confidence: float, per_row: bool = True) -> Diagnostic | None:
    """``95% CI half-widths: n ±3, avg ±0.33–0.66 (differs by row: DETAIL)`` and, when some column's
    half-width differs between rows (AVG per group), a DETAIL giving each row's value ± half-width.

    Everything shown is a released value or a half-width computed from public scales and released
    values (post-processing); the DETAIL is left out when the ``_ci95`` columns already carry it.
    """
    parts, varying = [], []
    for i, col in enumerate(result.columns):
        widths = [w for w in _widths(result, i) if w is not None]
        if not widths:
            continue
        low, high = min(widths), max(widths)
        if _fmt(low) == _fmt(high):
            parts.append(f"{col.name} ±{_fmt(low)}")
        else:
            parts.append(f"{col.name} ±{_fmt(low)}–{_fmt(high)}")
            varying.append(i)
    if not parts:
        return None
    label = ci_label(confidence)
    message = f"dpsql: {label}% CI half-widths: " + ", ".join(parts)
    if not varying:
        return Diagnostic("NOTICE", "00000", message)
    if not per_row:
        return Diagnostic("NOTICE", "00000", message + f" (per row in the _ci{label} columns)")
    keys = [i for i, col in enumerate(result.columns) if not col.noisy]
    per_column = {i: _widths(result, i) for i in varying}
    lines = []
    for j, row in enumerate(result.rows[:DETAIL_ROWS]):
        name = ", ".join(_value(row[i]) for i in keys) if keys else f"row {j + 1}"
        cells = []
        for i in varying:
            w = per_column[i][j]
            cells.append(f"{result.columns[i].name} {_value(row[i])}" + ("" if w is None else f" ±{_fmt(w)}"))
        lines.append(f"{name}: " + ", ".join(cells))
    if len(result.rows) > DETAIL_ROWS:
        lines.append(
            f"… {len(result.rows) - DETAIL_ROWS} more rows (SET dpsql.show_intervals = on: a _ci{label} column per row)"
        )
    return Diagnostic("NOTICE", "00000", message + " (differs by row: DETAIL)", detail="\n".join(lines))


def result_notices(result: Result, confidence: float, per_row: bool = True) -> list[Diagnostic]:
    """NOTICEs after a DP query: the charge and remaining budget (or the cache hit), the interval
    half-widths (per row in a DETAIL when they differ), then what ± cannot say (quantiles, modes, NULLs)."""
    typed = [Notice.of(t) for t in result.notices]
    accounting = [n for n in typed if n.budget]
    if result.epsilon_spent and not accounting:
        left = result.remaining_epsilon
        remaining = "" if left is None else f"; remaining ε={fmt(left, down=True)}"
        accounting.append(Notice(f"dpsql: charged ε={fmt(result.epsilon_spent)}{remaining}", NoticeKind.CHARGE))
    notices = [_diagnostic(n) for n in accounting]
    summary = interval_summary(result, confidence, per_row)
    if summary is not None:
        notices.append(summary)
    return notices + [_diagnostic(n) for n in typed if not n.budget]


def _diagnostic(notice: Notice) -> Diagnostic:
    """A typed notice as sent: its severity and SQLSTATE (a warning: 01000, its text's marker dropped)."""
    return Diagnostic(notice.severity.value, notice.sqlstate, notice.message)
