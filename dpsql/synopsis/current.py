"""Which stored releases serve queries: the newest of each declared synopsis, or, for a continual one,
all its periods stitched into one cube (issue #38 item 3).

A continual synopsis is released period by period: the first build covers its time key's whole domain,
each refresh only the buckets after the last one released (``dpsql synopsis refresh``, charged once each).
Every piece is its own least-squares problem over its own buckets, with independent noise, so the
estimate of the whole series is the pieces' estimates side by side and the variance of any sum the sum of
the pieces' variances (:class:`StitchedEstimate`). The stitched cube answers exactly what one release
over all the buckets would (keys, filters and coarser grains across periods: a year from months released
in two pieces). It serves only while it covers the time domain the policy now declares: after the
curator extends the bound, the new buckets are charged fresh until a refresh releases them.

Privacy: stitching reads released values and public variances and domains only; which pieces exist
depends on what the curator released, never on the data.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from dpsql.analyze import analyze_tree
from dpsql.analyze.parse import parse_statement
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy
from dpsql.synopsis.grains import normal
from dpsql.synopsis.solve import Totals
from dpsql.synopsis.store import Released, declaration_hash, prefix, unseal

#: How long the engine trusts its list of stored synopses before reading the ledger's again (seconds):
#: a build in another process is served within this long.
RELOAD_SECONDS = 1.0


@dataclass(frozen=True)
class StitchedEstimate:
    """Pieces' estimates side by side along one axis (``pieces``: each piece's first index and number of
    buckets on it, and its estimate)."""

    shape: tuple[int, ...]
    axis: int
    pieces: tuple[tuple[int, int, Totals], ...]

    def totals(self, groups: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`Estimate.totals`: each piece sums its own cells; independent noise, variances add."""
        grid = groups.reshape(self.shape)
        values, variances = np.zeros(count), np.zeros(count)
        for offset, size, piece in self.pieces:
            part = np.take(grid, np.arange(offset, offset + size), axis=self.axis)
            found, spread = piece.totals(np.ascontiguousarray(part).reshape(-1), count)
            values += found
            variances += spread
        return values, variances


@dataclass(frozen=True)
class Stitched(Released):
    """A continual synopsis's pieces as one release over all their buckets."""

    parts: tuple[Released, ...] = ()
    axis: int = 0

    @property
    def mechanisms(self) -> frozenset[str]:
        return frozenset(m for p in self.parts for m in p.mechanisms)

    @cached_property
    def estimates(self) -> tuple[Totals, ...]:
        sizes = [len(p.keys[self.axis].domain) for p in self.parts]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(
            StitchedEstimate(
                self.shape,
                self.axis,
                tuple((o, n, p.estimates[m]) for o, n, p in zip(offsets, sizes, self.parts, strict=True)),
            )
            for m in range(len(self.measures))
        )


def stitch(parts: Sequence[Released]) -> Released | None:
    """The pieces of a continual synopsis as one release, oldest buckets first; None when they are not
    pieces of one series (more or less than one time key, other keys or marginals differ, or overlap)."""
    if len(parts) == 1:
        return parts[0]
    axes = [a for a, k in enumerate(parts[0].keys) if k.kind == "trunc"]
    if len(axes) != 1 or any(not p.keys[axes[0]].domain for p in parts):
        return None
    axis = axes[0]
    ordered = sorted(parts, key=lambda p: normal(p.keys[axis].domain[0]))
    first = ordered[0]
    for part in ordered[1:]:
        same = all(k == f for i, (k, f) in enumerate(zip(part.keys, first.keys, strict=True)) if i != axis)
        if not same or part.axes != first.axes or part.measures != first.measures:
            return None
    domain = tuple(v for p in ordered for v in p.keys[axis].domain)
    times = [normal(v) for v in domain]
    if any(a >= b for a, b in itertools.pairwise(times)):
        return None  # overlapping pieces: not one series
    keys = list(first.keys)
    keys[axis] = dataclasses.replace(keys[axis], domain=domain)
    newest = max(ordered, key=lambda p: p.built_at)
    return Stitched(
        name=newest.name,
        dataset=newest.dataset,
        table=newest.table,
        declaration=newest.declaration,
        identity=newest.identity,
        built_at=newest.built_at,
        epsilon=sum(p.epsilon for p in ordered),
        delta=sum(p.delta for p in ordered),
        keys=tuple(keys),
        measures=newest.measures,
        marginals=newest.marginals,
        mechanism=newest.mechanism,
        generation=newest.generation,
        charge=newest.charge,
        parts=tuple(ordered),
        axis=axis,
    )


