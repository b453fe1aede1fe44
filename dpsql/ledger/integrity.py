"""The ledger checked against itself: running sums on the append-only charge rows (schema 5).

Each charge row carries its analyst's and its dataset's sums after it. A reservation charges against
the larger of those sums and the totals table (:func:`reconciled`), so a total lowered by hand
(``UPDATE dpsql_ledger_totals``) or deleted tail rows never give budget back; a disagreement is
logged at ERROR once per process. Max rather than fail-closed: either source alone already gives a
safe figure, and refusing every query would hand anyone with the ledger's credentials a switch to
stop the service without buying any privacy. :func:`verify` re-adds every row (``dpsql ledger verify``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from dpsql.accountant import Spent
from dpsql.errors import PrivacyBudgetExhausted
from dpsql.ledger.records import number, spent_of

log = logging.getLogger("dpsql.ledger")

#: (ledger, dataset, whose) mismatches already logged by this process: one operator line each.
_REPORTED: set[tuple[str, str, str]] = set()
#: Marks "no charge row at all" apart from "rows written before schema 5" (no sums to compare).
NO_ROWS = Spent(queries=0)

# The sums and the cost on the last charge row of the analyst (kind 0) and of the dataset (kind 1): two
# index probes. The cost lets :func:`trusted_sums` tell sums dpsql wrote from ones a hand wrote.
ANCHORS_SQL = (
    "SELECT 0, sum_epsilon, sum_delta, sum_rho, sum_queries, sum_selection_delta, epsilon, delta, rho, "
    "selection_delta FROM dpsql_ledger WHERE id = (SELECT MAX(id) FROM dpsql_ledger WHERE dataset = ? AND analyst = ?) "
    "UNION ALL SELECT 1, ds_epsilon, ds_delta, ds_rho, ds_queries, ds_selection_delta, epsilon, delta, rho, "
    "selection_delta FROM dpsql_ledger WHERE id = (SELECT MAX(id) FROM dpsql_ledger WHERE dataset = ?)"
)
# The fallback when the last row's sums cannot be trusted: every row re-added, and the largest running sum
# ever written (O(rows), only on a ledger written by hand or before schema 5).
_ROWS_SQL = (
    "SELECT COUNT(*), SUM(epsilon), SUM(delta), SUM(rho), SUM(COALESCE(selection_delta, delta)), "
    "MAX({p}_epsilon), MAX({p}_delta), MAX({p}_rho), MAX({p}_queries), MAX({p}_selection_delta) "
    "FROM dpsql_ledger WHERE dataset = ?"
)
#: Kind 0: one analyst's rows (params: dataset, analyst); kind 1: the dataset's (params: dataset).
ROWS_SQL = (_ROWS_SQL.format(p="sum") + " AND analyst = ?", _ROWS_SQL.format(p="ds"))


def require_finite(who: str, name: str, total: Spent) -> None:
    """53P01 when a recorded total plus this charge is not finite (a corrupt or overflowing ledger row):
    refused like an exhausted budget, never an internal error, and never a release."""
    if not all(math.isfinite(v) for v in (total.epsilon, total.delta, total.rho, total.selection_delta)):
        raise PrivacyBudgetExhausted(
            f'privacy budget exhausted for {who} "{name}"',
            detail=f"The ledger's recorded total for this {who} is not a finite number.",
            hint="Ask the data curator: the ledger's totals need to be checked.",
        )


def _at_least(a: Spent, b: Spent) -> Spent:
    """Componentwise maximum: the spending both records agree is at least."""
    return Spent(
        max(a.epsilon, b.epsilon),
        max(a.delta, b.delta),
        max(a.rho, b.rho),
        max(a.queries, b.queries),
        max(a.selection_delta, b.selection_delta),
    )


def _agree(a: Spent, b: Spent) -> bool:
    """Equal up to float rounding (the dataset's sums add in another order than its analysts' totals)."""
    pairs = ((a.epsilon, b.epsilon), (a.delta, b.delta), (a.rho, b.rho), (a.selection_delta, b.selection_delta))
    return a.queries == b.queries and all(x == y or abs(x - y) <= 1e-9 * max(abs(x), abs(y)) + 1e-15 for x, y in pairs)


def reconciled(url: str, dataset: str, whose: str, totals: Spent | None, anchor: Spent | None) -> Spent:
    """What ``whose`` has spent: the larger of the totals row and the sums on the last charge row.

    The totals are an index kept for speed; the charge rows are append-only. Taking the maximum means a
    lowered total (``UPDATE dpsql_ledger_totals``) or deleted tail rows never give budget back, and the
    service keeps answering. A disagreement is tampering or corruption: one operator log line (ERROR)
    per process names it and points at ``dpsql ledger verify``. ``anchor`` None: nothing to compare."""
    base = totals if totals is not None else Spent()
    if anchor is None:
        return base
    if not _agree(base, anchor):
        key = (url, dataset, whose)
        if key not in _REPORTED:
            _REPORTED.add(key)
            log.error(
                "privacy ledger integrity: the totals of %s on dataset %r (ε=%g, %d queries) disagree with its "
                "append-only charge rows (ε=%g, %d queries); charging against the larger. Someone with write "
                "access to the ledger may have changed it: run `dpsql ledger verify --ledger …`",
                whose,
                dataset,
                base.epsilon,
                base.queries,
                anchor.epsilon,
                anchor.queries,
            )
    return _at_least(base, anchor)


def trusted_sums(sums: Sequence[Any], cost: Sequence[Any]) -> Spent | None:
    """The running sums ``(ε, δ, ρ, queries, δ_sel)`` of a last charge row, or None when they cannot be
    what dpsql wrote: a NULL (a row inserted by hand, or before schema 5), a cost that is not a finite
    figure, or a sum below the row's own cost (dpsql writes the previous sum plus the cost, and adding a
    cost ≥ 0 never rounds below it). Untrusted sums never lower what is spent: see :func:`anchor_of`."""
    if any(v is None for v in sums):
        return None
    spent = spent_of(*sums)
    eps, delta, rho = number(cost[0]), number(cost[1]), number(cost[2])
    sel = delta if cost[3] is None else number(cost[3])
    if not all(0 <= v < math.inf for v in (eps, delta, rho, sel)):
        return None
    consistent = (
        spent.epsilon >= eps
        and spent.delta >= delta
        and spent.rho >= rho
        and spent.selection_delta >= sel
        and spent.queries >= 1
    )
    return spent if consistent else None


def rows_spent(row: Any) -> Spent:
    """What the charge rows say from a :data:`ROWS_SQL` row: the larger of their costs re-added and the
    largest running sum any of them carries. A cost SQLite cannot add (NULL SUM) or an infinite or NaN
    one reads as infinite spending (53P01 on the next charge), as does a single absurd ε (e.g. 1e308):
    it is in the sum, so the budget is exhausted."""
    if row is None or not int(row[0]):
        return NO_ROWS
    added = spent_of(row[1], row[2], row[3], row[0], row[4])
    running = spent_of(*(0 if v is None else v for v in row[5:10]))
    return _at_least(added, running)


def anchor_of(row: Sequence[Any] | None, rows: Callable[[], Any]) -> Spent:
    """What one analyst (or the dataset) has spent by the append-only rows: ``row`` is its last charge row
    as ``(sums…, cost…)`` (None: no charge at all, :data:`NO_ROWS`); its sums when trusted (two index
    probes), else ``rows()`` (a :data:`ROWS_SQL` row) read back through :func:`rows_spent`. So a hand-written
    last row with NULL or low sums cannot make a lowered total the larger figure: spent never drops below
    what the rows say."""
    if row is None:
        return NO_ROWS
    sums = trusted_sums(row[0:5], row[5:9])
    return sums if sums is not None else rows_spent(rows())


def anchors(rows: Sequence[Any], fallback: Callable[[int], Any]) -> tuple[Spent, Spent]:
    """(analyst's, dataset's) spending by the charge rows from :data:`ANCHORS_SQL` (see :func:`anchor_of`);
    ``fallback(kind)`` reads ``ROWS_SQL[kind]``'s row."""
    found = {int(row[0]): row[1:] for row in rows}
    return (
        anchor_of(found.get(0), lambda: fallback(0)),
        anchor_of(found.get(1), lambda: fallback(1)),
    )


