"""Shared benchmark helpers: timing statistics, the synthetic table and its policy, table printing.

Figures are reported as medians, p99s and ratios because absolute times depend on the machine
(2 shared cores here); ratios against a baseline measured in the same run are what carry over.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from dpsql.backends import Backend
from dpsql.policy import Policy, parse_policy

ANALYST = "bench"

# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Stats:
    """Summary of repeated timings, in microseconds."""

    n: int
    p50_us: float
    p99_us: float
    min_us: float
    mean_us: float

    @classmethod
    def of(cls, samples_ns: list[int]) -> Stats:
        us = sorted(s / 1000 for s in samples_ns)
        return cls(len(us), statistics.median(us), percentile(us, 0.99), us[0], statistics.fmean(us))

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "p50_us": self.p50_us, "p99_us": self.p99_us, "min_us": self.min_us}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples p99 is the maximum, honestly)."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def time_calls(
    fn: Callable[[], Any], *, reps: int, warmup: int = 3, budget_s: float | None = None, min_reps: int = 5
) -> Stats:
    """Time ``reps`` calls of ``fn`` (after ``warmup``), stopping early once ``budget_s`` is spent."""
    for _ in range(warmup):
        fn()
    samples: list[int] = []
    started = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection lands in an arbitrary iteration and inflates p99 for reasons outside the code
    try:
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t0)
            if budget_s is not None and len(samples) >= min_reps and time.perf_counter() - started > budget_s:
                break
            if len(samples) % 256 == 0:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Stats.of(samples)


def time_interleaved(
    fns: list[Callable[[], Any]], *, reps: int, warmup: int = 2, budget_s: float | None = None
) -> list[Stats]:
    """Time several callables round-robin, rotating the order, so drift in machine load hits all equally."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[int]] = [[] for _ in fns]
    started = time.perf_counter()
    for i in range(reps):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            t0 = time.perf_counter_ns()
            fns[k]()
            samples[k].append(time.perf_counter_ns() - t0)
        if budget_s is not None and i >= 4 and time.perf_counter() - started > budget_s:
            break
    return [Stats.of(s) for s in samples]


# --------------------------------------------------------------------------------------------------
# The synthetic table
# --------------------------------------------------------------------------------------------------

#: Category values; declared as the column's public domain.
CATEGORIES = ("a", "b", "c", "d", "e", "f", "g", "h")

# Deterministic hash-like columns from the row number i, written once and used on both backends so
# DuckDB and PostgreSQL hold identical data (no PRNG state, no seed to forget: the "seed" is the
# constants). Multipliers are odd 31/32-bit constants; products stay below 2^63 for i < 10^9.
_COLUMNS: dict[str, tuple[str, str]] = {
    "age": ("BIGINT", "((i * 2654435761 + 97) % 1000003) % 101"),
    "income": ("DOUBLE PRECISION", "CAST((i * 2246822519 + 13) % 2000001 AS DOUBLE PRECISION) / 10.0"),
    # Twice the declared upper bound: half the rows need clamping (no statistics can prove them in bounds).
    "spend": ("DOUBLE PRECISION", "CAST((i * 1103515245 + 12345) % 100001 AS DOUBLE PRECISION) / 100.0"),
    "score": ("BIGINT", "((i * 3266489917 + 7) % 1000033) % 11"),
    "category": ("TEXT", "chr(CAST(97 + ((i * 668265263 + 5) % 1000037) % 8 AS INTEGER))"),
    "region": ("BIGINT", "((i * 374761393 + 3) % 1000039) % 50"),
    "g1k": ("BIGINT", "((i * 2246822519 + 101) % 1000081) % 1000"),
    "g100k": ("BIGINT", "((i * 3266489917 + 103) % 10000019) % 100000"),
}


