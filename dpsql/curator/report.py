"""``dpsql policy report``: how much contribution bounding biases answers, measured on the data.

An answer's ± interval covers the noise only. Rows beyond a unit's ``max_rows_per_unit`` are left
out and values outside ``[lower, upper]`` are clamped, which shifts answers by amounts the analyst
never sees (``Sick 27273 ±180`` against a true 31,669). This report gives the curator those
amounts per table and column, and the bias–noise trade-off of other caps and bounds at the
policy's default ε (PipelineDP's utility analysis and parameter tuning, with the exact bias):

* per table: units, rows, the share of units and of rows beyond ``max_rows_per_unit``; with
  ``max_groups_per_unit``, per groupable column the share of units holding more groups and the
  expected share of rows in the groups beyond (the engine keeps a unit's groups in a salted order);
* per bounded column: the share of non-NULL values below ``lower`` and above ``upper``;
* for candidate caps, ``COUNT(*)``'s bias, noise standard deviation and RMSE = √(bias² + var), and
  for candidate bounds (quantiles of the data, and the best of a geometric ladder between p99
  and max: with a few huge values the best bound lies there; each rounded away from the data to two
  significant digits, so no candidate is one person's exact value) the same for ``SUM(column)``; the
  smallest RMSE among the rows shown is marked as the suggestion. The models are the engine's
  ungrouped measurements exactly: a unit's count capped at the cap, its sum of clamped values at
  cap × bounds (``rewrite.bounding``).

**Exact figures, curator only.** Everything except ``--dp-bounds`` is computed exactly from the
data (counts, quantiles, maxima: someone's exact values). That is acceptable because this is the
curator's own command reading the database they own, printing to their terminal; nothing here is
reachable from ``dpsql serve``, the engine or any analyst, and nothing is written anywhere. Bounds
chosen from these figures are themselves a function of the data: publish them (in the policy) only
if they are public knowledge, or use ``--dp-bounds`` (:mod:`dpsql.curator.dp_bounds`: noisy bounds,
charged to the ledger). The command itself is :func:`dpsql.curator.cli.cmd_policy_report`.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dpsql.accountant import fmt
from dpsql.backends import quote_ident
from dpsql.noise.mechanisms import MECHANISMS, gaussian_spec, laplace_spec
from dpsql.policy import ColumnPolicy, Policy, TablePolicy

from . import introspect

#: A share of rows beyond the caps, or of values outside the bounds, above this is worth a warning.
WARN_SHARE = 0.05
#: Caps tried for ``max_rows_per_unit`` (those up to the largest unit's rows, with its p99 and max).
CAP_LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000)
#: Quantiles whose values are tried as bounds (upper: q, lower: 1 − q, each widened to include 0).
BOUND_QUANTILES = (0.90, 0.95, 0.99, 1.0)
#: At most this many bounds tried between p99 and max (only the best of them is shown) …
LADDER_STEPS = 24
#: … labelled so.
LADDER_LABEL = "between p99 and max"


# --- what the report holds ------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    """One candidate cap or bounds, with the error it gives a ``COUNT(*)`` or ``SUM(column)``."""

    label: str
    cap: int | None
    lower: float | None
    upper: float | None
    bias: float
    noise_std: float
    rmse: float
    declared: bool = False
    suggested: bool = False


@dataclass(slots=True)
class GroupCap:
    """``max_groups_per_unit`` against one groupable column."""

    column: str
    units_beyond: int
    units_share: float
    #: Expected rows left out when grouping by the column: n·(k − G)/k for a unit with k > G groups.
    rows_beyond: float
    rows_share: float


@dataclass(slots=True)
class ColumnReport:
    name: str
    type: str
    lower: Any
    upper: Any
    values: int
    below: int
    above: int
    below_share: float
    above_share: float
    #: Exact quantiles of the non-NULL values ("p01", …, "min", "max"): numeric columns only.
    quantiles: dict[str, float] = field(default_factory=dict)
    #: SUM(column) at candidate bounds (numeric columns).
    tradeoff: list[Choice] = field(default_factory=list)
    #: DP-suggested bounds, when asked (``--dp-bounds``).
    dp_lower: float | None = None
    dp_upper: float | None = None


@dataclass(slots=True)
class TableReport:
    name: str
    source: str
    unit: str | None
    max_rows: int
    max_groups: int | None
    rows: int = 0
    units: int = 0
    units_beyond: int = 0
    rows_beyond: int = 0
    rows_per_unit: dict[str, int] = field(default_factory=dict)
    groups: list[GroupCap] = field(default_factory=list)
    columns: list[ColumnReport] = field(default_factory=list)
    #: COUNT(*) at candidate caps (tables with a privacy unit).
    caps: list[Choice] = field(default_factory=list)
    skipped: str | None = None

    @property
    def units_share(self) -> float:
        return self.units_beyond / self.units if self.units else 0.0

    @property
    def rows_share(self) -> float:
        return self.rows_beyond / self.rows if self.rows else 0.0


@dataclass(slots=True)
class PolicyReport:
    dataset: str
    epsilon: float
    delta: float
    mechanism: str
    tables: list[TableReport]
    dp_epsilon: float | None = None
    #: How many columns the DP ε was split over.
    dp_columns: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for table, raw in zip(self.tables, out["tables"], strict=True):
            raw["units_share"], raw["rows_share"] = table.units_share, table.rows_share
        finite: dict[str, Any] = _finite(out)
        return finite


def _finite(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, dates ISO strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# --- SQL pieces -----------------------------------------------------------------------------------


def _number(value: float) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return repr(float(value))


def _literal(value: Any, type_name: str) -> str:
    """A bound as an SQL literal of the column's type (numbers as numbers)."""
    if type_name in ("int", "float"):
        return _number(value)
    text = value.isoformat(sep=" ") if isinstance(value, dt.datetime) else value.isoformat()
    cast = "DATE" if type_name == "date" else "TIMESTAMP"
    return f"CAST('{text}' AS {cast})"


