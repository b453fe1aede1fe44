"""Which cells of a released cube a WHERE keeps: read on released keys only, in milliseconds.

A derived answer (a synopsis, or the cells of an earlier release) applies a filter to released cells,
never to rows. That is exact only when every cell is wholly in or wholly out, and only for values the
cells stand for; so a WHERE is usable when

* it reads only columns of the cube's plain or time keys (one axis each), with no subquery;
* a time key's column is compared, under ANDs only, with constants on its bucket edges (``>=``/``<`` a
  bucket start, ``>``/``<=`` a bucket's last value, BETWEEN a start AND a last value): each cell is then
  wholly inside or outside each comparison, and so of their conjunction (checked again at both ends of
  every cell by :func:`cell_mask`);
* every constant it compares a key column with lies in that key's declared domain: a plain key's value,
  or a time between the first bucket's start and the last bucket's end (issue #38 item 6: a value the
  policy does not declare has no cell, and an exact ``0 ± 0`` from the cells would contradict a fresh
  answer when the data hold it); a filter keeping no cell at all is refused for the same reason.

Anything else is not derivable and the query is answered fresh (charged). Every test reads the query's
text, the policy and the cube's public domains, never the data.

The kept cells are computed once per distinct (filter, axes it reads) on the distinct values of those
axes only (a department filter reads 6 values, not the 360 cells of department × month), in one in-memory
DuckDB per thread without file or network access, and cached (:data:`MASKS`).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import duckdb
import numpy as np
from sqlglot import exp

from dpsql.analyze.keys.base import literal_value
from dpsql.analyze.parse import dialect
from dpsql.lru import LRU
from dpsql.policy import PG_TYPE_NAMES, Scalar
from dpsql.synopsis.grains import bucket_end, normal, truncate
from dpsql.synopsis.solve import marginal_index
from dpsql.synopsis.store import SynopsisKey

_DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "text": "VARCHAR", "date": "DATE", "timestamp": "TIMESTAMP"}
_DUCKDB_TYPES["boolean"] = "BOOLEAN"
assert set(_DUCKDB_TYPES) == set(PG_TYPE_NAMES)

#: Kept-cell masks by (filter, the axes it reads and their domains): a dashboard repeats its filters.
MASKS: LRU[tuple[str, tuple[tuple[SynopsisKey, str], ...]], np.ndarray] = LRU(4096, 64 << 20)

_local = threading.local()


def _connection() -> duckdb.DuckDBPyConnection:
    """This thread's private evaluator (opening one costs ~20 ms: once per thread, not per statement)."""
    connection: duckdb.DuckDBPyConnection | None = getattr(_local, "connection", None)
    if connection is None:
        config: dict[str, str | bool | int | float | list[str]] = {
            "enable_external_access": False,
            "threads": 1,
            "memory_limit": "128MB",
        }
        connection = _local.connection = duckdb.connect(":memory:", config=config)
    return connection


def read_axes(where: exp.Expression, keys: Sequence[SynopsisKey], types: Mapping[str, str]) -> set[int] | None:
    """The cube axes a WHERE reads, or None when it is not usable on cells (see the module docstring)."""
    if any(isinstance(n, exp.Subquery | exp.Select) for n in where.walk()):
        return None
    axes: set[int] = set()
    for column in where.find_all(exp.Column):
        found = [a for a, k in enumerate(keys) if k.column == column.name and k.kind in ("plain", "trunc")]
        if len(found) != 1:
            return None  # not a key's column, or the column of two axes (which one would the cell hold?)
        axis = found[0]
        axes.add(axis)
        key = keys[axis]
        column_type = types.get(column.name, "timestamp")
        if key.kind == "trunc" and not _aligned(column, where, key, column_type):
            return None
        if not _constants_declared(column, key, column_type):
            return None
    return axes


_FLIP: dict[type[exp.Expression], type[exp.Expression]] = {exp.GT: exp.LT, exp.GTE: exp.LTE, exp.LT: exp.GT}
_FLIP[exp.LTE] = exp.GTE


def _operand(column: exp.Column) -> exp.Expression:
    node: exp.Expression = column
    while isinstance(node.parent, exp.Cast | exp.Paren):
        node = node.parent
    return node


def _aligned(column: exp.Column, root: exp.Expression, key: SynopsisKey, column_type: str) -> bool:
    """Whether ``column`` (a time key's column) is only compared with constants on the key's bucket
    edges, under ANDs only; equality and OR/NOT are refused (they could keep part of a cell)."""
    assert key.unit is not None
    operand = _operand(column)
    comparison = operand.parent
    if isinstance(comparison, exp.Between) and comparison.this is operand:
        low, high = time_constant(comparison.args.get("low")), time_constant(comparison.args.get("high"))
        edges_ok = _is_start(low, key.unit) and _is_end(high, key.unit, column_type)
    elif isinstance(comparison, exp.GT | exp.GTE | exp.LT | exp.LTE):
        kind: type[exp.Expression] = type(comparison)
        if comparison.this is operand:
            other = comparison.expression
        else:
            other, kind = comparison.this, _FLIP[kind]
        value = time_constant(other)
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


