"""GROUP BY expressions with derived domains, WHERE narrowing, SELECT DISTINCT and BI types (issue #17),
engine-level on the clinic and health demos, on DuckDB and on PostgreSQL."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import load_policy
from dpsql.session import Session
from tests.kinds import open_empty


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    opened = open_empty(request.param, request)
    load_demo(opened, ["clinic", "health"])
    yield opened
    opened.close()


@pytest.fixture
def clinic(backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))


@pytest.fixture
def health(backend: Backend) -> Engine:
    return Engine(load_policy(demo_policy_path("health")), backend, Ledger.open("sqlite:///:memory:"))


SESSION = Session("analyst", epsilon=1.0, delta=1e-6)


def _months(first: dt.datetime, last: dt.datetime) -> list[dt.datetime]:
    out, current = [], first
    while current <= last:
        out.append(current)
        current = dt.datetime(current.year + current.month // 12, current.month % 12 + 1, 1)
    return out


def test_monthly_series_releases_sixty_timestamp_rows(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1", SESSION
    )
    # date_trunc(text, date) is PostgreSQL's timestamptz form (released as UTC instants)
    assert [c.type for c in result.columns] == ["timestamp with time zone", "bigint"]
    assert [r[0] for r in result.rows] == _months(dt.datetime(2020, 1, 1), dt.datetime(2024, 12, 1))
    assert result.delta_spent == 0  # a public (derived) domain: no partition selection


def test_date_filter_keeps_only_its_months(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits "
        "WHERE visit_date >= '2023-03-15' AND visit_date < DATE '2023-06-01' GROUP BY m ORDER BY m",
        SESSION,
    )
    assert [r[0] for r in result.rows] == _months(dt.datetime(2023, 3, 1), dt.datetime(2023, 5, 1))


def test_folded_now_filter_narrows_the_domain(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT DATE_TRUNC('year', visit_date) AS y, COUNT(*) FROM visits "
        "WHERE visit_date >= MAKE_DATE(2022, 1, 1) + INTERVAL '1 year' GROUP BY 1 ORDER BY 1",
        SESSION,
    )
    assert [r[0] for r in result.rows] == [dt.datetime(2023, 1, 1), dt.datetime(2024, 1, 1)]


def test_unmatched_case_literal_and_empty_bucket_still_appear(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT CASE WHEN cost > 5000 THEN 'impossible' WHEN cost > 1000 THEN 'high' ELSE 'low' END AS band, "
        "COUNT(*) FROM visits GROUP BY band ORDER BY band",
        SESSION,
    )
    assert [r[0] for r in result.rows] == ["high", "impossible", "low"]


def test_extract_and_width_bucket_domains(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT EXTRACT(dow FROM visit_date) AS d, width_bucket(cost, 0, 2000, 4) AS b, COUNT(*) "
        "FROM visits GROUP BY 1, 2 ORDER BY 1, 2",
        SESSION,
    )
    assert {(r[0], r[1]) for r in result.rows} == {(d, b) for d in range(7) for b in range(1, 6)}


def test_grafana_epoch_buckets(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT floor(extract(epoch from visit_date)/86400)*86400 AS time, COUNT(*) FROM visits "
        "WHERE visit_date BETWEEN '2024-12-01' AND '2024-12-07' GROUP BY 1 ORDER BY 1",
        SESSION,
    )
    start = (dt.datetime(2024, 12, 1) - dt.datetime(1970, 1, 1)).total_seconds()
    assert [r[0] for r in result.rows] == [int(start) + 86400 * i for i in range(7)]


def test_where_equality_releases_one_row(health: Engine) -> None:
    result = health.execute("SELECT problem, COUNT(*) FROM patients WHERE problem = 'Asthma' GROUP BY problem", SESSION)
    assert [r[0] for r in result.rows] == ["Asthma"]
    result = health.execute(
        "SELECT problem, COUNT(*) FROM patients WHERE problem IN ('Asthma', 'Diabetes', 'Gout') GROUP BY 1", SESSION
    )
    assert sorted(r[0] for r in result.rows) == ["Asthma", "Diabetes"]


@pytest.mark.parametrize(
    ("where", "kept"),
    [
        # #29 item 6: NOT IN, LIKE/ILIKE and OR-ed equalities narrow the released groups as = and IN do
        (
            "problem NOT IN ('Asthma', 'Obesity')",
            ["Chest pain", "Diabetes", "Hypertension", "None", "Shortness of breath"],
        ),
        ("problem = 'Asthma' OR problem = 'Gout' OR problem IN ('Diabetes')", ["Asthma", "Diabetes"]),
        ("(problem = 'Asthma' OR 'Obesity' = problem)", ["Asthma", "Obesity"]),
        ("problem LIKE '%ss%'", ["Shortness of breath"]),
        ("problem LIKE 'H_pertension'", ["Hypertension"]),
        ("problem ILIKE 'a%'", ["Asthma"]),
        (
            "problem NOT LIKE 'A%'",
            ["Asthma", "Chest pain", "Diabetes", "Hypertension", "None", "Obesity", "Shortness of breath"],
        ),  # NOT LIKE: not narrowed (a superset)
        ("problem LIKE '%\\_%'", []),  # an escaped _ is a literal underscore: no declared value has one
        ("problem ILIKE '%BREATH'", ["Shortness of breath"]),
        (
            "problem = 'Asthma' OR age > 3",
            ["Asthma", "Chest pain", "Diabetes", "Hypertension", "None", "Obesity", "Shortness of breath"],
        ),  # not one column's equalities
    ],
)
def test_where_narrows_by_not_in_like_and_or(health: Engine, where: str, kept: list[str]) -> None:
    result = health.execute(f"SELECT problem, COUNT(*) FROM patients WHERE {where} GROUP BY problem", SESSION)
    assert sorted(r[0] for r in result.rows) == kept
    assert result.delta_spent == 0  # still the public domain, no partition selection


def test_is_not_null_drops_the_null_group(health: Engine) -> None:
    both = health.execute("SELECT bmi > 30 AS obese, COUNT(*) FROM patients GROUP BY 1", SESSION)
    assert [r[0] for r in both.rows] == [False, True, None]
    kept = health.execute("SELECT bmi > 30 AS obese, COUNT(*) FROM patients WHERE bmi IS NOT NULL GROUP BY 1", SESSION)
    assert [r[0] for r in kept.rows] == [False, True]


def test_coalesce_over_a_declared_domain(health: Engine) -> None:
    result = health.execute("SELECT COALESCE(problem, 'unknown') AS p, COUNT(*) FROM patients GROUP BY 1", SESSION)
    assert len(result.rows) == 7  # problem is not nullable: 'unknown' cannot occur, and is not added


def test_decades_from_integer_division(health: Engine) -> None:
    result = health.execute(
        "SELECT floor(age / 10) * 10 AS decade, SUM(visits) FROM patients GROUP BY decade ORDER BY 1", SESSION
    )
    assert [r[0] for r in result.rows] == list(range(0, 120, 10))


def test_unknown_domain_falls_back_to_partition_selection(health: Engine) -> None:
    result = health.execute("SELECT bmi * 2 AS b, COUNT(*) FROM patients GROUP BY 1", SESSION)
    assert result.delta_spent > 0


def test_select_distinct_public_keys_release_the_domain_free(health: Engine) -> None:
    result = health.execute("SELECT DISTINCT sex FROM patients ORDER BY 1", SESSION)
    assert result.rows == [("Female",), ("Male",)]
    assert result.epsilon_spent == 0


def test_select_distinct_private_keys_go_through_partition_selection(health: Engine) -> None:
    result = health.execute("SELECT DISTINCT zip FROM patients", SESSION)
    assert result.epsilon_spent == 1.0 and result.delta_spent > 0
    assert all(2100 <= r[0] <= 2199 for r in result.rows)


def test_bi_types(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT CAST(DATE_TRUNC('month', visit_date) AS date) AS m, CAST(COUNT(*) AS numeric) AS n, "
        "EXTRACT(year FROM visit_date) AS y FROM visits WHERE visit_date >= '2024-12-01' GROUP BY 1, 3",
        SESSION,
    )
    assert [(c.name, c.type) for c in result.columns] == [("m", "date"), ("n", "numeric"), ("y", "numeric")]
    assert result.rows[0][0] == dt.date(2024, 12, 1) and result.rows[0][2] == 2024


def test_now_is_each_statements_start(clinic: Engine) -> None:
    """A plan with NOW() folded is never reused: the next run folds its own start time."""
    sql = "SELECT COUNT(*) FROM visits WHERE visit_date < NOW() - INTERVAL '1 day'"
    first, second = clinic.prepare(sql, SESSION), clinic.prepare(sql, SESSION)
    assert first is not second and first.cache_key != second.cache_key


REFUSALS = [
    (
        "SELECT DATE_TRUNC('hour', visit_date), COUNT(*) FROM visits GROUP BY 1",
        "54000",
        "GROUP BY key \"DATE_TRUNC('HOUR', visit_date)\" would release 43825 groups (more than 10000)",
    ),
    ("SELECT lower(department), COUNT(*) FROM visits GROUP BY 1", "0A000", "LOWER is not supported in GROUP BY"),
    (
        "SELECT CASE WHEN cost > 1 THEN department END, COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        "CASE results in GROUP BY must be constants",
    ),
    (
        "SELECT floor(cost / (cost - 10)), COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        "division by an expression that can be zero",
    ),
    (
        "SELECT DATE_TRUNC('decade', visit_date), COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        'DATE_TRUNC("decade") is not supported in GROUP BY',
    ),
    ("SELECT COUNT(*) FROM visits GROUP BY 'a'", "0A000", "GROUP BY a constant is not supported"),
    ("SELECT COUNT(*) FROM visits GROUP BY COUNT(*)", "42803", "aggregate functions are not allowed in GROUP BY"),
    (
        "SELECT COUNT(*) FROM visits WHERE visit_date > MAKE_DATE(2022, 2, 30)",
        "22008",
        "date field value out of range: 2022-02-30",
    ),
    (
        "SELECT COUNT(*) FROM visits WHERE visit_date > TO_DATE('2022-xx-01', 'YYYY-MM-DD')",
        "22007",
        'invalid input syntax for type date: "2022-xx-01"',
    ),
    ("SELECT DISTINCT patient_id FROM visits", "42501", 'permission denied for column "patient_id"'),
]


@pytest.mark.parametrize(("sql", "sqlstate", "message"), REFUSALS, ids=[r[0][:50] for r in REFUSALS])
def test_refusals(sql: str, sqlstate: str, message: str, clinic: Engine) -> None:
    with pytest.raises(Error) as info:
        clinic.execute(sql, SESSION)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)
    assert clinic.ledger.charges("clinic", "analyst") == []


def test_derived_domain_is_a_function_of_policy_and_sql_only(backend: Backend) -> None:
    """Analysis never touches the backend: the released grid is fixed before any row is read."""
    policy = load_policy(demo_policy_path("clinic"))
    plan = analyze("SELECT DATE_TRUNC('quarter', visit_date), COUNT(*) FROM visits GROUP BY 1", policy)
    assert plan.keys[0].domain == tuple(dt.datetime(y, m, 1) for y in range(2020, 2025) for m in (1, 4, 7, 10))
    assert plan.public_keys and plan.selection_measure is None


# --- date_bin (Grafana/Superset time grains) -------------------------------------------------------

#: Timestamps before, at and after the origins below (PostgreSQL floors toward −∞ before the origin).
BIN_VALUES = [
    "1999-12-31 23:59:59.999999",
    "1999-12-31 23:45:00",
    "1999-12-31 23:44:59",
    "1999-12-25 03:00:00",
    "2000-01-01 00:00:00",
    "2000-01-01 00:07:00",
    "2000-01-01 00:15:00",
    "2000-01-03 13:30:00",
    "2001-01-01 00:00:00",
    "2024-02-29 23:59:59",
]
BIN_CASES = [
    ("15 minutes", "2000-01-01 00:00:00"),
    ("1 hour", "2000-01-01 00:10:00"),
    ("90 minutes", "2000-01-01 00:10:00"),
    ("1 day", "2000-01-01 12:00:00"),
    ("7 days", "2001-01-01 00:00:00"),
    ("1 day 1 hour", "2000-01-01 00:00:00"),
    ("1.5 seconds", "2000-01-01 00:00:00"),
]


@pytest.mark.parametrize(("stride", "origin"), BIN_CASES)
def test_date_bin_sql_equals_postgres_and_python(backend: Backend, stride: str, origin: str) -> None:
    """The generated key SQL, run raw on each backend, equals :func:`date_bin` (and PostgreSQL's own
    date_bin on PostgreSQL) before, at and after the origin."""
    from sqlglot import exp, parse_one

    from dpsql.analyze.domains import date_bin, derive
    from dpsql.analyze.fold import parse_interval
    from dpsql.policy import ColumnPolicy

    table = f"bins_{abs(hash((stride, origin))) % 10**8}"
    values = ", ".join(f"(CAST('{v}' AS TIMESTAMP))" for v in BIN_VALUES)
    backend.execute_script(
        f"DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (ts TIMESTAMP); INSERT INTO {table} VALUES {values}"
    )
    stamps = [dt.datetime.fromisoformat(v) for v in BIN_VALUES]
    # the domain as WHERE pins it
    policy = ColumnPolicy(type="timestamp", lower=min(stamps), upper=max(stamps), domain=tuple(stamps))
    node = parse_one(f"date_bin('{stride}', ts, TIMESTAMP '{origin}')", read="postgres")
    assert isinstance(node, exp.Expression)
    key = derive(node, lambda c: (exp.column("ts", table=table), policy), lambda p: p)
    assert key.type == "timestamp"
    sql = f"SELECT ts, {key.sql.sql(dialect=backend.dialect)} FROM {table} ORDER BY ts"
    if backend.dialect == "postgres":
        sql = sql.replace(" FROM", f", date_bin('{stride}', ts, TIMESTAMP '{origin}') FROM")
    interval = parse_interval(stride)
    micros = interval.days * 86_400_000_000 + interval.micros
    for row in backend.execute(sql)[1]:
        expected = date_bin(micros, row[0], dt.datetime.fromisoformat(origin))
        assert all(v == expected for v in row[1:]), (row, expected)
        assert key.values is not None and expected in key.values


def test_date_bin_releases_every_bin_of_the_where_range(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT date_bin(INTERVAL '7 days', visit_date, '2001-01-01') AS w, COUNT(*) FROM visits "
        "WHERE visit_date >= '2024-11-01' AND visit_date < '2024-12-01' GROUP BY 1 ORDER BY 1",
        SESSION,
    )
    # 2001-01-01 is a Monday: weekly bins from the Monday on or before Nov 1 to the one before Nov 30
    assert [r[0] for r in result.rows] == [dt.datetime(2024, 10, 28) + dt.timedelta(days=7 * i) for i in range(5)]
    assert [c.type for c in result.columns] == ["timestamp with time zone", "bigint"]
    assert result.delta_spent == 0


def test_date_bin_of_a_timestamp_cast_is_timestamp(clinic: Engine) -> None:
    result = clinic.execute(
        "SELECT date_bin('36 hours', visit_date::timestamp, TIMESTAMP '2024-12-30 06:00') AS b, COUNT(*) "
        "FROM visits WHERE visit_date >= '2024-12-25' GROUP BY 1 ORDER BY 1",
        SESSION,
    )
    assert [c.type for c in result.columns] == ["timestamp", "bigint"]
    first = dt.datetime(2024, 12, 30, 6) - dt.timedelta(hours=36 * 4)
    assert [r[0] for r in result.rows] == [first + dt.timedelta(hours=36 * i) for i in range(5)]


DATE_BIN_REFUSALS = [
    (
        "SELECT date_bin('1 month', visit_date, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        "timestamps cannot be binned into intervals containing months or years",
    ),
    (
        "SELECT date_bin(INTERVAL '1 year', visit_date, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        "timestamps cannot be binned into intervals containing months or years",
    ),
    (
        "SELECT date_bin('0 minutes', visit_date, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "22008",
        "stride must be greater than zero",
    ),
    (
        "SELECT date_bin('-1 day', visit_date, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "22008",
        "stride must be greater than zero",
    ),
    (
        "SELECT date_bin('1 hour', visit_date, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "54000",
        "GROUP BY key \"DATE_BIN('1 hour', visit_date, '2001-01-01')\" would release 43825 groups (more than 10000)",
    ),
    (
        "SELECT date_bin('1 day', visit_date, visit_date), COUNT(*) FROM visits GROUP BY 1",
        "0A000",
        "date_bin in GROUP BY needs a constant origin without time zone",
    ),
    (
        "SELECT date_bin('1 day', cost, '2001-01-01'), COUNT(*) FROM visits GROUP BY 1",
        "42883",
        "function date_bin(unknown, double precision, unknown) does not exist",
    ),
]


@pytest.mark.parametrize(("sql", "sqlstate", "message"), DATE_BIN_REFUSALS, ids=[r[0][:60] for r in DATE_BIN_REFUSALS])
def test_date_bin_refusals(sql: str, sqlstate: str, message: str, clinic: Engine) -> None:
    """PostgreSQL's own SQLSTATE and message (checked against PostgreSQL 15), before anything runs or is charged."""
    with pytest.raises(Error) as info:
        clinic.execute(sql, SESSION)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)
    assert clinic.ledger.charges("clinic", "analyst") == []


def test_integer_key_that_can_overflow_is_refused(health: Engine) -> None:
    """PostgreSQL would raise 22003 on the rows that overflow smallint (data-dependent): refused from the bounds."""
    with pytest.raises(Error) as info:
        health.execute(
            "SELECT CAST(age AS SMALLINT) * CAST(age AS SMALLINT) * CAST(age AS SMALLINT), COUNT(*) FROM patients "
            "GROUP BY 1",
            SESSION,
        )
    assert (info.value.sqlstate, info.value.message) == (
        "0A000",
        'GROUP BY key "CAST(age AS SMALLINT) * CAST(age AS SMALLINT) * CAST(age AS SMALLINT)" can exceed the '
        "smallint range",
    )
    assert health.ledger.charges("health", "analyst") == []
