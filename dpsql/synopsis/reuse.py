"""Every past release usable (issues #29 item 2, #37 item 1, #38 item 1): the index of released cells.

Every release over public keys (no partition selection; COUNT(*) and plain or centred SUMs; at most
:data:`~dpsql.synopsis.solve.MAX_CELLS` cells) is also indexed, in the result cache, as a one-marginal
synopsis of its own: its released cells and their noise variances with the conjuncts of its WHERE, under
the *base* of its table — the table, database, data stamp and policy (:func:`base_key`). A later query on
that base is answered from the releases whose WHERE is part of its own (the rest then applies to their
cells) and whose keys it can coarsen (a year from months, a total from departments): by
:func:`dpsql.synopsis.answer.estimate` from each, combined across releases (:mod:`dpsql.synopsis.derive`).

What is kept: every release of a base, in slots ``0, 1, 2, …`` of the result cache (up to
:data:`MAX_SLOTS`; a slot is written once, so every process reads the same index), found by probing the
next unknown slot once per statement. In memory, each process keeps what every release can answer (its
WHERE, keys, measures, size: a few hundred bytes) and the cells of the most useful ones within
:data:`MEMORY_BYTES`, evicting the least used (then least recently used) first, never by arrival; an
evicted release is read again from the cache when a query needs it. A query tries at most
:data:`MAX_TRIED` releases, the likeliest to be accurate first.

Privacy: the answer reads released values and public variances only (post-processing, free). Which
releases exist depends on what was released before on these data (as for the result cache), and which
are tried and used on public signatures and widths — never on the data.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sqlglot import exp

from dpsql.analyze.parse import dialect
from dpsql.cache import ResultCache
from dpsql.plan import Plan
from dpsql.session import OutputColumn, Result
from dpsql.synopsis.answer import key_signature
from dpsql.synopsis.grains import coarsens
from dpsql.synopsis.solve import MAX_CELLS, Marginal
from dpsql.synopsis.store import Released, SynopsisKey, SynopsisMeasure

#: Releases indexed per base (table, database, data stamp, policy).
MAX_SLOTS = 4096
#: Bytes of released cells one process keeps loaded (the signatures of all releases are always kept).
MEMORY_BYTES = 64 << 20
#: Bases (tables × data stamps) whose signatures one process keeps.
MAX_BASES = 256
#: Most releases estimated per statement (the likeliest to be accurate first).
MAX_TRIED = 8
#: New slots read per statement (the rest at the next one): an index written by other processes is
#: caught up with a bounded amount of work per statement.
PROBES_PER_STATEMENT = 64
#: The command tag of an index entry (one JSON document in one cell).
TAG = "DPSQL COARSENABLE 2"


def bare(where: exp.Expression | None) -> str:
    """A filter's text with its columns unqualified: how a release and a query name the same filter."""
    if where is None:
        return ""
    tree = where.transform(lambda n: exp.column(n.name, quoted=True) if isinstance(n, exp.Column) else n)
    return tree.sql(dialect=dialect("postgres"))


def conjuncts(where: exp.Expression | None) -> list[exp.Expression]:
    """The top-level AND terms of a WHERE (none without one)."""
    if where is None:
        return []
    if not isinstance(where, exp.And):
        return [where]
    return [c for c in where.flatten() if isinstance(c, exp.Expression)]


def _conjunction(parts: list[exp.Expression]) -> exp.Expression | None:
    """``a AND b AND …`` of copies of ``parts`` (one part: itself; none: None)."""
    if not parts:
        return None
    copies = [exp.paren(p.copy(), copy=False) if isinstance(p, exp.Or) else p.copy() for p in parts]
    tree = copies[0]
    for part in copies[1:]:
        tree = exp.And(this=tree, expression=part)
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
        m.star or (m.clamped_sum and m.expr is None and not m.square and m.column is not None) for m in plan.measures
    )


def base_key(table: str, database: str, stamp: str, policy: str) -> str:
    """What must be equal for one release's cells to answer another query: the table, the database, its
    data stamp and the policy. The WHERE, keys and measures are matched per release (:class:`Entry`)."""
    parts = ["coarsenable 2", table.lower(), database, stamp, policy]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _slot(base: str, i: int) -> str:
    return hashlib.sha256(f"{base}\x1f{i}".encode()).hexdigest()


@dataclass(frozen=True)
class KeySignature:
    """A released key without its domain: what matching a query's keys needs."""

    text: str
    kind: str
    column: str | None
    unit: str | None