def _clamp(x: str, low: str, high: str) -> str:
    """NULL stays NULL (GREATEST/LEAST would skip it on PostgreSQL); NaN clamps to ``high`` like the engine."""
    return f"CASE WHEN {x} < {low} THEN {low} WHEN {x} > {high} THEN {high} ELSE {x} END"


@dataclass(frozen=True, slots=True)
class Relation:
    """How to read one table with its unit: ``SELECT … FROM {from_sql}`` with ``{unit}`` the unit."""

    from_sql: str
    unit: str | None
    description: str | None

    def col(self, name: str) -> str:
        return f"t.{quote_ident(name)}"


def relation(policy: Policy, name: str, table: TablePolicy, stored: dict[str, str]) -> Relation:
    """The table aliased ``t`` and its unit expression, the way the engine finds the unit
    (:mod:`dpsql.units`): its own column, or the end of its foreign-key chain through inner joins
    (households, a customer two hops away). No unit: each row is one person."""
    source = quote_ident(table.source or name)
    base = f"{source} AS t"
    path = policy.unit_path(name)
    if path is None:
        return Relation(base, None, None)
    if not path.hops:
        return Relation(base, f"t.{quote_ident(stored_column(stored, path.column))}", path.describe)
    joined, previous = base, "t"
    for i, hop in enumerate(path.hops):
        target = policy.tables[hop.target]
        column = stored_column(stored, hop.column) if previous == "t" else hop.column
        joined += (
            f" JOIN {quote_ident(target.source or hop.target)} AS u{i} "
            f"ON {previous}.{quote_ident(column)} = u{i}.{quote_ident(hop.to)}"
        )
        previous = f"u{i}"
    return Relation(joined, f"{previous}.{quote_ident(path.column)}", path.describe)


def stored_column(stored: dict[str, str], column: str) -> str:
    if column in stored:
        return column
    lowered = {k.lower(): k for k in stored}
    return lowered.get(column.lower(), column)


def _one(backend: Any, sql: str) -> tuple[Any, ...]:
    _, rows = backend.execute(sql)
    return tuple(rows[0])


# --- noise ---------------------------------------------------------------------------------------


