"""Answering a query from a released synopsis: post-processing, free.

A DP query (its analysed :class:`~dpsql.plan.Plan`) is answered from a synopsis when

* it reads the synopsis's table alone, with public keys (no partition selection);
* each GROUP BY key is a synopsis key, or a coarser time grain of one (``DATE_TRUNC('year', d)`` from
  ``DATE_TRUNC('month', d)``: a year is a union of months);
* each measure is ``COUNT(*)``, or a SUM/AVG of a column the synopsis sums (an AVG's centred sum is
  ``Σx − centre·COUNT(*)``);
* the WHERE reads only synopsis key columns, and a time key's column only in comparisons with constants
  joined by AND (a convex range), that never split a cell: every cell is then wholly in or wholly out,
  checked at both ends of each cell;
* every key and filtered column lies inside one measured marginal (the answer is in the span of what was
  measured: a linear function of released values).

Each output cell is then the sum of the consistent cube estimate over the cells it covers, with the
variance of that sum (:mod:`dpsql.synopsis.solve`), and the usual post-processing (outputs, HAVING,
ORDER BY, LIMIT) follows; several releases that answer one query are combined cell by cell
(:func:`combine`). Privacy: every value read is a released noisy value or public (domains, noise
variances, the query); whether a query is answerable depends on its text, the policy and which synopses
were released, never on the data. The WHERE is evaluated over released cells only
(:mod:`dpsql.synopsis.where`).

Cost: labelling the cube's cells with the output row they add to, then sums over the cube per term of
the closed-form covariance (:mod:`dpsql.synopsis.solve`): ``O(cells · 2ᵏ)`` array work, no solve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import sqlglot
from sqlglot import exp

from dpsql.analyze.parse import dialect
from dpsql.noise.mechanisms import mechanism_named
from dpsql.plan import GroupKey, Measure, Plan
from dpsql.policy import Policy, Scalar
from dpsql.synopsis.grains import coarsens, normal, truncate
from dpsql.synopsis.solve import marginal_index
from dpsql.synopsis.store import Released, SynopsisKey
from dpsql.synopsis.where import cell_mask, read_axes

# -- keys ----------------------------------------------------------------------------------------------


def key_signature(key: GroupKey) -> tuple[str, str | None, str | None, str]:
    """(kind, column, unit, text) of a plan key: a plain column, ``DATE_TRUNC(unit, column)``, or another
    expression matched by its text with table qualifiers removed."""
    if key.expr is None:
        return "plain", key.column, None, key.column
    return _expression_signature(key.column)


@lru_cache(maxsize=4096)
def _expression_signature(text: str) -> tuple[str, str | None, str | None, str]:
    tree = sqlglot.parse_one(text, dialect=dialect("postgres"))
    bare = tree.transform(lambda n: exp.column(n.name) if isinstance(n, exp.Column) else n)
    bare_text = bare.sql(dialect=dialect("postgres"))
    trunc = tree if isinstance(tree, exp.TimestampTrunc | exp.DateTrunc) else None
    if trunc is not None and isinstance(trunc.this, exp.Column):
        unit = trunc.args.get("unit")
        name = unit.name.upper() if isinstance(unit, exp.Expression) else str(unit).strip("'").upper()
        return "trunc", trunc.this.name, name, bare_text
    return "expr", None, None, bare_text


# -- matching ------------------------------------------------------------------------------------------


def _axis_for(key: GroupKey, keys: Sequence[SynopsisKey]) -> tuple[int, Callable[[Scalar], Scalar]] | None:
    kind, column, unit, text = key_signature(key)
    for axis, synopsis_key in enumerate(keys):
        if kind == "plain" and synopsis_key.kind == "plain" and synopsis_key.column == column:
            return axis, lambda v: v
        if kind == "trunc" and synopsis_key.kind == "trunc" and synopsis_key.column == column:
            assert unit is not None and synopsis_key.unit is not None
            if coarsens(synopsis_key.unit, unit):
                return axis, lambda v, u=unit: truncate(v, u)
        if kind == "expr" and synopsis_key.kind == "expr" and synopsis_key.text == text:
            return axis, lambda v: v
    return None


def _measure_terms(measure: Measure, released: Released) -> list[tuple[int, float]] | None:
    """A plan measure as a linear combination of synopsis measures: [(synopsis measure, coefficient)]."""
    count = next((i for i, m in enumerate(released.measures) if m.aggregate.counts_rows), None)
    if measure.star:
        return None if count is None else [(count, 1.0)]
    if measure.clamped_sum and measure.expr is None and not measure.square and measure.column is not None:
        sums = [i for i, m in enumerate(released.measures) if m.aggregate.clamped_sum and m.column == measure.column]
        if not sums:
            return None
        # Σ(x − c') = Σ(x − c) + (c − c')·COUNT: another centre needs the count too
        total, shift = sums[0], released.measures[sums[0]].centre - float(measure.centre)
        if not shift:
            return [(total, 1.0)]
        return None if count is None else [(total, 1.0), (count, shift)]
    return None


def half_width_factor(confidence: float, mechanisms: Iterable[str]) -> float:
    """Half-width per standard deviation of a sum of independent noises of ``mechanisms`` at
    ``confidence``: the largest of the registered mechanisms' own (``sum_quantile``), so the interval
    never undercovers; an unregistered name is a loud error."""
    return max(mechanism_named(name).sum_quantile(confidence) for name in mechanisms)


#: A derived answer before post-processing: rows (keys), each measure's column, each row's half-widths.
Derived = tuple[list[tuple[Any, ...]], list[list[Any]], list[list[float | None]]]


@dataclass(frozen=True)
class Cells:
    """A plan's output cells estimated from released values: its rows (every combination of its keys'
    domains) and, per measure and row, the estimate and its noise variance."""

    rows: list[tuple[Any, ...]]
    values: np.ndarray
    variances: np.ndarray
    #: The noise mechanisms in it, by name (its intervals use the widest one's quantile).
    mechanisms: frozenset[str]


def estimate(plan: Plan, released: Released, policy: Policy) -> Cells | None:
    """The plan's output cells from ``released``; None when it cannot answer them exactly (see the
    module docstring). Reads released values, public domains and variances only."""
    sources = plan.sources.sources
    if len(sources) != 1 or plan.sources.joins or sources[0].name.lower() != released.table.lower():
        return None
    if plan.selection_measure is not None or not plan.public_keys or not plan.measures:
        return None
    mapped = [_axis_for(k, released.keys) for k in plan.keys]
    terms = [_measure_terms(m, released) for m in plan.measures]
    if any(m is None for m in mapped) or any(t is None for t in terms):
        return None
    axes = {m[0] for m in mapped if m is not None}
    types: dict[str, str] = {}
    read: set[int] | None = None
    if plan.where is not None:
        table_policy = policy.table(sources[0].name)
        assert table_policy is not None
        types = {name: column.type for name, column in table_policy.columns.items()}
        read = read_axes(plan.where, released.keys, types)
        if read is None:
            return None
        axes |= read
    if not any(axes <= set(measured) for measured in released.axes):
        return None  # not in the span of one measured marginal
    labels, count = _labels(plan, released, [m for m in mapped if m is not None])
    if count and np.bincount(labels[labels >= 0], minlength=count).min() == 0:
        return None  # a row no released cell stands for (a bucket not released yet): not an exact 0
    if plan.where is not None:
        assert read is not None
        mask = cell_mask(plan.where, released.keys, types, read)
        if mask is None:
            return None
        labels = np.where(mask, labels, -1)
    estimates = released.estimates
    values, variances = np.zeros((len(terms), count)), np.zeros((len(terms), count))
    for i, measure_terms in enumerate(terms):
        assert measure_terms is not None
        for synopsis_measure, coefficient in measure_terms:
            v, var = estimates[synopsis_measure].totals(labels, count)
            values[i] += coefficient * v
            variances[i] += coefficient**2 * var  # the measures' noises are independent
    rows = _rows(plan)
    return Cells(rows, values, variances, released.mechanisms)


def _rows(plan: Plan) -> list[tuple[Any, ...]]:
    """Every combination of the plan's key domains, row-major (the order :func:`_labels` numbers)."""
    rows: list[tuple[Any, ...]] = [()]
    for key in plan.keys:
        rows = [(*row, value) for row in rows for value in key.domain or ()]
    return rows


