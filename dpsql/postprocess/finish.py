"""Finishing a released query: output expressions, HAVING, DISTINCT, ORDER BY, OFFSET and LIMIT.

Everything here reads only noisy measures, released keys and public scales, so by the
post-processing theorem it costs no privacy. Plans whose outputs are bare keys, counts and
sums skip the per-row interpreter (:func:`_postprocess_direct`); the values are the same.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.aggregates import OUTPUTS, Aggregate, Key
from dpsql.errors import DataError, Error
from dpsql.notices import Notice, NoticeKind
from dpsql.plan import Measure, Plan
from dpsql.postprocess.expressions import compile_expression, order_rows
from dpsql.release.accuracy import accuracy
from dpsql.release.apply import ReleaseCache
from dpsql.session import Result


def finish(
    plan: Plan,
    rows: list[tuple[Any, ...]],
    columns: list[list[Any]],
    widths: list[list[float | None]],
    cache: ReleaseCache | None = None,
) -> Result:
    """Outputs, HAVING, DISTINCT, ORDER BY and LIMIT over released values (row j: keys, measures, widths)."""
    columns = _empty_groups_counted_empty(plan, columns)
    direct = _direct_columns(plan)
    if direct is not None and (not widths or all(w is widths[0] for w in widths)):
        return _postprocess_direct(plan, rows, columns, widths[0] if widths else [], direct)
    nkeys = len(plan.keys)
    released: list[tuple[tuple[Any, ...], tuple[Any, ...], tuple[float | None, ...], tuple[Any, ...]]] = []
    key_names = [f"k{i}" for i in range(nkeys)]
    measure_names = [f"m{i}" for i in range(len(columns))]
    converters = [converter(m) for m in plan.measures]
    cache = cache or ReleaseCache()
    if cache.compiled is None:
        cache.compiled = (
            [compile_expression(out.expr) for out in plan.outputs],
            None if plan.having is None else compile_expression(plan.having),
            [compile_expression(term) for term, _, _ in plan.order],
        )
    outputs, having, order = cache.compiled
    for j, row in enumerate(rows):
        env: dict[str, Any] = dict(zip(key_names, row, strict=False))
        for name, values, convert in zip(measure_names, columns, converters, strict=True):
            env[name] = convert(values[j])
        out_values, out_acc, out_ranges = [], [], []
        for o, out in enumerate(plan.outputs):
            value = _evaluate_released(outputs[o], env)
            value = OUTPUTS[out.kind].coerce(out, value)
            if out.clamp is not None and value is not None:
                value = min(max(value, out.clamp[0]), out.clamp[1])
            env[f"o{o}"] = value
            out_values.append(value)
            out_acc.append(None if value is None else accuracy(out, env, widths[j]))  # NULL: no interval
            out_ranges.append(None if value is None else OUTPUTS[out.kind].interval(out, plan, env))
        if having is not None and _evaluate_released(having, env) is not True:
            continue
        sort_key = tuple(_evaluate_released(term, env) for term in order)
        released.append((sort_key, tuple(out_values), tuple(out_acc), tuple(out_ranges)))
    if plan.distinct:
        seen: dict[tuple[Any, ...], Any] = {}
        for item in released:
            seen.setdefault(item[1], item)
        released = list(seen.values())
    if plan.order:
        spec = [(desc, nulls_first) for _, desc, nulls_first in plan.order]
        released = order_rows([(item[0], item) for item in released], spec)
    end = None if plan.limit is None else plan.offset + plan.limit
    released = released[plan.offset : end]
    ranged = any(r is not None for item in released for r in item[3])
    return Result(
        columns=[o.column for o in plan.outputs],
        rows=[item[1] for item in released],
        accuracy=[item[2] for item in released],
        epsilon_spent=0.0,
        delta_spent=0.0,
        intervals=[item[3] for item in released] if ranged else [],
    )


def _empty_groups_counted_empty(plan: Plan, columns: list[list[Any]]) -> list[list[Any]]:
    """In a row whose released COUNT(*) is 0, read every count measure of the row as at most 0.

    AVG and the variances divide by a count of their own column (a separate noisy measure, or
    COUNT(*) itself), and are NULL when that noisy count is <= 0. A group released with COUNT(*) = 0
    could still show a non-NULL AVG beside it. No column's count exceeds the row count, and
    PostgreSQL's AVG of an empty group is NULL: with the counts under it read as at most 0, that AVG
    (in outputs, HAVING and ORDER BY alike) is NULL and a COUNT(column) beside it shows 0. Negative
    noisy counts are kept (sums over groups keep their noise unbiased); only positive ones in such a
    row become 0. Privacy: the decision reads only the released noisy COUNT(*) (as its output shows
    it: rounded, never below 0), never a true count: post-processing, free. ``columns`` is not
    changed in place (it may be stored for measurement reuse).
    """
    star = next((i for i, m in enumerate(plan.measures) if m.star), None)
    if star is None:
        return columns
    convert = converter(plan.measures[star])  # as the COUNT(*) output reads it
    empty = [j for j, value in enumerate(columns[star]) if value is not None and round(convert(value)) <= 0]
    if not empty:
        return columns
    columns = list(columns)
    for i, measure in enumerate(plan.measures):
        if not measure.counts:
            continue
        column = columns[i] = list(columns[i])
        for j in empty:
            if column[j] is not None and float(column[j]) > 0:
                column[j] = 0
    return columns


def _direct_columns(plan: Plan) -> list[tuple[Aggregate, int]] | None:
    """For plans whose outputs are bare keys, counts and sums (no HAVING/ORDER BY/DISTINCT): where each comes from.

    Such plans — the common shape of large grouped results — skip the per-row interpreter.
    """
    if plan.having is not None or plan.order or plan.distinct:
        return None
    sources: list[tuple[Aggregate, int]] = []
    for out in plan.outputs:
        if not isinstance(out.expr, exp.Var) or not OUTPUTS[out.kind].direct or out.clamp is not None:
            return None
        sources.append((OUTPUTS[out.kind], int(out.expr.name[1:])))
    return sources


def _postprocess_direct(
    plan: Plan,
    rows: list[tuple[Any, ...]],
    columns: list[list[Any]],
    widths: list[float | None],
    direct: list[tuple[Aggregate, int]],
) -> Result:
    """Column-wise release of key/count/sum outputs: same values as the interpreter, without it."""
    end = None if plan.limit is None else plan.offset + plan.limit
    window = slice(plan.offset, end)
    rows = rows[window]
    cells: list[list[Any]] = []
    accuracy: list[float | None] = []
    for aggregate, index in direct:
        if isinstance(aggregate, Key):
            cells.append([row[index] for row in rows])
            accuracy.append(None)
            continue
        values = columns[index][window]
        convert = converter(plan.measures[index])
        cells.append(aggregate.direct_values(values, convert))
        accuracy.append(widths[index] if widths else None)
    released = list(zip(*cells, strict=True)) if cells else []
    return Result(
        columns=[o.column for o in plan.outputs],
        rows=released,
        accuracy=[tuple(accuracy)] * len(released),
        epsilon_spent=0.0,
        delta_spent=0.0,
    )


def _evaluate_released(expr: Callable[[dict[str, Any]], Any], env: dict[str, Any]) -> Any:
    """Post-processing never fails with a Python exception: it reads only noisy values, so a
    PostgreSQL-style data error is safe to report."""
    try:
        return expr(env)
    except Error:
        raise
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise DataError("could not compute an output from the released values", detail=str(exc)) from None


def converter(measure: Measure) -> Any:
    """How a released value of this measure becomes a Python value: int, float, or a chosen key."""
    return measure.aggregate.converter(measure)


def from_cache(cached: Result, created: float) -> Result:
    """A stored answer, re-released: same values, nothing charged; its accuracy notes are kept
    (the cache notice takes the place of the charge notice)."""
    return _free(
        cached,
        f"dpsql: answered from the result cache (first computed at {released_at(created)}; this exact query was "
        "already released on this database and data); no budget charged",
    )


def from_release(finished: Result, created: float) -> Result:
    """An answer finished again from measurements an earlier query released (the same DP measurement
    with other outputs, aliases, HAVING, ORDER BY or LIMIT): nothing charged, nothing noised again;
    the notice names that release in place of the charge notice."""
    return _free(
        finished,
        f"dpsql: answered from an earlier release (its measurements were first released at {released_at(created)}: "
        "the same DP measurement on this database and data, post-processed again for this query's outputs); "
        "no budget charged",
    )


def released_at(created: float) -> str:
    """When something was released (seconds since the epoch), as every notice names it."""
    return dt.datetime.fromtimestamp(created, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _free(result: Result, notice: str) -> Result:
    """``result`` again, nothing charged: ``notice`` in place of its budget notices (by their kind)."""
    return Result(
        columns=result.columns,
        rows=result.rows,
        accuracy=result.accuracy,
        epsilon_spent=0.0,
        delta_spent=0.0,
        notices=[Notice(notice, NoticeKind.FREE), *(n for n in map(Notice.of, result.notices) if not n.budget)],
    )