def noise_std(policy: Policy, sensitivity: float, *, integer: bool) -> float:
    """Standard deviation of the noise one measurement of ``sensitivity`` gets at the policy's default
    ε, δ and mechanism (the whole ε on it: ``SELECT COUNT(*)`` or ``SELECT SUM(x)`` alone), with the
    engine's own calibration (grid included). Policy only: no data."""
    if sensitivity <= 0:
        return 0.0
    d = policy.defaults
    if MECHANISMS[d.mechanism].uses_delta:  # the Gaussian
        spec = gaussian_spec(sensitivity, d.epsilon, d.delta, integer=integer)
        return spec.grid * spec.scale
    spec = laplace_spec(sensitivity, d.epsilon, integer=integer)
    alpha = math.exp(-1.0 / spec.scale)  # discrete Laplace: variance 2α/(1 − α)²
    return spec.grid * math.sqrt(2.0 * alpha) / (1.0 - alpha)


def _choose(choices: list[Choice]) -> list[Choice]:
    if choices:
        best = min(choices, key=lambda c: (c.rmse, c.cap or 0, c.upper or 0))
        best.suggested = True
    return choices


# --- the report ----------------------------------------------------------------------------------


def build_report(
    policy: Policy,
    backend: Any,
    tables: Sequence[str] | None = None,
    dp: dict[tuple[str, str], tuple[float, float] | None] | None = None,
) -> PolicyReport:
    """The report for ``tables`` (default: every non-public table); ``dp``: DP bounds already drawn."""
    if not introspect.checkable(backend):
        raise ValueError(f"the {backend.dialect} backend has no schema to read: report on DuckDB or PostgreSQL")
    out = []
    for name in tables or list(policy.tables):
        out.append(table_report(policy, backend, name, dp or {}))
    d = policy.defaults
    return PolicyReport(
        policy.dataset, d.epsilon, d.delta if MECHANISMS[d.mechanism].uses_delta else 0.0, d.mechanism, out
    )


def table_report(
    policy: Policy,
    backend: Any,
    name: str,
    dp: dict[tuple[str, str], tuple[float, float] | None] | None = None,
    *,
    tradeoffs: bool = True,
) -> TableReport:
    """One table's shares (and, with ``tradeoffs``, its candidate caps and bounds)."""
    table = policy.tables[name]
    source = table.source or name
    report = TableReport(name, source, None, table.max_rows_per_unit, table.max_groups_per_unit)
    if table.public:
        report.skipped = "public: read without noise, nothing is bounded"
        return report
    if source.startswith(("parquet:", "orc:")):
        report.skipped = "read by Spark only"
        return report
    stored = introspect.columns(backend, source)
    if stored is None:
        report.skipped = f'table "{source}" does not exist'
        return report
    rel = relation(policy, name, table, stored)
    report.unit = rel.description
    m = table.max_rows_per_unit if rel.unit is not None else 1
    if rel.unit is None:
        report.rows = int(_one(backend, f"SELECT COUNT(*) FROM {rel.from_sql}")[0])
        report.units = report.rows
    else:
        histogram = _units(backend, rel, report)
        report.caps = _caps(policy, report, histogram) if tradeoffs else []
        if table.max_groups_per_unit is not None:
            report.groups = [
                _group_cap(backend, rel, stored_column(stored, col), col, table.max_groups_per_unit, report)
                for col, c in table.columns.items()
                if _groupable(c) and _present(stored, col)
            ]
    for col, c in table.columns.items():
        if c.identifier or not c.bounded or not _present(stored, col):
            continue
        report.columns.append(
            _column(policy, backend, rel, name, col, stored_column(stored, col), c, m, dp or {}, tradeoffs=tradeoffs)
        )
    return report


def _present(stored: dict[str, str], column: str) -> bool:
    return column in stored or column.lower() in {k.lower() for k in stored}


def _groupable(column: ColumnPolicy) -> bool:
    """Columns an analyst is likely to GROUP BY: text, boolean or a declared domain."""
    return not column.identifier and (column.type in ("text", "boolean") or column.domain is not None)


