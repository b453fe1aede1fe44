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
ORDER BY, LIMIT) follows. Privacy: every value read is a released noisy value or public (domains, noise
variances, the query); whether a query is answerable depends on its text, the policy and which synopses
were released, never on the data. The WHERE is evaluated over released cells only, in a private in-memory
DuckDB without file or network access.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist
from typing import Any

import duckdb
import numpy as np
import sqlglot
from sqlglot import exp

from dpsql.analyze.expressions import date_unit
from dpsql.analyze.fold import truncate as fold_truncate
from dpsql.analyze.parse import dialect
from dpsql.plan import GroupKey, Measure, Plan
from dpsql.policy import PG_TYPE_NAMES, Policy, Scalar
from dpsql.synopsis.store import Released, SynopsisKey

#: Time grains in nesting order: a grain is a union of cells of every finer one (weeks only of days).
_GRAINS = ("MICROSECOND", "MILLISECOND", "SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "QUARTER", "YEAR")
_DAY_OR_FINER = frozenset(_GRAINS[: _GRAINS.index("DAY") + 1])

_DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "text": "VARCHAR", "date": "DATE", "timestamp": "TIMESTAMP"}
_DUCKDB_TYPES["boolean"] = "BOOLEAN"
assert set(_DUCKDB_TYPES) == set(PG_TYPE_NAMES)


# -- keys ----------------------------------------------------------------------------------------------


def key_signature(key: GroupKey) -> tuple[str, str | None, str | None, str]:
    """(kind, column, unit, text) of a plan key: a plain column, ``DATE_TRUNC(unit, column)``, or another
    expression matched by its text with table qualifiers removed."""
    if key.expr is None:
        return "plain", key.column, None, key.column
    tree = sqlglot.parse_one(key.column, dialect=dialect("postgres"))
    bare = tree.transform(lambda n: exp.column(n.name) if isinstance(n, exp.Column) else n)
    text = bare.sql(dialect=dialect("postgres"))
    trunc = tree if isinstance(tree, exp.TimestampTrunc | exp.DateTrunc) else None
    if trunc is not None and isinstance(trunc.this, exp.Column):
        unit = trunc.args.get("unit")
        name = unit.name.upper() if isinstance(unit, exp.Expression) else str(unit).strip("'").upper()
        return "trunc", trunc.this.name, name, text
    return "expr", None, None, text


def coarsens(fine: str, coarse: str) -> bool:
    """Whether every ``coarse`` time bucket is a union of ``fine`` buckets."""
    if coarse == "WEEK":
        return fine == "WEEK" or fine in _DAY_OR_FINER
    if fine not in _GRAINS or coarse not in _GRAINS:
        return fine == coarse
    return _GRAINS.index(fine) <= _GRAINS.index(coarse)


def truncate(value: Scalar, unit: str) -> Scalar:
    """``value`` (a bucket start) truncated to ``unit`` as PostgreSQL's ``date_trunc`` does
    (:func:`dpsql.analyze.fold.truncate`), its type kept (a date stays a date)."""
    if not isinstance(value, dt.date):
        return value
    stamp = value if isinstance(value, dt.datetime) else dt.datetime(value.year, value.month, value.day)
    canonical = date_unit(unit, "date_trunc", "timestamp")
    truncated = fold_truncate(canonical, stamp.replace(tzinfo=None)).replace(tzinfo=stamp.tzinfo)
    return truncated if isinstance(value, dt.datetime) else truncated.date()


