"""``dpsql policy check``: does a policy fit its database, and does it say what the curator meant?

Run by hand, and by ``dpsql serve`` at start and on every reload (a policy with errors is refused).
Each finding is reported like a policy load error, ``file:line: key.path: message``, so the curator
jumps to the line. Errors are what would make queries fail or protect less than the policy seems to
say; warnings are what is legal but probably not intended.

What is read from the database: its schema; for each ``privacy_unit`` whether its first 100,000
rows hold at least 100 distinct values (``SELECT DISTINCT … LIMIT 100``: that number is never read
or printed); and, over whole tables, one aggregate per table (NULLs per column, distinct values per
identifier) and, for each ``references`` (and a unit that looks like a row id), how many distinct
values the referenced column does not hold. Those are exact counts: the result goes to the curator's
terminal or the server's log only, never to an analyst.

``dpsql policy check`` alone also asks for the bias summary (:func:`bias_findings`): per table the
exact share of rows beyond its caps and of values outside its bounds, a warning above 5 %. Those are
exact figures from the data, for the curator's terminal only (``dpsql policy report`` has the detail).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpsql.analyze import analyze_tree
from dpsql.analyze.parse import parse_statement
from dpsql.backends import quote_ident
from dpsql.errors import Error, PolicyError
from dpsql.policy import ColumnPolicy, Policy, _line_index, did_you_mean, parse_policy
from dpsql.synopsis.solve import MAX_CELLS
from dpsql.synopsis.widths import WARN_RATIO, chart_widths

from . import introspect
from .findings import Finding, count_table
from .report import summary_findings, table_report
from .synopsis_cli import check_plan, cube_cells, marginal_sql, noise_warning
from .unit_check import reference_findings, unit_findings

#: A privacy unit with fewer distinct values than this is an error (it is surely the wrong column) …
MIN_UNITS = 10
#: … and with fewer than this a warning (few units: DP answers will be mostly noise).
FEW_UNITS = 100
#: The units are counted among this many rows (any rows): enough to tell a person from a department.
SCAN_ROWS = 100_000


def line_finder(text: str) -> Callable[[tuple[str, ...]], int]:
    """The 1-based line of a key path in the policy text (of its nearest declared ancestor)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        node = None
    lines = {tuple(map(str, p)): n for p, n in _line_index(node)} if node is not None else {}

    def line_of(path: tuple[str, ...]) -> int:
        probe = path
        while probe and probe not in lines:
            probe = probe[:-1]
        return lines.get(probe, 1)

    return line_of


def _domain_fits(column: ColumnPolicy, value: Any) -> bool:
    if value is None:
        return True
    type_name = column.type
    if type_name == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_name == "int":
        return isinstance(value, int)
    if type_name == "float":
        return isinstance(value, int | float)
    if type_name == "text":
        return isinstance(value, str)
    if type_name == "date":
        return isinstance(value, dt.date) and not isinstance(value, dt.datetime)
    return isinstance(value, dt.date)  # timestamp: a date or a datetime


def policy_findings(policy: Policy) -> Iterator[Finding]:
    """What is wrong or suspicious in the policy alone (no database needed)."""
    for name, table in policy.tables.items():
        for col_name, column in table.columns.items():
            path = ("tables", name, "columns", col_name)
            for i, value in enumerate(column.domain or ()):
                if not _domain_fits(column, value):
                    yield Finding(
                        "error",
                        (*path, "domain", str(i)),
                        f"domain value {value!r} is not of type {column.type} (the column's type); "
                        "GROUP BY would release a key that can never match",
                    )
        unit = table.privacy_unit
        if unit is not None and not table.columns[unit].identifier:
            yield Finding(
                "error",
                ("tables", name, "privacy_unit"),
                f"privacy unit '{unit}' must be declared 'identifier: true' (else analysts could group or "
                "filter on it and single people out)",
            )
        ref = table.references
        if ref is not None and not table.columns[ref.column].identifier:
            yield Finding(
                "error",
                ("tables", name, "references", "column"),
                f"'{ref.column}' leads to the privacy unit: declare it 'identifier: true'",
            )
    if policy.budget.dataset.delta == 0:
        yield Finding(
            "warning",
            ("budget", "dataset"),
            "no δ budget (delta: 0): every GROUP BY on a key without a 'domain' (partition selection) and "
            "every Gaussian query will be refused as exhausted (53P01); declare e.g. 'delta: 1.0e-5'",
        )
    if not policy.analysts:
        yield Finding("warning", ("analysts",), "no analysts declared: nobody can connect")
    elif not policy.auth.trust:
        for i, analyst in enumerate(policy.analysts):
            if analyst.password is None:
                yield Finding(
                    "warning",
                    ("analysts", str(i), "name"),
                    f"analyst '{analyst.name}' has no password and auth.trust is false: they cannot log in "
                    "(generate a verifier with `dpsql passwd`)",
                )


