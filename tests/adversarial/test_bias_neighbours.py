"""The bias estimate (issue #40 items 1 and 6) on neighbouring databases, DuckDB and PostgreSQL.

``SET dpsql.bias = on`` (the default) runs one more query per release: per group, the rows beyond each
person's cap and how far values lie beyond the bounds (:mod:`dpsql.release.bias`), released under DP
at a share of the query's ε. The neighbours: a base database where every person holds more rows than
the cap and some amounts exceed the bound, and the base plus one adversary — a heavy person (200 rows,
the cap is 5), or one whose stored amounts are NaN, ±infinity, ±1e300 and NULL — or minus one person.

- outcome, SQLSTATE and notice text may differ between neighbours only through DP-released numbers
  (and whether a released total is above its detection threshold, a function of them): the texts agree
  once those are masked, and no neighbour errs;
- each total's un-noised vector over the groups moves by at most its stated sensitivity (the property
  the noise is calibrated to; the sensitivity fuzzer checks it on random queries too);
- the released ``cut`` total is ε-DP empirically at its share of ε (Clopper–Pearson bounds on each
  public bin, both directions), the neighbours at exactly its sensitivity apart.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from scipy.stats import beta

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.release.accuracy import caps_cut
from dpsql.release.bias import BiasEstimate, split_folded, totals_query
from dpsql.session import Session
from tests.adversarial.worlds import neighbour_worlds, roomy_policy
from tests.policies import table_yaml

POLICY = roomy_policy(
    "biasn",
    """
  people:
    privacy_unit: pid
    max_rows_per_unit: 1
    columns:
      pid: {type: int, identifier: true}
  events:
    references: {column: pid, table: people, to: pid}
    max_rows_per_unit: 5
    columns:
      pid: {type: int, identifier: true}
      kind: {type: text, domain: [a, b, c], nullable: false}
      amount: {type: float, lower: 0.0, upper: 10.0, nullable: true}
