"""Accuracy-first querying (issue #29 item 4): ``SET dpsql.accuracy = '±10'`` charges the least ε meeting it.

The ε is chosen from public figures only (bounds, caps, group counts, δ, mechanism, confidence), so it
is the same for the same query and settings: repeats are answered from the cache, free. Refusals
(relative targets, quantiles, an ε above the analyst's whole budget) come before any charge.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dpsql.accountant import fmt
from dpsql.backends import Backend
from dpsql.cache import ResultCache
from dpsql.cli import main
from dpsql.dbapi import connect
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.noise.mechanisms import MECHANISMS, half_width
from dpsql.policy import Policy
from dpsql.release.calibrate import calibrate
from dpsql.server import ThreadedServer
from dpsql.session import Session

COUNTS = "SELECT problem, COUNT(*) FROM patients GROUP BY problem"
COUNT_AND_SUM = "SELECT sex, COUNT(*), SUM(age) FROM patients GROUP BY sex"


def _engine(policy: Policy, backend: Backend) -> Engine:
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"), ResultCache())


def _spent(engine: Engine, analyst: str = "alice") -> float:
    return engine.ledger.spent("health", analyst).epsilon


def _refusal(exc: pytest.ExceptionInfo[Error]) -> tuple[str, str, str | None]:
    return exc.value.sqlstate, exc.value.message, exc.value.hint


@pytest.fixture(params=["duckdb", "postgresql"])
def backend(request: pytest.FixtureRequest) -> Backend:
    name = "health_duckdb" if request.param == "duckdb" else "health_pg"
    found: Backend = request.getfixturevalue(name)
    return found


def _widths(engine: Engine, sql: str, session: Session, epsilon: float, confidence: float = 0.95) -> list[float]:
    """Every noisy measure's half-width if ``sql`` were calibrated at ``epsilon`` (same δ, mechanism)."""
    prepared = engine.prepare(sql, session)
    b = prepared.budgeting
    selecting = prepared.plan.selection_measure is not None
    delta = session.delta if session.delta is not None else engine.policy.defaults.delta
    assert MECHANISMS[b.mechanism].uses_delta or not selecting or delta > 0
    at = calibrate(prepared.plan, epsilon, delta, b.mechanism, selecting)
    return [half_width(s, confidence) for s in at.specs if s is not None]


@pytest.mark.parametrize(
    ("sql", "settings"),
    [
        (COUNTS, {}),
        (COUNT_AND_SUM, {"accuracy": "±150"}),
        (COUNTS, {"mechanism": "gaussian", "delta": 1e-7}),
        (COUNTS, {"confidence": 0.9}),
    ],
)
def test_least_epsilon_meets_the_target_and_is_charged(
    health_policy: Policy, backend: Backend, sql: str, settings: dict[str, object]
) -> None:
    engine = _engine(health_policy, backend)
    options: dict[str, object] = {"accuracy": "±10", **settings}
    session = Session.configure("alice", **options)  # type: ignore[arg-type]
    session.apply("dpsql.max_share", 1.0, "1")  # the guard is tested below: any ε within the budget
    target = session.accuracy
    assert target is not None
    level = session.confidence or 0.95
    budgeting = engine.prepare(sql, session).budgeting
    chosen = budgeting.epsilon
    assert budgeting.accuracy == target
    assert max(_widths(engine, sql, session, chosen, level)) <= target
    assert max(_widths(engine, sql, session, chosen * (1 - 1e-6), level)) > target  # the least such ε
    result = engine.execute(sql, session)
    assert result.epsilon_spent == chosen == _spent(engine)
    shown = [w for row in result.accuracy for w in row if w is not None]
    assert shown and max(shown) <= target