def verify(read: Callable[[str, tuple[Any, ...]], list[Any]], dataset: str | None = None) -> list[str]:
    """Check the whole ledger against itself; one line per problem (none: consistent).

    Reads every charge row in order (``read``: the store's read-only query): each cost finite, each
    row's sums equal to the sum of the rows before it plus its own (so a deleted or changed row shows),
    and each totals row equal to its analyst's rows. O(charges): never on a query's path."""
    where, params = ("", ()) if dataset is None else (" WHERE dataset = ?", (dataset,))
    rows = read(
        "SELECT id, dataset, analyst, epsilon, delta, rho, selection_delta, sum_epsilon, sum_delta, sum_rho, "
        "sum_queries, sum_selection_delta, ds_epsilon, ds_delta, ds_rho, ds_queries, ds_selection_delta "
        f"FROM dpsql_ledger{where} ORDER BY id",
        params,
    )
    problems: list[str] = []
    mine: dict[tuple[str, str], Spent] = {}
    everyone: dict[str, Spent] = {}
    summed: set[tuple[str, str]] = set()  # (dataset, whose) with a row carrying sums already
    for r in rows:
        ds, who = r[1], r[2]
        eps, delta, rho = number(r[3]), number(r[4]), number(r[5])
        sel = delta if r[6] is None else number(r[6])
        if not all(0 <= v < math.inf for v in (eps, delta, rho, sel)):
            problems.append(
                f'charge #{r[0]} of analyst "{who}" on dataset "{ds}": a cost that is not a '
                f"finite number ≥ 0 (ε={r[3]!r}, δ={r[4]!r}, ρ={r[5]!r}); it counts as exhausting"
            )
            eps, delta, rho, sel = (math.inf,) * 4
        step = Spent(eps, delta, rho, 1, sel)
        mine[(ds, who)] = mine.get((ds, who), Spent()) + step
        everyone[ds] = everyone.get(ds, Spent()) + step
        for label, sums, running in (
            (f'analyst "{who}"', r[7:12], mine[(ds, who)]),
            ("the dataset", r[12:17], everyone[ds]),
        ):
            if any(v is None for v in sums):
                if (ds, label) in summed:  # dpsql writes sums on every row since schema 5: a hand did this
                    problems.append(
                        f'charge #{r[0]} on dataset "{ds}": no running sums for {label} after rows that have '
                        "them: a row was written by hand"
                    )
                continue  # written before schema 5
            summed.add((ds, label))
            recorded = spent_of(*sums)
            if not _agree(recorded, running):
                problems.append(
                    f'charge #{r[0]} on dataset "{ds}": its sums for {label} (ε={recorded.epsilon:g}, '
                    f"{recorded.queries} queries) disagree with the rows up to it (ε={running.epsilon:g}, "
                    f"{running.queries} queries): a row was changed or deleted"
                )
    totals = read(
        f"SELECT dataset, analyst, epsilon, delta, rho, queries, selection_delta FROM dpsql_ledger_totals{where}",
        params,
    )
    seen = set()
    for t in totals:
        key = (t[0], t[1])
        seen.add(key)
        recorded, actual = spent_of(*t[2:7]), mine.get(key, Spent())
        if not _agree(recorded, actual):
            problems.append(
                f'totals of analyst "{t[1]}" on dataset "{t[0]}" (ε={recorded.epsilon:g}, {recorded.queries} '
                f"queries) disagree with its charge rows (ε={actual.epsilon:g}, {actual.queries} queries)"
            )
    for ds, who in sorted(set(mine) - seen):
        problems.append(f'analyst "{who}" on dataset "{ds}" has charge rows but no totals row')
    return problems
