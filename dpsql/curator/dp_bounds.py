"""``dpsql policy report --dp-bounds``: bounds for the policy suggested through a DP mechanism.

Tumult Analytics' ``get_bounds`` approach (:func:`dp_bounds`): per column a histogram
of the values in signed power-of-two bins (``[2^k, 2^(k+1))`` and their negatives, over a range set
by the declared bounds: the policy, never the data), each unit's rows cut to the table's
``max_rows_per_unit`` in a random order, with exact discrete Laplace noise of scale
``max_rows_per_unit / ε_column`` on every bin (one unit changes the histogram by at most that many
rows in L1, so each histogram is ε_column-DP; bins are disjoint). The bounds are the outer edges of
the bins where the noisy count beyond them clears ``1 − coverage`` of the noisy total plus a few
standard deviations of the noise summed there, from either end (:func:`dp_bounds_from_counts`):
post-processing. The ε given is split evenly over the k columns: one person is in every column's
histogram, so by sequential composition the k histograms together are ε-DP. It is charged once per
run (``cmd_policy_report`` calls :func:`charge_dp_bounds` once, before anything is read; the report
prints that same ε) to the curator's identity in the ledger (dataset budget included: it bounds what
everyone together learns about the data), with one audit row naming the columns.

Unlike the rest of the report (exact figures, :mod:`dpsql.curator.report`), these bounds may be
published: they are ε-DP, and the ε is in the ledger before anything is read.
"""

from __future__ import annotations

import getpass
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpsql.accountant import Cost
from dpsql.ledger import Charge, Ledger
from dpsql.ledger.audit import AuditTrail
from dpsql.noise.samplers import discrete_laplace, laplace_rational_scale
from dpsql.policy import ColumnPolicy, Policy
from dpsql.step import reserve_charge

from . import introspect
from .report import Relation, relation, stored_column

#: The DP bounds' bins reach 2^DP_ABOVE beyond the declared reach and span DP_SPAN powers of two.
DP_ABOVE = 6
DP_SPAN = 20
#: Standard deviations of summed noise a DP bound's crossing must clear (see dp_bounds_from_counts) …
DP_MARGIN = 2.0
#: … and at most this share of the noisy total that margin may be, else no bound is given.
DP_MAX_SHARE = 0.1
#: Share of the (noisy) values the DP bounds keep inside, from each end.
DP_COVERAGE = 0.99
#: The ledger fingerprint of a DP-bounds charge.
DP_FINGERPRINT = "dpsql policy report --dp-bounds"


@dataclass(frozen=True, slots=True)
class _Bin:
    low: float  # the edge a lower bound takes when this bin is the first kept
    high: float  # the edge an upper bound takes when this bin is the last kept


def dp_exponents(column: ColumnPolicy) -> tuple[int, int]:
    """The bins' power-of-two exponents: 2^6 beyond the declared reach max(|lower|, |upper|) down to
    2^-14 of it (int columns: not below 1). From the policy alone (public), never the data; fewer
    bins mean less noise summed over empty ones. Bounds off by more than that end at the edge bin."""
    reach = max(abs(float(column.lower)), abs(float(column.upper)), 1.0)  # type: ignore[arg-type]
    kmax = math.ceil(math.log2(reach)) + DP_ABOVE
    kmin = kmax - DP_SPAN
    return (max(0, kmin), kmax) if column.type == "int" else (kmin, kmax)


def _bins(kmin: int, kmax: int) -> list[tuple[tuple[int, int], _Bin]]:
    """The signed power-of-two bins in ascending order: ((sign, k), edges). k = kmin − 1 is the bin
    next to zero, k = kmax the bin beyond ±2^kmax (infinities and NaN included)."""
    out: list[tuple[tuple[int, int], _Bin]] = []
    for k in range(kmax, kmin - 2, -1):  # negatives, most negative first: (−2^(k+1), −2^k]
        high = -(2.0**k) if k >= kmin else 0.0
        low = -(2.0 ** (k + 1)) if k < kmax else -(2.0**kmax)
        out.append(((-1, k), _Bin(low, high)))
    for k in range(kmin - 1, kmax + 1):  # non-negatives: [2^k, 2^(k+1))
        low = 2.0**k if k >= kmin else 0.0
        high = 2.0 ** (k + 1) if k < kmax else 2.0**kmax
        out.append(((1, k), _Bin(low, high)))
    return out