def _labels(
    plan: Plan, released: Released, mapped: Sequence[tuple[int, Callable[[Scalar], Scalar]]]
) -> tuple[np.ndarray, int]:
    """For every cube cell, the output row it adds to (-1: none), and the number of rows."""
    shape = released.shape
    labels = np.zeros(math.prod(shape), dtype=np.int64)
    count = 1
    for key, (axis, _) in zip(plan.keys, mapped, strict=True):
        domain = tuple(key.domain or ())
        unit = key_signature(key)[2]
        at = _to_row(released.keys[axis], unit, domain)[marginal_index(shape, (axis,))]
        labels = np.where((labels < 0) | (at < 0), -1, labels * len(domain) + at)
        count *= len(domain)
    return labels, count


def _to_row(key: SynopsisKey, unit: str | None, domain: tuple[Scalar, ...]) -> np.ndarray:
    """For each value of a released key, the position of its bucket at ``unit`` (None: itself) in an asked
    key's ``domain``, or -1."""
    position = {normal(v): i for i, v in enumerate(domain)}
    return np.array([position.get(v, -1) for v in _buckets(key, unit)] or [-1], dtype=np.int64)


@lru_cache(maxsize=1024)
def _buckets(key: SynopsisKey, unit: str | None) -> list[Any]:
    """Each value of a released key, truncated to ``unit`` when it is a coarser grain, in normal form
    (:func:`~dpsql.synopsis.grains.normal`): computed once per released key and grain."""
    if unit is None or key.kind != "trunc":
        return [normal(v) for v in key.domain]
    return [normal(truncate(v, unit)) for v in key.domain]


