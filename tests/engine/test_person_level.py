"""Person-level privacy across tables: contribution bounding, joins, neighbouring databases."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from dpsql.analyze import analyze
from dpsql.backends import Backend, open_backend
from dpsql.dev.demo import HEAVY_PATIENTS, demo_policy_path, load_demo
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.plan import Physical, Plan
from dpsql.policy import Policy, load_policy, parse_policy
from dpsql.release.apply import centre_rows
from dpsql.rewrite import to_sql
from dpsql.session import Session
from tests.demos import demo_fixture
from tests.policies import one_table

HEAVY = HEAVY_PATIENTS[1]


@pytest.fixture(scope="module")
def clinic_policy() -> Policy:
    return load_policy(demo_policy_path("clinic"))


def _without_person(backend: Backend, patient: int) -> None:
    for table in ("visits", "prescriptions"):
        backend.execute_script(f"DELETE FROM {table} WHERE patient_id = {patient}")
    backend.execute_script(f"DELETE FROM patients WHERE id = {patient}")


@pytest.fixture(scope="module")
def clinic_duckdb() -> Iterator[tuple[Backend, Backend]]:
    """The clinic, and its neighbour without every row of one heavy patient."""
    full, neighbour = open_backend("duckdb://"), open_backend("duckdb://")
    load_demo(full, ["clinic"])
    load_demo(neighbour, ["clinic"])
    _without_person(neighbour, HEAVY)
    yield full, neighbour
    full.close()
    neighbour.close()


clinic_pg = demo_fixture("clinic", kind="postgres", scope="module")


@pytest.fixture(scope="module")
def clinic_pg_neighbour(pg_new_database: Callable[[], str]) -> Iterator[Backend]:
    """The clinic on PostgreSQL without every row of the heavy patient (``clinic_pg``'s neighbour)."""
    backend = open_backend(pg_new_database())
    load_demo(backend, ["clinic"])
    _without_person(backend, HEAVY)
    yield backend
    backend.close()


QUERIES = [
    "SELECT COUNT(*) FROM visits",
    "SELECT SUM(cost), AVG(cost) FROM visits",
    "SELECT AVG(dose_mg), COUNT(*) FROM prescriptions WHERE drug IN ('Insulin', 'Metformin')",
    "SELECT d.building, COUNT(*), SUM(v.cost), COUNT(DISTINCT v.patient_id) "
    "FROM visits v JOIN departments d ON v.department = d.name GROUP BY d.building",
    "SELECT p.sex, COUNT(*), AVG(r.dose_mg) FROM patients p JOIN prescriptions r ON r.patient_id = p.id GROUP BY p.sex",
    "SELECT v.department, COUNT(*), SUM(v.cost) FROM patients p JOIN visits v ON v.patient_id = p.id "
    "LEFT JOIN departments d ON d.name = v.department WHERE p.age > 20 GROUP BY v.department",
    "SELECT COUNT(DISTINCT id), SUM(age) FROM patients",
    # counts by key only: identical rows are collapsed with their multiplicity before bounding
    "SELECT department, COUNT(*) FROM visits GROUP BY department",
    "SELECT d.building, COUNT(*) FROM visits v JOIN departments d ON v.department = d.name GROUP BY d.building",
]


#: Physical choices: md5 order (every backend), DuckDB's HASH order, HASH with MIN_BY top rows (the
#: engine's DuckDB choice), HASH with ROW_NUMBER top rows, and PostgreSQL's hashtextextended with
#: ROW_NUMBER top rows (the engine's PostgreSQL choice).
PHYSICAL = {
    "md5": Physical("fixed-salt-for-the-test"),
    "duckdb": Physical("fixed-salt-for-the-test", hash="duckdb"),
    "top": Physical("fixed-salt-for-the-test", hash="duckdb", top_rows="min_by"),
    "top_rn": Physical("fixed-salt-for-the-test", hash="duckdb", top_rows="row_number"),
    "postgres": Physical("fixed-salt-for-the-test", hash="postgres", top_rows="row_number"),
}


def _plan(sql: str, policy: Policy, *, physical: str = "md5") -> Plan:
    """``physical``: a key of :data:`PHYSICAL` (the engine picks "top" on DuckDB, "md5" elsewhere)."""
    return replace(analyze(sql, policy), physical=PHYSICAL[physical])


def _cells(backend: Backend, plan: Plan, dialect: str) -> dict[tuple, tuple]:
    _, rows = backend.execute(to_sql(plan, dialect))
    rows = centre_rows(plan, rows)
    n = len(plan.keys)
    return {tuple(r[:n]): tuple(0 if v is None else v for v in r[n:]) for r in rows}


@pytest.mark.parametrize("physical", ["md5", "top", "top_rn", "postgres"])
@pytest.mark.parametrize("sql", QUERIES)
def test_neighbours_differ_by_at_most_the_sensitivity(
    sql: str,
    physical: str,
    clinic_policy: Policy,
    clinic_duckdb: tuple[Backend, Backend],
    request: pytest.FixtureRequest,
) -> None:
    """Remove *all* rows of a patient with hundreds of rows: each measure moves ≤ its L1 sensitivity
    (PostgreSQL's own hash on PostgreSQL, the others on DuckDB)."""
    plan = _plan(sql, clinic_policy, physical=physical)
    if physical == "postgres":
        pair = (request.getfixturevalue("clinic_pg"), request.getfixturevalue("clinic_pg_neighbour"))
    else:
        pair = clinic_duckdb
    full, neighbour = (_cells(b, plan, b.dialect) for b in pair)
    zeros = (0,) * len(plan.measures)
    for i, measure in enumerate(plan.measures):
        l1, _ = plan.sensitivities(measure)
        moved = sum(abs(full.get(k, zeros)[i] - neighbour.get(k, zeros)[i]) for k in set(full) | set(neighbour))
        assert moved <= l1 + 1e-6, (measure, moved, l1)
    # float sums may differ in the last bit where nothing changed (summation order): compare approximately
    changed_groups = sum(
        full.get(k, zeros) != pytest.approx(neighbour.get(k, zeros), rel=1e-12) for k in set(full) | set(neighbour)
    )
    assert changed_groups <= plan.max_groups


def test_heavy_person_bounded_by_max_rows_and_explain_matches(
    clinic_policy: Policy, clinic_duckdb: tuple[Backend, Backend]
) -> None:
    raw = [b.execute("SELECT COUNT(*) FROM visits")[1][0][0] for b in clinic_duckdb]
    assert raw[0] - raw[1] == 300  # unbounded, the heavy patient moves the count by 300
    plan = _plan("SELECT COUNT(*) FROM visits", clinic_policy)
    bounded = [_cells(b, plan, "duckdb")[()][0] for b in clinic_duckdb]
    assert bounded[0] - bounded[1] == 20  # max_rows_per_unit of visits
    engine = Engine(clinic_policy, clinic_duckdb[0], Ledger.open("sqlite:///:memory:"))
    explanation = engine.explain("SELECT COUNT(*) FROM visits", Session("alice", epsilon=0.5))
    assert explanation.columns[0]["sensitivity"] == 20 and explanation.columns[0]["scale"] == 40
    assert explanation.unit.startswith("patients.id (at most 20 rows")
    assert 'GROUP BY "visits"."patient_id"' in explanation.sql  # ungrouped: per-patient partial counts
    grouped = engine.explain("SELECT department, COUNT(*) FROM visits GROUP BY department", Session("alice"))
    assert "<secret>" in grouped.sql and engine._salt not in grouped.sql  # the row-selection salt stays hidden


@pytest.mark.parametrize("sql", QUERIES)
def test_identical_pre_noise_results_on_duckdb_and_postgres(
    sql: str, clinic_policy: Policy, clinic_duckdb: tuple[Backend, Backend], clinic_pg: Backend
) -> None:
    """In md5 order (the portable one) every backend keeps the same rows and cells."""
    plan = _plan(sql, clinic_policy)
    duck, pg = _cells(clinic_duckdb[0], plan, "duckdb"), _cells(clinic_pg, plan, "postgres")
    assert duck.keys() == pg.keys()
    for key in duck:
        assert duck[key] == pytest.approx(pg[key], rel=1e-12), key


def test_engine_answers_person_level_queries(clinic_policy: Policy, clinic_duckdb: tuple[Backend, Backend]) -> None:
    engine = Engine(clinic_policy, clinic_duckdb[0], Ledger.open("sqlite:///:memory:"))
    result = engine.execute("SELECT COUNT(DISTINCT patient_id) FROM visits", Session("alice"))
    assert 1900 < result.rows[0][0] < 2100
    grouped = engine.execute("SELECT department, COUNT(*) FROM visits GROUP BY department", Session("alice"))
    assert {r[0] for r in grouped.rows} <= {
        "Cardiology",
        "Oncology",
        "Pediatrics",
        "Emergency",
        "Dermatology",
        "Neurology",
    }


JOIN_REFUSALS = [
    (
        "SELECT COUNT(*) FROM visits a JOIN visits b ON a.patient_id = b.patient_id",
        "0A000",
        'self-joins of private table "visits" are not supported',
    ),
    ("SELECT COUNT(*) FROM visits CROSS JOIN prescriptions", "0A000", "cross joins are not supported"),
    ("SELECT COUNT(*) FROM visits, prescriptions", "0A000", "cross joins are not supported"),
    (
        "SELECT COUNT(*) FROM visits v JOIN prescriptions r ON v.patient_id < r.patient_id",
        "0A000",
        "JOIN conditions need an equality between columns",
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN prescriptions r ON v.id = r.id",
        "0A000",
        'private tables "visits" and "prescriptions" must be joined on their privacy unit',
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.department = d.name "
        "JOIN prescriptions r ON r.drug = d.name",
        "0A000",
        "private tables must be joined on their privacy unit",
    ),
    (
        "SELECT COUNT(*) FROM visits v RIGHT JOIN patients p ON v.patient_id = p.id",
        "0A000",
        "RIGHT JOIN is not supported",
    ),
    (
        "SELECT COUNT(*) FROM visits v FULL JOIN patients p ON v.patient_id = p.id",
        "0A000",
        "FULL JOIN is not supported",
    ),
    ("SELECT COUNT(*) FROM visits v JOIN patients p USING (id)", "0A000", "JOIN ... USING is not supported"),
    (
        "SELECT COUNT(*) FROM visits UNION ALL SELECT COUNT(*) FROM prescriptions",
        "0A000",
        "UNION is not supported",
    ),
    ("SELECT SUM(patient_id) FROM visits", "42501", 'permission denied for column "patient_id"'),
    (
        "SELECT COUNT(*) FROM visits v JOIN patients p ON v.patient_id = p.id WHERE p.id = 42",
        "42501",
        'permission denied for column "id"',
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN patients p ON v.patient_id = p.id GROUP BY id",
        "42702",
        'column reference "id" is ambiguous',
    ),
]


@pytest.mark.parametrize(("sql", "sqlstate", "message"), JOIN_REFUSALS, ids=[r[0][:70] for r in JOIN_REFUSALS])
def test_join_refusals(sql: str, sqlstate: str, message: str, clinic_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze(sql, clinic_policy)
    assert (info.value.sqlstate, info.value.message) == (sqlstate, message)


def test_row_level_table_cannot_join(health_policy: Policy) -> None:
    with pytest.raises(Error) as info:
        analyze("SELECT COUNT(*) FROM patients a JOIN patients b ON a.age = b.age", health_policy)
    assert info.value.message == 'self-joins of private table "patients" are not supported'


def test_group_privacy_bounds_a_whole_household(clinic_duckdb: tuple[Backend, Backend]) -> None:
    """With households as the unit, removing a household (two members) moves each measure ≤ its sensitivity."""
    policy = load_policy(demo_policy_path("clinic_households"))
    full = clinic_duckdb[0]
    neighbour = open_backend("duckdb://")
    load_demo(neighbour, ["clinic"])
    household = (HEAVY + 1) // 2
    for member in (2 * household - 1, 2 * household):
        _without_person(neighbour, member)
    household_queries = [
        *QUERIES[:-1],
        "SELECT p.sex, COUNT(*) FROM visits v JOIN patients p ON v.patient_id = p.id GROUP BY p.sex",
    ]
    for sql in household_queries:
        if "DISTINCT" in sql:
            continue
        plan = _plan(sql, policy)
        a, b = _cells(full, plan, "duckdb"), _cells(neighbour, plan, "duckdb")
        zeros = (0,) * len(plan.measures)
        for i, measure in enumerate(plan.measures):
            moved = sum(abs(a.get(k, zeros)[i] - b.get(k, zeros)[i]) for k in set(a) | set(b))
            assert moved <= plan.sensitivities(measure)[0] + 1e-6, (sql, measure)
    engine = Engine(policy, full, Ledger.open("sqlite:///:memory:"))
    assert engine.explain("SELECT COUNT(*) FROM visits", Session("alice")).unit.startswith("patients.household_id")
    neighbour.close()


def test_subquery_over_a_private_table_keeps_the_person_bound(
    clinic_policy: Policy, clinic_duckdb: tuple[Backend, Backend]
) -> None:
    sql = (
        "SELECT d.building, COUNT(*) FROM (SELECT patient_id, department FROM visits WHERE cost > 100) v "
        "JOIN departments d ON v.department = d.name GROUP BY d.building"
    )
    plan = _plan(sql, clinic_policy)
    assert plan.max_rows == 20
    full, neighbour = (_cells(b, plan, "duckdb") for b in clinic_duckdb)
    moved = sum(abs(full.get(k, (0,))[0] - neighbour.get(k, (0,))[0]) for k in set(full) | set(neighbour))
    assert moved <= plan.sensitivities(plan.measures[0])[0]


FLOAT_COLUMNS = """
person: {type: int, identifier: true}
shop: {type: text, domain: [a, b]}
amount: {type: float, lower: -1.0, upper: 1.0e+16}
"""
FLOAT_POLICY = one_table("floats", "spend", "person", 5, FLOAT_COLUMNS, groups=3)


def test_float_values_pick_the_same_rows_on_every_backend(pg_new_database: Callable[[], str]) -> None:
    """Doubles print differently (DuckDB 4999.0 and 1000000000000000.0, PostgreSQL 4999 and 1e+15): the row
    hash must not depend on that, or a person over the bound keeps different rows on each backend."""
    policy = parse_policy(FLOAT_POLICY)
    amounts = [4999.0, 1e15, 0.1, 2.5e-7, 123456789.0, 1e16, -0.0, 7.0, 3.0e9, 42.0, 0.30000000000000004, 1e-5]
    rows = [(1, "a" if i % 3 else "b", v) for i, v in enumerate(amounts)] + [(2, "a", 10.0), (3, "b", None)]
    queries = [
        "SELECT shop, COUNT(*), SUM(amount) FROM spend GROUP BY shop",
        "SELECT amount, COUNT(*) FROM spend GROUP BY amount",  # a float key ranks the groups a person keeps
    ]
    cells: dict[str, list[dict[tuple, tuple]]] = {sql: [] for sql in queries}
    for url in ("duckdb://", pg_new_database()):
        backend = open_backend(url)
        backend.load_rows("spend", [("person", "bigint"), ("shop", "text"), ("amount", "double precision")], rows)
        for sql in queries:
            cells[sql].append(_cells(backend, _plan(sql, policy), backend.dialect))
        backend.close()
    for sql, (duck, pg) in cells.items():
        assert duck.keys() == pg.keys(), sql
        for key in duck:
            assert duck[key] == pytest.approx(pg[key], rel=1e-12), (sql, key)


CELLS_COLUMNS = """
u: {type: int, identifier: true}
w: {type: int}
k: {type: text}
x: {type: float, lower: 0.0, upper: 1.0}
"""
CELLS_POLICY = one_table("cells", "ev", "u", 5, CELLS_COLUMNS, groups="%d")


def _cell_rows() -> list[tuple[int | None, str | None, float]]:
    """(unit, key, 1.0): units with 1-40 rows over keys a-e and NULL, duplicates included, rows without a unit."""
    rows: list[tuple[int | None, str | None, float]] = []
    keys: list[str | None] = ["a", "b", "c", "d", "e", None]
    for unit in range(1, 41):
        for i in range(unit):
            rows.append((unit, keys[(unit * i) % (1 + unit % 6)], 1.0))
    rows += [(None, "a", 1.0)] * 7 + [(None, None, 1.0)] * 3 + [(0, "", 1.0), (0, None, 1.0)] * 4
    return rows


@pytest.mark.parametrize("physical", ["md5", "duckdb", "postgres"])
@pytest.mark.parametrize("max_groups", [5, 2])
def test_grouped_sums_keep_max_rows_of_each_unit(
    max_groups: int, physical: str, pg_new_database: Callable[[], str]
) -> None:
    """Grouped sums keep at most max_rows rows and max_groups groups of each unit: whole cells (one unit
    in one group) in salted order and a share of the crossing cell, in md5, DuckDB HASH or PostgreSQL
    hashtextextended order.

    With x = 1, SUM(x) counts the rows kept. Restricted to one unit by WHERE (on ``w``, a copy of the
    unit), the query must keep at most min(max_rows, rows in its largest max_groups groups) rows of
    it, exactly min(max_rows, its rows) when no group is ranked out, in at most max_groups groups;
    over all units, the sum of those. NULL units and NULL keys are cells like any other.
    """
    policy = parse_policy(CELLS_POLICY % max_groups)
    rows = _cell_rows()
    units = sorted({r[0] for r in rows}, key=lambda u: -1 if u is None else u)
    sql = "SELECT k, SUM(x) FROM ev {where} GROUP BY k"
    assert "__cells" in to_sql(_plan(sql.format(where=""), policy, physical=physical), "duckdb")
    results: list[dict[tuple, tuple]] = []
    urls = {"md5": ("duckdb://", pg_new_database()), "duckdb": ("duckdb://",), "postgres": (pg_new_database(),)}
    for url in urls[physical]:
        backend = open_backend(url)
        columns = [("u", "bigint"), ("w", "bigint"), ("k", "text"), ("x", "double precision")]
        backend.load_rows("ev", columns, [(u, u, k, x) for u, k, x in rows])
        total = 0.0
        for unit in units:
            where = "WHERE w IS NULL" if unit is None else f"WHERE w = {unit}"
            kept = _cells(backend, _plan(sql.format(where=where), policy, physical=physical), backend.dialect)
            per_key: dict[str | None, int] = {}
            for u, k, _ in rows:
                if u == unit:
                    per_key[k] = per_key.get(k, 0) + 1
            largest_first = sorted(per_key.values(), reverse=True)
            assert sum(v[0] for v in kept.values()) <= min(5, sum(largest_first[:max_groups])), (url, unit)
            assert sum(v[0] for v in kept.values()) >= min(5, min(per_key.values())), (url, unit)
            assert sum(1 for v in kept.values() if v[0]) <= max_groups, (url, unit)
            if len(per_key) <= max_groups:  # no group ranked out: exactly min(max_rows, rows) kept
                assert sum(v[0] for v in kept.values()) == min(5, sum(per_key.values())), (url, unit)
            total += sum(v[0] for v in kept.values())
        everyone = _cells(backend, _plan(sql.format(where=""), policy, physical=physical), backend.dialect)
        assert sum(v[0] for v in everyone.values()) == total
        results.append(everyone)
        backend.close()
    if physical == "md5":
        assert results[0] == results[1]  # the same rows kept on DuckDB and PostgreSQL


def test_engine_orders_cells_by_the_backends_cheapest_hash(
    clinic_policy: Policy, clinic_duckdb: tuple[Backend, Backend], clinic_pg: Backend
) -> None:
    """DuckDB orders a heavy unit's cells by its own HASH (an order of magnitude cheaper than md5 per
    cell); PostgreSQL by hashtextextended (a bigint: its sort is cheaper than md5's text). Both keep
    whole cells and scale the crossing one."""
    sql = "SELECT department, SUM(cost) FROM visits GROUP BY department"
    for backend, order in ((clinic_duckdb[0], "HASH("), (clinic_pg, "HASHTEXTEXTENDED(")):
        engine = Engine(clinic_policy, backend, Ledger.open("sqlite:///:memory:"))
        text = engine.prepare(sql, Session("alice")).sql
        assert "__cells" in text and order in text, backend.dialect
        assert len(engine.execute(sql, Session("alice")).rows) <= 6
        engine.ledger.close()


TOP_COLUMNS = """
u: {type: int, identifier: true}
w: {type: int}
k: {type: text, domain: [a, b, c, d, e, f, g, h], nullable: false}
"""
TOP_POLICY = one_table("top", "ev", "u", 5, TOP_COLUMNS)


@pytest.mark.parametrize("top", ["top", "top_rn", "postgres"])
def test_top_rows_keep_what_cells_keep(top: str, pg_new_database: Callable[[], str]) -> None:
    """Counts over a public domain larger than max_rows (8 keys, 5 rows) take each unit's first rows in
    cell-hash order (MIN_BY on DuckDB, ROW_NUMBER elsewhere): the very counts the cells path keeps in
    that order, each unit exactly min(max_rows, its rows); a distinct-unit count adds 1 per group a unit
    keeps rows in. ``postgres`` runs on PostgreSQL with its own hash, the others on DuckDB."""
    policy = parse_policy(TOP_POLICY)
    rows = [(u, u, "abcdefgh"[(u * i) % 8]) for u in range(1, 30) for i in range(u)] + [(0, 0, "a")] * 9
    backend = open_backend(pg_new_database() if top == "postgres" else "duckdb://")
    backend.load_rows("ev", [("u", "bigint"), ("w", "bigint"), ("k", "text")], rows)
    sql = "SELECT k, COUNT(*), COUNT(DISTINCT u) FROM ev {where} GROUP BY k"
    marker = "MIN_BY" if top == "top" else "ROW_NUMBER"
    assert marker in to_sql(_plan(sql.format(where=""), policy, physical=top), backend.dialect)
    assert marker not in to_sql(_plan("SELECT k, COUNT(w) FROM ev GROUP BY k", policy, physical=top), backend.dialect)
    cells_physical = "postgres" if top == "postgres" else "duckdb"
    cells_plan = _plan(sql.format(where=""), policy, physical=cells_physical)
    if top == "postgres":  # the same hash without top rows: the cells path
        cells_plan = replace(cells_plan, physical=replace(cells_plan.physical, top_rows=None))
    top_cells = _cells(backend, _plan(sql.format(where=""), policy, physical=top), backend.dialect)
    assert top_cells == _cells(backend, cells_plan, backend.dialect)
    for unit in range(30):
        kept = _cells(backend, _plan(sql.format(where=f"WHERE w = {unit}"), policy, physical=top), backend.dialect)
        assert sum(v[0] for v in kept.values()) == min(5, sum(1 for r in rows if r[0] == unit)), unit
        assert all(v[1] == 1 for v in kept.values()), unit
    backend.close()
