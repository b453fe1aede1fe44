"""Coarsening (issue #29 item 2): a query answered by summing the cells of an earlier, finer release.

Every release over public keys (no partition selection; COUNT(*) and plain or centred SUMs; at most
:data:`~dpsql.synopsis.solve.MAX_CELLS` cells) is also indexed, in the result cache, as a one-marginal
synopsis of its own: its released cells and their noise variances, under the *base* of the release —
its table, WHERE, measures, database, data stamp and policy, not its keys or ε. A later query with the
same base whose keys are some of those keys or coarser time grains of them (a year from months, a total
from departments), or with no WHERE of its own beyond filters on those keys when the earlier release had
none, is then answered by :func:`dpsql.synopsis.answer.answer` from those cells, with the variance of the
sum — but only when that is accurate enough: every interval within the analyst's ``dpsql.accuracy``, or
without one, no wider than the fresh query's own interval at its ε. Otherwise it is a fresh, charged query.

Privacy: the answer reads released values and public variances only (post-processing, free). Whether a
candidate exists depends on what was released before on these data (as for the result cache), and whether
it is used on public widths — never on the data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from sqlglot import exp

from dpsql.analyze.parse import dialect
from dpsql.cache import ResultCache
from dpsql.plan import Plan
from dpsql.session import OutputColumn, Result
from dpsql.synopsis.answer import key_signature
from dpsql.synopsis.solve import MAX_CELLS, Marginal
from dpsql.synopsis.store import Released, SynopsisKey, SynopsisMeasure

#: Finer releases kept per base (the first ones: a cache key's entry never changes).
SLOTS = 8
#: The command tag of an index entry (one JSON document in one cell).
TAG = "DPSQL COARSENABLE"


def _bare(where: exp.Expression | None) -> str:
    if where is None:
        return ""
    bare = where.transform(lambda n: exp.column(n.name, quoted=True) if isinstance(n, exp.Column) else n)
    return bare.sql(dialect=dialect("postgres"))


def _bare_where(plan: Plan) -> str:
    return _bare(plan.where)


#: The most WHERE conjuncts whose subsets are tried as an earlier release's filter.
MAX_CONJUNCTS = 4


def _splits(where: exp.Expression | None) -> list[tuple[str, exp.Expression | None]]:
    """Ways the WHERE can be an earlier release's filter plus a residual over keys: (the filter as that
    release's base names it, the residual to apply to its cells), the whole WHERE first, no filter last."""
    if where is None:
        return [("", None)]
    conjuncts: list[exp.Expression] = [c for c in where.flatten() if isinstance(c, exp.Expression)]
    if not isinstance(where, exp.And):
        conjuncts = [where]
    if len(conjuncts) > MAX_CONJUNCTS:
        return [(_bare(where), None), ("", where)]
    splits: list[tuple[str, exp.Expression | None]] = [(_bare(where), None)]
    for size in range(len(conjuncts) - 1, -1, -1):
        for kept in itertools.combinations(range(len(conjuncts)), size):
            filtered = _conjunction([conjuncts[i] for i in kept]) if kept else None
            residual = _conjunction([conjuncts[i] for i in range(len(conjuncts)) if i not in kept])
            splits.append((_bare(filtered), residual))
    return splits


def _conjunction(parts: list[exp.Expression]) -> exp.Expression:
    """``a AND b AND …`` of copies of ``parts`` (one part: itself)."""
    tree = parts[0].copy()
    for part in parts[1:]:
        tree = exp.And(this=tree, expression=part.copy())
    return tree


def indexable(plan: Plan) -> bool:
    """Public keys, COUNT(*) and plain or centred SUMs of columns, a small cube, one table."""
    if plan.selection_measure is not None or not plan.public_keys or not plan.keys:
        return False
    if len(plan.sources.sources) != 1 or plan.sources.joins:
        return False
    cells = 1
    for key in plan.keys:
        cells *= len(key.domain or ())
    if cells > MAX_CELLS or cells == 0:
        return False
    return all(
        m.kind == "count_star" or (m.kind == "sum" and m.expr is None and not m.square and m.column is not None)
        for m in plan.measures
    )


def base_key(plan: Plan, where: str, database: str, stamp: str, policy: str) -> str:
    """What must be equal for one release's cells to answer another query: the table, the WHERE (as
    given), the database, its data stamp and the policy. Keys and measures are matched by
    :func:`dpsql.synopsis.answer.answer` (a measure's bounds are the policy's, its centre a shift by the count)."""
    parts = ["coarsenable", plan.sources.sources[0].name.lower(), where, database, stamp, policy]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _slot(base: str, i: int) -> str:
    return hashlib.sha256(f"{base}\x1f{i}".encode()).hexdigest()


def record(
    cache: ResultCache,
    plan: Plan,
    columns: list[list[Any]],
    variances: list[float],
    *,
    database: str,
    stamp: str,
    policy: str,
    built_at: float,
    laplace: bool,
) -> None:
    """Index a release's noisy columns (over every combination of its public keys' domains, in the order
    :func:`dpsql.release.apply.apply` releases them) with each measure's noise variance."""
    if not indexable(plan):
        return
    keys = []
    for key in plan.keys:
        kind, column, unit, text = key_signature(key)
        keys.append(SynopsisKey(text, kind, column, unit, key.type or "", tuple(key.domain or ())))
    measures = tuple(SynopsisMeasure(m.kind, m.column, float(m.centre)) for m in plan.measures)
    axes = tuple(range(len(keys)))
    released = Released(
        name="",
        dataset="",
        table=plan.sources.sources[0].name,
        declaration="",
        identity=database,
        built_at=built_at,
        epsilon=0.0,
        delta=0.0,
        keys=tuple(keys),
        measures=measures,
        marginals=tuple(
            (Marginal(axes, [float(v or 0) for v in column], variance),)
            for column, variance in zip(columns, variances, strict=True)
        ),
        laplace=laplace,
    )
    document = json.dumps(released.document(), sort_keys=True)
    entry = Result(
        columns=[OutputColumn("document", "text")],
        rows=[(document,)],
        accuracy=[],
        epsilon_spent=0.0,
        delta_spent=0.0,
        command_tag=TAG,
    )
    base = base_key(plan, _bare_where(plan), database, stamp, policy)
    for i in range(SLOTS):
        if cache.get_entry(_slot(base, i)) is None:
            cache.put(_slot(base, i), entry)
            return


def candidates(
    cache: ResultCache, plan: Plan, *, database: str, stamp: str, policy: str
) -> list[tuple[Released, exp.Expression | None, float]]:
    """Earlier releases that may answer ``plan``: (release, the part of the plan's WHERE still to apply to
    its cells, when it was released). Releases with the same WHERE first, then with part of it (the rest
    must then read only their keys: :func:`dpsql.synopsis.answer.answer` checks)."""
    if plan.selection_measure is not None or len(plan.sources.sources) != 1 or plan.sources.joins:
        return []
    found: list[tuple[Released, exp.Expression | None, float]] = []
    for where, residual in _splits(plan.where):
        base = base_key(plan, where, database, stamp, policy)
        for i in range(SLOTS):
            entry = cache.get_entry(_slot(base, i))
            if entry is None:
                break
            result, created = entry
            if result.command_tag != TAG or len(result.rows) != 1:
                continue
            try:
                found.append((Released.from_document(json.loads(str(result.rows[0][0]))), residual, created))
            except (ValueError, KeyError, TypeError):
                continue
    return found