def bucket_bound_findings(policy: Policy) -> Iterator[Finding]:
    """A date/timestamp upper bound that starts a time bucket (#40 item 3): the derived key domains leave
    that bucket out (only the bound's own instant, or day, and values clamped to it could fall there),
    so the curator hears which buckets charts stop before."""
    for name, table in policy.tables.items():
        for col_name, column in table.columns.items():
            upper = column.upper
            if column.type not in ("date", "timestamp") or not isinstance(upper, dt.date):
                continue
            stamp = upper if isinstance(upper, dt.datetime) else dt.datetime(upper.year, upper.month, upper.day)
            if stamp.time() != dt.time():
                continue
            units = [] if column.type == "date" else ["day"]
            units += ["week"] if stamp.weekday() == 0 else []
            units += ["month"] if stamp.day == 1 else []
            units += ["quarter"] if stamp.day == 1 and stamp.month in (1, 4, 7, 10) else []
            units += ["year"] if (stamp.month, stamp.day) == (1, 1) else []
            if units:
                which = ", ".join(units[:-1]) + (" or " if len(units) > 1 else "") + units[-1]
                yield Finding(
                    "warning",
                    ("tables", name, "columns", col_name, "upper"),
                    f"upper bound {upper} starts a {'/'.join(units)}: GROUP BY DATE_TRUNC/date_bin/EXTRACT "
                    f"releases no {which} starting at it (only the bound itself could fall there); values "
                    "after it are clamped to it: write the last day or instant the data hold",
                )


def synopsis_findings(policy: Policy) -> Iterator[Finding]:
    """Each declared synopsis analysed as the DP queries that would measure it (policy alone): keys without
    a public domain, measures other than COUNT(*)/SUM, identifiers or a cube too large are errors here,
    not at ``dpsql synopsis build``; many marginals get a warning (each costs its share of ε)."""
    for name, synopsis in policy.synopses.items():
        every = tuple(range(len(synopsis.axes)))
        for axes in dict.fromkeys((every, *synopsis.measured)):
            sql = marginal_sql(policy, name, axes)
            try:
                plan = analyze_tree(parse_statement(sql), policy, None)
                check_plan(name, sql, plan)
            except Error as exc:
                hint = f" ({exc.hint})" if exc.hint else ""
                yield Finding("error", ("synopses", name), f"{exc.message}{hint}")
                break
            if axes == every and cube_cells(plan) > MAX_CELLS:
                yield Finding(
                    "error",
                    ("synopses", name, "keys"),
                    f"{cube_cells(plan)} cells, more than {MAX_CELLS}: use fewer keys or a coarser grain",
                )
                break
        else:
            warning = noise_warning(synopsis)
            if warning is not None:
                yield Finding("warning", ("synopses", name), warning)