def time_constant(node: exp.Expression | None) -> dt.datetime | None:
    """A date/timestamp literal (possibly cast) as a naive datetime; None otherwise (or beyond year 9999)."""
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
    return bool(normal(end) == normal(value))


def _constants_declared(column: exp.Column, key: SynopsisKey, column_type: str) -> bool:
    """Whether every constant ``column`` is compared with lies in ``key``'s declared domain."""
    operand = _operand(column)
    comparison = operand.parent
    if isinstance(comparison, exp.Between):
        constants = [comparison.args.get("low"), comparison.args.get("high")]
    elif isinstance(comparison, exp.In) and comparison.this is operand:
        constants = list(comparison.expressions)
    elif isinstance(comparison, exp.EQ | exp.NEQ | exp.GT | exp.GTE | exp.LT | exp.LTE):
        constants = [comparison.expression if comparison.this is operand else comparison.this]
    else:
        return True  # LIKE, IS NULL, functions: they select among the domain's values (never none: see mask)
    if key.kind == "trunc":
        return _times_declared(constants, key, column_type)
    declared = {normal(v) for v in key.domain}
    for node in constants:
        value = literal_value(node) if node is not None else exp.Expression
        if isinstance(value, type):
            continue  # not a plain literal (a cast, an expression): the empty-mask rule still applies
        if value is not None and normal(value) not in declared:
            return False
    return True


def _times_declared(constants: Sequence[exp.Expression | None], key: SynopsisKey, column_type: str) -> bool:
    """Whether every time constant lies between the first bucket's start and the end of the last."""
    span = _span(key, column_type)
    for node in constants:
        value = time_constant(node)
        if span is None or value is None or not span[0] <= value <= span[1]:
            return False
    return True


@lru_cache(maxsize=1024)
def _span(key: SynopsisKey, column_type: str) -> tuple[dt.datetime, dt.datetime] | None:
    """From the first bucket's start to the first value after the last bucket (its exclusive end)."""
    assert key.unit is not None
    starts = [normal(v)[1] for v in key.domain if isinstance(v, dt.date)]
    if not starts:
        return None
    last = normal(bucket_end(max(starts), key.unit, column_type))[1]
    return min(starts), _after(last, column_type)


def _after(last: dt.datetime, column_type: str) -> dt.datetime:
    """The first value after ``last`` (a bucket's end): where an exclusive upper edge sits."""
    step = dt.timedelta(days=1) if column_type == "date" else dt.timedelta(microseconds=1)
    try:
        return last + step
    except OverflowError:
        return dt.datetime.max


def cell_mask(
    where: exp.Expression, keys: Sequence[SynopsisKey], types: Mapping[str, str], axes: set[int]
) -> np.ndarray | None:
    """Which cube cells (row-major) ``where`` keeps, each of its AND terms evaluated at both ends of every
    cell over the axes it reads (``axes``: :func:`read_axes`); None when a term splits a cell, no cell is
    kept, or the evaluation fails."""
    shape = tuple(len(k.domain) for k in keys)
    mask = np.ones(math.prod(shape), dtype=bool)
    for term in _terms(where):
        read = sorted({a for c in term.find_all(exp.Column) for a in axes if keys[a].column == c.name})
        columns = tuple((keys[a], types[str(keys[a].column)]) for a in read)
        bare = term.transform(lambda n: exp.column(n.name, quoted=True) if isinstance(n, exp.Column) else n)
        condition = bare.sql(dialect=dialect("duckdb"))
        kept = MASKS.get((condition, columns))
        if kept is None:
            kept = _fast(term, columns)
            kept = _evaluate(condition, columns) if kept is _SLOW else kept
            if kept is None:
                return None
            MASKS.put((condition, columns), kept, kept.nbytes)
        mask &= kept[marginal_index(shape, tuple(read))] if read else bool(kept.all())
    return mask if mask.any() else None


def _terms(where: exp.Expression) -> list[exp.Expression]:
    """The AND terms of a WHERE (through parentheses)."""
    while isinstance(where, exp.Paren):
        where = where.this
    if isinstance(where, exp.And):
        return _terms(where.this) + _terms(where.expression)
    return [where]


#: :func:`_fast` cannot tell: evaluate in DuckDB.
_SLOW = np.zeros(0, dtype=bool)

_COMPARE: dict[type[exp.Expression], Any] = {
    exp.GT: np.greater,
    exp.GTE: np.greater_equal,
    exp.LT: np.less,
    exp.LTE: np.less_equal,
}


def _fast(term: exp.Expression, columns: Sequence[tuple[SynopsisKey, str]]) -> np.ndarray | None:
    """The common terms, in NumPy: a time key's column compared with a time constant (at both ends of each
    bucket; None when they disagree: a split cell), a plain key's column ``=``/``<>``/``IN``/``NOT IN``
    non-NULL literals. :data:`_SLOW` for anything else."""
    if len(columns) != 1:
        return _SLOW
    key, column_type = columns[0]
    negated = isinstance(term, exp.Not)
    inner = term.this if negated else term
    if key.kind == "trunc" and not negated and isinstance(inner, exp.Between | exp.GT | exp.GTE | exp.LT | exp.LTE):
        return _fast_time(inner, key, column_type)
    if key.kind == "plain" and isinstance(inner, exp.EQ | exp.NEQ | exp.In):
        return _fast_plain(inner, key, negated)
    return _SLOW


