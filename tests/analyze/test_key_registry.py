"""The GROUP BY key registry (issue #30): one handler per expression class, registered once.

Derived domains are privacy-relevant (a public domain is released without a threshold), so the
registry refactor is pinned by golden results recorded from the code before it
(``fixtures/key_registry.json``: SQL, type, domain, bounds or refusal of each representative key).
Regenerate only for an intended change: ``python -m tests.analyze.test_key_registry``.
"""

from __future__ import annotations

import ast
import datetime as dt
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from sqlglot import exp, parse_one

from dpsql.analyze import analyze, domains, keys
from dpsql.dev.demo import demo_policy_path
from dpsql.errors import Error
from dpsql.policy import ColumnPolicy, load_policy

GOLDEN = Path(__file__).parent / "fixtures" / "key_registry.json"

#: Columns of table ``t`` the derive-level cases group by.
COLUMNS = {
    "n": ColumnPolicy(type="int", lower=0, upper=110, nullable=False),
    "k": ColumnPolicy(type="int", domain=(1, 2, 3), nullable=False),
    "kb": ColumnPolicy(type="int", lower=1, upper=3, domain=(1, 2, 3), nullable=False),
    "z": ColumnPolicy(type="int", lower=-3, upper=3),
    "big": ColumnPolicy(type="int", lower=-(10**6), upper=10**6),
    "u": ColumnPolicy(type="int"),
    "x": ColumnPolicy(type="float", lower=12.0, upper=60.0),
    "small": ColumnPolicy(type="float", lower=1e-300, upper=1.0, nullable=False),
    "t": ColumnPolicy(type="text", domain=("a", "b", "c")),
    "free": ColumnPolicy(type="text"),
    "b": ColumnPolicy(type="boolean", nullable=False),
    "d": ColumnPolicy(type="date", lower=dt.date(2020, 1, 1), upper=dt.date(2024, 12, 31), nullable=False),
    "ud": ColumnPolicy(type="date"),
    "ts": ColumnPolicy(type="timestamp", lower=dt.datetime(2024, 1, 1), upper=dt.datetime(2024, 1, 3, 12, 30)),
    "pin": ColumnPolicy(
        type="date",
        lower=dt.date(2021, 3, 4),
        upper=dt.date(2023, 11, 30),
        domain=(dt.date(2021, 3, 4), dt.date(2023, 11, 30)),
    ),
}