def time_domain(policy: Policy, name: str) -> tuple[Any, ...] | None:
    """The time key's domain the policy declares now (its column's bounds): what a continual synopsis
    must cover to serve; None when it has no single time key."""
    synopsis = policy.synopses[name]
    keys = ", ".join(synopsis.axes)
    try:
        plan = analyze_tree(parse_statement(f"SELECT {keys}, COUNT(*) FROM {synopsis.table} GROUP BY {keys}"), policy)
    except Error:
        return None
    found = [k.domain for k in plan.keys if k.expr is not None and k.domain is not None and "(" in k.column]
    return tuple(found[0]) if len(found) == 1 else None


class Synopses:
    """The engine's view of the stored synopses of its policy (see the module docstring), re-read from
    the ledger at most every :data:`RELOAD_SECONDS`."""

    def __init__(self, policy: Policy, ledger: Ledger) -> None:
        self.policy = policy
        self.ledger = ledger
        self._declarations = {name: declaration_hash(policy, name) for name in policy.synopses}
        self._loaded: dict[str, Released] = {}
        self._keys: list[str] = []
        self._read_at = -RELOAD_SECONDS
        self._lock = threading.Lock()
        self._stitched: dict[tuple[str, ...], Released | None] = {}
        self._domains: dict[str, tuple[Any, ...] | None] = {}

    def current(self, identity: str) -> list[Released]:
        """What serves queries on the database ``identity``: per declared synopsis its newest valid
        release, or a continual one's valid pieces stitched (when they cover the declared time domain)."""
        if not self._declarations:
            return []
        with self._lock:
            if time.monotonic() - self._read_at >= RELOAD_SECONDS:
                self._keys = self.ledger.synopsis_keys(prefix(self.policy.dataset))
                self._read_at = time.monotonic()
            keys = self._keys
        found: dict[str, list[tuple[str, Released]]] = {}
        for key in reversed(keys):  # newest first within each name
            released = self._load(key)
            if released is None or released.declaration != self._declarations.get(released.name):
                continue
            if released.identity != identity:
                continue
            pieces = found.setdefault(released.name, [])
            if not pieces or self.policy.synopses[released.name].continual:
                pieces.append((key, released))
        served = []
        for name, pieces in found.items():
            if not self.policy.synopses[name].continual:
                served.append(pieces[0][1])
            elif (whole := self._whole(name, pieces)) is not None:
                served.append(whole)
        return served

    def _whole(self, name: str, pieces: list[tuple[str, Released]]) -> Released | None:
        signature = tuple(key for key, _ in pieces)
        if signature not in self._stitched:
            whole = stitch([r for _, r in pieces])
            if whole is not None and not self._covers(name, whole):
                whole = None
            self._stitched[signature] = whole
        return self._stitched[signature]

    def _covers(self, name: str, whole: Released) -> bool:
        if name not in self._domains:
            self._domains[name] = time_domain(self.policy, name)
        declared = self._domains[name]
        axis = next((a for a, k in enumerate(whole.keys) if k.kind == "trunc"), None)
        if declared is None or axis is None:
            return False
        have = {normal(v) for v in whole.keys[axis].domain}
        return all(normal(v) in have for v in declared)

    def _load(self, key: str) -> Released | None:
        released = self._loaded.get(key)
        if released is None and key not in self._loaded:
            text = self.ledger.synopsis_document(key)
            released = None if text is None else unseal(text, self.ledger.signing_key())
            if released is not None:
                self._loaded[key] = released
        return released
