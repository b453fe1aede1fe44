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
import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dpsql.analyze import analyze_tree
from dpsql.analyze.parse import parse_statement
from dpsql.backends import quote_ident
from dpsql.errors import Error, PolicyError
from dpsql.policy import ColumnPolicy, Policy, _line_index, did_you_mean, parse_policy
from dpsql.synopsis.solve import MAX_CELLS

from . import introspect
from .report import summary_findings, table_report
from .synopsis import check_plan, cube_cells, marginal_sql, noise_warning

#: A privacy unit with fewer distinct values than this is an error (it is surely the wrong column) …
MIN_UNITS = 10
#: … and with fewer than this a warning (few units: DP answers will be mostly noise).
FEW_UNITS = 100
#: The units are counted among this many rows (any rows): enough to tell a person from a department.
SCAN_ROWS = 100_000


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Literal["error", "warning"]
    path: tuple[str, ...]
    message: str

    def render(self, where: str, line_of: Callable[[tuple[str, ...]], int]) -> str:
        key = ".".join(self.path) or "<top>"
        label = "" if self.severity == "error" else "warning: "
        return f"{where}:{line_of(self.path)}: {key}: {label}{self.message}"


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
        every = tuple(range(len(synopsis.keys)))
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
        yield from _reference_findings(policy, name, backend, stored)
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


@dataclass(frozen=True, slots=True)
class _Counts:
    """Whole-table counts of one table (one aggregate query): rows, non-NULL values per column, and
    distinct non-NULL values per identifier. Exact, for the curator's terminal or the server's log only."""

    rows: int
    filled: dict[str, int]
    distinct: dict[str, int]

    def nulls(self, column: str) -> int:
        return self.rows - self.filled[column]

    def repeats(self, column: str) -> bool:
        return self.distinct[column] < self.filled[column]

    def unique(self, column: str) -> bool:
        return self.filled[column] > 1 and self.distinct[column] == self.filled[column]


def _count(backend: Any, source: str, plain: list[str], ids: list[str]) -> _Counts:
    """:class:`_Counts` of ``source`` over all its rows: one scan, cheap on DuckDB and PostgreSQL, so a
    NULL or a repeat on the last row is seen as surely as on the first."""
    columns = [*plain, *ids]
    items = ["COUNT(*)", *(f"COUNT({quote_ident(c)})" for c in columns)]
    items += [f"COUNT(DISTINCT {quote_ident(c)})" for c in ids]
    _, rows = backend.execute(f"SELECT {', '.join(items)} FROM {quote_ident(source)}")
    values = [int(v or 0) for v in rows[0]]
    filled = dict(zip(columns, values[1 : 1 + len(columns)], strict=True))
    distinct = dict(zip(ids, values[1 + len(columns) :], strict=True))
    return _Counts(values[0], filled, distinct)


def _unmatched(backend: Any, source: str, column: str, target: str, to: str) -> tuple[int, int]:
    """(distinct non-NULL values of ``source.column``, how many of them ``target.to`` does not hold):
    one anti-join of the two distinct sets, whole tables."""
    _, rows = backend.execute(
        f"SELECT COUNT(*), COUNT(q.k) FROM (SELECT DISTINCT {quote_ident(column)} AS c FROM {quote_ident(source)} "
        f"WHERE {quote_ident(column)} IS NOT NULL) AS r LEFT JOIN (SELECT DISTINCT {quote_ident(to)} AS k FROM "
        f"{quote_ident(target)}) AS q ON r.c = q.k"
    )
    distinct, matched = int(rows[0][0] or 0), int(rows[0][1] or 0)
    return distinct, distinct - matched


def _person_tables(policy: Policy, name: str, backend: Any) -> Iterator[tuple[str, str, str, str]]:
    """(table, its source, its privacy unit, the unit's stored type) of the other private tables with a
    stored privacy unit: where a person identifier of ``name`` may point."""
    for other, table in policy.tables.items():
        source = table.source or other
        if other == name or table.public or table.privacy_unit is None or source.startswith(("parquet:", "orc:")):
            continue
        stored = introspect.columns(backend, source) or {}
        if table.privacy_unit in stored:
            yield other, source, table.privacy_unit, stored[table.privacy_unit]