#: (registered class, GROUP BY expression, dialect it is read in): at least one per registered class.
DERIVE_CASES: list[tuple[type[exp.Expr], str, str]] = [
    (exp.Paren, "(n + 1)", "postgres"),
    (exp.Paren, "((t))", "postgres"),
    (exp.Column, "n", "postgres"),
    (exp.Column, "k", "postgres"),
    (exp.Column, "kb", "postgres"),
    (exp.Column, "z", "postgres"),
    (exp.Column, "x", "postgres"),
    (exp.Column, "big", "postgres"),
    (exp.Column, "t", "postgres"),
    (exp.Column, "free", "postgres"),
    (exp.Column, "b", "postgres"),
    (exp.Column, "u", "postgres"),
    (exp.Column, "d", "postgres"),
    (exp.TimestampTrunc, "date_trunc('month', d)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('week', ts)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('hour', ts)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('quarter', CAST(d AS TIMESTAMP))", "postgres"),
    (exp.TimestampTrunc, "date_trunc('year', ud)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('month', pin)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('hour', d)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('minute', d)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('month', n)", "postgres"),
    (exp.TimestampTrunc, "date_trunc('month', CAST(n AS TEXT))", "postgres"),
    (exp.DateTrunc, "DATE_TRUNC(d, MONTH)", "bigquery"),
    (exp.Extract, "EXTRACT(month FROM d)", "postgres"),
    (exp.Extract, "EXTRACT(year FROM d)", "postgres"),
    (exp.Extract, "EXTRACT(dow FROM ts)", "postgres"),
    (exp.Extract, "EXTRACT(hour FROM d)", "postgres"),
    (exp.Extract, "EXTRACT(epoch FROM d)", "postgres"),
    (exp.Extract, "EXTRACT(epoch FROM ts)", "postgres"),
    (exp.Extract, "EXTRACT(epoch FROM pin)", "postgres"),
    (exp.Extract, "EXTRACT(quarter FROM pin)", "postgres"),
    (exp.Extract, "date_part('doy', d)", "postgres"),
    (exp.Extract, "EXTRACT(century FROM d)", "postgres"),
    (exp.Extract, "EXTRACT(month FROM x)", "postgres"),
    (exp.DateBin, "date_bin('15 minutes', ts, TIMESTAMP '2000-01-01')", "postgres"),
    (exp.DateBin, "date_bin('7 days', d, '2001-01-01')", "postgres"),
    (exp.DateBin, "date_bin('1 day', pin, TIMESTAMP '2000-01-01')", "postgres"),
    (exp.DateBin, "date_bin('1 day', ud, DATE '2000-01-01')", "postgres"),
    (exp.DateBin, "date_bin('1 month', d, '2000-01-01')", "postgres"),
    (exp.DateBin, "date_bin('1 day', d, n)", "postgres"),
    (exp.DateBin, "date_bin('-1 day', d, '2000-01-01')", "postgres"),
    (exp.DateBin, "date_bin('1 minute', d, '2000-01-01')", "postgres"),
    (exp.Floor, "FLOOR(x / 5)", "postgres"),
    (exp.Floor, "FLOOR(x)", "postgres"),
    (exp.Floor, "FLOOR(big / 3)", "postgres"),
    (exp.Floor, "FLOOR(x, 1)", "postgres"),
    (exp.Floor, "FLOOR(t)", "postgres"),
    (exp.Ceil, "CEIL(n / 10.0)", "postgres"),
    (exp.Ceil, "CEILING(k * 1.5)", "postgres"),
    (exp.Ceil, "CEILING(kb * 1.5)", "postgres"),
    (exp.WidthBucket, "width_bucket(x, 0, 100, 10)", "postgres"),
    (exp.WidthBucket, "width_bucket(k, 0, 3, 3)", "postgres"),
    (exp.WidthBucket, "width_bucket(kb, 0, 3, 3)", "postgres"),
    (exp.WidthBucket, "width_bucket(n, 0, 100, 0)", "postgres"),
    (exp.WidthBucket, "width_bucket(n, 10, 0, 5)", "postgres"),
    (exp.WidthBucket, "width_bucket(n, 5, 5, 5)", "postgres"),
    (exp.WidthBucket, "width_bucket(n, n, 10, 5)", "postgres"),
    (exp.WidthBucket, "width_bucket(n, 0, 1e600, 5)", "postgres"),
    (exp.Neg, "-n", "postgres"),
    (exp.Neg, "-(x)", "postgres"),
    (exp.Neg, "-k", "postgres"),
    (exp.Neg, "-kb", "postgres"),
    (exp.Add, "n + 1", "postgres"),
    (exp.Add, "k + k", "postgres"),
    (exp.Add, "kb + kb", "postgres"),
    (exp.Add, "u + 1", "postgres"),
    (exp.Sub, "x - 2.5", "postgres"),
    (exp.Mul, "n * 2", "postgres"),
    (exp.Mul, "x * x", "postgres"),
    (exp.Mul, "big * 1e12", "postgres"),
    (exp.Mul, "small * small * small * small", "postgres"),
    (exp.Mul, "t * 2", "postgres"),
    (exp.Mul, "z * kb", "postgres"),
    (exp.Sub, "z - 1.5", "postgres"),
    (exp.Div, "n / 2", "postgres"),
    (exp.Div, "k / 2", "postgres"),
    (exp.Div, "kb / 2", "postgres"),
    (exp.Div, "x / 2", "postgres"),
    (exp.Div, "n / (n - 5)", "postgres"),
    (exp.Div, "n / z", "postgres"),
    (exp.Div, "z / -2", "postgres"),
    (exp.Div, "x / kb", "postgres"),
    (exp.Div, "n / k", "postgres"),
    (exp.Div, "n / kb", "postgres"),
    (exp.Cast, "CAST(date_trunc('month', d) AS DATE)", "postgres"),
    (exp.Cast, "CAST(date_trunc('month', d) AS TIMESTAMP)", "postgres"),
    (exp.Cast, "CAST(FLOOR(x) AS BIGINT)", "postgres"),
    (exp.Cast, "CAST(n AS INT)", "postgres"),
    (exp.Cast, "CAST(k * 1.0 AS SMALLINT)", "postgres"),
    (exp.Cast, "CAST(kb * 1.0 AS SMALLINT)", "postgres"),
    (exp.Cast, "CAST(big * 10000 AS INT)", "postgres"),
    (exp.Cast, "CAST(t AS TEXT)", "postgres"),
    (exp.Cast, "CAST(b AS BOOLEAN)", "postgres"),
    (exp.Cast, "CAST(n AS DOUBLE PRECISION)", "postgres"),
    (exp.Cast, "CAST(k AS NUMERIC)", "postgres"),
    (exp.Cast, "CAST(kb AS NUMERIC)", "postgres"),
    (exp.Cast, "n::real", "postgres"),
    (exp.Cast, "CAST(t AS INT)", "postgres"),
    (exp.Cast, "CAST(x AS INT)", "postgres"),
    (exp.Cast, "TRY_CAST(n AS BIGINT)", "duckdb"),
    (exp.Case, "CASE WHEN n < 18 THEN 'child' WHEN n < 65 THEN 'adult' ELSE 'senior' END", "postgres"),
    (exp.Case, "CASE t WHEN 'a' THEN 1 WHEN 'b' THEN 2 END", "postgres"),
    (exp.Case, "CASE WHEN b THEN 1.5 ELSE 2 END", "postgres"),
    (exp.Case, "CASE WHEN b THEN TRUE ELSE FALSE END", "postgres"),
    (exp.Case, "CASE WHEN n > 1 THEN 3000000000 ELSE 1 END", "postgres"),
    (exp.Case, "CASE WHEN n > 1 THEN 'x' ELSE 1 END", "postgres"),
    (exp.Case, "CASE WHEN n > 1 THEN n END", "postgres"),
    (exp.Coalesce, "COALESCE(t, 'none')", "postgres"),
    (exp.Coalesce, "COALESCE(x, 0)", "postgres"),
    (exp.Coalesce, "COALESCE(NULL, k)", "postgres"),
    (exp.Coalesce, "COALESCE(NULL, kb)", "postgres"),
    (exp.Coalesce, "COALESCE(free, 'z')", "postgres"),
    (exp.Coalesce, "COALESCE(k, 2.5, n)", "postgres"),
    (exp.Coalesce, "COALESCE(kb, 2.5, n)", "postgres"),
    (exp.Coalesce, "COALESCE(t, 1)", "postgres"),
    (exp.Predicate, "n > 18", "postgres"),
    (exp.Predicate, "x IS NULL", "postgres"),
    (exp.Predicate, "t = 'a'", "postgres"),
    (exp.Predicate, "t IN ('a', 'b')", "postgres"),
    (exp.Predicate, "free LIKE 'a%'", "postgres"),
    (exp.Predicate, "n BETWEEN 1 AND 5", "postgres"),
    (exp.Connector, "n > 18 AND b", "postgres"),
    (exp.Connector, "n > 1 OR x < 3", "postgres"),
    (exp.Not, "NOT b", "postgres"),
]

