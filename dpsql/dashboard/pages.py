"""The dashboard's pages as HTML fragments: the analysts' budgets with the levers' form, ε spent over
time, the audit trail and the policy. The HTTP side (sessions, CSRF, the page frame) is
:mod:`dpsql.dashboard.server`; every value shown is escaped (:func:`dpsql.dashboard.views.esc`).

They read the policy and the ledger only, never the data; the one write is a curator's lever,
through the same checks as ``dpsql budget`` (:func:`dpsql.curator.lever_checks.apply_lever`).
"""

from __future__ import annotations

import logging
import threading

from dpsql.curator.lever_checks import apply_lever
from dpsql.errors import InvalidParameterValue
from dpsql.ledger import Ledger
from dpsql.policy import Policy

from . import views

log = logging.getLogger("dpsql.dashboard")


def analysts(policy: Policy, ledger: Ledger, csrf: str) -> tuple[str, str]:
    """The analysts' budgets and the levers' form: (title, body)."""
    rows, dataset = views.budget_rows(ledger, policy)
    columns = (
        "analyst",
        "ε spent",
        "ε total",
        "of which granted",
        "ε remaining",
        "spent / total",
        "δ spent",
        "δ total",
        "queries",
        "state",
        "last charge",
    )

    def cells(r: views.BudgetRow) -> tuple[str, ...]:
        return (
            f'<span class="analyst">{views.esc(r.name)}</span>',
            f'<span class="eps-spent">{views.esc(r.spent)}</span>',
            views.esc(r.total),
            views.esc(r.granted),
            f'<span class="eps-remaining">{views.esc(r.remaining)}</span>',
            views.bar(r.spent, r.total),
            views.esc(r.delta_spent),
            views.esc(r.delta_total),
            views.esc(r.queries),
            '<span class="frozen">frozen</span>' if r.frozen else "active",
            views.esc(r.last_at),
        )

    body_rows = [(f'<tr id="analyst-{views.esc(r.name)}">', cells(r)) for r in rows]
    tbody = "".join(f"{tr}{''.join(f'<td>{c}</td>' for c in cs)}</tr>" for tr, cs in body_rows)
    tbody += '<tr id="dataset" class="dataset">' + "".join(f"<td>{c}</td>" for c in cells(dataset)) + "</tr>"
    head = "".join(f"<th>{views.esc(c)}</th>" for c in columns)
    names = "".join(f'<option value="{views.esc(a.name)}">{views.esc(a.name)}</option>' for a in policy.analysts)
    accounting = policy.budget.accounting
    body = (
        f'<table id="analysts"><thead><tr>{head}</tr></thead><tbody>{tbody}</tbody></table>'
        f"<p>Accounting: <code>{views.esc(accounting)}</code>. An analyst's total is the policy's budget plus "
        "every grant less every revoke; grants never raise the dataset's total, and an analyst's remaining "
        "ε is never more than the dataset's.</p>"
        '<h2>Curator levers</h2><form method="post" action="/levers" class="lever" id="lever-form">'
        f'<input type="hidden" name="csrf" value="{views.esc(csrf)}">'
        f'<label>analyst<select name="analyst" id="lever-analyst">{names}</select></label>'
        '<label>action<select name="lever" id="lever-action"><option value="grant">grant</option>'
        '<option value="revoke">revoke</option>'
        '<option value="freeze">freeze</option><option value="unfreeze">unfreeze</option></select></label>'
        '<label>ε<input name="epsilon" id="lever-epsilon" value="0" inputmode="decimal"></label>'
        '<label>δ<input name="delta" id="lever-delta" value="0" inputmode="decimal"></label>'
        '<label>reason<input name="reason" id="lever-reason" required></label>'
        '<button type="submit" id="lever-submit">Apply</button></form>'
        "<p>Every action is a new, append-only ledger row with who, when and why (shown in the audit trail).</p>"
    )
    return "Analysts", body


def apply_lever_form(ledger: Ledger, policy: Policy, by: str, lock: threading.Lock, form: dict[str, str]) -> str:
    """Apply the form's lever (the checks of :func:`dpsql.curator.lever_checks.apply_lever`, under ``lock``):
    the confirmation shown; an invalid lever raises its :class:`~dpsql.errors.Error`."""
    lever = form.get("lever", "")
    analyst = form.get("analyst", "")

    def number(key: str) -> float:
        text = form.get(key, "0").strip() or "0"
        try:
            return float(text)
        except ValueError:
            raise InvalidParameterValue(f'invalid {key}: "{text}"', hint="Give a number, e.g. 0.5.") from None

    epsilon, delta = (number("epsilon"), number("delta")) if lever in ("grant", "revoke") else (0.0, 0.0)
    with lock:
        warnings = apply_lever(
            ledger,
            policy,
            lever,
            analyst,
            by=by,
            reason=form.get("reason", ""),
            epsilon=epsilon,
            delta=delta,
        )
    log.info("curator %s analyst %s from the dashboard", lever, analyst)
    done = f"{lever} ε={epsilon:g} δ={delta:g}" if lever in ("grant", "revoke") else lever
    warned = "".join(f'<p class="warning" id="warning">{views.esc(w)}</p>' for w in warnings)
    return (
        f'<p class="ok" id="message">{views.esc(done)}: analyst “{views.esc(analyst)}”, recorded in the ledger.</p>'
        + warned
    )