def _units(backend: Any, rel: Relation, report: TableReport) -> list[tuple[int, int]]:
    """Rows per unit as a histogram (rows per unit → units): every figure below is exact from it."""
    _, rows = backend.execute(
        f"SELECT n, COUNT(*) FROM (SELECT {rel.unit} AS unit, COUNT(*) AS n FROM {rel.from_sql} "
        f"GROUP BY {rel.unit}) AS per_unit GROUP BY n ORDER BY n"
    )
    histogram = [(int(n), int(c)) for n, c in rows]
    m = report.max_rows
    report.units = sum(c for _, c in histogram)
    report.rows = sum(n * c for n, c in histogram)
    report.units_beyond = sum(c for n, c in histogram if n > m)
    report.rows_beyond = sum((n - m) * c for n, c in histogram if n > m)
    report.rows_per_unit = {
        label: _histogram_quantile(histogram, q) for label, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1))
    }
    return histogram


def _histogram_quantile(histogram: list[tuple[int, int]], q: float) -> int:
    """``percentile_disc(q)``: the smallest value whose cumulative count reaches q of all."""
    total = sum(c for _, c in histogram)
    if not total:
        return 0
    target = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for n, c in histogram:
        seen += c
        if seen >= target:
            return n
    return histogram[-1][0]


def _caps(policy: Policy, report: TableReport, histogram: list[tuple[int, int]]) -> list[Choice]:
    """``SELECT COUNT(*)`` at each candidate cap: bias Σ min(n_u, cap) − rows (exact), noise of
    sensitivity cap (each unit's count is capped at it)."""
    if not histogram or histogram[-1][0] <= 1:
        return []  # one row per unit: no cap to trade
    # rounded up to two significant digits: a suggested cap is never one person's exact row count
    p99, top = (int(_outward(float(report.rows_per_unit.get(q, 1)), up=True)) for q in ("p99", "max"))
    candidates = sorted({c for c in CAP_LADDER if c <= top} | {p99, top, report.max_rows})
    choices = []
    for cap in candidates:
        kept = sum(min(n, cap) * c for n, c in histogram)
        bias = float(kept - report.rows)
        std = noise_std(policy, cap, integer=True)
        label = "declared" if cap == report.max_rows else {p99: "p99", top: "max"}.get(cap, "")
        choices.append(
            Choice(label, cap, None, None, bias, std, math.hypot(bias, std), declared=cap == report.max_rows)
        )
    return _choose(choices)


def _group_cap(backend: Any, rel: Relation, stored_col: str, col: str, limit: int, report: TableReport) -> GroupCap:
    """Units holding more than ``limit`` groups of ``col`` (NULL is a group), and the rows expected
    in their groups beyond the limit (each unit keeps ``limit`` of its k groups, in a salted order)."""
    c = rel.col(stored_col)
    k = f"COUNT(DISTINCT {c}) + MAX(CASE WHEN {c} IS NULL THEN 1 ELSE 0 END)"
    units, rows = _one(
        backend,
        f"SELECT COALESCE(SUM(CASE WHEN k > {limit} THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN k > {limit} THEN CAST(n AS DOUBLE PRECISION) * (k - {limit}) / k ELSE 0 END), 0) "
        f"FROM (SELECT {rel.unit} AS unit, {k} AS k, COUNT(*) AS n FROM {rel.from_sql} GROUP BY {rel.unit}) AS g",
    )
    units, rows = int(units), float(rows)
    return GroupCap(
        col,
        units,
        units / report.units if report.units else 0.0,
        rows,
        rows / report.rows if report.rows else 0.0,
    )


def _column(
    policy: Policy,
    backend: Any,
    rel: Relation,
    table: str,
    col: str,
    stored_col: str,
    c: ColumnPolicy,
    m: int,
    dp: dict[tuple[str, str], tuple[float, float] | None],
    *,
    tradeoffs: bool = True,
) -> ColumnReport:
    x = rel.col(stored_col)
    low, high = _literal(c.lower, c.type), _literal(c.upper, c.type)
    numeric = c.type in ("int", "float")
    probes = [
        f"COUNT({x})",
        f"COALESCE(SUM(CASE WHEN {x} < {low} THEN 1 ELSE 0 END), 0)",
        f"COALESCE(SUM(CASE WHEN {x} > {high} THEN 1 ELSE 0 END), 0)",
    ]
    labels = ("p01", "p05", "p10", "p90", "p95", "p99")
    if numeric and tradeoffs:
        xd = f"CAST({x} AS DOUBLE PRECISION)"
        probes += [f"MIN({xd})", f"MAX({xd})"]
        probes += [f"percentile_disc({q}) WITHIN GROUP (ORDER BY {xd})" for q in (0.01, 0.05, 0.10, 0.90, 0.95, 0.99)]
    row = _one(backend, f"SELECT {', '.join(probes)} FROM {rel.from_sql}")
    values, below, above = int(row[0]), int(row[1]), int(row[2])
    report = ColumnReport(
        col,
        c.type,
        c.lower,
        c.upper,
        values,
        below,
        above,
        below / values if values else 0.0,
        above / values if values else 0.0,
    )
    if not numeric or not values or not tradeoffs:
        return report
    report.quantiles = {"min": float(row[3]), "max": float(row[4])}
    report.quantiles.update({label: float(v) for label, v in zip(labels, row[5:], strict=True)})
    found = dp.get((table, col))
    if found is not None:
        report.dp_lower, report.dp_upper = found
    report.tradeoff = _bounds(policy, backend, rel, x, c, m, report)
    return report


