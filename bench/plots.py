"""PNG plots of a benchmark report: ``.venv/bin/python bench/plots.py [bench/results/latest.json]``.

run.py calls :func:`write_plots` after every run; each section present in the report gets one figure in
``bench/results/`` (a section that failed or was not run gets none, and an older PNG of it is left as is:
the figure's subtitle says which run it comes from). matplotlib is the optional ``bench`` extra
(``.venv/bin/pip install -e '.[bench]'``), so its absence is reported, never fatal. The Agg backend
renders without a display.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent

#: Colours by series, consistent across figures.
DPSQL = "#1f77b4"
DPSQL_LIGHT = "#9ecae1"
OTHER = "#ff7f0e"
OTHER_LIGHT = "#fdd0a2"
BAR = "#d62728"


class MissingMatplotlib(RuntimeError):
    """matplotlib (the ``bench`` extra) is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingMatplotlib(str(exc)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label_rows(n: int) -> str:
    return f"10^{round(math.log10(n))}"


def _subtitle(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    return f"{report.get('mode', '?')} run {report.get('started', '?')}, {machine.get('cpus', '?')} CPUs"


def _plain_log(ax: Any, axis: str = "y") -> None:
    """Log scale with ticks at 1, 2, 5 × 10^k labelled as plain numbers (ratios span less than a decade)."""
    from matplotlib import ticker

    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:g}"))
    target.set_minor_formatter(ticker.NullFormatter())


def _save(plt: Any, fig: Any, report: dict[str, Any], title: str, path: Path) -> Path:
    fig.suptitle(f"{title}\n{_subtitle(report)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# One function per section: (plt, section, report, out_dir) -> written path or None
# --------------------------------------------------------------------------------------------------


def plot_overhead(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    """Stacked p50 stages per query, uncached and plan-cached, with the issue's bars as ticks."""
    queries = [q for q, rec in section.items() if isinstance(rec, dict) and "parse" in rec]
    if not queries:
        return None
    stacks = {
        "uncached": ["parse", "analyze+rewrite", "reserve sqlite-mem", "noise+post"],
        "cached": ["prepare (cached)", "reserve sqlite-mem", "noise+post"],
    }
    colours = {
        "parse": "#6baed6",
        "analyze+rewrite": "#2171b5",
        "prepare (cached)": "#74c476",
        "reserve sqlite-mem": "#fd8d3c",
        "noise+post": "#9e9ac8",
    }
    fig, ax = plt.subplots(figsize=(10, 1.2 + 1.1 * len(queries)))
    labels: list[str] = []
    ticks: list[float] = []
    y, seen = 0.0, set()
    for q in queries:
        rec = section[q]
        for mode, stages in stacks.items():
            left = 0.0
            for stage in stages:
                width = rec[stage]["p50_us"] / 1000
                ax.barh(y, width, left=left, color=colours[stage], label=None if stage in seen else stage)
                seen.add(stage)
                left += width
            total = rec[f"overhead {mode} (mem ledger)"]
            if total.get("bar_ms") is not None:
                ax.plot([total["bar_ms"]] * 2, [y - 0.4, y + 0.4], color=BAR, lw=2)
            ax.text(left, y, f" {total['p50_us'] / 1000:.2f} ms", va="center", fontsize=8)
            labels.append(f"{q}\n{mode}")
            ticks.append(y)
            y += 1
        y += 0.5
    ax.plot([], [], color=BAR, lw=2, label="bar (p50)")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("p50 per stage, ms (stacked; the total's p50 is printed)")
    ax.set_xlim(right=ax.get_xlim()[1] * 1.15)  # room for the printed totals
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(plt, fig, report, "dpsql overhead per query by stage (backend time excluded)", out / "overhead.png")


def _ratio_vs_rows(
    plt: Any, section: dict[str, Any], report: dict[str, Any], path: Path, title: str, bar: tuple[float, int] | None
) -> Path | None:
    backends = [b for b in ("duckdb", "postgresql") if isinstance(section.get(b), dict) and section[b].get("results")]
    if not backends:
        return None
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4.2), squeeze=False, sharey=True)
    for ax, backend in zip(axes[0], backends, strict=True):
        by_query: dict[str, list[tuple[int, float]]] = {}
        for r in section[backend]["results"]:
            by_query.setdefault(r["query"], []).append((r["rows"], r["ratio_p50"]))
        for query, points in by_query.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=query)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        if bar is not None and backend == "duckdb":
            ax.plot([bar[1]], [bar[0]], marker="_", color=BAR, ms=30, mew=2, ls="none", label=f"bar ≤ {bar[0]:g}")
        ax.set_xscale("log")
        _plain_log(ax)
        ax.set_xlabel("rows")
        ax.set_title(backend, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("DP / raw wall time (p50)")
    return _save(plt, fig, report, title, path)


def plot_e2e(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    return _ratio_vs_rows(plt, section, report, out / "e2e.png", "end-to-end DP/raw, row-level policy", None)


def plot_person(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    bar = (2.0, 10**7)
    for backend in ("duckdb", "postgresql"):
        for r in (section.get(backend) or {}).get("results", []):
            if r.get("bar_ratio") is not None:
                bar = (r["bar_ratio"], r["rows"])
    title = "end-to-end DP/raw, person-level policy (privacy unit, ≤10 rows/user)"
    return _ratio_vs_rows(plt, section, report, out / "person.png", title, bar)


def plot_noise(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    """Samples (cells) per second of the samplers and of ``release``, with the × urandom factor."""
    items = []
    for key, rec in section.items():
        if not isinstance(rec, dict):
            continue
        rate = rec.get("samples_per_s") or rec.get("cells_per_s")
        if rate:
            items.append((key.replace("_", " "), rate, rec.get("ratio_vs_urandom")))
    if not items:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(range(len(items)), [i[1] for i in items], color=DPSQL)
    for b, (_, _, ratio) in zip(bars, items, strict=True):
        if ratio is not None:
            x = b.get_x() + b.get_width() / 2
            ax.text(x, b.get_height(), f"{ratio:.1f}× urandom", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(items)), [i[0] for i in items], rotation=15, fontsize=8)
    rates = [i[1] for i in items]
    if max(rates) / min(rates) > 20:  # bars on a log axis only when a linear one would hide the small ones
        _plain_log(ax)
        ax.set_ylim(top=max(rates) * 1.6)
    else:
        ax.set_ylim(0, max(rates) * 1.15)
    ax.set_ylabel("samples (cells) per second, p50")
    return _save(plt, fig, report, "noise throughput (exact discrete Laplace, OS CSPRNG)", out / "noise.png")


def plot_groups(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    results = (section.get("duckdb") or {}).get("results") or []
    if not results:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(results))
    raw = [r["raw"]["p50_us"] / 1000 for r in results]
    dp = [r["dp"]["p50_us"] / 1000 for r in results]
    ax.bar([i - 0.2 for i in x], raw, 0.4, color=OTHER, label="raw SQL")
    ax.bar([i + 0.2 for i in x], dp, 0.4, color=DPSQL, label="DP (Engine.execute)")
    for i, r in zip(x, results, strict=True):
        ax.text(i + 0.2, dp[i], f"{r['ratio_p50']:.2f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["query"].replace(", ", "\n") for r in results], fontsize=8)
    ax.set_ylabel("wall time p50, ms")
    ax.legend(fontsize=8)
    rows = _label_rows(results[0]["rows"])
    return _save(plt, fig, report, f"grouped queries, DuckDB {rows} rows (DP/raw above the bars)", out / "groups.png")


def plot_wire(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    results = section.get("results") or []
    varied = sorted((r for r in results if r["query"] != "cached repeat"), key=lambda r: r["clients"])
    if not varied:
        return None
    cached = sorted((r for r in results if r["query"] == "cached repeat"), key=lambda r: r["clients"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    clients = [r["clients"] for r in varied]
    left.plot(clients, [r["dpsql"]["qps"] for r in varied], marker="o", color=DPSQL, label="dpsql serve")
    left.plot(clients, [r["direct"]["qps"] for r in varied], marker="o", color=OTHER, label="direct PostgreSQL")
    if cached:
        xs = [r["clients"] for r in cached]
        left.plot(xs, [r["dpsql"]["qps"] for r in cached], marker="s", ls="--", color=DPSQL, label="dpsql, cached")
        left.plot(xs, [r["direct"]["qps"] for r in cached], marker="s", ls="--", color=OTHER, label="direct, repeat")
    left.set_ylabel("queries / s")
    _plain_log(left)  # cached repeats run ~10× the rest
    for side, colour in (("dpsql", DPSQL), ("direct", OTHER)):
        for pct, style in (("p50_us", "-"), ("p99_us", ":")):
            right.plot(
                clients,
                [r[side][pct] / 1000 for r in varied],
                marker="o",
                ls=style,
                color=colour,
                label=f"{side} {pct[:3]}",
            )
    right.set_ylabel("latency per query, ms")
    _plain_log(right)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, report, "wire: dpsql serve vs direct PostgreSQL (new constant per query)", out / "wire.png")


def plot_peers(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    """Per query: wall time split into database and DP layer; the overhead ratio; the RMSE ratio."""
    queries = [q for q, rec in section.items() if isinstance(rec, dict) and "bars" in rec]
    if not queries:
        return None
    systems = [("dpsql, no caches", DPSQL), ("dpsql, plan cache", DPSQL_LIGHT), ("SmartNoise nominal ε", OTHER)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    width = 0.27
    for j, (system, colour) in enumerate(systems):
        xs = [i + (j - 1) * width for i in range(len(queries))]
        db = [section[q][system]["db"]["p50_us"] / 1000 for q in queries]
        layer = [max(section[q][system]["dp_layer"]["p50_us"], 0) / 1000 for q in queries]
        ax.bar(xs, db, width, color="#bdbdbd", edgecolor=colour, label="database" if j == 0 else None)
        ax.bar(xs, layer, width, bottom=db, color=colour, label=f"{system}: DP layer")
    ax.set_xticks(range(len(queries)), queries, fontsize=8)
    ax.set_ylabel("p50 ms (database time + DP layer)")
    ax.set_title("wall time per query", fontsize=10)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.45)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[1]
    ratios = [section[q]["bars"]["dp_layer_ratio"] for q in queries]
    cached = [section[q]["bars"]["dp_layer_ratio_plan_cache"] for q in queries]
    e2e = [section[q]["bars"]["e2e_ratio"] for q in queries]
    xs = list(range(len(queries)))
    ax.bar([x - width for x in xs], ratios, width, color=DPSQL, label="DP layer, no caches")
    ax.bar(xs, cached, width, color=DPSQL_LIGHT, label="DP layer, plan cache")
    ax.bar([x + width for x in xs], e2e, width, color=OTHER, label="end to end")
    ax.axhline(50, color=BAR, ls="--", lw=1, label="bar: DP layer ≥ 50×")
    ax.axhline(5, color=BAR, ls=":", lw=1, label="bar: end to end ≥ 5×")
    _plain_log(ax)
    ax.set_xticks(xs, queries, fontsize=8)
    ax.set_ylabel("SmartNoise / dpsql (p50)")
    ax.set_title("how many times faster dpsql is", fontsize=10)
    ax.set_ylim(top=max([*ratios, *cached, *e2e, 50.0]) * 8)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax = axes[2]
    acc = [section[q]["bars"]["rmse_ratio_same_epsilon"] for q in queries]
    se = [section[q]["bars"]["rmse_ratio_se_log"] for q in queries]
    lo = [a - a * math.exp(-2 * s) for a, s in zip(acc, se, strict=True)]
    hi = [a * math.exp(2 * s) - a for a, s in zip(acc, se, strict=True)]
    ax.bar(xs, acc, 0.5, color=DPSQL, yerr=[lo, hi], capsize=4)
    ax.axhline(1.0, color=BAR, ls="--", lw=1, label="bar: ≤ 1 (no worse)")
    ax.set_xticks(xs, queries, fontsize=8)
    ax.set_ylabel("RMSE dpsql / SmartNoise, same charged ε (±2σ)")
    ax.set_title("accuracy at equal privacy cost", fontsize=10)
    ax.legend(fontsize=7)
    return _save(plt, fig, report, "dpsql vs SmartNoise SQL, PostgreSQL 10^5 rows", out / "peers.png")


def plot_spark(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    results = [r for r in section.get("results") or [] if isinstance(r.get("ratio"), int | float)]
    if not results:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(results)), [r["ratio"] for r in results], color=DPSQL)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(results)), [str(r.get("query", i)) for i, r in enumerate(results)], fontsize=8)
    ax.set_ylabel("DP / raw wall time")
    rows = section.get("rows")
    title = "dpsql on Spark: DP/raw" + (f", {_label_rows(rows)} rows" if isinstance(rows, int) else "")
    return _save(plt, fig, report, title, out / "spark.png")


def plot_outer(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    """Post-processing: the outer statement's p50 beside its inner DP query's (both cached), ratio above."""
    results = section.get("results") or []
    if not results:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(results))
    inner = [r["inner_p50_ms"] for r in results]
    outer = [r["outer_p50_ms"] for r in results]
    ax.bar([i - 0.2 for i in x], inner, 0.4, color=OTHER, label="inner DP query (cached)")
    ax.bar([i + 0.2 for i in x], outer, 0.4, color=DPSQL, label="the statement with its outer query")
    for i, r in zip(x, results, strict=True):
        label = f"{r['ratio_p50']:.2f}×" + (f", +{r['overhead_p50_ms']:.1f} ms" if r.get("overhead_p50_ms") else "")
        ax.text(i + 0.2, outer[i], label, ha="center", va="bottom", fontsize=8)
        ax.plot([i - 0.4, i + 0.4], [r["bar"]] * 2, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), [r["case"] for r in results], fontsize=8)
    _plain_log(ax)
    ax.set_ylabel("wall time p50, ms (dashed: bar)")
    ax.legend(fontsize=8)
    return _save(plt, fig, report, "post-processing: outer statement vs its inner query", out / "outer.png")


def plot_cli(plt: Any, section: dict[str, Any], report: dict[str, Any], out: Path) -> Path | None:
    """Start of each ``dpsql`` command per source tree, p50 seconds, with its bar and × python -c pass."""
    results = section.get("results") or []
    if not results:
        return None
    trees = list(results[0]["seconds"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(trees)
    for t, tree in enumerate(trees):
        xs = [i - 0.4 + width * (t + 0.5) for i in range(len(results))]
        values = [r["seconds"][tree] for r in results]
        ax.bar(xs, values, width, color=DPSQL if t == 0 else OTHER, label=tree)
        for x, r in zip(xs, results, strict=True):
            ax.text(x, r["seconds"][tree], f"{r['over_python'][tree]:.0f}×", ha="center", va="bottom", fontsize=7)
    for i, r in enumerate(results):
        bar = r.get("bar")
        if bar:
            ax.plot([i - 0.4, i + 0.4], [bar, bar], color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(results)), [r["command"] for r in results], fontsize=8)
    _plain_log(ax)
    ax.set_ylabel("seconds p50 (× python -c pass above; dashed: bar)")
    ax.legend(fontsize=8)
    return _save(plt, fig, report, "dpsql command start", out / "cli.png")


PLOTS: dict[str, Callable[[Any, dict[str, Any], dict[str, Any], Path], Path | None]] = {
    "overhead": plot_overhead,
    "e2e": plot_e2e,
    "person": plot_person,
    "noise": plot_noise,
    "groups": plot_groups,
    "wire": plot_wire,
    "peers": plot_peers,
    "spark": plot_spark,
    "outer": plot_outer,
    "cli": plot_cli,
}


def write_plots(report_path: Path, out_dir: Path) -> list[Path]:
    """One PNG per plottable section of the report; a section whose plot fails is reported and skipped."""
    plt = _pyplot()
    report = json.loads(report_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, section in report.get("benchmarks", {}).items():
        plot = PLOTS.get(name)
        if plot is None or "error" in section or "skipped" in section:
            continue
        try:
            path = plot(plt, section, report, out_dir)
        except (KeyError, TypeError, ValueError) as exc:  # a report from an older layout: say so, plot the rest
            print(f"plot {name} skipped: {type(exc).__name__}: {exc}")
            plt.close("all")
            continue
        if path is not None:
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    report = Path(argv[0]) if argv else BENCH / "results" / "latest.json"
    try:
        written = write_plots(report, report.parent)
    except MissingMatplotlib:
        print("matplotlib is not installed: `.venv/bin/pip install -e '.[bench]'`")
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