#: Expressions refused before or without a handler: constants, and classes no handler takes.
UNREGISTERED_CASES: list[tuple[str, str]] = [
    ("1", "postgres"),
    ("'a'", "postgres"),
    ("(1)", "postgres"),
    ("-1", "postgres"),
    ("NULL", "postgres"),
    ("TRUE", "postgres"),
    ("ABS(n)", "postgres"),
    ("UPPER(t)", "postgres"),
    ("n % 2", "postgres"),
    ("ROUND(x)", "postgres"),
    ("LENGTH(t)", "postgres"),
    ("CONCAT(t, 'a')", "postgres"),
    ("t || 'a'", "postgres"),
    ("my_function(n)", "postgres"),
]

#: Whole statements on the demo policies: keys as the planner builds them (WHERE narrowing included).
ANALYZE_CASES: list[tuple[str, str]] = [
    ("clinic", "SELECT date_trunc('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY m"),
    (
        "clinic",
        "SELECT date_trunc('month', visit_date) AS m, COUNT(*) FROM visits WHERE visit_date >= '2023-06-01' GROUP BY m",
    ),
    ("clinic", "SELECT EXTRACT(dow FROM visit_date) AS d, department, COUNT(*) FROM visits GROUP BY 1, 2"),
    ("clinic", "SELECT FLOOR(cost / 100) AS c, COUNT(*) FROM visits WHERE cost > 1500 GROUP BY c"),
    (
        "clinic",
        "SELECT urgent, department, COUNT(*) FROM visits "
        "WHERE urgent AND department IN ('Cardiology', 'X') GROUP BY 1, 2",
    ),
    (
        "clinic",
        "SELECT date_bin('7 days', visit_date, '2020-01-06') AS w, COUNT(*) FROM visits "
        "WHERE visit_date < '2020-03-01' GROUP BY w",
    ),
    ("clinic", "SELECT cost > 100 AS dear, COUNT(*) FROM visits GROUP BY dear"),
    ("clinic", "SELECT COALESCE(building, 'none') AS b, COUNT(*) FROM departments GROUP BY b"),
    ("health", "SELECT problem, COUNT(*) FROM patients WHERE problem = 'Asthma' GROUP BY problem"),
    (
        "health",
        "SELECT CASE WHEN age < 18 THEN 'minor' WHEN age < 65 THEN 'adult' ELSE 'senior' END AS g, COUNT(*) "
        "FROM patients WHERE age BETWEEN 10 AND 30 GROUP BY g",
    ),
    ("health", "SELECT EXTRACT(year FROM dob) AS y, COUNT(*) FROM patients WHERE dob < DATE '1950-01-01' GROUP BY y"),
    ("health", "SELECT width_bucket(bmi, 10, 60, 5) AS b, COUNT(*) FROM patients WHERE bmi IS NOT NULL GROUP BY b"),
    ("health", "SELECT age / 10 * 10 AS decade, sex, COUNT(*) FROM patients WHERE sex <> 'Male' GROUP BY decade, sex"),
    ("health", "SELECT CAST(date_trunc('year', dob) AS DATE) AS y, COUNT(*) FROM patients GROUP BY y"),
    ("health", "SELECT DISTINCT marital_status FROM patients WHERE marital_status IS NOT NULL"),
    ("health", "SELECT date_trunc('day', dob) AS d, COUNT(*) FROM patients GROUP BY d"),
    ("health", "SELECT ABS(age) AS a, COUNT(*) FROM patients GROUP BY a"),
    ("health", "SELECT 1 AS one, COUNT(*) FROM patients GROUP BY 1"),
]


