"""EXPLAIN: what a query would cost and how accurate it would be, without running it.

Everything shown is public: the policy's bounds, the calibrated scales, the generated SQL
(with the row-selection salt hidden). Nothing is read from the data and nothing is charged.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from dpsql.accountant import fmt
from dpsql.aggregates import OUTPUTS
from dpsql.analyze.parse import skip_comments
from dpsql.analyze.statement import EXPLAIN_OPTIONS
from dpsql.notices import Notice, NoticeKind
from dpsql.plan import Plan
from dpsql.release.accuracy import bias_note
from dpsql.release.calibrate import Budgeting
from dpsql.session import OutputColumn, Result, ci_label


@dataclass
class Explanation:
    """``dpsql explain`` / ``EXPLAIN``: what a query would cost and how accurate it would be."""

    sql: str
    epsilon: float
    delta: float
    mechanism: str
    columns: list[dict[str, Any]] = field(default_factory=list)
    keys: str = "none"
    unit: str = ""
    #: What the intervals leave out (clamping, contribution caps): :func:`dpsql.release.accuracy.bias_note`.
    bias: str = ""
    #: Accuracy-first (``dpsql.accuracy``): the half-width asked for, met by ``epsilon``; None otherwise.
    accuracy: float | None = None
    confidence: float = 0.95
    #: Where the answer would come from when it is free (a stored or derived answer), as its notice says,
    #: and how much wider than a fresh answer a synopsis's ± are (when they are).
    answered: str | None = None
    wider: str | None = None

    def answered_by(self, result: Result) -> Explanation:
        """What the statement would really get (issue #38 item 4): ``result``, the stored or derived answer
        that costs nothing, with its own ± per output (the widest row's)."""
        free = (str(n) for n in map(Notice.of, result.notices) if n.kind is NoticeKind.FREE)
        source = next(free, "released values")
        wider = next((str(n) for n in result.notices if "those of a fresh answer" in n), None)
        columns = []
        for i, column in enumerate(self.columns):
            widths = [w for row in result.accuracy if i < len(row) and (w := row[i]) is not None]
            ci = max(widths) if widths else math.nan
            columns.append({**column, "epsilon": 0.0, "ci": ci, "answered": True})
        return replace(
            self,
            epsilon=0.0,
            delta=0.0,
            columns=columns,
            answered=source.removeprefix("dpsql: "),
            wider=None if wider is None else wider.removeprefix("dpsql: "),
        )

    def as_json(self) -> str:
        """PostgreSQL's ``EXPLAIN (FORMAT JSON)`` shape: an array holding one ``{"Plan": …}`` object."""

        def finite(value: Any) -> Any:
            return value if not isinstance(value, float) or math.isfinite(value) else None

        plan = {
            "Node Type": "DP Aggregate",
            "Mechanism": self.mechanism,
            "Epsilon": self.epsilon,
            "Delta": self.delta,
            "Privacy Unit": self.unit,
            "Group Keys": self.keys,
            "Intervals": self.bias or "noise only",
            **({} if self.accuracy is None else {"Accuracy Target": self.accuracy, "Confidence": self.confidence}),
            **({} if self.answered is None else {"Free": self.answered}),
            **({} if self.wider is None else {"Wider": self.wider}),
            "Outputs": [{k: finite(v) for k, v in c.items()} for c in self.columns],
            "Backend SQL": self.sql,
        }
        return json.dumps([{"Plan": plan}], indent=2)

    def as_result(self, format: str = "text") -> Result:
        if format == "json":
            return Result(
                columns=[OutputColumn("QUERY PLAN", "text", noisy=False)],
                rows=[(self.as_json(),)],
                accuracy=[(None,)],
                epsilon_spent=0.0,
                delta_spent=0.0,
                command_tag="EXPLAIN",
            )
        lines = [
            f"DP Aggregate  (mechanism={self.mechanism} epsilon={fmt(self.epsilon)} delta={fmt(self.delta)})",
            f"  Privacy unit: {self.unit}",
            f"  Group keys: {self.keys}",
            f"  Intervals: {self.bias or 'noise only'}",
        ]
        if self.accuracy is not None:
            lines.insert(1, f"  {self.accuracy_line()}")
        if self.wider is not None:
            lines.insert(1, f"  Wider: {self.wider}")
        if self.answered is not None:
            lines.insert(1, f"  Free: {self.answered}")
        for c in self.columns:
            lines.append(f"  Output {c['name']}: {c['measure']}" + _figures(c))
        lines.append("  ->  Backend SQL:")
        lines.extend(sql_lines(self.sql, indent=8))
        return Result(
            columns=[OutputColumn("QUERY PLAN", "text", noisy=False)],
            rows=[(line,) for line in lines],
            accuracy=[(None,) for _ in lines],
            epsilon_spent=0.0,
            delta_spent=0.0,
            command_tag="EXPLAIN",
        )

    def accuracy_line(self) -> str:
        """What accuracy-first chose: ``ε chosen for accuracy ±10 at 95 %: 0.37``."""
        return f"ε chosen for accuracy ±{self.accuracy:g} at {ci_label(self.confidence)} %: {self.epsilon:.4g}"


def _figures(c: dict[str, Any]) -> str:
    """An output's figures on its EXPLAIN line: sensitivity, scale, ε, then its accuracy — a CI,
    a rank error bound (quantiles), or why the CI is per row (it depends on released values)."""
    if "rank_error95" in c:
        return f"  epsilon={fmt(c['epsilon'])} rank error <= {c['rank_error95']:.4g} at 95%"
    if not c["noisy"]:
        return ""
    if c.get("answered"):  # nothing charged: the ± of the stored or derived answer
        return "  epsilon=0" + (f" ci95=±{c['ci']:.4g}" if not math.isnan(c["ci"]) else "")
    text = f"  sensitivity={c['sensitivity']:g} scale={c['scale']:g} epsilon={fmt(c['epsilon'])}"
    if not math.isnan(c["ci"]):
        return text + f" ci95=±{c['ci']:.4g}"
    if c["measure"].startswith("AVG"):
        return text + " ci95 per row (depends on the noisy count)"
    return text


#: Where EXPLAIN starts a new line of the backend SQL: before these clause keywords (as sqlglot
#: writes them, upper case, outside quotes), at the top and inside subqueries, never inside a
#: function's or window's parentheses.
_CLAUSES: tuple[str, ...] = ("WITH", "SELECT", "FROM", "WHERE", "GROUP BY", "HAVING", "ORDER BY", "LIMIT", "OFFSET")
_CLAUSES += ("UNION ALL", "LEFT JOIN", "INNER JOIN", "JOIN")
#: Lines longer than this are wrapped at a space outside quotes.
_WIDTH = 100
_CTE = re.compile(r'[\w"]+ AS \(')


def sql_lines(sql: str, indent: int = 0) -> list[str]:
    """The backend SQL as PostgreSQL-style plan text: one clause per line, indented by parenthesis
    depth, long lines wrapped. Only whitespace changes: the statement's text stays as generated."""
    pieces: list[tuple[int, str]] = []
    line_depth = start = 0
    quote = ""
    subquery: list[bool] = []  # per open parenthesis: does a SELECT start inside it?
    for i, c in enumerate(sql):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "(":
            subquery.append(sql.startswith("SELECT ", i + 1))
            if subquery[-1]:
                pieces.append((line_depth, sql[start : i + 1]))
                start, line_depth = i + 1, len(subquery)
        elif c == ")" and subquery:
            subquery.pop()
        elif c == " " and i > start and (not subquery or subquery[-1]) and _breaks_before(sql, i + 1, len(subquery)):
            pieces.append((line_depth, sql[start:i]))
            start, line_depth = i + 1, len(subquery)
    pieces.append((line_depth, sql[start:]))
    lines: list[str] = []
    for level, text in pieces:
        lines.extend(_wrap(text, " " * (indent + 2 * level)))
    return lines


def _breaks_before(sql: str, at: int, depth: int) -> bool:
    """A clause keyword starts at ``at``, or (at the top) the next CTE (``, name AS (``)."""
    if depth == 0 and sql[at - 2] == "," and _CTE.match(sql, at):
        return True
    for keyword in _CLAUSES:
        if sql.startswith(keyword, at):
            after = sql[at + len(keyword) : at + len(keyword) + 1]
            if after in ("", " ", "("):
                return True
    return False


def _wrap(text: str, prefix: str) -> list[str]:
    """Greedy wrap at spaces outside quotes; continuation lines indented four more."""
    lines, current, quote, word_start = [], prefix, "", 0
    words: list[str] = []
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == " ":
            words.append(text[word_start:i])
            word_start = i + 1
    words.append(text[word_start:])
    for word in words:
        if current.strip() and len(current) + 1 + len(word) > _WIDTH:
            lines.append(current)
            current = prefix + "    " + word
        else:
            current = current + (" " if current.strip() else "") + word
    lines.append(current)
    return lines


def explain(plan: Plan, budgeting: Budgeting, confidence: float, shown_sql: str) -> Explanation:
    """Cost, sensitivity, noise scale and expected error per output, from the plan and its calibration."""
    columns = []
    for out in plan.outputs:
        entry: dict[str, Any] = {"name": out.column.name, "type": out.column.type, "noisy": out.noisy}
        entry.update(OUTPUTS[out.kind].explain(out, plan, budgeting, confidence))
        columns.append(entry)
    if not plan.keys:
        keys = "none"
    elif plan.public_keys:
        keys = "public domain: " + ", ".join(k.column for k in plan.keys)
    else:
        counted = plan.measures[plan.selection_measure].label if plan.selection_measure is not None else "COUNT(*)"
        keys = (
            ", ".join(k.column for k in plan.keys)
            + f" (partition selection: noisy {counted} >= {budgeting.threshold}, δ={fmt(budgeting.selection_delta)})"
        )
    unit = plan.sources.unit_description
    if plan.unit is not None:
        unit += f" (at most {plan.max_rows} rows and {plan.max_groups} groups per unit{plan.cap_origin})"
    note = bias_note(plan, confidence, budgeting.interval_cut)
    bias = note.split(" cover", 1)[1].split(" ", 1)[1] if note else ""  # "the noise only, not the bias of …"
    return Explanation(
        shown_sql,
        budgeting.epsilon,
        budgeting.delta,
        budgeting.mechanism,
        columns,
        keys,
        unit,
        bias,
        budgeting.accuracy,
        confidence,
    )


def explain_format(sql: str) -> str:
    """``json`` for ``EXPLAIN (FORMAT JSON) …``, else ``text``."""
    stripped = skip_comments(sql)
    options = EXPLAIN_OPTIONS.match(skip_comments(stripped[7:])) if stripped[:7].upper() == "EXPLAIN" else None
    return options.group(1).lower() if options else "text"