def test_epsilon_setting_is_overridden_and_intervals_follow_the_confidence(engine: Engine) -> None:
    plain = engine.prepare(COUNTS, Session.configure("alice", accuracy="10")).budgeting.epsilon
    assert engine.prepare(COUNTS, Session.configure("alice", accuracy="+-10", epsilon=5)).budgeting.epsilon == plain
    assert engine.prepare(COUNTS, Session.configure("alice", accuracy=10.0)).budgeting.epsilon == plain
    # a higher confidence at the same half-width needs more ε; a wider target less
    assert engine.prepare(COUNTS, Session.configure("alice", accuracy=10, confidence=0.99)).budgeting.epsilon > plain
    assert engine.prepare(COUNTS, Session.configure("alice", accuracy=20)).budgeting.epsilon < plain
    assert engine.prepare(COUNTS, Session("alice")).budgeting.accuracy is None


def test_repeats_are_free_from_the_cache(health_policy: Policy, backend: Backend) -> None:
    engine = _engine(health_policy, backend)
    session = Session.configure("alice", accuracy="±10")
    first = engine.execute(COUNTS, session)
    again = engine.execute(COUNTS, Session.configure("alice", accuracy="±10"))
    assert first.epsilon_spent > 0 and again.epsilon_spent == 0
    assert again.rows == first.rows and _spent(engine) == first.epsilon_spent
    # the same measurement finished otherwise, or asked at that ε explicitly: the same noise, free
    top = engine.execute(COUNTS + " ORDER BY 2 DESC LIMIT 3", Session.configure("alice", accuracy="10"))
    assert top.epsilon_spent == 0 and top.rows == sorted(first.rows, key=lambda r: -r[1])[:3]
    explicit = engine.execute(COUNTS, Session("alice", epsilon=first.epsilon_spent))
    assert explicit.epsilon_spent == 0 and explicit.rows == first.rows
    assert _spent(engine) == first.epsilon_spent


@pytest.mark.parametrize(
    ("value", "message", "hint"),
    [
        (
            "10%",
            'invalid value for parameter "dpsql.accuracy": "10%"',
            "A relative accuracy is not supported: choosing ε from the true value would make the ε (and so the "
            "charge) depend on the data, which is not private. Give an absolute half-width in the measure's "
            "units, e.g. SET dpsql.accuracy = '±10'.",
        ),
        *(
            (
                bad,
                f'invalid value for parameter "dpsql.accuracy": "{bad}"',
                "dpsql.accuracy is a positive half-width in the measure's units, e.g. '±10' (or DEFAULT: none).",
            )
            for bad in ("0", "-3", "±-3", "nan", "inf", "ten", "")
        ),
    ],
)
def test_invalid_targets_are_refused(value: str, message: str, hint: str) -> None:
    with pytest.raises(Error) as exc:
        Session.configure("alice", accuracy=value)
    assert _refusal(exc) == ("22023", message, hint)


def test_refusals_charge_nothing(health_policy: Policy, backend: Backend) -> None:
    engine = _engine(health_policy, backend)
    session = Session.configure("alice", accuracy="±10")
    with pytest.raises(Error) as exc:
        engine.execute(
            "SELECT problem, percentile_cont(0.5) WITHIN GROUP (ORDER BY age) FROM patients GROUP BY problem", session
        )
    state, message, hint = _refusal(exc)
    assert (state, message) == ("0A000", "dpsql.accuracy cannot be met by column percentile_cont")
    assert hint is not None and "not a ± half-width" in hint and "RESET dpsql.accuracy" in hint
    with pytest.raises(Error) as exc:
        engine.execute(COUNT_AND_SUM, session)
    left = "the ε=10 you have left (ε=10 in all, grants included)"
    assert _refusal(exc)[:2] == ("22023", f"accuracy ±10 needs ε=62.56, more than {left}")
    total = "SELECT SUM(age) FROM patients"
    with pytest.raises(Error) as exc:  # bob's own budget is 5 in all
        engine.execute(total, Session.configure("bob", accuracy="±50"))
    bob = "the ε=5 you have left (ε=5 in all, grants included)"
    assert _refusal(exc)[:2] == ("22023", f"accuracy ±50 needs ε=6.525, more than {bob}")
    assert _spent(engine) == 0 and _spent(engine, "bob") == 0