@dataclass
class Entry:
    """One indexed release as a process keeps it: what it can answer, and its cells when loaded."""

    slot: str
    where: frozenset[str]
    keys: tuple[KeySignature, ...]
    measures: tuple[tuple[str, str | None], ...]
    cells: int
    #: The largest per-cell noise variance of its measures (ranks releases for a query).
    variance: float
    created: float
    #: The cache key of its cells (content-addressed: a signature never names another release's cells).
    document: str
    released: Released | None = None
    uses: int = 0
    used_at: float = 0.0

    @property
    def nbytes(self) -> int:
        """What its loaded cells hold, roughly: values, estimates and key domains."""
        return 24 * self.cells * (1 + len(self.measures)) + 1024

    def may_answer(self, plan: Plan, asked: frozenset[str], residual_columns: set[str]) -> bool:
        """Whether its signature can answer ``plan`` (the full check is the estimate's): its WHERE is part
        of the query's, the rest reads only its key columns, every key and measure is in it."""
        if not self.where <= asked:
            return False
        columns = {k.column for k in self.keys if k.kind in ("plain", "trunc")}
        if not residual_columns <= columns:
            return False
        for key in plan.keys:
            kind, column, unit, text = key_signature(key)
            if not any(_matches(kind, column, unit, text, k) for k in self.keys):
                return False
        for measure in plan.measures:
            if measure.star and (measure.kind, None) not in self.measures:
                return False
            if measure.clamped_sum and (measure.kind, measure.column) not in self.measures:
                return False
        return True


def _matches(kind: str, column: str | None, unit: str | None, text: str, key: KeySignature) -> bool:
    if kind != key.kind:
        return False
    if kind == "plain":
        return key.column == column
    if kind == "trunc":
        return key.column == column and key.unit is not None and unit is not None and coarsens(key.unit, unit)
    return key.text == text


@dataclass
class _Base:
    entries: list[Entry] = field(default_factory=list)
    #: The next slot not read yet.
    probed: int = 0


