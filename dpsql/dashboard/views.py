"""The dashboard's pages: figures read from the ledger and the policy, rendered as escaped HTML.

Nothing here reads the data: every figure comes from the ledger (charges, totals, levers, audit
rows) or the policy, exactly what ``dpsql budget`` and ``dpsql audit`` print. What an analyst
controls — their name and, through their query text, an audit row's *shape* — reaches the page
only through :func:`esc` (HTML-escaped, quotes too), and the pages carry no script at all, so a
``<script>`` in a shape is text. Plots are SVG drawn here (no JavaScript, no CDN).
"""

from __future__ import annotations

import datetime as dt
import functools
import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any

from dpsql.accountant import Allowance, Spent, remaining_budget, shown
from dpsql.errors import InvalidParameterValue
from dpsql.ledger import LEVER_KINDS, Ledger, dataset_charge
from dpsql.ledger.audit_report import SPENT_OUTCOMES, audit_rows, parse_since
from dpsql.policy import DomainReference, Policy

#: Audit outcomes and curator actions the filter accepts (anything else is 22023).
OUTCOMES = ("answered", "charged", "cache hit", "refused", "failed", *LEVER_KINDS)
#: Rows read at most for one page (audit, spend plot): a page never walks an unbounded history.
MAX_ROWS = 5000
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def esc(value: Any) -> str:
    """Text for HTML (element content and quoted attributes alike); None is empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return html.escape(f"{value:.6g}")
    if isinstance(value, dt.datetime):
        return html.escape(value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))
    return html.escape(str(value), quote=True)


def template(name: str) -> Template:
    return Template(resources.files("dpsql.dashboard").joinpath("templates", name).read_text(encoding="utf-8"))


# --- figures -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetRow:
    """One analyst's (or the dataset's) budget as ``dpsql budget`` reckons it."""

    name: str
    spent: float
    total: float
    granted: float
    remaining: float
    delta_spent: float
    delta_total: float
    queries: int
    frozen: bool
    last_at: dt.datetime | None


def budget_rows(ledger: Ledger, policy: Policy) -> tuple[list[BudgetRow], BudgetRow]:
    """Every analyst of the policy or the ledger, and the dataset's row (spent by all analysts). An
    analyst's remaining ε is no more than the dataset's: it is what they can really spend."""
    accounting = policy.budget.accounting
    summary = {row.analyst: row for row in ledger.summary(policy.dataset)}
    all_spent = ledger.spent(policy.dataset)
    budget = policy.budget.dataset
    dataset_left = remaining_budget(all_spent, budget, accounting).epsilon
    rows = []
    declared = {a.name for a in policy.analysts}
    for name in sorted(declared | set(summary)):
        base = Allowance.of(policy.analyst_budget(name))
        levers = ledger.levers(policy.dataset, name)
        total = levers.limit(base)
        entry = summary.get(name)
        used = entry.spent if entry else Spent()
        eps, delta = used.privacy_loss(accounting, total.delta)
        left = min(remaining_budget(used, total, accounting).epsilon, dataset_left)
        if dataset_charge(name, declared):  # a synopsis or DP bounds: drawn from the dataset's budget
            name, base, left = f"(dataset) {name}", Allowance.of(budget), dataset_left
            total = base
        rows.append(
            BudgetRow(
                name,
                shown(eps, up=True),  # 4 significant digits: spent rounded up, what is left down
                total.epsilon,
                total.epsilon - base.epsilon,
                shown(left, down=True),
                delta,
                total.delta,
                used.queries,
                levers.frozen,
                entry.last_at if entry else None,
            )
        )
    eps, delta = all_spent.privacy_loss(accounting, budget.delta)
    left = dataset_left
    last = max((r.last_at for r in rows if r.last_at), default=None)
    dataset = BudgetRow(
        "(dataset)",
        shown(eps, up=True),
        budget.epsilon,
        0.0,
        shown(left, down=True),
        delta,
        budget.delta,
        all_spent.queries,
        False,
        last,
    )
    return rows, dataset


Series = dict[str, list[tuple[dt.datetime, float]]]


def spend_series(ledger: Ledger, policy: Policy, analyst: str | None = None) -> Series:
    """Per analyst, the ε spent after each charge (the ledger's own composition, so the last point
    is the analysts page's figure); the newest :data:`MAX_ROWS` charges at most. A corrupt charge row
    (a non-finite cost: tampering) counts as exhausting: its analyst's line is infinite from there."""
    accounting = policy.budget.accounting
    records = list(reversed(ledger.charges(policy.dataset, analyst, limit=MAX_ROWS)))
    running: dict[str, Spent] = {}
    series: Series = {}
    for record in records:
        spent = running.get(record.analyst, Spent()) + record.cost
        if record.corrupt:
            spent = Spent(math.inf, math.inf, math.inf, spent.queries, math.inf)
        running[record.analyst] = spent
        delta = policy.analyst_budget(record.analyst).delta
        series.setdefault(record.analyst, []).append((record.at, spent.privacy_loss(accounting, delta)[0]))
    return series


@dataclass(frozen=True)
class AuditFilter:
    analyst: str | None = None
    since: dt.datetime | None = None
    outcome: str | None = None
    limit: int = 200

    @staticmethod
    def parse(query: dict[str, list[str]]) -> AuditFilter:
        """The audit page's query string; a bad value is 22007/22023 (a 400 page), never a guess."""

        def one(key: str) -> str | None:
            values = query.get(key) or [""]
            return values[-1].strip() or None

        since = None
        if (text := one("since")) is not None:
            since = parse_since(text)  # 22007 / 22008 (a 400 page), never an OverflowError
        outcome = one("outcome")
        if outcome is not None and outcome not in OUTCOMES:
            raise InvalidParameterValue(f'invalid outcome "{outcome}"', hint=f"Use one of: {', '.join(OUTCOMES)}.")
        limit = 200
        if (text := one("limit")) is not None:
            if not text.isdigit() or not 1 <= int(text) <= MAX_ROWS:
                raise InvalidParameterValue(f'invalid limit "{text}"', hint=f"Use an integer from 1 to {MAX_ROWS}.")
            limit = int(text)
        return AuditFilter(one("analyst"), since, outcome, limit)


def audit_page_rows(ledger: Ledger, policy: Policy, f: AuditFilter) -> list[dict[str, Any]]:
    """``dpsql audit``'s rows for the page, newest first. Without an outcome filter, statements that
    were answered or charged (and curator actions) are read apart from refusals, up to ``limit`` each:
    however many refusals an analyst sends, no answered or charged statement is pushed off the page."""
    read = functools.partial(audit_rows, ledger, policy.dataset, analyst=f.analyst, since=f.since, limit=f.limit)
    if f.outcome:
        return read(outcomes=(f.outcome,))
    rows = read(outcomes=(*SPENT_OUTCOMES, *LEVER_KINDS)) + read(outcomes=("refused",))
    rows.sort(key=lambda r: r["at"], reverse=True)
    return rows


# --- HTML pieces ---------------------------------------------------------------------------------


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], css: str = "") -> str:
    """An HTML table; cells are already HTML (callers escape with :func:`esc`)."""
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{esc(css)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def bar(spent: float, total: float, width: int = 220) -> str:
    """ε spent of the total as an SVG bar (red once ≥ 90 %); attributes, not styles (strict CSP)."""
    ratio = spent / total if total > 0 and math.isfinite(total) else 0.0
    share = 1.0 if math.isnan(ratio) or ratio > 1 else max(ratio, 0.0)  # a corrupt (inf, NaN) total: full
    fill = "#d62728" if share >= 0.9 else "#1f77b4"
    label = f"{share * 100:.0f}% of ε spent"
    return (
        f'<svg class="bar" width="{width}" height="14" role="img" aria-label="{esc(label)}">'
        f'<rect width="{width}" height="14" fill="#e8e8e8"/>'
        f'<rect width="{share * width:.1f}" height="14" fill="{fill}"/></svg>'
    )


def spend_plot(series: Series, width: int = 760, height: int = 300) -> str:
    """Cumulative ε per analyst over time, as SVG step lines with axes and a legend."""
    if not series:
        return '<p class="empty">No charge yet.</p>'
    left, right, top, bottom = 60, 150, 16, 40
    points = [p for line in series.values() for p in line]
    t0 = min(t for t, _ in points).timestamp()
    t1 = max(t for t, _ in points).timestamp()
    span = max(t1 - t0, 1.0)
    # a non-finite value (a corrupt charge) is drawn at the top of the axis, never as NaN coordinates
    ymax = max(max((v for _, v in points if math.isfinite(v)), default=0.0), 1e-9) * 1.05
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(t: dt.datetime) -> float:
        return left + (t.timestamp() - t0) / span * plot_w

    def y(v: float) -> float:
        return top + plot_h - (min(v, ymax) if v == v else ymax) / ymax * plot_h

    parts = [
        f'<svg class="plot" width="{width}" height="{height}" role="img" aria-label="ε spent over time">',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#333"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#333"/>',
    ]
    for i in range(5):
        v = ymax * i / 4
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.3g}</text>')
        parts.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}" stroke="#eee"/>')
    for i, stamp in enumerate((t0, t1)):
        label = dt.datetime.fromtimestamp(stamp, dt.UTC).strftime("%Y-%m-%d %H:%M")
        anchor = "start" if i == 0 else "end"
        xt = left if i == 0 else left + plot_w
        parts.append(f'<text x="{xt}" y="{top + plot_h + 16}" text-anchor="{anchor}" font-size="11">{label}</text>')
    mid = f"{top + plot_h / 2:.0f}"
    parts.append(f'<text x="14" y="{mid}" font-size="12" transform="rotate(-90 14 {mid})">ε spent</text>')
    for i, (name, line) in enumerate(sorted(series.items())):
        colour = PALETTE[i % len(PALETTE)]
        coords: list[tuple[float, float]] = [(left, y(0.0))]
        previous = 0.0
        for t, v in line:
            coords += [(x(t), y(previous)), (x(t), y(v))]
            previous = v
        coords.append((left + plot_w, y(previous)))
        path = " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)
        parts.append(
            f'<polyline class="series" data-analyst="{esc(name)}" points="{path}" fill="none" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        ly = top + 14 + i * 18
        parts.append(f'<rect x="{width - right + 12}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{width - right + 28}" y="{ly}" font-size="12">{esc(name)} ({previous:.3g})</text>')
    parts.append("</svg>")
    return "".join(parts)


def describe_domain(column: Any) -> str:
    domain = column.domain
    if domain is None:
        return ""
    if isinstance(domain, DomainReference):
        return f"{domain.table}.{domain.column}"
    return ", ".join("NULL" if v is None else str(v) for v in domain)


def policy_tables(policy: Policy) -> str:
    """Every table and column as the policy declares them: bounds, units, domains; never data."""
    out = []
    for name, t in sorted(policy.tables.items()):
        facts = [
            f"source <code>{esc(t.source or name)}</code>",
            "public" if t.public else f"privacy unit <code>{esc(t.privacy_unit or '(one row per person)')}</code>",
            f"max rows per unit {t.max_rows_per_unit}",
        ]
        if t.max_groups_per_unit is not None:
            facts.append(f"max groups per unit {t.max_groups_per_unit}")
        if t.references is not None:
            r = t.references
            facts.append(f"unit through <code>{esc(r.column)} → {esc(r.table)}.{esc(r.to)}</code>")
        rows = []
        for cname, c in t.columns.items():
            rows.append(
                (
                    f"<code>{esc(cname)}</code>",
                    esc(c.type),
                    esc(c.lower),
                    esc(c.upper),
                    esc(describe_domain(c)),
                    "yes" if c.nullable else "no",
                    "yes" if c.identifier else "",
                    esc(c.randomized_response.epsilon) if c.randomized_response else "",
                    "yes" if c.writable else "",
                )
            )
        columns = ("column", "type", "lower", "upper", "domain", "nullable", "identifier", "randomized ε", "writable")
        out.append(
            f'<section class="table-policy"><h3>{esc(name)}</h3><p>{" · ".join(facts)}</p>'
            + (f"<p>{esc(t.description)}</p>" if t.description else "")
            + table(columns, rows)
            + "</section>"
        )
    return "".join(out)