def combine(found: Sequence[Cells]) -> Cells:
    """Several independent releases' estimates of the same cells as one: weighted by inverse variance,
    cell by cell (the least-squares combination of unbiased estimates with independent noise), so its
    variance ``1/Σ(1/vᵢ)`` is never above the best one's. Post-processing of released values."""
    if len(found) == 1:
        return found[0]
    variances = np.stack([c.variances for c in found])
    values = np.stack([c.values for c in found])
    exact = variances <= 0
    weights = np.where(exact, 0.0, 1.0 / np.where(exact, 1.0, variances))
    any_exact = exact.any(axis=0)
    total = weights.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(
            any_exact,
            (values * exact).sum(axis=0) / np.maximum(exact.sum(axis=0), 1),
            (weights * values).sum(axis=0) / total,
        )
        variance = np.where(any_exact, 0.0, 1.0 / total)
    return Cells(found[0].rows, value, variance, frozenset(m for c in found for m in c.mechanisms))


def derived(plan: Plan, cells: Cells, confidence: float) -> Derived:
    """The rows, measure columns and half-widths post-processing finishes (integer measures rounded)."""
    z = half_width_factor(confidence, cells.mechanisms)
    columns: list[list[Any]] = []
    for i, measure in enumerate(plan.measures):
        integer = measure.integer and float(measure.centre).is_integer()
        columns.append([round(v) if integer else float(v) for v in cells.values[i]])
    half = z * np.sqrt(cells.variances)
    widths: list[list[float | None]] = [[float(w) for w in row] for row in half.T]
    return cells.rows, columns, widths


def answer(plan: Plan, released: Released, policy: Policy, confidence: float) -> Derived | None:
    """The plan's released rows, measure columns and half-widths from ``released``; None when the
    synopsis cannot answer it exactly (see the module docstring)."""
    cells = estimate(plan, released, policy)
    return None if cells is None else derived(plan, cells, confidence)
