"""Shaping engine results for the wire: extra confidence-interval columns and NOTICE texts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpsql.pgtypes import FLOAT8, type_size
from dpsql.session import OutputColumn, Result, ci_label

from .protocol import Diagnostic, FieldDescription

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


def interval_summary(result: Result, confidence: float) -> str | None:
    """``95% CI half-widths: n ±3.0, avg_age ±0.4–0.9`` (a range when cells differ)."""
    parts = []
    for i, col in enumerate(result.columns):
        widths = [
            float(w)
            for acc in result.accuracy
            if i < len(acc) and isinstance(w := acc[i], int | float) and math.isfinite(w)
        ]
        if not widths:
            continue
        low, high = min(widths), max(widths)
        parts.append(f"{col.name} ±{_fmt(low)}" if _fmt(low) == _fmt(high) else f"{col.name} ±{_fmt(low)}–{_fmt(high)}")
    if not parts:
        return None
    return f"dpsql: {round(confidence * 100):d}% CI half-widths: " + ", ".join(parts)


def result_notices(result: Result, confidence: float) -> list[Diagnostic]:
    """NOTICEs after a DP query: the charge and remaining budget, then the interval half-widths."""
    texts = list(result.notices)
    if result.epsilon_spent and not any("charged" in t for t in texts):
        remaining = "" if result.remaining_epsilon is None else f"; remaining ε={result.remaining_epsilon:g}"
        texts.append(f"dpsql: charged ε={result.epsilon_spent:g}{remaining}")
    summary = interval_summary(result, confidence)
    if summary:
        texts.append(summary)
    return [Diagnostic("NOTICE", "00000", t) for t in texts]