def _ladder(q: dict[str, float]) -> list[tuple[float, float]]:
    """Bounds between the p01/p99 pair and min/max in geometric steps (factor 2, or finer to stay
    within :data:`LADDER_STEPS`): with a few huge values the RMSE-best bound lies between, where
    clamping them costs less bias than covering them costs noise (a SUM's noise grows with the bound,
    its bias with the outliers' mass beyond it)."""
    lo0, hi0, lo1, hi1 = min(0.0, q["p01"]), max(0.0, q["p99"]), min(0.0, q["min"]), max(0.0, q["max"])
    if not all(math.isfinite(v) for v in (lo0, hi0, lo1, hi1)):
        return []
    spans = [b / a for a, b in ((-lo0, -lo1), (hi0, hi1)) if a > 0 and b > 2 * a]
    if not spans:
        return []
    ratio = max(2.0, max(spans) ** (1 / LADDER_STEPS))
    out = []
    for i in range(1, LADDER_STEPS + 1):
        lo, hi = max(lo1, lo0 * ratio**i), min(hi1, hi0 * ratio**i)
        if (lo, hi) == (lo1, hi1):
            break
        out.append((lo, hi))
    return out


def _candidate_bounds(c: ColumnPolicy, report: ColumnReport) -> list[tuple[str, float, float]]:
    """(label, lower, upper): the declared bounds, the data's quantile pairs widened to include 0
    (a SUM's sensitivity is max(|lower|, |upper|): a bound at 0 costs nothing), the DP bounds (also
    widened to 0), and, labelled ``LADDER_LABEL``, the :func:`_ladder` between p99 and max."""
    q = report.quantiles
    out: list[tuple[str, float, float]] = [("declared", float(c.lower), float(c.upper))]  # type: ignore[arg-type]
    pairs = {0.90: ("p10", "p90"), 0.95: ("p05", "p95"), 0.99: ("p01", "p99"), 1.0: ("min", "max")}
    for level in BOUND_QUANTILES:
        lo_key, hi_key = pairs[level]
        lo, hi = _outward(min(0.0, q[lo_key]), up=False), _outward(max(0.0, q[hi_key]), up=True)
        if math.isfinite(lo) and math.isfinite(hi) and (lo, hi) != (0.0, 0.0):
            out.append((hi_key if hi_key != "max" else "min/max", lo, hi))
    if report.dp_lower is not None and report.dp_upper is not None:
        out.append(("dp", min(0.0, report.dp_lower), max(0.0, report.dp_upper)))
    out += [(LADDER_LABEL, _outward(lo, up=False), _outward(hi, up=True)) for lo, hi in _ladder(q)]
    seen: set[tuple[float, float]] = set()
    unique = []
    for label, lo, hi in out:
        if (lo, hi) not in seen:
            seen.add((lo, hi))
            unique.append((label, lo, hi))
    return unique


def _outward(value: float, *, up: bool) -> float:
    """A bound read from the data, rounded away from the data to two significant digits (−599,716 →
    −600,000): a suggestion is never one person's exact value (#40 item 4)."""
    if value == 0 or not math.isfinite(value):
        return value
    exact = decimal.Decimal(repr(value))
    step = decimal.Decimal(1).scaleb(exact.adjusted() - 1)
    return float(exact.quantize(step, rounding=decimal.ROUND_CEILING if up else decimal.ROUND_FLOOR))