def test_a_large_share_of_what_is_left_needs_a_confirmation(health_policy: Policy, backend: Backend) -> None:
    """Issue #38 item 5: ``SET dpsql.accuracy = '±50'`` silently took 6.5 of alice's 10. Beyond 25 % of what
    is left (``dpsql.max_share``) it is refused with the ε it would take, until confirmed; the figures
    count the curator's grants."""
    engine = _engine(health_policy, backend)
    total = "SELECT SUM(age) FROM patients"
    session = Session.configure("alice", accuracy="±50")
    with pytest.raises(Error) as exc:
        engine.execute(total, session)
    state, message, hint = _refusal(exc)
    assert (state, message) == (
        "22023",
        "accuracy ±50 needs ε=6.525, more than 25% of the ε=10 you have left (ε=10 in all, grants included)",
    )
    assert hint is not None and hint.startswith("SET dpsql.confirm_epsilon = 6.525 to spend it on this query")
    assert _spent(engine) == 0
    engine.ledger.grant(dataset="health", analyst="alice", epsilon=2.0, by="curator", reason="test")  # counted
    with pytest.raises(Error) as exc:
        engine.execute(total, session)
    assert "25% of the ε=12 you have left (ε=12 in all, grants included)" in exc.value.message
    session.apply("dpsql.confirm_epsilon", 6.0, "6")  # less than it needs: still refused
    with pytest.raises(Error):
        engine.execute(total, session)
    session.apply("dpsql.confirm_epsilon", 6.525, "6.525")
    assert engine.execute(total, session).epsilon_spent == pytest.approx(6.524, 1e-3)
    relaxed = Session.configure("alice", accuracy="±80")  # ε≈4.1 of the 5.5 left: more than half
    relaxed.apply("dpsql.max_share", 0.9, "0.9")
    assert engine.execute(total, relaxed).epsilon_spent > 0


def test_explain_shows_the_chosen_epsilon_and_charges_nothing(engine: Engine) -> None:
    session = Session.configure("alice", accuracy="±10")
    chosen = engine.prepare(COUNTS, session).budgeting.epsilon
    lines = [row[0] for row in engine.execute("EXPLAIN " + COUNTS, session).rows]
    assert (
        lines[1]
        == f"  ε chosen for accuracy ±10 at 95 %: {chosen:.4g}"
        == "  ε chosen for accuracy ±10 at 95 %: 0.2843"
    )
    assert f"epsilon={fmt(chosen)}" in lines[0]
    at90 = engine.execute("EXPLAIN " + COUNTS, Session.configure("alice", accuracy="±10", confidence=0.9))
    assert at90.rows[1][0].startswith("  ε chosen for accuracy ±10 at 90 %: ")
    plan = json.loads(engine.execute("EXPLAIN (FORMAT JSON) " + COUNTS, session).rows[0][0])[0]["Plan"]
    assert plan["Accuracy Target"] == 10 and plan["Epsilon"] == chosen
    plain = [row[0] for row in engine.execute("EXPLAIN " + COUNTS, Session("alice")).rows]
    assert not any("accuracy ±" in line for line in plain)
    assert _spent(engine) == 0