""",
)
PEOPLE = 60

#: The adversary's events (kind, amount SQL), or None: absent; "removed" drops person 1 instead.
ADVERSARIES: dict[str, list[tuple[str, str]] | None] = {
    "absent": None,
    "heavy": [("abc"[i % 3], f"{i % 13}.5") for i in range(200)],
    "odd": [
        ("a", "CAST('NaN' AS DOUBLE PRECISION)"),
        ("b", "CAST('Infinity' AS DOUBLE PRECISION)"),
        ("c", "CAST('-Infinity' AS DOUBLE PRECISION)"),
        ("a", "1e300"),
        ("b", "-1e300"),
        ("c", "NULL"),
        ("a", "1e300"),
    ],
    "removed": None,
}

QUERIES = [
    "SELECT COUNT(*), SUM(amount) FROM events",
    "SELECT kind, COUNT(*) AS n, AVG(amount) AS mean FROM events GROUP BY kind",
    "SELECT kind, SUM(amount) FROM events GROUP BY kind HAVING COUNT(*) > 10",
    "SELECT COUNT(*) FROM events WHERE amount > 5",
]


def _script(name: str) -> str:
    people = [p for p in range(1, PEOPLE + 1) if not (name == "removed" and p == 1)]
    rows = [f"({p}, '{'abc'[(p + j) % 3]}', {(p * 7 + j) % 14}.25)" for p in people for j in range(8)]
    adversary = ADVERSARIES[name]
    if adversary is not None:
        people.append(999)
        rows += [f"(999, '{kind}', {amount})" for kind, amount in adversary]
    return (
        "DROP TABLE IF EXISTS events; DROP TABLE IF EXISTS people; CREATE TABLE people (pid BIGINT); "
        "CREATE TABLE events (pid BIGINT, kind TEXT, amount DOUBLE PRECISION); "
        f"INSERT INTO people VALUES {', '.join(f'({p})' for p in people)}; INSERT INTO events VALUES {', '.join(rows)}"
    )


@pytest.fixture(scope="module")
def worlds(pg_new_database: Callable[[], str]) -> Iterator[dict[tuple[str, str], Backend]]:
    with neighbour_worlds(pg_new_database, ADVERSARIES, _script) as backends:
        yield backends


def _masked(text: str) -> str:
    """A notice with its DP-released figures masked, and whether a total was detected (a function of them)."""
    text = re.sub(r"no rows cut (beyond \d+ per [^ ]+) detected \(fewer than ~[^)]*\)", r"ROWS CUT \1", text)
    text = re.sub(r"~[^ ]+ % of rows cut (beyond \d+ per [^ ;]+)", r"ROWS CUT \1", text)
    text = re.sub(r"no (amount beyond \[[^]]*\]) detected \(less than ~[^ ]+ a row\)", r"EXCESS \1", text)
    text = re.sub(r"(amount beyond \[[^]]*\]) by ~[^ ]+ a row", r"EXCESS \1", text)
    text = re.sub(r"remaining ε=[^ ]+", "remaining ε=#", text)
    return text.replace("covers the noise only; the estimated", "covers noise and the estimated")


#: Notes about released values that may or may not appear, by their noise (post-processing of them).
RELEASED_ONLY = ("clipped to its possible range", "its noisy count is <= 0")


def _outcome(engine: Engine, sql: str) -> tuple[object, ...]:
    try:
        result = engine.execute(sql, Session("alice"))
    except Error as error:
        return ("error", error.sqlstate, error.message)
    widened = any("estimated" in n for n in result.notices)
    notices = tuple(_masked(n) for n in result.notices if not any(m in n for m in RELEASED_ONLY))
    return ("ok", tuple(c.name for c in result.columns), notices, widened)


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
@pytest.mark.parametrize("sql", QUERIES)
def test_outcome_and_notices_differ_only_through_released_figures(
    worlds: dict[tuple[str, str], Backend], kind: str, sql: str
) -> None:
    outcomes = {}
    for name in ADVERSARIES:
        engine = Engine(parse_policy(POLICY), worlds[(kind, name)], Ledger.open("sqlite:///:memory:"))
        outcomes[name] = _outcome(engine, sql)
    assert all(o[0] == "ok" for o in outcomes.values()), outcomes
    assert all(o[3] for o in outcomes.values()), outcomes  # every neighbour states its estimate
    assert len(set(outcomes.values())) == 1, outcomes


def _estimate(engine: Engine, sql: str) -> BiasEstimate:
    prepared = engine.prepare(sql, Session("alice"))
    assert prepared.bias is not None
    return prepared.bias


def _total_rows(backend: Backend, estimate: BiasEstimate, tau: int) -> list[tuple[Any, ...]]:
    """The exact totals' rows: from the totals' own statement, or from the one folded into the measurement
    (DuckDB at the policy's cap: :func:`dpsql.release.bias.folded_query`), which must move alike."""
    if estimate.folded is not None:
        return split_folded(backend.execute(estimate.folded[0])[1], estimate.folded[1], estimate.nkeys)[1]
    sql = estimate.sql_at(tau)
    assert sql is not None
    return list(backend.execute(sql)[1])


def _totals(backend: Backend, estimate: BiasEstimate, tau: int) -> dict[tuple[object, ...], list[float]]:
    n = estimate.nkeys
    return {tuple(r[:n]): [float(v or 0.0) for v in r[n:]] for r in _total_rows(backend, estimate, tau)}


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
@pytest.mark.parametrize("sql", QUERIES)
def test_each_total_moves_within_its_sensitivity(worlds: dict[tuple[str, str], Backend], kind: str, sql: str) -> None:
    base_backend = worlds[(kind, "absent")]
    engine = Engine(parse_policy(POLICY), base_backend, Ledger.open("sqlite:///:memory:"))
    estimate = _estimate(engine, sql)
    tau = engine.prepare(sql, Session("alice")).plan.max_rows
    base = _totals(base_backend, estimate, tau)
    for name in ADVERSARIES:
        after = _totals(worlds[(kind, name)], estimate, tau)
        zeros = [0.0] * len(estimate.totals)
        for t, total in enumerate(estimate.totals):
            moved = sum(abs(after.get(k, zeros)[t] - base.get(k, zeros)[t]) for k in set(base) | set(after))
            assert moved <= total.sensitivity * (1 + 1e-9), (name, total, moved)
            assert math.isfinite(moved), (name, total)


@pytest.mark.parametrize("sql", [*QUERIES, "SELECT kind, SUM(amount * 2) AS s, COUNT(*) FROM events GROUP BY kind"])
def test_folded_statement_measures_and_totals_as_the_two_apart(
    worlds: dict[tuple[str, str], Backend], sql: str
) -> None:
    """On DuckDB the measurement and the bias totals run as one statement (issue #37: one scan of the rows):
    on every neighbour (NaN, ±infinity, 1e300, a heavy person, one removed) its measurement rows are the
    measurement's own and its totals those of the totals' own statement (up to float summation order)."""
    engine = Engine(parse_policy(POLICY), worlds[("duckdb", "absent")], Ledger.open("sqlite:///:memory:"))
    prepared = engine.prepare(sql, Session("alice"))
    estimate = prepared.bias
    if estimate is None or estimate.folded is None:
        pytest.skip("not folded: an ungrouped or row-level measurement")  # (the cell-bounded ones are)
    plan = prepared.plan
    apart = engine.backend.render(totals_query(plan, plan.max_rows, estimate.clamped, estimate.cuts))
    for name in ADVERSARIES:
        backend = worlds[("duckdb", name)]
        measured, totals = split_folded(backend.execute(estimate.folded[0])[1], estimate.folded[1], estimate.nkeys)
        assert _close(measured, backend.execute(prepared.sql)[1]), name
        assert _close(totals, backend.execute(apart)[1]), name


def _close(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> bool:
    def key(row: tuple[Any, ...]) -> str:
        return repr([v for v in row if not isinstance(v, float)])

    if len(got) != len(want):
        return False
    for a, b in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        for x, y in zip(a, b, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                if not (x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) or (math.isnan(x) and math.isnan(y))):
                    return False
            elif x != y:
                return False
    return True


def test_released_cut_total_is_epsilon_dp_on_neighbours(worlds: dict[tuple[str, str], Backend]) -> None:
    """Base vs the heavy person, whose rows beyond the cap reach the ceiling: the exact ``cut`` totals are
    exactly its sensitivity apart, the worst case. Each released value's bin (public edges, a scale
    wide around the midpoint) is as likely on either neighbour within e^ε_cut (Clopper–Pearson, α per bin)."""
    sql = "SELECT COUNT(*) FROM events"
    engine = Engine(parse_policy(POLICY), worlds[("duckdb", "absent")], Ledger.open("sqlite:///:memory:"))
    estimate = _estimate(engine, sql)
    plan = engine.prepare(sql, Session("alice")).plan
    assert caps_cut(plan) and estimate.cuts
    cut = next(t for t in estimate.totals if t.name == "cut")
    rows = {name: _total_rows(worlds[("duckdb", name)], estimate, plan.max_rows) for name in ("absent", "heavy")}
    at = [t.name for t in estimate.totals].index("cut")  # no keys: one row, the totals
    exact = {name: float(r[0][at]) for name, r in rows.items()}
    assert exact["heavy"] - exact["absent"] == pytest.approx(cut.sensitivity)
    spec = estimate.spec(cut, 1)
    epsilon = spec.epsilon
    scale = spec.scale * spec.grid
    n = 6000
    mid = (exact["heavy"] + exact["absent"]) / 2
    edges = [mid + k * scale for k in range(-3, 4)]
    samples = {}
    release = partial(estimate.release, keys=[()], level=0.95)
    for name, r in rows.items():
        bins: Counter[int] = Counter()
        for _ in range(n):
            value = release(r).noisy[()]["cut"]
            bins[sum(value > e for e in edges)] += 1
        samples[name] = bins
    alpha = 0.001 / (2 * (len(edges) + 1))
    for b in range(len(edges) + 1):
        for one, other in (("absent", "heavy"), ("heavy", "absent")):
            k_a, k_b = samples[one][b], samples[other][b]
            if k_a:
                high_b = beta.ppf(1 - alpha, k_b + 1, n - k_b) if k_b < n else 1.0
                assert beta.ppf(alpha, k_a, n - k_a + 1) <= math.exp(epsilon) * high_b, (b, samples)
    # and the noise is not wider than stated: the two worlds' medians sit about the sensitivity apart
    assert samples["heavy"][len(edges)] + samples["heavy"][len(edges) - 1] > samples["absent"][len(edges)]


#: Each row is one person (no privacy_unit): no cap cuts a row, but values are clamped, so the estimate
#: has a clamp excess total whose sensitivity is one value's reach.
ROW_COLUMNS = """
kind: {type: text, domain: [a, b, c], nullable: false}
amount: {type: float, lower: 0.0, upper: 10.0, nullable: true}
"""
ROW_POLICY = roomy_policy("biasrow", table_yaml("rowpeople", ROW_COLUMNS))
#: The one adversary row's amount (SQL), per neighbour; None: absent.
ROW_ADVERSARIES = [None, "CAST('NaN' AS DOUBLE PRECISION)", "CAST('Infinity' AS DOUBLE PRECISION)", "-1e300", "1e300"]


@pytest.mark.parametrize("kind", ["duckdb", "postgres"])
def test_row_level_clamp_estimate_moves_within_its_sensitivity(pg_new_database: Callable[[], str], kind: str) -> None:
    sql = "SELECT kind, SUM(amount) AS s, AVG(amount) AS m FROM rowpeople GROUP BY kind"
    rows = [f"('{'abc'[i % 3]}', {(i * 7) % 23}.5)" for i in range(90)]
    totals, estimate = [], None
    for adversary in ROW_ADVERSARIES:
        backend = open_backend("duckdb://" if kind == "duckdb" else pg_new_database())
        extra = [] if adversary is None else [f"('b', {adversary})"]
        backend.execute_script(
            "CREATE TABLE rowpeople (kind TEXT, amount DOUBLE PRECISION); "
            f"INSERT INTO rowpeople VALUES {', '.join(rows + extra)}"
        )
        engine = Engine(parse_policy(ROW_POLICY), backend, Ledger.open("sqlite:///:memory:"))
        if estimate is None:
            estimate = _estimate(engine, sql)
            assert not estimate.cuts and estimate.clamped and estimate.totals
            result = engine.execute(sql, Session("alice"))  # it runs and says what its ± covers
            assert any("clamp bias" in n for n in result.notices), result.notices
        totals.append(_totals(backend, estimate, 1))
        backend.close()
    assert estimate is not None
    zeros = [0.0] * len(estimate.totals)
    for after in totals[1:]:
        for t, total in enumerate(estimate.totals):
            moved = sum(abs(after.get(k, zeros)[t] - totals[0].get(k, zeros)[t]) for k in set(totals[0]) | set(after))
            assert math.isfinite(moved) and moved <= total.sensitivity * (1 + 1e-9), (total, moved)