def bucket_end(start: Scalar, unit: str, column_type: str) -> Scalar:
    """The last value of ``column_type`` inside the bucket starting at ``start``."""
    if not isinstance(start, dt.date):
        return start
    stamp = start if isinstance(start, dt.datetime) else dt.datetime(start.year, start.month, start.day)
    months = {"YEAR": 12, "QUARTER": 3, "MONTH": 1}.get(unit)
    if months is not None:
        total = stamp.year * 12 + stamp.month - 1 + months
        following = stamp.replace(year=total // 12, month=total % 12 + 1)
    else:
        step = {"WEEK": dt.timedelta(weeks=1), "DAY": dt.timedelta(days=1), "HOUR": dt.timedelta(hours=1)}
        step |= {"MINUTE": dt.timedelta(minutes=1), "SECOND": dt.timedelta(seconds=1)}
        following = stamp + step.get(unit, dt.timedelta(microseconds=1))
    if column_type == "date":
        return (following - dt.timedelta(days=1)).date()
    return following - dt.timedelta(microseconds=1)


def _normal(value: Scalar) -> Any:
    """A comparable form of a key value (a date and the timestamp of its midnight are one bucket)."""
    if isinstance(value, dt.datetime):
        return ("t", value.replace(tzinfo=None))
    if isinstance(value, dt.date):
        return ("t", dt.datetime(value.year, value.month, value.day))
    return ("v", value)


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
    count = next((i for i, m in enumerate(released.measures) if m.kind == "count_star"), None)
    if measure.kind == "count_star":
        return None if count is None else [(count, 1.0)]
    if measure.kind == "sum" and measure.expr is None and not measure.square and measure.column is not None:
        sums = [i for i, m in enumerate(released.measures) if m.kind == "sum" and m.column == measure.column]
        if not sums:
            return None
        # Σ(x − c') = Σ(x − c) + (c − c')·COUNT: another centre needs the count too
        total, shift = sums[0], released.measures[sums[0]].centre - float(measure.centre)
        if not shift:
            return [(total, 1.0)]
        return None if count is None else [(total, 1.0), (count, shift)]
    return None


def _where_axes(where: exp.Expression, keys: Sequence[SynopsisKey], policy_types: Mapping[str, str]) -> set[int] | None:
    """The synopsis axes a WHERE reads, or None when it reads anything else, or bounds a time column in a
    way that could split a cell (see :func:`_aligned`)."""
    if any(isinstance(n, exp.Subquery | exp.Select) for n in where.walk()):
        return None
    axes: set[int] = set()
    for column in where.find_all(exp.Column):
        axis = next((a for a, k in enumerate(keys) if k.column == column.name and k.kind in ("plain", "trunc")), None)
        if axis is None:
            return None
        axes.add(axis)
        key = keys[axis]
        if key.kind == "trunc" and not _aligned(column, where, key, policy_types.get(column.name, "timestamp")):
            return None
    return axes


_FLIP: dict[type[exp.Expression], type[exp.Expression]] = {exp.GT: exp.LT, exp.GTE: exp.LTE, exp.LT: exp.GT}
_FLIP[exp.LTE] = exp.GTE


def _aligned(column: exp.Column, root: exp.Expression, key: SynopsisKey, column_type: str) -> bool:
    """Whether ``column`` (a time key's column) is only compared with constants on the synopsis's bucket
    edges, under ANDs only: ``>=``/``<`` a bucket start, ``>``/``<=`` a bucket's last value, BETWEEN a start
    AND a last value. Every cell is then wholly inside or wholly outside each comparison, and so of
    their conjunction; equality and OR/NOT are refused (they could keep part of a cell)."""
    assert key.unit is not None
    operand: exp.Expression = column.parent if isinstance(column.parent, exp.Cast) else column
    comparison = operand.parent
    if isinstance(comparison, exp.Between) and comparison.this is operand:
        low, high = _constant(comparison.args.get("low")), _constant(comparison.args.get("high"))
        edges_ok = _is_start(low, key.unit) and _is_end(high, key.unit, column_type)
    elif isinstance(comparison, exp.GT | exp.GTE | exp.LT | exp.LTE):
        kind: type[exp.Expression] = type(comparison)
        if comparison.this is operand:
            other = comparison.expression
        else:
            other, kind = comparison.this, _FLIP[kind]
        value = _constant(other)
        edges_ok = _is_start(value, key.unit) if kind in (exp.GTE, exp.LT) else _is_end(value, key.unit, column_type)
    else:
        return False
    if not edges_ok:
        return False
    node: exp.Expression = comparison
    while node is not root:
        parent = node.parent
        if parent is None or not isinstance(parent, exp.And | exp.Paren):
            return False
        node = parent
    return True


def _constant(node: exp.Expression | None) -> dt.datetime | None:
    """A date/timestamp literal (possibly cast) as a naive datetime; None otherwise."""
    while isinstance(node, exp.Cast | exp.Paren):
        node = node.this
    if not isinstance(node, exp.Literal) or not node.is_string:
        return None
    try:
        value = dt.datetime.fromisoformat(node.this.strip())
    except ValueError:
        return None
    return value.replace(tzinfo=None)


def _is_start(value: dt.datetime | None, unit: str) -> bool:
    return value is not None and truncate(value, unit) == value


def _is_end(value: dt.datetime | None, unit: str, column_type: str) -> bool:
    if value is None:
        return False
    end = bucket_end(truncate(value, unit), unit, column_type)
    return bool(_normal(end) == _normal(value))


def _where_mask(where: exp.Expression, released: Released, policy: Policy, table: str) -> np.ndarray | None:
    """Which cube cells the WHERE keeps, evaluated at both ends of every cell; None if some cell is split."""
    table_policy = policy.table(table)
    assert table_policy is not None
    columns = sorted({k.column for k in released.keys if k.column is not None and k.kind in ("plain", "trunc")})
    types = {c: table_policy.columns[c].type for c in columns}
    bare = where.transform(lambda n: exp.column(n.name, quoted=True) if isinstance(n, exp.Column) else n)
    condition = bare.sql(dialect=dialect("duckdb"))
    cells = list(itertools.product(*(range(len(k.domain)) for k in released.keys)))
    connection = duckdb.connect(":memory:", config={"enable_external_access": False})
    try:
        definition = ", ".join(f'"{c}" {_DUCKDB_TYPES[types[c]]}' for c in columns)
        kept = []
        for end in (False, True):
            connection.execute(f"CREATE OR REPLACE TABLE cells (i BIGINT, {definition})")
            rows = []
            for i, cell in enumerate(cells):
                values: dict[str, Scalar] = {}
                for axis, key in enumerate(released.keys):
                    if key.column is None or key.kind not in ("plain", "trunc"):
                        continue
                    value = key.domain[cell[axis]]
                    if key.kind == "trunc" and end:
                        assert key.unit is not None
                        value = bucket_end(value, key.unit, types[key.column])
                    elif key.kind == "trunc" and types[key.column] == "date" and isinstance(value, dt.datetime):
                        value = value.date()
                    values[key.column] = value
                rows.append((i, *(values[c] for c in columns)))
            row_marks = "(" + ", ".join("?" * (len(columns) + 1)) + ")"
            connection.execute(
                f"INSERT INTO cells VALUES {', '.join([row_marks] * len(rows))}", [v for r in rows for v in r]
            )
            kept.append({int(r[0]) for r in connection.execute(f"SELECT i FROM cells WHERE {condition}").fetchall()})
    except duckdb.Error:
        return None
    finally:
        connection.close()
    if kept[0] != kept[1]:
        return None
    mask = np.zeros(len(cells), dtype=bool)
    mask[list(kept[0])] = True
    return mask


def half_width_factor(confidence: float, laplace: bool) -> float:
    """Half-width per standard deviation of a sum of independent noises at ``confidence``: the normal
    quantile for Gaussian noise (a sum of Gaussians is one); for Laplace noise the larger, single Laplace's
    (``ln(1/(1−c))/√2``: a sum of Laplace noises lies between the two), so the interval never undercovers."""
    normal = NormalDist().inv_cdf((1 + confidence) / 2)
    return max(normal, math.log(1 / (1 - confidence)) / math.sqrt(2)) if laplace else normal


#: A derived answer before post-processing: rows (keys), each measure's column, each row's half-widths.
Derived = tuple[list[tuple[Any, ...]], list[list[Any]], list[list[float | None]]]


def answer(plan: Plan, released: Released, policy: Policy, confidence: float) -> Derived | None:
    """The plan's released rows, measure columns and half-widths from ``released``; None when the
    synopsis cannot answer it exactly (see the module docstring)."""
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
    mask: np.ndarray | None = None
    if plan.where is not None:
        table_policy = policy.table(sources[0].name)
        assert table_policy is not None
        types = {name: column.type for name, column in table_policy.columns.items()}
        read = _where_axes(plan.where, released.keys, types)
        if read is None:
            return None
        axes |= read
    if not any(axes <= set(measured) for measured in released.axes):
        return None  # not in the span of one measured marginal
    if plan.where is not None:
        mask = _where_mask(plan.where, released, policy, sources[0].name)
        if mask is None:
            return None
    cells = list(itertools.product(*(range(len(k.domain)) for k in released.keys)))
    members: dict[tuple[Any, ...], list[int]] = {}
    for i, cell in enumerate(cells):
        if mask is not None and not mask[i]:
            continue
        key = tuple(
            _normal(transform(released.keys[axis].domain[cell[axis]]))
            for axis, transform in (m for m in mapped if m is not None)
        )
        members.setdefault(key, []).append(i)
    combos = list(itertools.product(*(k.domain or () for k in plan.keys)))
    estimates = released.estimates
    z = half_width_factor(confidence, released.laplace)
    columns: list[list[Any]] = [[] for _ in plan.measures]
    widths: list[list[float | None]] = []
    for combo in combos:
        index = np.asarray(members.get(tuple(_normal(v) for v in combo), []), dtype=np.int64)
        row_widths: list[float | None] = []
        for i, measure_terms in enumerate(terms):
            assert measure_terms is not None
            value, variance = 0.0, 0.0
            for synopsis_measure, coefficient in measure_terms:
                v, var = estimates[synopsis_measure].total(index)
                value += coefficient * v
                variance += coefficient**2 * var  # the measures' noises are independent
            integer = plan.measures[i].integer and float(plan.measures[i].centre).is_integer()
            columns[i].append(round(value) if integer else value)
            row_widths.append(z * math.sqrt(variance))
        widths.append(row_widths)
    return [tuple(c) for c in combos], columns, widths
