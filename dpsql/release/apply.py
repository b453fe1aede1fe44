"""Applying the release: raw measures in, noisy columns out (nothing raw leaves this module).

Additive measures get their calibrated noise (``release``); quantile and mode measures are
chosen by the exponential mechanism / report-noisy-max over their histograms; with private
keys, rows whose noisy distinct-unit count is under the partition-selection threshold are dropped
(:mod:`dpsql.release.selection`); with public keys, every combination of the declared domains is
released (zeros included), and keys outside the domains never are. What follows is
post-processing (:mod:`dpsql.postprocess`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dpsql.aggregates import Selection
from dpsql.analyze.randomized import LocalQuery
from dpsql.errors import FeatureNotSupported
from dpsql.noise.mechanisms import NoiseSpec, half_width, release_many
from dpsql.plan import Plan
from dpsql.release.calibrate import Budgeting

#: Largest cross product of public key domains released in one query.
MAX_PUBLIC_GROUPS = 1_000_000


@dataclass(slots=True)
class ReleaseCache:
    """What release and post-processing build once per prepared query (never part of the plan):
    the compiled output/HAVING/ORDER BY closures and the public-key grid with its positions."""

    compiled: Any = None
    key_grid: Any = None


class Released(NamedTuple):
    """Released rows (keys first), each measure's noisy column, and each row's CI half-widths per measure."""

    rows: list[tuple[Any, ...]]
    columns: list[list[Any]]
    widths: list[list[float | None]]


def centre_rows(plan: Plan, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows of the measurement query with each ``m<i> − centre·z<i>`` folded in and the ``z`` columns
    dropped (the ``z<i>`` counts come from :func:`dpsql.rewrite.centre.centre_sums`). Exact arithmetic
    on the raw measures, before noise: the released sum is that of the centred values."""
    centred = plan.post_centred()
    if not centred:
        return rows
    width = len(plan.keys) + len(plan.measures)
    columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width + len(centred))]
    for z, i in enumerate(centred, start=width):
        measure, c = plan.measures[i], plan.measures[i].centre
        centre = int(c) if measure.integer and float(c).is_integer() else c
        m = len(plan.keys) + i
        columns[m] = [(v or 0) - centre * n for v, n in zip(columns[m], columns[z], strict=True)]
    return list(zip(*columns[:width], strict=True))


def apply(
    plan: Plan,
    budgeting: Budgeting,
    rows: list[tuple[Any, ...]],
    confidence: float,
    histograms: dict[int, list[tuple[Any, ...]]] | None = None,
    cache: ReleaseCache | None = None,
) -> Released:
    """Noise every measure of the measurement query's rows, then apply partition selection."""
    nkeys = len(plan.keys)
    rows = centre_rows(plan, rows)
    measured: list[list[Any]] | None = None
    if plan.keys and plan.public_keys:
        rows, measured = public_key_rows(plan, rows, cache or ReleaseCache())
    if not rows and not plan.keys:
        rows = [tuple([0] * len(plan.measures))]
    noisy: list[Any] = [None] * len(budgeting.specs)
    additive: list[tuple[int, list[Any], NoiseSpec]] = []
    for i, spec in enumerate(budgeting.specs):
        if spec is None:
            selection = plan.measures[i].aggregate
            assert isinstance(selection, Selection)
            level = budgeting.interval_level if budgeting.interval_level is not None else confidence
            histogram = (histograms or {}).get(i, [])
            cut = budgeting.interval_cut or 0.0
            noisy[i] = selection.select(plan, i, rows, histogram, budgeting.shares[i], level=level, cut=cut)
            continue
        values = measured[i] if measured is not None else [0 if r[nkeys + i] is None else r[nkeys + i] for r in rows]
        if values:
            additive.append((i, values, spec))
        else:
            noisy[i] = np.zeros(0)
    # every additive measure's noise in one draw (independent draws, as many calls to release would give)
    for (i, _, _), column in zip(additive, release_many([(v, spec) for _, v, spec in additive]), strict=True):
        noisy[i] = column
    widths = widths_at(budgeting, confidence)
    columns = [values.tolist() if isinstance(values, np.ndarray) else values for values in noisy]
    if budgeting.threshold is not None and plan.selection_measure is not None:
        counts = columns[plan.selection_measure]
        keep = [j for j in range(len(rows)) if counts[j] >= budgeting.threshold]
        rows = [rows[j] for j in keep]
        columns = [[values[j] for j in keep] for values in columns]
    return Released(rows, columns, [widths] * len(rows))