def synopsis_width_findings(policy: Policy, notes: list[str]) -> Iterator[Finding]:
    """Per declared synopsis and chart shape, the ± it will get beside the same chart alone (a line in
    ``notes``), and a warning where it is more than 2× wider (:mod:`dpsql.synopsis.widths`; policy only)."""
    for name, synopsis in policy.synopses.items():
        try:
            every = tuple(range(len(synopsis.axes)))
            full = analyze_tree(parse_statement(marginal_sql(policy, name, every)), policy, None)
            plans = [
                analyze_tree(parse_statement(marginal_sql(policy, name, a)), policy, None) for a in synopsis.measured
            ]
            found = chart_widths(policy, name, plans, full)
        except Error:
            continue  # reported by synopsis_findings
        notes.extend(chart.line(name, policy.defaults.epsilon) for chart in found)
        wide = [chart for chart in found if chart.ratio > WARN_RATIO]
        if wide:
            worst = max(wide, key=lambda chart: chart.ratio)
            yield Finding(
                "warning",
                ("synopses", name),
                f"{len(wide)} of {len(found)} chart shapes get a ± more than {WARN_RATIO:g}× that of the chart asked "
                f"alone at ε={policy.defaults.epsilon:g} (up to {worst.ratio:.2g}×: {worst.measure} by "
                f"{', '.join(worst.keys) or 'no key'}); raise the synopsis's ε or declare fewer marginals or "
                "measures (analysts see the factor, and can SET dpsql.max_widening to get fresh answers instead)",
            )


def database_findings(policy: Policy, backend: Any) -> Iterator[Finding]:
    """Tables and columns exist with compatible stored types; each privacy unit has many values."""
    if not introspect.checkable(backend):
        yield Finding(
            "warning", ("tables",), f"tables not checked: the {backend.dialect} backend has no schema to read"
        )
        return
    for name, table in policy.tables.items():
        source = table.source or name
        if source.startswith(("parquet:", "orc:")):
            continue  # read by Spark only
        stored = introspect.columns(backend, source)
        if stored is None:
            yield Finding(
                "error",
                ("tables", name),
                f'table "{source}" does not exist in the database' + did_you_mean(source, introspect.tables(backend)),
            )
            continue
        lowered = {k.lower(): v for k, v in stored.items()}
        for col_name, column in table.columns.items():
            path = ("tables", name, "columns", col_name)
            type_name = stored.get(col_name) or lowered.get(col_name.lower())
            if type_name is None:
                hint = did_you_mean(col_name, list(stored))
                yield Finding("error", path, f'column "{col_name}" does not exist in table "{source}"' + hint)
                continue
            fam = introspect.family(type_name)
            if fam not in introspect.COMPATIBLE[column.type]:
                yield Finding(
                    "error",
                    (*path, "type"),
                    f"the database stores {type_name} but the policy declares {column.type}",
                )
        present = {c for c in table.columns if (stored.get(c) or lowered.get(c.lower())) is not None}
        yield from _data_findings(policy, name, backend, source, present, stored)
        yield from reference_findings(policy, name, backend, stored)
        unit = table.privacy_unit
        if unit is not None and (stored.get(unit) or lowered.get(unit.lower())) is not None:
            # capped at FEW_UNITS: the curator learns "few" or "enough", never the exact number; and
            # bounded to the first SCAN_ROWS rows, so a start or reload costs the same on any table size
            _, rows = backend.execute(
                f"SELECT COUNT(*) FROM (SELECT DISTINCT u FROM (SELECT {quote_ident(unit)} AS u FROM "
                f"{quote_ident(source)} LIMIT {SCAN_ROWS}) AS scanned LIMIT {FEW_UNITS}) AS units"
            )
            distinct = int(rows[0][0])
            if distinct < MIN_UNITS:
                yield Finding(
                    "error",
                    ("tables", name, "privacy_unit"),
                    f"'{unit}' has fewer than {MIN_UNITS} distinct values: it cannot be who a person is "
                    "(each unit would be a whole group, and DP answers would be noise)",
                )
            elif distinct < FEW_UNITS:
                yield Finding(
                    "warning",
                    ("tables", name, "privacy_unit"),
                    f"'{unit}' has fewer than {FEW_UNITS} distinct values: is it really who a person is?",
                )