def _fast_time(term: exp.Expression, key: SynopsisKey, column_type: str) -> np.ndarray | None:
    starts, ends = _cell_times(key, column_type)
    if isinstance(term, exp.Between):
        if not isinstance(term.this, exp.Column | exp.Cast):
            return _SLOW
        low, high = time_constant(term.args.get("low")), time_constant(term.args.get("high"))
        if low is None or high is None:
            return _SLOW
        at_start = (starts >= np.datetime64(low)) & (starts <= np.datetime64(high))
        at_end = (ends >= np.datetime64(low)) & (ends <= np.datetime64(high))
    else:
        kind: type[exp.Expression] = type(term)
        value = time_constant(term.expression)
        if value is None:
            kind, value = _FLIP[kind], time_constant(term.this)
        if value is None:
            return _SLOW
        compare = _COMPARE[kind]
        at_start, at_end = compare(starts, np.datetime64(value)), compare(ends, np.datetime64(value))
    return None if not np.array_equal(at_start, at_end) else at_start


def _fast_plain(term: exp.Expression, key: SynopsisKey, negated: bool) -> np.ndarray:
    if isinstance(term, exp.In):
        if term.args.get("query") is not None or not isinstance(term.this, exp.Column):
            return _SLOW
        constants = list(term.expressions)
    else:
        other = term.expression if isinstance(term.this, exp.Column) else term.this
        constants = [other]
    wanted = set()
    for constant in constants:
        value = literal_value(constant)
        if value is None or isinstance(value, type):
            return _SLOW  # NULL (three-valued logic) or not a literal
        wanted.add(normal(value))
    equal = np.array([normal(v) in wanted for v in key.domain], dtype=bool)
    present = np.array([v is not None for v in key.domain], dtype=bool)  # NULL = x is never true, nor NULL <> x
    keep = ~equal if isinstance(term, exp.NEQ) else equal
    found: np.ndarray = (~keep if negated else keep) & present
    return found


@lru_cache(maxsize=1024)
def _cell_times(key: SynopsisKey, column_type: str) -> tuple[np.ndarray, np.ndarray]:
    """A time key's bucket starts and last values as microsecond timestamps (a date at its midnight, as
    SQL compares a date with a timestamp)."""
    starts, ends = _cell_values(key, column_type)
    as_time = [np.datetime64(normal(v)[1], "us") for v in starts], [np.datetime64(normal(v)[1], "us") for v in ends]
    return np.array(as_time[0]), np.array(as_time[1])


def _evaluate(condition: str, columns: Sequence[tuple[SynopsisKey, str]]) -> np.ndarray | None:
    """``condition`` over every combination of the keys' values (row-major), at both ends of each time
    bucket; None when the two ends disagree somewhere (a split cell) or the evaluation fails."""
    names = [str(key.column) for key, _ in columns]
    sizes = tuple(len(key.domain) for key, _ in columns)
    count = math.prod(sizes)
    kept: list[set[int]] = []
    for end in (False, True):
        lists: list[list[Any]] = [list(range(count))]
        for position, (key, column_type) in enumerate(columns):
            values = _cell_values(key, column_type)[end]
            at = marginal_index(sizes, (position,))
            lists.append(values if len(columns) == 1 else [values[i] for i in at])
        select = ", ".join(
            ["UNNEST($1::BIGINT[]) AS i"]
            + [
                f"UNNEST(${j + 2}::{_DUCKDB_TYPES[column_type]}[]) AS {_quoted(name)}"
                for j, (name, (_, column_type)) in enumerate(zip(names, columns, strict=True))
            ]
        )
        try:
            rows = _connection().execute(f"SELECT i FROM (SELECT {select}) AS cells WHERE {condition}", lists)
            kept.append({int(r[0]) for r in rows.fetchall()})
        except (duckdb.Error, OverflowError, ValueError):
            return None
    if kept[0] != kept[1]:
        return None
    mask = np.zeros(count, dtype=bool)
    mask[list(kept[0])] = True
    return mask


def _quoted(name: str) -> str:
    return exp.to_identifier(name, quoted=True).sql(dialect=dialect("duckdb"))


@lru_cache(maxsize=1024)
def _cell_values(key: SynopsisKey, column_type: str) -> tuple[list[Scalar], list[Scalar]]:
    """Each cell's value of ``key``'s column at its start and at its end (a time bucket's last value;
    a date column's values as dates): computed once per released key."""
    if key.kind != "trunc":
        return list(key.domain), list(key.domain)
    assert key.unit is not None
    unit = key.unit
    starts = [v.date() if column_type == "date" and isinstance(v, dt.datetime) else v for v in key.domain]
    return starts, [bucket_end(v, unit, column_type) for v in key.domain]