def spend(ledger: Ledger, policy: Policy, query: dict[str, list[str]]) -> tuple[str, str]:
    """ε spent over time, per analyst or all: (title, body)."""
    analyst = (query.get("analyst") or [""])[-1].strip() or None
    series = views.spend_series(ledger, policy, analyst)
    names = sorted({a.name for a in policy.analysts} | set(series))
    options = '<option value="">all analysts</option>' + "".join(
        f'<option value="{views.esc(n)}"{" selected" if n == analyst else ""}>{views.esc(n)}</option>' for n in names
    )
    body = (
        f'<form method="get" action="/spend" class="filters"><label>analyst<select name="analyst">{options}'
        '</select></label><button type="submit">Show</button></form>'
        f'<div id="spend-plot">{views.spend_plot(series)}</div>'
        f"<p>ε spent after each charge (the ledger's composition: "
        f"<code>{views.esc(policy.budget.accounting)}</code>), "
        f"newest {views.MAX_ROWS} charges at most.</p>"
    )
    return "Spend over time", body


def audit(ledger: Ledger, policy: Policy, query: dict[str, list[str]]) -> tuple[str, str]:
    """The audit trail with its filters: (title, body)."""
    f = views.AuditFilter.parse(query)
    rows = views.audit_page_rows(ledger, policy, f)
    outcomes = '<option value="">any</option>' + "".join(
        f'<option value="{views.esc(o)}"{" selected" if o == f.outcome else ""}>{views.esc(o)}</option>'
        for o in views.OUTCOMES
    )
    since = f.since.isoformat() if f.since else ""  # ISO, so year 1 reads back as 0001-…
    form = (
        '<form method="get" action="/audit" class="filters" id="audit-filters">'
        f'<label>analyst<input name="analyst" id="filter-analyst" value="{views.esc(f.analyst)}"></label>'
        f'<label>since<input name="since" id="filter-since" value="{views.esc(since)}" '
        'placeholder="2026-11-01"></label>'
        f'<label>outcome<select name="outcome" id="filter-outcome">{outcomes}</select></label>'
        f'<label>limit<input name="limit" value="{f.limit}"></label>'
        '<button type="submit" id="filter-submit">Filter</button></form>'
    )
    columns = (
        "at",
        "analyst",
        "event",
        "SQLSTATE",
        "ε",
        "δ",
        "ρ",
        "latency ms",
        "fingerprint",
        "shape / reason",
        "by",
    )
    cells = [
        (
            f'<span class="at">{views.esc(r["at"])}</span>',
            f'<span class="analyst">{views.esc(r["analyst"])}</span>',
            f'<span class="event">{views.esc(r["event"])}</span>'
            + (
                f' <span class="repeats">×{r["repeats"]}</span>, last '
                f'<span class="last-at">{views.esc(r["last_at"])}</span>'
                if r["repeats"] > 1
                else ""
            ),
            views.esc(r["sqlstate"]),
            f'<span class="eps">{views.esc(r["epsilon"])}</span>',
            views.esc(r["delta"]),
            views.esc(r["rho"]),
            f'<span class="latency">{views.esc(r["latency_ms"])}</span>',
            f"<code>{views.esc((r['fingerprint'] or '')[:16])}</code>",
            f'<span class="shape">{views.esc(r["shape"] if r["shape"] is not None else r["reason"])}</span>',
            views.esc(r["by"]),
        )
        for r in rows
    ]
    body = (
        form
        + f"<p>{len(rows)} row{'s' if len(rows) != 1 else ''}, newest first"
        + (
            ""
            if f.outcome
            else f" (answered and charged statements and curator actions, and refusals: up to {f.limit} each)"
        )
        + ". Identical free statements of an analyst between two charges share one row (×repeats).</p>"
        + views.table(columns, cells, "audit").replace("<table ", '<table id="audit" ', 1)
    )
    return "Audit trail", body


def policy_page(p: Policy) -> tuple[str, str]:
    """The policy: budgets, analysts, tables: (title, body)."""
    b = p.budget
    analysts = [
        (
            views.esc(a.name),
            views.esc(p.analyst_budget(a.name).epsilon),
            views.esc(p.analyst_budget(a.name).delta),
            "yes" if a.password else "no",
        )
        for a in p.analysts
    ]
    body = (
        (f"<p>{views.esc(p.description)}</p>" if p.description else "")
        + "<h2>Budgets</h2>"
        + views.table(
            ("", "ε", "δ"),
            [
                ("dataset (all analysts)", views.esc(b.dataset.epsilon), views.esc(b.dataset.delta)),
                ("each analyst (default)", views.esc(b.analyst.epsilon), views.esc(b.analyst.delta)),
            ],
        )
        + f"<p>Accounting <code>{views.esc(b.accounting)}</code>; per query by default "
        f"ε={views.esc(p.defaults.epsilon)}, δ={views.esc(p.defaults.delta)}, {views.esc(p.defaults.mechanism)}; "
        f"authentication {'trust (no passwords)' if p.auth.trust else 'SCRAM-SHA-256'}.</p>"
        + "<h2>Analysts</h2>"
        + views.table(("analyst", "ε budget", "δ budget", "password set"), analysts)
        + "<h2>Tables</h2>"
        + views.policy_tables(p)
    )
    return "Policy", body