def test_dbapi_and_cli(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with connect(engine=engine, analyst="alice", accuracy="±10") as conn:
        cur = conn.cursor()
        cur.execute("SELECT COUNT(*) FROM patients")
        assert cur.epsilon_spent == pytest.approx(0.2843, abs=1e-4) == _spent(engine)
    monkeypatch.setenv("DPSQL_HOME", str(tmp_path))
    assert main(["explain", "--accuracy", "±10", "-U", "alice", COUNTS]) == 0
    assert "ε chosen for accuracy ±10 at 95 %: 0.2843" in capsys.readouterr().out
    assert main(["query", "--accuracy", "10", "--json", "-U", "alice", COUNTS]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon_spent"] == pytest.approx(0.2843, abs=1e-4)
    assert max(w for row in payload["ci_half_width"] for w in row if w is not None) <= 10
    assert main(["query", "--accuracy", "10%", COUNTS]) == 1
    assert "not private" in capsys.readouterr().err


# --- over the wire -------------------------------------------------------------------------------


@pytest.fixture
def server(health_policy: Policy, health_duckdb: Backend) -> Iterator[tuple[str, Engine]]:
    engine = _engine(health_policy, health_duckdb)
    running = ThreadedServer(engine, catalog_dsn="")
    try:
        yield f"host={running.host} port={running.port} user=alice dbname=health", engine
    finally:
        running.stop()


def test_set_show_reset_over_the_wire(server: tuple[str, Engine]) -> None:
    dsn, engine = server
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("",)
        conn.execute("SET dpsql.accuracy = '±10'")
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("10.0",)
        plan = [r[0] for r in conn.execute("EXPLAIN " + COUNTS)]
        assert plan[1] == "  ε chosen for accuracy ±10 at 95 %: 0.2843"
        assert _spent(engine) == 0
        conn.execute(COUNTS).fetchall()
        chosen = _spent(engine)
        assert chosen == pytest.approx(0.2843, abs=1e-4)
        conn.execute(COUNTS).fetchall()  # the same query and settings: the cache
        assert _spent(engine) == chosen
        with pytest.raises(psycopg.Error) as exc:
            conn.execute("SET dpsql.accuracy = '10%'")
        assert exc.value.sqlstate == "22023" and exc.value.diag.message_hint is not None
        assert "not private" in exc.value.diag.message_hint
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(COUNT_AND_SUM)
        assert exc.value.sqlstate == "22023"
        assert exc.value.diag.message_primary.startswith("accuracy ±10 needs ε=62.56, more than the ε=9.7")
        assert _spent(engine) == chosen
        conn.execute("RESET dpsql.accuracy")
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("",)
        conn.execute("SELECT COUNT(*) FROM patients").fetchall()  # the policy's ε = 1 again
        assert _spent(engine) == pytest.approx(chosen + 1.0)
        conn.execute("SET dpsql.accuracy = '+-20'")
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("20.0",)
        conn.execute("SET dpsql.accuracy = DEFAULT")
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("",)


def test_accuracy_100_is_refused_with_its_epsilon_not_charged(server: tuple[str, Engine]) -> None:
    """Issue #38: ``SET dpsql.accuracy = '±100'`` silently charged ε=5.96, half an analyst's budget. Over the
    wire it is now a 22023 naming the ε it needs and the real budget, nothing charged, until confirmed."""
    dsn, engine = server
    total = "SELECT SUM(age) FROM patients"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET dpsql.accuracy = '±100'")
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(total)
        assert exc.value.sqlstate == "22023"
        message = exc.value.diag.message_primary or ""
        assert message.startswith("accuracy ±100 needs ε=3.279, more than 25%"), message
        assert message.endswith("more than 25% of the ε=10 you have left (ε=10 in all, grants included)")
        assert _spent(engine) == 0
        needed = message.split("needs ε=")[1].split(",")[0]
        conn.execute(f"SET dpsql.confirm_epsilon = {needed}")
        conn.execute(total).fetchall()
    assert _spent(engine) == pytest.approx(float(needed), rel=1e-3)


def test_accuracy_in_startup_options_holds_for_the_connection_only(server: tuple[str, Engine]) -> None:
    """docs/bi.md's recipes: ``?options=-c dpsql.accuracy=10`` (what ``dpsql://…?accuracy=10`` sends) sets it
    for every statement of that connection; a ``SET`` holds on its own connection only, so a SQL Lab run
    that may get another connection must carry its ``SET`` with it."""
    dsn, engine = server
    with psycopg.connect(dsn, autocommit=True, options="-c dpsql.accuracy=10") as conn:
        assert conn.execute("SHOW dpsql.accuracy").fetchone() == ("10.0",)
        conn.execute(COUNTS).fetchall()
        assert _spent(engine) == pytest.approx(0.2843, abs=1e-4)
    with psycopg.connect(dsn, autocommit=True) as first:
        first.execute("SET dpsql.accuracy = '±20'")
        with psycopg.connect(dsn, autocommit=True) as second:  # the next SQL Lab run, another connection
            assert second.execute("SHOW dpsql.accuracy").fetchone() == ("",)
        assert first.execute("SHOW dpsql.accuracy").fetchone() == ("20.0",)
