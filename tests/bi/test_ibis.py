"""ibis 12 over ``dpsql serve`` (PostgreSQL backend): the SQL it sends for mutate, filter and nested selects.

ibis wraps every ``.mutate()``/``.filter()``/``.select()`` of a ``con.sql(…, schema=…)`` query in one
more ``SELECT … FROM (…) AS tN``, and ``.mutate()`` adds computed columns (``"t0"."cost" > 1000 AS
"big"``). These row-level views are inlined (dpsql/analyze/views.py), so each query measures exactly
what its flat form measures, on DuckDB and PostgreSQL; aggregates, windows and subqueries inside a
view stay refused before any charge. ``con.sql()`` without ``schema=`` probes the columns with
``CREATE TEMPORARY VIEW``, which dpsql refuses like any DDL (25006): see docs/bi.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import Policy, load_policy
from dpsql.rewrite import to_sql
from dpsql.session import Session
from tests.pg import open_demo_backend

#: (the SQL ibis 12.0 sent, verbatim; the flat query it must measure)
IBIS_SHAPES = [
    (  # v.mutate(big=v.cost > 1000).group_by("big").aggregate(n=_.count())
        'SELECT "t1"."big", COUNT(*) AS "n" FROM (SELECT "t0"."department", "t0"."visit_date", "t0"."cost", '
        '"t0"."urgent", "t0"."cost" > 1000 AS "big" FROM "visits" AS "t0") AS "t1" GROUP BY 1',
        'SELECT cost > 1000 AS "big", COUNT(*) AS n FROM visits GROUP BY 1',
    ),
    (  # v.select("department", "cost").mutate(c=_.cost + 1).group_by("department").aggregate(m=_.c.mean())
        'SELECT "t1"."department", AVG("t1"."c") AS "m" FROM (SELECT "t0"."department", "t0"."cost", '
        '"t0"."cost" + 1 AS "c" FROM "visits" AS "t0") AS "t1" GROUP BY 1',
        "SELECT department, AVG(cost + 1) AS m FROM visits GROUP BY 1",
    ),
    (  # con.sql("SELECT department, cost FROM visits WHERE urgent", schema=…).filter(_.cost > 10).group_by(…)
        'SELECT "t1"."department", COUNT(*) AS "n" FROM (SELECT * FROM (SELECT department, cost FROM visits '
        'WHERE urgent) AS "t0" WHERE "t0"."cost" > 10) AS "t1" GROUP BY 1',
        "SELECT department, COUNT(*) AS n FROM visits WHERE cost > 10 AND urgent GROUP BY 1",
    ),
    (  # con.sql("SELECT t.department AS d, t.cost FROM visits t WHERE t.urgent", schema=…).mutate(c2=_.cost * 2)…
        'SELECT "t1"."d", SUM("t1"."c2") AS "s" FROM (SELECT "t0"."d", "t0"."cost", "t0"."cost" * 2 AS "c2" '
        'FROM (SELECT t.department AS d, t.cost FROM visits AS t WHERE t.urgent) AS "t0") AS "t1" GROUP BY 1',
        'SELECT department AS "d", SUM(cost * 2) AS s FROM visits WHERE urgent GROUP BY 1',
    ),
    (  # three levels, a computed column of a computed column, and precedence: (cost * 2 + 1) * 3
        'SELECT "t2"."department", SUM("t2"."c3" * 3) AS "s" FROM (SELECT "t1"."department", "t1"."c2" + 1 AS "c3" '
        'FROM (SELECT "t0"."department", "t0"."cost" * 2 AS "c2" FROM "visits" AS "t0" WHERE "t0"."urgent") AS "t1") '
        'AS "t2" GROUP BY 1',
        "SELECT department, SUM((cost * 2 + 1) * 3) AS s FROM visits WHERE urgent GROUP BY 1",
    ),
]

#: Still refused, before any charge: what a view computes from other rows or tables is not a row's value.
REFUSED = [
    (  # a window in a mutate (ibis: _.cost.mean().over()), one level down
        'SELECT "t2"."department", COUNT(*) FROM (SELECT "t1"."department" FROM (SELECT "t0"."department", '
        'AVG("t0"."cost") OVER () AS "w" FROM "visits" AS "t0") AS "t1") AS "t2" GROUP BY 1',
        "0A000",
        'the subquery or CTE "t1" may only select columns and row-level expressions',
    ),
    (  # a scalar subquery as a computed column
        'SELECT SUM("t1"."m") FROM (SELECT (SELECT MAX(cost) FROM visits) AS "m" FROM "visits" AS "t0") AS "t1"',
        "0A000",
        'the subquery or CTE "t1" may only select columns and row-level expressions',
    ),
    (  # random() would be drawn once per reference once inlined
        'SELECT COUNT(*) FROM (SELECT "t0"."department", RANDOM() AS "r" FROM "visits" AS "t0") AS "t1" '
        'WHERE "t1"."r" < 0.5',
        "0A000",
        'the subquery or CTE "t1" may only select columns and row-level expressions',
    ),
    (  # an identifier stays an identifier through a computed column
        'SELECT COUNT(*) FROM (SELECT "t0"."patient_id" + 0 AS "p" FROM "visits" AS "t0") AS "t1" GROUP BY "t1"."p"',
        "42501",
        'permission denied for column "patient_id"',
    ),
    (  # ibis's con.sql() schema probe: DDL, refused as in a read-only transaction
        "CREATE TEMPORARY VIEW ibis_postgres_metadata_x AS SELECT department, COUNT(*) FROM visits GROUP BY 1",
        "25006",
        None,
    ),
]

SESSION = Session("analyst", epsilon=1.0, delta=1e-6)


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    opened = open_demo_backend(request, "clinic")
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy(demo_policy_path("clinic"))


def _exact(backend: Backend, sql: str, policy: Policy) -> dict[Any, tuple[Any, ...]]:
    rows = backend.execute(to_sql(analyze(sql, policy), backend.dialect))[1]
    return {row[0]: tuple(row[1:]) for row in rows}


@pytest.mark.parametrize(("ibis_sql", "flat_sql"), IBIS_SHAPES, ids=range(len(IBIS_SHAPES)))
def test_ibis_views_measure_what_the_flat_query_measures(
    backend: Backend, policy: Policy, ibis_sql: str, flat_sql: str
) -> None:
    via, expected = _exact(backend, ibis_sql, policy), _exact(backend, flat_sql, policy)
    assert via.keys() == expected.keys()
    for key, values in via.items():  # float sums: summation order differs in the last bits
        assert values == pytest.approx(expected[key], rel=1e-9), key


@pytest.mark.parametrize(("ibis_sql", "flat_sql"), IBIS_SHAPES[:2], ids=range(2))
def test_ibis_views_keep_output_names_and_charge_once(backend: Backend, ibis_sql: str, flat_sql: str) -> None:
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))
    result = engine.execute(ibis_sql, SESSION)
    flat = engine.execute(flat_sql, SESSION)
    assert [c.name for c in result.columns] == [c.name for c in flat.columns]
    assert result.epsilon_spent == pytest.approx(1.0)


@pytest.mark.parametrize(("sql", "sqlstate", "message"), REFUSED, ids=range(len(REFUSED)))
def test_views_that_are_not_row_level_are_refused_free(
    backend: Backend, sql: str, sqlstate: str, message: str | None
) -> None:
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"))
    with pytest.raises(Error) as info:
        engine.execute(sql, SESSION)
    assert info.value.sqlstate == sqlstate
    if message is not None:
        assert info.value.message == message
    assert engine.ledger.charges("clinic", SESSION.analyst) == []


def test_an_aggregate_two_levels_down_is_not_inlined(policy: Policy, backend: Backend) -> None:
    """The inliner refuses it (its GROUP BY is not row-level); the engine answers it only as post-processing
    of the inner DP query (a sum of released counts), charged once."""
    sql = (
        'SELECT SUM("t2"."n") FROM (SELECT "t1"."n" FROM (SELECT "t0"."department", COUNT(*) AS "n" '
        'FROM "visits" AS "t0" GROUP BY 1) AS "t1") AS "t2"'
    )
    with pytest.raises(Error) as info:
        analyze(sql, policy)
    assert (info.value.sqlstate, info.value.message) == (
        "0A000",
        'GROUP BY inside the subquery or CTE "t1" is only supported on the privacy unit',
    )
    engine = Engine(policy, backend, Ledger.open("sqlite:///:memory:"))
    assert engine.execute(sql, SESSION).epsilon_spent == pytest.approx(1.0)


def test_ibis_against_a_live_server(clinic_server: tuple[str, Engine]) -> None:
    """ibis itself, over the PostgreSQL wire: ``con.sql(…, schema=…)`` needs no catalog, and its
    ``.filter()``/``.mutate()`` wrappers are answered; ``con.sql()`` without a schema is refused (25006)."""
    ibis = pytest.importorskip("ibis")
    from ibis import _

    dsn, engine = clinic_server
    params = dict(part.split("=", 1) for part in dsn.split())
    con = ibis.postgres.connect(
        host=params["host"],
        port=int(params["port"]),
        user=params["user"],
        database=params["dbname"],
        options="-c dpsql.epsilon=0.05",
    )
    try:
        schema = {"department": "string", "cost": "float64"}
        rows = con.sql("SELECT department, cost FROM visits WHERE urgent", schema=schema)
        counts = rows.filter(_.cost > 10).group_by("department").aggregate(n=_.count()).execute()
        assert list(counts.columns) == ["department", "n"] and len(counts) > 0
        sums = rows.mutate(c2=_.cost * 2).group_by("department").aggregate(s=_.c2.sum()).execute()
        assert list(sums.columns) == ["department", "s"] and len(sums) > 0
        before = engine.ledger.spent("clinic", "analyst").epsilon
        with pytest.raises(psycopg.Error) as info:
            con.sql("SELECT department, COUNT(*) FROM visits GROUP BY department")
        assert info.value.sqlstate == "25006"
        assert engine.ledger.spent("clinic", "analyst").epsilon == before
    finally:
        con.disconnect()


def test_doubling_computed_columns_are_refused_not_expanded(policy: Policy) -> None:
    """c + c nested 30 levels would inline to 2^30 nodes: refused (54001) once one copy passes the bound."""
    sql = "SELECT department, cost AS c FROM visits"
    for i in range(30):
        sql = f"SELECT t{i}.department, t{i}.c + t{i}.c AS c FROM ({sql}) AS t{i}"
    with pytest.raises(Error) as info:
        analyze(f"SELECT x.department, SUM(x.c) FROM ({sql}) AS x GROUP BY 1", policy)
    assert info.value.sqlstate == "54001"