def _data_findings(
    policy: Policy, name: str, backend: Any, source: str, present: set[str], stored: dict[str, str]
) -> Iterator[Finding]:
    """What the data contradicts in the declarations of one table (all its rows, one scan):
    ``nullable: false`` on a column holding NULLs (an error: those rows silently leave answers), a
    nullable column holding none (a warning: GROUP BY releases a phantom NULL group, AVG widens), and
    who the rows belong to (:func:`~dpsql.curator.unit_check.unit_findings`)."""
    table = policy.tables[name]
    if table.public:
        return
    plain = [c for c, column in table.columns.items() if c in present and not column.identifier]
    keys = (table.privacy_unit, table.references.column if table.references else None)
    ids = [c for c in table.columns if c in present and (table.columns[c].identifier or c in keys)]
    counts = count_table(backend, source, plain, ids)
    for col_name in plain:
        column = table.columns[col_name]
        path = ("tables", name, "columns", col_name, "nullable")
        nulls = counts.nulls(col_name)
        if not column.nullable and nulls:
            yield Finding(
                "error",
                path,
                f"'{col_name}' is declared 'nullable: false' but holds NULLs ({nulls:,} of {counts.rows:,} rows): "
                "rows with a NULL would drop out of answers without a word; declare it nullable (or fix the data)",
            )
        elif column.nullable and not nulls:
            yield Finding(
                "warning",
                path,
                f"'{col_name}' holds no NULL: declare 'nullable: false' (else GROUP BY releases a NULL group "
                "nobody is in, and AVG's interval is wider than it needs to be)",
            )
    yield from unit_findings(policy, name, backend, source, stored, counts)


@dataclass(frozen=True, slots=True)
class Report:
    """The outcome of checking one policy file: the policy (None if it does not load) and printed lines."""

    policy: Policy | None
    errors: list[str]
    warnings: list[str]
    #: With ``bias=True``: one line per private table, the shares its caps and bounds cut (exact).
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.policy is not None and not self.errors


def check_text(text: str, where: str, backend: Any | None = None, *, bias: bool = False) -> Report:
    """Load and check a policy's text; ``backend`` (optional) for the database checks; ``bias`` adds
    the exact bias summary of :func:`bias_findings` (``dpsql policy check`` only)."""
    try:
        policy = parse_policy(text, where)
    except PolicyError as exc:
        problems = [exc.message, *(exc.detail.splitlines() if exc.detail else [])]
        return Report(None, problems, [])
    findings = [*policy_findings(policy), *synopsis_findings(policy), *bucket_bound_findings(policy)]
    notes: list[str] = []
    if bias:  # `dpsql policy check`: what each chart of each synopsis will get
        findings += synopsis_width_findings(policy, notes)
    if backend is not None:
        findings += database_findings(policy, backend)
        if bias and not any(f.severity == "error" for f in findings) and introspect.checkable(backend):
            findings += bias_findings(policy, backend, notes)
    line_of = line_finder(text)
    errors = [f.render(where, line_of) for f in findings if f.severity == "error"]
    warnings = [f.render(where, line_of) for f in findings if f.severity == "warning"]
    return Report(policy, errors, warnings, notes)


def bias_findings(policy: Policy, backend: Any, notes: list[str]) -> Iterator[Finding]:
    """Per private table, the exact share of rows beyond its caps and of values outside each bound
    (a line in ``notes``), and a warning where one exceeds :data:`~dpsql.curator.report.WARN_SHARE`:
    answers are then biased by more than their ± intervals say.

    Exact figures read from the data (:mod:`dpsql.curator.report`): asked for by ``dpsql policy
    check`` only, for the curator's terminal. ``dpsql serve`` and ``dpsql reload`` do not ask (their
    checks stay the same on neighbouring databases, and cost the same on any table size)."""
    for name, table in policy.tables.items():
        if table.public or (table.source or name).startswith(("parquet:", "orc:")):
            continue
        try:
            report = table_report(policy, backend, name, tradeoffs=False)
        except Error as exc:
            notes.append(f"{name}: bias not measured ({exc.message})")
            continue
        if report.skipped:
            continue
        line, warnings = summary_findings(report)
        notes.append(line)
        for path, message in warnings:
            yield Finding("warning", path, message)


def check_file(path: str | Path, backend: Any | None = None, *, bias: bool = False) -> Report:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return Report(None, [f"{path}: cannot read policy file: {exc.strerror}"], [])
    return check_text(text, str(path), backend, bias=bias)