def widths_at(budgeting: Budgeting, confidence: float) -> list[float | None]:
    """Each measure's CI half-width at ``confidence``: a function of its noise spec alone (public), the
    same for every released row; None for selected measures (quantiles, modes)."""
    return [None if spec is None else half_width(spec, confidence) for spec in budgeting.specs]


def released_again(
    budgeting: Budgeting, keys: list[tuple[Any, ...]], columns: list[list[Any]], confidence: float
) -> Released:
    """Measurements released earlier (their keys and noisy columns), with their half-widths at this
    ``confidence``: exactly what :func:`apply` returned for them, minus the raw measures it leaves in
    the rows (post-processing never reads them). No noise drawn, nothing read: post-processing."""
    return Released(keys, columns, [widths_at(budgeting, confidence)] * len(keys))


def apply_local(plan: Plan, local: LocalQuery, observed: dict[Any, int], confidence: float) -> Released:
    """Counts of a randomized-response column, debiased; post-processing of stored values, free."""
    estimates = local.mechanism.estimate(observed, confidence)
    total = sum(observed.get(v, 0) for v in local.mechanism.domain)
    rows: list[tuple[Any, ...]]
    widths: list[list[float | None]]
    if plan.keys:
        rows = [(value, estimates[value][0]) for value in local.mechanism.domain]
        widths = [[estimates[value][1]] for value in local.mechanism.domain]
    elif local.filtered:
        rows, widths = [(estimates[local.value][0],)], [[estimates[local.value][1]]]
    else:
        rows, widths = [(total,)], [[0.0]]
    return Released(rows, [[round(r[-1]) for r in rows]], widths)


def public_key_rows(
    plan: Plan, rows: list[tuple[Any, ...]], cache: ReleaseCache
) -> tuple[list[tuple[Any, ...]], list[list[Any]]]:
    """Every combination of the public domains, in domain order (key tuples), and each measure's
    column over them: absent combinations get zeros.

    Keys outside the declared domain are dropped: releasing them would reveal that
    someone holds an undeclared value. The combinations and their positions are built once per query.
    """
    if cache.key_grid is None:
        domains = [k.domain or () for k in plan.keys]
        size = math.prod(len(d) for d in domains)
        if size > MAX_PUBLIC_GROUPS:
            raise FeatureNotSupported(
                f"GROUP BY would release {size} groups (more than {MAX_PUBLIC_GROUPS})",
                hint="Group by fewer columns.",
            )
        combos = list(itertools.product(*domains))
        keys = [c[0] for c in combos] if len(domains) == 1 else combos  # one key: look up bare values
        cache.key_grid = (combos, {key: j for j, key in enumerate(keys)})
    combos, position = cache.key_grid
    nkeys = len(plan.keys)
    found = map(position.get, (r[0] for r in rows) if nkeys == 1 else (r[:nkeys] for r in rows))
    hits = [(j, row) for j, row in zip(found, rows, strict=True) if j is not None]
    measured: list[list[Any]] = []
    for i in range(nkeys, nkeys + len(plan.measures)):
        column: list[Any] = [0] * len(combos)
        for j, row in hits:
            if row[i] is not None:
                column[j] = row[i]
        measured.append(column)
    return combos, measured