def create_table_sql(table: str, n: int, dialect: str) -> str:
    """``CREATE TABLE … AS SELECT`` generating ``n`` rows server-side (fast even for 10^7 rows)."""
    if dialect == "duckdb":
        source = f"range({int(n)}) AS r(i)"
    elif dialect == "postgres":
        source = f"generate_series(0, {int(n) - 1}::bigint) AS r(i)"
    else:
        raise ValueError(dialect)
    cols = ", ".join(f"CAST({expr} AS {sqltype}) AS {name}" for name, (sqltype, expr) in _COLUMNS.items())
    derived = ", ".join(
        [
            f"CAST({_COLUMNS['g1k'][1]} AS BIGINT) AS g1k_pub",
            f"CAST({_COLUMNS['g100k'][1]} AS BIGINT) AS g100k_pub",
        ]
    )
    create = f"CREATE TABLE {table} AS SELECT i AS id, {cols}, {derived} FROM {source}"
    return f"DROP TABLE IF EXISTS {table}; {create}"


def make_table(backend: Backend, table: str, n: int) -> float:
    """Create the synthetic table; returns seconds taken (for the log only)."""
    t0 = time.perf_counter()
    backend.execute_script(create_table_sql(table, n, backend.dialect))
    if backend.dialect == "postgres":
        backend.execute_script(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - t0


POLICY_YAML = """
dataset: bench
defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}
budget:
  dataset: {epsilon: 1.0e15, delta: 0.5}
  analyst: {epsilon: 1.0e15, delta: 0.5}
auth: {trust: true}
analysts: [{name: bench}]
tables:
  t:
    columns:
      id: {type: int, identifier: true}
      age: {type: int, lower: 0, upper: 100, nullable: false}
      income: {type: float, lower: 0.0, upper: 200000.0, nullable: false}
      spend: {type: float, lower: 0.0, upper: 500.0, nullable: false}
      score: {type: int, lower: 0, upper: 10, nullable: false}
      category: {type: text, domain: [a, b, c, d, e, f, g, h], nullable: false}
      region: {type: int, lower: 0, upper: 49, nullable: false}
      g1k: {type: int, lower: 0, upper: 999, nullable: false}
      g100k: {type: int, lower: 0, upper: 99999, nullable: false}
      g1k_pub: {type: int, nullable: false}
      g100k_pub: {type: int, nullable: false}
"""


def bench_policy(*, public_group_domains: bool = False) -> Policy:
    """The policy matching :func:`create_table_sql`, with a huge budget so no benchmark runs out.

    With ``public_group_domains`` the ``g1k_pub``/``g100k_pub`` columns get public domains of 10^3 and
    10^5 integers; that variant is validated from a dict because PyYAML needs seconds for 10^5 items.
    """
    if not public_group_domains:
        return parse_policy(POLICY_YAML, "<bench policy>")
    raw = yaml.safe_load(POLICY_YAML)
    cols = raw["tables"]["t"]["columns"]
    cols["g1k_pub"]["domain"] = list(range(1000))
    cols["g100k_pub"]["domain"] = list(range(100_000))
    return Policy.model_validate(raw)


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


@dataclass
class Section:
    """One benchmark's results: printable rows plus a JSON-able record."""

    name: str
    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Further tables printed after the main one (e.g. a bar summary): {title, headers, rows}.
    extra_tables: list[dict[str, Any]] = field(default_factory=list)

    def print(self) -> None:
        print(f"\n== {self.name}: {self.title} ==")
        print_table(self.headers, self.rows)
        for extra in self.extra_tables:
            print(f"\n  -- {extra['title']} --")
            print_table(extra["headers"], extra["rows"])
        for note in self.notes:
            print(f"  * {note}")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e6 or abs(value) < 1e-3:
            return f"{value:.3g}"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def print_table(headers: list[str], rows: Iterable[list[Any]]) -> None:
    rows = list(rows)
    cells = [[fmt(v) for v in row] for row in rows]
    left = [all(isinstance(r[i], str) or r[i] is None for r in rows) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for r in cells:
        print(
            "  "
            + "  ".join(c.ljust(w) if left[i] else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )


def ms(us: float) -> float:
    return us / 1000.0