def _bounds(
    policy: Policy, backend: Any, rel: Relation, x: str, c: ColumnPolicy, m: int, report: ColumnReport
) -> list[Choice]:
    """``SELECT SUM(column)`` at each candidate bounds, as the engine computes it without GROUP BY:
    each unit's sum of clamped values, capped at ``m`` × the bounds widened to 0. Bias against the
    plain sum (exact), noise of sensitivity ``m`` · max(|lower|, |upper|)."""
    candidates = _candidate_bounds(c, report)
    xd = f"CAST({x} AS DOUBLE PRECISION)"
    # each row is its own unit without a privacy unit: its value is its unit's sum
    total = "SUM({})" if rel.unit is not None else "{}"
    inner, outer = [], []
    for i, (_, lo, hi) in enumerate(candidates):
        inner.append(total.format(_clamp(xd, _number(lo), _number(hi))) + f" AS s{i}")
        outer.append(f"SUM({_clamp(f's{i}', _number(m * min(lo, 0.0)), _number(m * max(hi, 0.0)))})")
    inner.append(total.format(xd) + " AS raw")
    outer.append("SUM(raw)")
    grouped = f" GROUP BY {rel.unit}" if rel.unit is not None else ""
    per_unit = f"SELECT {', '.join(inner)} FROM {rel.from_sql}{grouped}"
    row = _one(backend, f"SELECT {', '.join(outer)} FROM ({per_unit}) AS per_unit")
    raw = float(row[-1] or 0.0)
    integer = c.type == "int"
    choices = []
    for (label, lo, hi), total in zip(candidates, row[:-1], strict=True):
        bias = float(total or 0.0) - raw
        std = noise_std(policy, m * max(abs(lo), abs(hi)), integer=integer)
        declared = label == "declared"
        choices.append(Choice(label, None, lo, hi, bias, std, math.hypot(bias, std), declared=declared))
    # of the ladder only its best is shown: the suggestion is the smallest RMSE among the rows printed
    ladder = [ch for ch in choices if ch.label == LADDER_LABEL]
    best = min(ladder, key=lambda ch: ch.rmse, default=None)
    return _choose([ch for ch in choices if ch.label != LADDER_LABEL or ch is best])