def _dp_histogram_sql(rel: Relation, x: str, m: int, kmin: int, kmax: int) -> str:
    """Exact counts per (sign, k) bin of each unit's first ``m`` non-NULL values in a random order (a
    unit's rows kept depend on its own rows and fresh randomness only). ``k`` is ⌊log2 |v|⌋ corrected
    against exact powers of two (a rounding error moves no row out of every bin, only between two)."""
    two = "CAST(2 AS DOUBLE PRECISION)"
    xd = f"CAST({x} AS DOUBLE PRECISION)"
    if rel.unit is None:
        kept = f"SELECT {xd} AS v FROM {rel.from_sql} WHERE {x} IS NOT NULL"
    else:
        shuffled = f"SELECT {xd} AS v, {rel.unit} AS unit, random() AS r FROM {rel.from_sql} WHERE {x} IS NOT NULL"
        kept = (
            "SELECT v FROM (SELECT v, ROW_NUMBER() OVER (PARTITION BY unit ORDER BY r) AS rn "
            f"FROM ({shuffled}) AS shuffled) AS numbered WHERE rn <= {m}"
        )
    k0 = (
        f"CASE WHEN ABS(v) >= POWER({two}, {kmax}) THEN {kmax} WHEN ABS(v) < POWER({two}, {kmin}) THEN {kmin - 1} "
        f"ELSE CAST(FLOOR(LN(ABS(v)) / LN({two})) AS INTEGER) END"
    )
    fixed = (
        f"CASE WHEN k0 >= {kmin} AND k0 < {kmax} AND a < POWER({two}, k0) THEN k0 - 1 "
        f"WHEN k0 >= {kmin - 1} AND k0 < {kmax} AND a >= POWER({two}, k0 + 1) THEN k0 + 1 ELSE k0 END"
    )
    return (
        f"SELECT s, {fixed} AS k, COUNT(*) FROM (SELECT CASE WHEN v < 0 THEN -1 ELSE 1 END AS s, ABS(v) AS a, "
        f"{k0} AS k0 FROM ({kept}) AS kept) AS binned GROUP BY s, {fixed}"
    )


def dp_bounds_from_counts(
    counts: dict[tuple[int, int], int],
    kmin: int,
    kmax: int,
    epsilon: float,
    max_rows: int,
    coverage: float = DP_COVERAGE,
    *,
    integer: bool = False,
) -> tuple[float, float] | None:
    """ε-DP bounds from exact bin counts. Exact discrete Laplace noise of scale ``max_rows/ε`` on
    every bin (OS CSPRNG) makes the histogram ε-DP; the rest is post-processing of noisy counts and
    public constants. From each end, the bound is the outer edge of the bin where the noisy count of
    values beyond it (it included) exceeds ``tail`` = ``1 − coverage`` of the noisy total plus
    :data:`DP_MARGIN` standard deviations of the noise summed so far (``margin``) for good: the
    innermost such crossing, so that neither noise over the empty bins beyond the data nor one noisy
    bin places a bound out there; the margin only moves a bound inward, and past the true
    ``coverage`` edge only by chance (then by one bin, a factor 2). None when the margin at the crossing
    exceeds :data:`DP_MAX_SHARE` of the noisy total (the bound could leave out far more than
    ``1 − coverage`` of the values: too few values for this ε), or when no bin qualifies.

    The margin is measured against the data's size, not against the tail: at ε = 0.1 and 10 rows per
    unit one bin's noise has a standard deviation of ~141 rows, which a 1% tail of 25,000 values
    (250) never clears over several bins, yet a bound leaving out ~5% instead of 1% is still useful."""
    bins = _bins(kmin, kmax)
    scale = max_rows / epsilon
    noise = discrete_laplace(scale, len(bins))
    noisy = [counts.get(key, 0) + int(z) for (key, _), z in zip(bins, noise, strict=True)]
    total = sum(noisy)
    if total <= 0:
        return None
    t, s = laplace_rational_scale(scale)
    alpha = math.exp(-s / t)
    variance = 2 * alpha / (1 - alpha) ** 2  # of one bin's discrete Laplace noise
    tail = (1 - coverage) * total

    def crossing(order: Iterable[tuple[_Bin, int]]) -> _Bin | None:
        # the innermost bin whose noisy count of values beyond it (it included) clears the threshold,
        # after the last bin that does not: a noise excursion over the empty bins beyond the data,
        # followed by counts back under the threshold, places no bound out there
        running, found = 0, None
        for j, (edges, count) in enumerate(order, start=1):
            margin = DP_MARGIN * math.sqrt(j * variance)
            running += count
            if running <= tail + margin:
                found = None
            elif found is None:
                found = (edges, margin)
        if found is None or found[1] > DP_MAX_SHARE * total:
            return None
        return found[0]

    first = crossing(zip((b for _, b in bins), noisy, strict=True))
    last = crossing(zip((b for _, b in reversed(bins)), reversed(noisy), strict=True))
    if first is None or last is None or first.low > last.high:
        return None
    lower, upper = first.low, last.high
    if integer:
        return float(math.floor(lower)), float(math.ceil(upper))
    return lower, upper