def _data_findings(
    policy: Policy, name: str, backend: Any, source: str, present: set[str], stored: dict[str, str]
) -> Iterator[Finding]:
    """What the data contradicts in the declarations of one table (all its rows, :func:`_count`).

    - ``nullable: false`` on a column holding NULLs (an error: those rows silently leave answers);
      a nullable column holding none (a warning: GROUP BY releases a phantom NULL group, AVG widens);
    - a table without ``privacy_unit`` or ``references`` (each row one person) whose ``*_id``
      identifier repeats: one person's many rows would each count as a person (an error);
    - a ``privacy_unit`` unique per row, in a table no other table references, while the table allows
      many rows per person and another identifier repeats, or another identifier's values all are
      another table's privacy unit: a row id, not a person, so each of one person's rows would be
      protected as a different person (an error naming the probable person column).
    """
    table = policy.tables[name]
    if table.public:
        return
    plain = [c for c, column in table.columns.items() if c in present and not column.identifier]
    keys = (table.privacy_unit, table.references.column if table.references else None)
    ids = [c for c in table.columns if c in present and (table.columns[c].identifier or c in keys)]
    counts = _count(backend, source, plain, ids)
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
    identifiers = [c for c in ids if table.columns[c].identifier]
    person_ids = [c for c in identifiers if c.lower() == "id" or c.lower().endswith("_id")]
    if table.privacy_unit is None and table.references is None:
        for col_name in person_ids:
            if counts.repeats(col_name):
                yield Finding(
                    "error",
                    ("tables", name),
                    f"no 'privacy_unit' (each row is one person), but identifier '{col_name}' repeats: if it names "
                    f"the person, declare 'privacy_unit: {col_name}' (or 'references') and 'max_rows_per_unit'",
                )
                break
    unit = table.privacy_unit
    if unit is None or unit not in present or not counts.unique(unit):
        return
    referenced = any(
        t.references is not None and t.references.table == name and t.references.to == unit
        for t in policy.tables.values()
    )
    if referenced:
        return  # the person table: other tables' keys point at its unit, one row per person
    person = next((c for c in identifiers if c != unit and counts.repeats(c) and c in person_ids), None)
    if table.references is not None and table.references.column != unit:
        person = table.references.column
    repeating = [c for c in identifiers if c != unit and counts.repeats(c)]
    pointing = _pointing(policy, name, backend, source, stored, repeating)
    if pointing is not None:
        person, other, other_unit = pointing
    if person is None or not (pointing or table.max_rows_per_unit > 1 or table.references is not None):
        return
    why, fix = "", f"privacy_unit: {person}"
    if pointing is not None:
        why = f" and all its values are {other}.{other_unit}"
        fix = f"references: {{column: {person}, table: {other}, to: {other_unit}}}"
    yield Finding(
        "error",
        ("tables", name, "privacy_unit"),
        f"'{unit}' is unique per row (a row id, not a person) while '{person}' repeats{why}: each of one "
        f"person's rows would be protected as a different person; did you mean '{person}'? (declare {fix})",
    )


def _pointing(
    policy: Policy, name: str, backend: Any, source: str, stored: dict[str, str], candidates: list[str]
) -> tuple[str, str, str] | None:
    """(column, table, unit): the first of ``candidates`` whose values all are another table's privacy
    unit (same stored type family), i.e. the column naming the person this table's rows belong to."""
    people = list(_person_tables(policy, name, backend)) if candidates else []  # each table introspected once
    for col_name in candidates:
        for other, other_source, other_unit, other_type in people:
            if introspect.family(other_type) != introspect.family(stored.get(col_name, "")):
                continue
            distinct, unmatched = _unmatched(backend, source, col_name, other_source, other_unit)
            if distinct and not unmatched:
                return col_name, other, other_unit
    return None


def _reference_findings(policy: Policy, name: str, backend: Any, stored: dict[str, str]) -> Iterator[Finding]:
    """``references`` between columns stored as different types (every query joining them would fail on
    the database, after its charge), or whose values the referenced column does not hold (the column
    names no row there: a row id, say, so each of its values would count as a person of its own)."""
    table = policy.tables[name]
    ref = table.references
    target = policy.tables.get(ref.table) if ref is not None else None
    if ref is None or target is None:
        return
    target_source = target.source or ref.table
    here = stored.get(ref.column)
    there = (introspect.columns(backend, target_source) or {}).get(ref.to)
    if here is None or there is None:
        return
    if introspect.family(here) != introspect.family(there):
        yield Finding(
            "error",
            ("tables", name, "references"),
            f"'{ref.column}' is stored as {here} but {ref.table}.{ref.to} as {there}: the join to the privacy "
            "unit cannot match them; store both with one type",
        )
        return
    if table.public or target_source.startswith(("parquet:", "orc:")):
        return
    source = table.source or name
    distinct, unmatched = _unmatched(backend, source, ref.column, target_source, ref.to)
    if not unmatched:
        return
    fitting = []
    for col_name, column in table.columns.items():
        if col_name == ref.column or not column.identifier or col_name not in stored:
            continue
        if introspect.family(stored[col_name]) != introspect.family(there):
            continue
        others, missing = _unmatched(backend, source, col_name, target_source, ref.to)
        if others and not missing:
            fitting.append(col_name)
    fitting.sort(key=lambda c: -difflib.SequenceMatcher(None, c.lower(), ref.table.lower()).ratio())
    hint = f"; did you mean '{fitting[0]}' (all its values are in {ref.table}.{ref.to})?" if fitting else ""
    yield Finding(
        "error",
        ("tables", name, "references", "column"),
        f"{unmatched:,} of the {distinct:,} distinct values of '{ref.column}' are not in {ref.table}.{ref.to}: "
        f"'{ref.column}' does not name a row of '{ref.table}', so each of its values would be protected as a "
        f"person of its own{hint}",
    )


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