def _resolve(column: exp.Column) -> tuple[exp.Column, ColumnPolicy]:
    return exp.column(column.name, table="t"), COLUMNS[column.name]


def _refusal(error: Error) -> dict[str, Any]:
    return {"error": type(error).__name__, "sqlstate": error.sqlstate, "message": str(error), "hint": error.hint}


def _sql(node: exp.Expression | None) -> dict[str, str] | None:
    if node is None:
        return None
    return {"postgres": node.sql(dialect="postgres"), "duckdb": node.sql(dialect="duckdb")}


def derive_result(text: str, dialect: str) -> dict[str, Any]:
    node = parse_one(text, read=dialect)
    assert isinstance(node, exp.Expression)
    try:
        key = domains.derive(node, _resolve, lambda p: p)
    except Error as error:
        return _refusal(error)
    return {
        "sql": _sql(key.sql),
        "type": key.type,
        "values": repr(key.values),
        "nullable": key.nullable,
        "lower": repr(key.lower),
        "upper": repr(key.upper),
        "tiny": key.tiny,
    }


def analyze_result(demo: str, sql: str) -> Any:
    try:
        plan = analyze(sql, load_policy(demo_policy_path(demo)))
    except Error as error:
        return _refusal(error)
    return [
        {
            "column": k.column,
            "table": k.table,
            "type": k.type,
            "domain": repr(k.domain),
            "nullable": k.policy.nullable,
            "sql": _sql(k.expr),
        }
        for k in plan.keys
    ]


def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def _registered() -> list[tuple[type[exp.Expr], object]]:
    return list(domains.KEY_FUNCTIONS.items())