# --- text ----------------------------------------------------------------------------------------


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _g(value: Any) -> str:
    """A bound or quantile as the curator would write it in the policy (no digit grouping)."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.6g}"
    if isinstance(value, dt.date):
        return value.isoformat()
    return str(value)


def _err(value: float) -> str:
    """A bias, noise or RMSE figure: whole numbers from 100 on, else 3 significant digits."""
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _tradeoff_lines(head: str, what: str, choices: list[Choice]) -> list[str]:
    lines = [head, f"    {what:>22} {'bias':>12} {'noise sd':>12} {'rmse':>12}"]
    for c in choices:
        key = f"{c.cap:,}" if c.cap is not None else f"[{_g(c.lower)}, {_g(c.upper)}]"
        tag = f" {c.label}" if c.label else ""
        mark = "  <- suggested" if c.suggested else ""
        lines.append(f"    {key:>22} {_err(c.bias):>12} {_err(c.noise_std):>12} {_err(c.rmse):>12}{tag}{mark}")
    return lines


def render(report: PolicyReport) -> str:
    """The report as text for the curator's terminal."""
    mech = report.mechanism + (f", δ={fmt(report.delta)}" if MECHANISMS[report.mechanism].uses_delta else "")
    out = [
        f"dpsql policy report: dataset {report.dataset}. EXACT figures read from the data: for the curator only,",
        "never for analysts (bounds read from them reveal someone's values unless public knowledge).",
        f"Noise: the policy's default ε={fmt(report.epsilon)} ({mech}) on one measurement.",
    ]
    if report.dp_epsilon is not None:
        share = report.dp_epsilon / max(report.dp_columns, 1)
        out.append(
            f"DP bounds: ε={fmt(report.dp_epsilon)} charged to the ledger, ε={fmt(share)} for each of "
            f"{report.dp_columns} column{'s' if report.dp_columns != 1 else ''}."
        )
    for t in report.tables:
        out.append("")
        if t.skipped:
            out.append(f"{t.name}: skipped ({t.skipped})")
            continue
        if t.unit is None:
            out.append(f"{t.name}: {t.rows:,} rows, each row one person (no rows dropped)")
        else:
            rpu = ", ".join(f"{k} {v:,}" for k, v in t.rows_per_unit.items())
            out.append(f"{t.name}: {t.rows:,} rows, {t.units:,} units ({t.unit}); rows per unit: {rpu}")
            out.append(
                f"  max_rows_per_unit {t.max_rows}: {_pct(t.units_share)} of units ({t.units_beyond:,}) and "
                f"{_pct(t.rows_share)} of rows ({t.rows_beyond:,}) are beyond it"
            )
            for g in t.groups:
                out.append(
                    f"  max_groups_per_unit {t.max_groups} (GROUP BY {g.column}): {_pct(g.units_share)} of units "
                    f"({g.units_beyond:,}) hold more groups; ~{_pct(g.rows_share)} of rows expected beyond"
                )
        for c in t.columns:
            out.append(
                f"  {c.name} [{_g(c.lower)}, {_g(c.upper)}]: {_pct(c.below_share)} below ({c.below:,}), "
                f"{_pct(c.above_share)} above ({c.above:,}) of {c.values:,} non-NULL values"
            )
            if c.quantiles:
                q = c.quantiles
                out.append("    " + ", ".join(f"{k} {_g(q[k])}" for k in ("min", "p01", "p50", "p99", "max") if k in q))
            if c.dp_lower is not None:
                out.append(f"    DP suggestion: [{_g(c.dp_lower)}, {_g(c.dp_upper)}]")
            elif report.dp_epsilon is not None and c.quantiles:
                out.append("    DP suggestion: none (too few values for this ε: the noise hides where they lie)")
        if t.caps:
            out += _tradeoff_lines("  COUNT(*) by max_rows_per_unit:", "cap", t.caps)
        for c in t.columns:
            if c.tradeoff:
                head = f"  SUM({c.name}) by bounds (max_rows_per_unit {t.max_rows if t.unit else 1}):"
                out += _tradeoff_lines(head, "bounds", c.tradeoff)
    return "\n".join(out) + "\n"


def summary_findings(report: TableReport) -> tuple[str, list[tuple[tuple[str, ...], str]]]:
    """One summary line for ``dpsql policy check``, and warnings (key path, message) where the shares
    exceed :data:`WARN_SHARE`."""
    warnings: list[tuple[tuple[str, ...], str]] = []
    parts = []
    if report.unit is not None:
        parts.append(f"{_pct(report.rows_share)} of rows beyond max_rows_per_unit {report.max_rows}")
        if report.rows_share > WARN_SHARE:
            warnings.append(
                (
                    ("tables", report.name, "max_rows_per_unit"),
                    f"{_pct(report.rows_share)} of rows ({_pct(report.units_share)} of units) are beyond "
                    f"max_rows_per_unit {report.max_rows}: counts and sums are biased low by that much, beyond their "
                    "± intervals; see `dpsql policy report`",
                )
            )
        for g in report.groups:
            if g.rows_share > WARN_SHARE:
                warnings.append(
                    (
                        ("tables", report.name, "max_groups_per_unit"),
                        f"GROUP BY {g.column} leaves out ~{_pct(g.rows_share)} of rows ({_pct(g.units_share)} of "
                        f"units hold more than {report.max_groups} groups); see `dpsql policy report`",
                    )
                )
    for c in report.columns:
        outside = (c.below + c.above) / c.values if c.values else 0.0
        parts.append(f"{_pct(outside)} of {c.name} outside its bounds")
        if outside > WARN_SHARE:
            warnings.append(
                (
                    ("tables", report.name, "columns", c.name),
                    f"{_pct(outside)} of {c.name} values are outside [{_g(c.lower)}, {_g(c.upper)}] "
                    f"({_pct(c.below_share)} below, {_pct(c.above_share)} above) and are clamped: sums and averages "
                    "are biased; see `dpsql policy report`",
                )
            )
    line = f"{report.name}: " + ("; ".join(parts) if parts else "nothing bounded")
    return line, warnings