class Index:
    """A process's view of the indexed releases (see the module docstring); thread-safe."""

    def __init__(self, cache: ResultCache) -> None:
        self.cache = cache
        self._bases: OrderedDict[str, _Base] = OrderedDict()
        self._loaded_bytes = 0
        self._lock = threading.Lock()

    # -- writing -----------------------------------------------------------------------------------

    def record(
        self,
        plan: Plan,
        columns: list[list[Any]],
        variances: list[float],
        *,
        database: str,
        stamp: str,
        policy: str,
        built_at: float,
        mechanism: str,
    ) -> None:
        """Index a release's noisy columns (over every combination of its public keys' domains, in the order
        :func:`dpsql.release.apply.apply` releases them) with each measure's noise variance."""
        if not indexable(plan):
            return
        keys = []
        for key in plan.keys:
            kind, column, unit, text = key_signature(key)
            keys.append(SynopsisKey(text, kind, column, unit, key.type or "", tuple(key.domain or ())))
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
            measures=tuple(SynopsisMeasure(m.kind, m.column, float(m.centre)) for m in plan.measures),
            marginals=tuple(
                (Marginal(axes, [float(v or 0) for v in column], variance),)
                for column, variance in zip(columns, variances, strict=True)
            ),
            mechanism=mechanism,
        )
        cells = json.dumps(released.document(), sort_keys=True)
        cells_key = hashlib.sha256(f"coarsenable cells\x1f{cells}".encode()).hexdigest()
        self.cache.put(cells_key, _entry(cells))  # first: a signature never points at missing cells
        signature = {
            "where": sorted({bare(c) for c in conjuncts(plan.where)}),
            "keys": [[k.text, k.kind, k.column, k.unit, k.type] for k in released.keys],
            "measures": [[m.kind, m.column, m.centre] for m in released.measures],
            "cells": released.cells,
            "variance": max(variances, default=0.0),
            "document": cells_key,
        }
        text = json.dumps(signature, sort_keys=True)
        base = base_key(released.table, database, stamp, policy)
        with self._lock:
            state = self._base(base)
        self._catch_up(base, state, limit=MAX_SLOTS)
        for _ in range(16):  # another process may take the slot first: then the next one
            with self._lock:
                slot = state.probed
            if slot >= MAX_SLOTS:
                return
            self.cache.put(_slot(base, slot), _entry(text))
            if text in self._catch_up(base, state, limit=1):
                return

    # -- reading -----------------------------------------------------------------------------------

    def candidates(
        self, plan: Plan, *, database: str, stamp: str, policy: str
    ) -> list[tuple[Released, exp.Expression | None, float]]:
        """Releases that may answer ``plan``, the likeliest to be accurate first (at most
        :data:`MAX_TRIED`): (release, the part of the plan's WHERE still to apply to its cells, when it
        was released)."""
        if plan.selection_measure is not None or len(plan.sources.sources) != 1 or plan.sources.joins:
            return []
        base = base_key(plan.sources.sources[0].name, database, stamp, policy)
        with self._lock:
            state = self._base(base)
        self._catch_up(base, state, limit=PROBES_PER_STATEMENT)
        parts = {bare(c): c for c in conjuncts(plan.where)}
        asked = frozenset(parts)
        with self._lock:
            entries = list(state.entries)
        fitting = []
        for entry in entries:
            rest = [c for text, c in parts.items() if text not in entry.where]
            columns = {col.name for c in rest for col in c.find_all(exp.Column)}
            if entry.may_answer(plan, asked, columns):
                fitting.append((entry, _conjunction(rest)))
        fitting.sort(key=lambda f: (f[0].variance * f[0].cells, -f[0].created))
        found = []
        for entry, residual in fitting[:MAX_TRIED]:
            released = self._load(entry)
            if released is not None:
                found.append((released, residual, entry.created))
        return found

    def used(self, released: Released) -> None:
        """Count a use of a loaded release (what eviction keeps)."""
        with self._lock:
            for state in self._bases.values():
                for entry in state.entries:
                    if entry.released is released:
                        entry.uses += 1
                        entry.used_at = time.monotonic()
                        return

    # -- internals ---------------------------------------------------------------------------------

    def _base(self, base: str) -> _Base:
        state = self._bases.get(base)
        if state is None:
            state = self._bases[base] = _Base()
            while len(self._bases) > MAX_BASES:
                _, dropped = self._bases.popitem(last=False)
                for entry in dropped.entries:
                    self._unload(entry)
        self._bases.move_to_end(base)
        return state

    def _read(self, key: str) -> tuple[str, float] | None:
        """The text stored under ``key`` and when; "" for an entry that is not the index's."""
        found = self.cache.get_entry(key)
        if found is None:
            return None
        result, created = found
        if result.command_tag != TAG or len(result.rows) != 1:
            return "", created
        return str(result.rows[0][0]), created

    def _catch_up(self, base: str, state: _Base, *, limit: int) -> list[str]:
        """Read up to ``limit`` slots not read yet; the texts found."""
        texts: list[str] = []
        while len(texts) < limit:
            with self._lock:
                i = state.probed
            if i >= MAX_SLOTS:
                break
            read = self._read(_slot(base, i))
            if read is None:
                break
            entry = _parse(_slot(base, i), *read)
            with self._lock:
                if state.probed != i:  # another thread read it meanwhile
                    continue
                state.probed = i + 1
                if entry is not None:
                    state.entries.append(entry)
            texts.append(read[0])
        return texts

    def _load(self, entry: Entry) -> Released | None:
        """The entry's cells, read from the cache when not loaded (then kept, within the memory budget)."""
        with self._lock:
            if entry.released is not None:
                return entry.released
        read = self._read(entry.document)
        if read is None:
            return None
        try:
            released = Released.from_document(json.loads(read[0]))
        except (ValueError, KeyError, TypeError):
            return None
        if released.cells != entry.cells or len(released.measures) != len(entry.measures):
            return None
        with self._lock:
            if entry.released is not None:
                return entry.released
            entry.released = released
            self._admit(entry)
        return released  # used now even when not kept (the least useful of all loaded)

    def _admit(self, entry: Entry) -> None:
        """Count a loaded entry's bytes and, beyond :data:`MEMORY_BYTES`, unload the least useful (fewest
        uses, then least recently used; the newcomer too) until within it (called under the lock)."""
        self._loaded_bytes += entry.nbytes
        if self._loaded_bytes <= MEMORY_BYTES:
            return
        loaded = [e for s in self._bases.values() for e in s.entries if e.released is not None]
        loaded.sort(key=lambda e: (e.uses, e.used_at, e is not entry))
        for victim in loaded:
            if self._loaded_bytes <= MEMORY_BYTES:
                break
            self._unload(victim)

    def _unload(self, entry: Entry) -> None:
        if entry.released is not None:
            entry.released = None
            self._loaded_bytes -= entry.nbytes


def _entry(text: str) -> Result:
    return Result([OutputColumn("document", "text")], [(text,)], [], 0.0, 0.0, command_tag=TAG)


def _parse(slot: str, text: str, created: float) -> Entry | None:
    """An index slot's signature (None: not one)."""
    try:
        doc = json.loads(text)
        keys = tuple(KeySignature(str(k[0]), str(k[1]), k[2], k[3]) for k in doc["keys"])
        measures = tuple((str(m[0]), m[1]) for m in doc["measures"])
        where = frozenset(str(w) for w in doc["where"])
        return Entry(
            slot, where, keys, measures, int(doc["cells"]), float(doc["variance"]), created, str(doc["document"])
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None