def test_every_handler_is_registered_exactly_once() -> None:
    """(a) Every handler of the keys package (a function taking ``node, keys``) is registered, and
    each expression class once: the table's source is read, since a dict literal silently keeps the
    last of two equal keys."""
    tree = ast.parse(inspect.getsource(domains))
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "KEY_FUNCTIONS"
    )
    assert isinstance(table, ast.Dict)
    written = [ast.unparse(k) for k in table.keys if k is not None]
    assert len(written) == len(set(written)) == len(domains.KEY_FUNCTIONS)
    defined = set()
    for path in Path(keys.__file__).parent.glob("*.py"):  # read, not imported: an unimported handler counts too
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and [a.arg for a in fn.args.args] == ["node", "keys"]:
                defined.add(f"{keys.__name__}.{path.stem}.{fn.name}")
    assert defined == {f"{fn.__module__}.{fn.__name__}" for fn in domains.KEY_FUNCTIONS.values()}


def test_every_registered_class_has_a_representative_case() -> None:
    assert {cls for cls, _ in _registered()} == {cls for cls, _, _ in DERIVE_CASES}


@pytest.mark.parametrize(
    ("cls", "text", "dialect"), DERIVE_CASES, ids=[f"{c.__name__}:{t}" for c, t, _ in DERIVE_CASES]
)
def test_registered_class_round_trips(cls: type[exp.Expr], text: str, dialect: str) -> None:
    """(b) The representative key parses to its registered class and derives what the code before
    the registry derived (SQL on both backends, type, domain, bounds, underflow bound, or refusal)."""
    node = parse_one(text, read=dialect)
    assert isinstance(node, cls)
    assert domains.handler_for(node) is domains.KEY_FUNCTIONS[cls]
    assert derive_result(text, dialect) == _golden()["derive"][text]


@pytest.mark.parametrize(("text", "dialect"), UNREGISTERED_CASES, ids=[t for t, _ in UNREGISTERED_CASES])
def test_unregistered_class_is_refused_as_before(text: str, dialect: str) -> None:
    """(c) A constant or a class no handler takes gets the refusal it got before (0A000, same text)."""
    result = derive_result(text, dialect)
    assert result["sqlstate"] == "0A000"
    assert result == _golden()["derive"][text]


@pytest.mark.parametrize(("demo", "sql"), ANALYZE_CASES, ids=[s[:70] for _, s in ANALYZE_CASES])
def test_planned_keys_unchanged(demo: str, sql: str) -> None:
    assert analyze_result(demo, sql) == _golden()["analyze"][sql]


def test_dispatch_follows_the_old_isinstance_order() -> None:
    """Lookup by the most specific registered class of the node's MRO picks, for every sqlglot
    expression class, the handler the old first-match isinstance chain picked."""
    chain: list[tuple[type[exp.Expr], ...]] = [
        (exp.Paren,),
        (exp.Column,),
        (exp.TimestampTrunc, exp.DateTrunc),
        (exp.Extract,),
        (exp.DateBin,),
        (exp.Floor, exp.Ceil),
        (exp.WidthBucket,),
        (exp.Neg,),
        (exp.Add, exp.Sub, exp.Mul, exp.Div),
        (exp.Cast,),
        (exp.Case,),
        (exp.Coalesce,),
        (exp.Predicate, exp.Connector, exp.Not),
    ]
    classes = {c for c in vars(exp).values() if isinstance(c, type) and issubclass(c, exp.Expr)}
    for cls in classes:
        old = next((group for group in chain if issubclass(cls, group)), None)
        new = next((c for c in cls.__mro__ if c in domains.KEY_FUNCTIONS), None)
        if old is None:
            assert new is None, cls
        else:
            assert new is not None and issubclass(cls, old) and new in old and issubclass(cls, new), cls
            assert len({domains.KEY_FUNCTIONS[c] for c in old}) == 1, old


def _regenerate() -> None:
    derive = {text: derive_result(text, dialect) for _, text, dialect in DERIVE_CASES}
    derive |= {text: derive_result(text, dialect) for text, dialect in UNREGISTERED_CASES}
    planned = {sql: analyze_result(demo, sql) for demo, sql in ANALYZE_CASES}
    GOLDEN.write_text(json.dumps({"derive": derive, "analyze": planned}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    _regenerate()
