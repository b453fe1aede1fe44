"""Superset's series limit (issue #17): the ranking sub-query released first, the outer query filtered by its
released keys (adaptive composition), charged once for both, on DuckDB and PostgreSQL and over the wire."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import psycopg
import pytest

from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.dev.demo import demo_policy_path
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.pgtypes import INT8, TEXT, TIMESTAMPTZ
from dpsql.policy import load_policy
from dpsql.session import Session
from tests.demos import demo_fixture

EPS = 0.5
RANKING = (
    "SELECT department AS department__, COUNT(*) AS mme_inner__ FROM visits "
    "GROUP BY department ORDER BY mme_inner__ DESC LIMIT 3"
)
#: Superset 6.1's time-series chart with a dimension and "series limit: 3", as it sends it.
SERIES = (
    "SELECT DATE_TRUNC('YEAR', visit_date) AS visit_date, department AS department, COUNT(*) AS count "
    f"FROM public.visits JOIN ({RANKING}) AS series_limit ON department = department__ "
    "GROUP BY DATE_TRUNC('YEAR', visit_date), department ORDER BY count DESC LIMIT 10000"
)
YEARS = {dt.datetime(y, 1, 1) for y in range(2020, 2025)}


backend = demo_fixture("clinic", kind="both", scope="module")


@pytest.fixture
def clinic(backend: Backend) -> Iterator[Engine]:
    """The clinic engine with a fresh ledger and a fresh result cache."""
    engine = Engine(load_policy(demo_policy_path("clinic")), backend, Ledger.open("sqlite:///:memory:"), ResultCache())
    yield engine
    assert engine.cache is not None
    engine.cache.close()


def run(engine: Engine, sql: str, analyst: str = "alice", epsilon: float = EPS):
    return engine.execute(sql, Session(analyst, epsilon=epsilon))


def spent(engine: Engine, analyst: str = "alice") -> float:
    return engine.ledger.spent("clinic", analyst).epsilon


def test_superset_series_limit(clinic: Engine) -> None:
    result = run(clinic, SERIES)
    assert [(c.name, c.type) for c in result.columns] == [
        ("visit_date", "timestamp with time zone"),  # date_trunc of a date, as PostgreSQL
        ("department", "text"),
        ("count", "bigint"),
    ]
    departments = {r[1] for r in result.rows}
    assert len(departments) == 3  # exactly the released keys: the domain intersected with the list
    assert len(result.rows) == 15 and {r[0] for r in result.rows} == YEARS
    assert [r[2] for r in result.rows] == sorted((r[2] for r in result.rows), reverse=True)
    assert result.epsilon_spent == pytest.approx(2 * EPS) and result.delta_spent == 0  # no partition selection
    assert spent(clinic) == pytest.approx(2 * EPS)
    assert len(clinic.ledger.charges("clinic", "alice")) == 1  # one reservation for inner and outer
    assert any("3 series chosen" in n for n in result.notices)
    # the ranking's release is public now: asked alone, it is the cached release the series were chosen by
    ranking = run(clinic, RANKING)
    assert ranking.epsilon_spent == 0 and {r[0] for r in ranking.rows} == departments
    assert clinic.describe(SERIES, Session("alice")).columns == result.columns
    assert spent(clinic) == pytest.approx(2 * EPS)


def test_exact_repeat_is_a_free_cache_hit(clinic: Engine) -> None:
    """A repeat is free whenever the data stamp did not move between the two runs. On PostgreSQL the stamp is
    the cluster's next xid, which anything in the shared test cluster may move (autovacuum ANALYZE, another
    database): then the repeat is a miss, charged, never stale; the pair is retried until the stamp holds."""
    for _ in range(5):
        before = clinic.backend.data_stamp()
        spent_before = spent(clinic)
        first = run(clinic, SERIES)
        again = run(clinic, SERIES)
        if clinic.backend.data_stamp() == before:
            break
    else:
        pytest.fail("the data stamp moved during every attempt")
    assert again.rows == first.rows and again.epsilon_spent == 0
    assert spent(clinic) - spent_before == pytest.approx(first.epsilon_spent)
    assert first.epsilon_spent == pytest.approx(2 * EPS) or clinic.backend.dialect == "postgres"
    assert any("result cache" in n for n in again.notices)


def test_multi_column_keys_release_only_the_listed_pairs(clinic: Engine) -> None:
    ranking = (
        "SELECT department AS d__, urgent AS u__, COUNT(*) AS n FROM visits GROUP BY department, urgent "
        "ORDER BY n DESC LIMIT 4"
    )
    result = run(
        clinic,
        f"SELECT department, urgent, AVG(cost) AS c FROM visits JOIN ({ranking}) AS s "
        "ON department = d__ AND s.u__ = urgent GROUP BY department, urgent",
    )
    pairs = {(r[0], r[1]) for r in result.rows}
    assert len(result.rows) == 4 and len(pairs) == 4
    alone = run(clinic, ranking)
    if alone.epsilon_spent == 0 or clinic.backend.dialect != "postgres":
        assert {(r[0], r[1]) for r in alone.rows} == pairs  # the ranking's own (cached) release
        assert spent(clinic) == pytest.approx(2 * EPS)
    # else: PostgreSQL's data stamp (the cluster's next xid) moved, e.g. autovacuum ANALYZE in the shared
    # test cluster: a cache miss (a fresh release, charged), never a stale answer


def test_in_subquery_spelling(clinic: Engine) -> None:
    result = run(
        clinic,
        "SELECT department, COUNT(*) AS n FROM visits WHERE urgent AND department IN "
        "(SELECT department FROM visits GROUP BY department ORDER BY COUNT(*) DESC LIMIT 2) GROUP BY department",
    )
    assert [(c.name, c.type) for c in result.columns] == [("department", "text"), ("n", "bigint")]
    assert len(result.rows) == 2
    assert spent(clinic) == pytest.approx(2 * EPS)


def test_no_released_key_returns_no_row_and_is_still_charged(clinic: Engine) -> None:
    result = run(
        clinic,
        "SELECT department, COUNT(*) AS n FROM visits JOIN (SELECT department AS d, COUNT(*) AS c FROM visits "
        "GROUP BY department HAVING COUNT(*) > 1e12) AS s ON department = d GROUP BY department",
    )
    assert [(c.name, c.type) for c in result.columns] == [("department", "text"), ("n", "bigint")]
    assert result.rows == []
    assert spent(clinic) == pytest.approx(2 * EPS)  # reserved before the keys were known


REFUSALS = [
    # a ranking of persons is a per-person subquery, which keeps every person
    (
        "SELECT department, COUNT(*) FROM visits JOIN (SELECT patient_id AS p, COUNT(*) AS n FROM visits "
        "GROUP BY patient_id LIMIT 3) AS s ON patient_id = p GROUP BY department",
        "0A000",
        'LIMIT is not supported inside the per-person subquery "s"',
    ),
    (
        "SELECT department, COUNT(*) FROM visits JOIN (SELECT department AS d, COUNT(*) AS n FROM visits "
        "GROUP BY department LIMIT 3) AS s ON department <> d GROUP BY department",
        "0A000",
        'the series-limit sub-query "s" can only be joined by equality of its columns (ON key = s.column)',
    ),
    (
        "SELECT department, MAX(s.n) FROM visits JOIN (SELECT department AS d, COUNT(*) AS n FROM visits "
        "GROUP BY department LIMIT 3) AS s ON department = d GROUP BY department",
        "0A000",
        'columns of the series-limit sub-query "s" can only be used in its ON condition',
    ),
    # the outer query's own refusal, found with the stand-in keys before anything is charged
    (
        "SELECT name, COUNT(*) FROM patients JOIN (SELECT sex AS s__, COUNT(*) AS n FROM patients "
        "GROUP BY sex LIMIT 1) AS s ON sex = s__ GROUP BY name",
        "42501",
        'permission denied for column "name"',
    ),
    (
        "SELECT department, COUNT(*) FROM visits WHERE department IN "
        "(SELECT department, COUNT(*) FROM visits GROUP BY department LIMIT 2) GROUP BY department",
        "0A000",
        None,
    ),
]


@pytest.mark.parametrize(("sql", "state", "message"), REFUSALS, ids=[r[2] or r[1] for r in REFUSALS])
def test_refusals_exact_and_free(clinic: Engine, sql: str, state: str, message: str | None) -> None:
    with pytest.raises(Error) as info:
        run(clinic, sql)
    assert info.value.sqlstate == state
    if message is not None:
        assert str(info.value).split("\n")[0] == message
    assert clinic.ledger.charges("clinic", "alice") == []


def test_inner_and_outer_reserved_together(clinic: Engine) -> None:
    """Inner and outer are one reservation: if their sum exceeds the budget, neither is released."""
    with pytest.raises(Error) as info:
        run(clinic, SERIES, epsilon=12.0)  # the analyst budget is 20: one part fits, both do not
    assert info.value.sqlstate == "53P01"
    assert spent(clinic) == 0


def test_explain_shows_both_parts_and_charges_nothing(clinic: Engine) -> None:
    lines = [r[0] for r in run(clinic, f"EXPLAIN {SERIES}").rows]
    text = "\n".join(lines)
    assert "Series limit" in lines[0] and f"epsilon={2 * EPS:g}" in lines[0]
    assert text.count("DP Aggregate") == 2
    assert spent(clinic) == 0


def test_through_the_wire_with_psycopg(clinic_server: tuple[str, Engine]) -> None:
    dsn, engine = clinic_server
    before = engine.ledger.spent("clinic", "analyst").epsilon
    with psycopg.connect(dsn + " options='-c dpsql.epsilon=0.25'", autocommit=True) as conn:
        cur = conn.execute(SERIES)
        rows = cur.fetchall()
        assert cur.description is not None
        assert [(d.name, d.type_code) for d in cur.description] == [
            ("visit_date", TIMESTAMPTZ),  # date_trunc of a date: timestamptz, as PostgreSQL
            ("department", TEXT),
            ("count", INT8),
        ]
        assert len(rows) == 15 and len({r[1] for r in rows}) == 3
        assert engine.ledger.spent("clinic", "analyst").epsilon - before == pytest.approx(0.5)
        again = conn.execute(SERIES).fetchall()  # the exact repeat: the cached releases, free
    assert again == rows
    assert engine.ledger.spent("clinic", "analyst").epsilon - before == pytest.approx(0.5)