def dp_targets(policy: Policy, tables: Iterable[str]) -> list[tuple[str, str]]:
    """(table, column) of every bounded numeric, non-identifier column of the private tables: what
    ``--dp-bounds`` measures (the ε is split evenly over them)."""
    return [
        (name, col)
        for name in tables
        if not policy.tables[name].public
        for col, c in policy.tables[name].columns.items()
        if c.numeric and c.bounded and not c.identifier
    ]


def dp_bounds(
    policy: Policy, backend: Any, targets: Sequence[tuple[str, str]], epsilon: float, coverage: float = DP_COVERAGE
) -> dict[tuple[str, str], tuple[float, float] | None]:
    """ε-DP suggested bounds for ``targets`` (ε split evenly). The caller charges ε first."""
    out: dict[tuple[str, str], tuple[float, float] | None] = {}
    if not targets:
        return out
    share = epsilon / len(targets)
    for name, col in targets:
        table = policy.tables[name]
        stored = introspect.columns(backend, table.source or name) or {}
        rel = relation(policy, name, table, stored)
        m = table.max_rows_per_unit if rel.unit is not None else 1
        c = table.columns[col]
        kmin, kmax = dp_exponents(c)
        _, rows = backend.execute(_dp_histogram_sql(rel, rel.col(stored_column(stored, col)), m, kmin, kmax))
        counts = {(int(s), int(k)): int(n) for s, k, n in rows}
        out[(name, col)] = dp_bounds_from_counts(counts, kmin, kmax, share, m, coverage, integer=c.type == "int")
    return out


def curator_name() -> str:
    """Who a DP-bounds charge is recorded for by default: ``curator:<OS user>``."""
    try:
        return f"curator:{getpass.getuser()}"
    except Exception:  # no login name (containers)
        return "curator"


def charge_dp_bounds(
    policy: Policy, ledger: Ledger, epsilon: float, who: str, targets: Sequence[tuple[str, str]]
) -> Charge:
    """Charge ε to ``who`` and the dataset before any DP bounds are computed (refused when the
    budget is exhausted). The audit row's shape names the columns, never a value."""
    reason = f"{DP_FINGERPRINT} (curator bounds suggestion): " + ", ".join(f"{t}.{c}" for t, c in targets)
    trail = AuditTrail(ledger, policy.dataset, lambda sql: (DP_FINGERPRINT, sql))
    try:
        with trail.recording(reason, who):
            return reserve_charge(ledger, policy, Cost(epsilon=epsilon), who=who, fingerprint=DP_FINGERPRINT)
    finally:
        trail.close()
