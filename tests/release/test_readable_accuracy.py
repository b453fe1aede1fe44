"""Readable accuracy (#28 item 7): MIN/MAX as value ranges, quantile ranks as levels, small-group
warnings from noisy counts, intervals clipped to what a value can be, notes for post-processed
columns, and result cells rounded to their interval (``SET dpsql.round = off`` for raw values)."""

from __future__ import annotations

import math
import re

import pytest

from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.ledger import Ledger
from dpsql.policy import Policy, parse_policy
from dpsql.release.rounding import round_result, round_value, round_width
from dpsql.server.results import result_notices
from dpsql.session import OutputColumn, Result, Session
from tests.policies import policy_yaml, table_yaml

STAFF = """
dept: {type: text, domain: [ops, lab, tiny]}
overtime: {type: float, lower: 0.0, upper: 80.0, nullable: false}
hours: {type: int, lower: 0, upper: 80, nullable: false}
salary: {type: float, lower: 0.0, upper: 200000.0, nullable: false}
"""
POLICY = policy_yaml(
    "readable", table_yaml("staff", STAFF), budget="{dataset: {epsilon: 1.0e9}, analyst: {epsilon: 1.0e9}}"
)


@pytest.fixture(scope="module")
def staff() -> tuple[Policy, Backend]:
    backend = open_backend("duckdb://")
    # ops: 2,000 people, overtime uniform on [0, 80] (data up to the cap); lab: 1,000; tiny: 3
    backend.execute_script(
        "CREATE TABLE staff AS SELECT CASE WHEN i < 2000 THEN 'ops' WHEN i < 3000 THEN 'lab' ELSE 'tiny' END AS dept, "
        "(i * 37 % 2001) / 25.0 AS overtime, (i * 37 % 81) AS hours, 40000 + (i * 7919 % 60000) AS salary "
        "FROM range(3003) r(i)"
    )
    return parse_policy(POLICY), backend


def _engine(staff: tuple[Policy, Backend]) -> Engine:
    policy, backend = staff
    return Engine(policy, backend, Ledger.open("sqlite:///:memory:"))


def _notes(result: Result) -> list[str]:
    return [n for n in result.notices if "charged" not in n]


def test_max_is_a_value_range_up_to_the_bound(staff: tuple[Policy, Backend]) -> None:
    result = _engine(staff).execute("SELECT MAX(hours), MIN(overtime) FROM staff", Session("alice", epsilon=2.0))
    high, low = result.rows[0]
    notes = [n for n in _notes(result) if n.startswith(("dpsql: max: ", "dpsql: min: "))]
    ends = f"between {high} and 80" if high < 80 else "80 \\(the declared bound\\)"
    assert re.fullmatch(
        rf"dpsql: max: {ends} at 95% \(noise only; bounds \[0, 80\] clamp hours\); no DP mechanism "
        rf"finds the exact maximum: at 95% at most \d+ of the group's values lie above {high}; it means little "
        r"unless the group holds well over \d+ values \(add COUNT\(\*\) to see\)",
        notes[0],
    ), notes
    assert re.fullmatch(
        r"dpsql: min: between 0 and ~[0-9.]+ at 95% \(noise only; bounds \[0, 80\] clamp overtime\); no DP "
        rf"mechanism finds the exact minimum: at 95% at most \d+ of the group's values lie below {low}; .*",
        notes[1],
    ), notes
    top = float(re.search(r"between 0 and ~([0-9.]+)", notes[1]).group(1))
    assert low <= top <= low + 80 / 512  # the chosen run's upper edge


def test_interior_quantile_is_a_value_interval(staff: tuple[Policy, Backend]) -> None:
    """A median comes with its 95% value interval (#40 item 2): the released ends of two more ε-DP
    choices, each a third of the quantile's share, stated in the note and holding the exact median."""
    _, backend = staff
    exact = backend.execute("SELECT quantile_cont(salary, 0.5) FROM staff")[1][0][0]
    result = _engine(staff).execute("SELECT median(salary), COUNT(*) FROM staff", Session("alice", epsilon=2.0))
    (note,) = [n for n in _notes(result) if n.startswith("dpsql: median")]
    match = re.fullmatch(
        r"dpsql: median: between ([0-9.]+) and ([0-9.]+), at 95% \(the exponential mechanism chose the value at "
        r"ε=0.5 and each end at ε=0.5 of this query's ε; noise only; bounds \[0, 200000\] clamp salary\)",
        note,
    )
    assert match, note
    low, high = float(match.group(1)), float(match.group(2))
    assert low <= exact <= high and high - low < 20000, (low, exact, high)
    assert result.intervals[0][0] is not None and result.intervals[0][1] is None  # the count has a ±
    released_low, released_high = result.intervals[0][0]
    assert low <= released_low and released_high <= high  # shown rounded outwards


def test_small_groups_get_a_warning_from_their_noisy_count(staff: tuple[Policy, Backend]) -> None:
    result = _engine(staff).execute(
        "SELECT dept, COUNT(*), median(overtime) FROM staff GROUP BY dept", Session("alice", epsilon=3.0)
    )
    counts = {row[0]: row[1] for row in result.rows}
    warnings = [n for n in result.notices if n.startswith("dpsql: WARNING: ")]
    assert len(warnings) == 1, result.notices
    match = re.fullmatch(
        r"dpsql: WARNING: median means little in (\d) of 4 groups \((.+)\): their noisy counts \((.+)\) are "
        r"below (\d+) \(twice its 95% rank error\)",
        warnings[0],
    )
    assert match, warnings
    named = match.group(2).split(", ")
    assert "tiny" in named and "ops" not in named and "lab" not in named
    need = int(match.group(4))
    assert all(counts[k] < need for k in named if k != "None")  # decided from the released (noisy) counts
    # the server sends it with severity WARNING, the marker dropped
    (sent,) = [d for d in result_notices(result, 0.95) if d.severity == "WARNING"]
    assert sent.sqlstate == "01000" and sent.message.startswith("dpsql: median means little in ")


def test_counts_and_averages_have_intervals_clipped_to_what_they_can_be(staff: tuple[Policy, Backend]) -> None:
    result = _engine(staff).execute(
        "SELECT dept, COUNT(*), AVG(overtime) FROM staff WHERE overtime >= 79.9 GROUP BY dept",
        Session("alice", epsilon=0.5),
    )
    notes = _notes(result)
    clipped = [n for n in notes if n.startswith("dpsql: count: 95% intervals clipped")]
    assert len(clipped) == 1, notes
    assert re.match(r"dpsql: count: 95% intervals clipped to its possible range \[0, ∞\) in \d of 4 rows: ", clipped[0])
    for shown in re.findall(r"(-?\d+) ±(\d+) is (\d+) to (\d+)", clipped[0]):
        value, width, low, high = map(int, shown)
        assert (low, high) == (max(0, value - width), value + width)
    for note in (n for n in notes if n.startswith("dpsql: avg: 95% interval")):
        for low, high in re.findall(r"is (-?[0-9.]+) to (-?[0-9.]+)", note):
            assert 0 <= float(low) <= float(high) <= 80


def test_post_processed_columns_get_an_interval_or_a_note(staff: tuple[Policy, Backend]) -> None:
    result = _engine(staff).execute(
        "SELECT COUNT(*) * 2 AS twice, COUNT(*) / 10.0 AS tenth, round(SUM(overtime), -1) AS r, "
        "SUM(overtime) / COUNT(*) AS ratio, round(AVG(overtime), 1) AS ra FROM staff",
        Session("alice", epsilon=1.0),
    )
    (widths,) = result.accuracy
    count_w = next(w for w in widths if w is not None) / 2  # COUNT(*)'s own half-width
    assert widths[0] == pytest.approx(2 * count_w) and widths[1] == pytest.approx(count_w / 10, rel=0.05)
    assert widths[2] is not None and widths[3] is None and widths[4] is None
    notes = _notes(result)
    for name in ("ratio", "ra"):
        assert (
            f"dpsql: no interval for column {name} (post-processed: computed from noisy values by arithmetic, "
            "ROUND, a ratio or several measures; only bare aggregates and constant multiples of one get ±)"
        ) in notes
    assert not any("column twice" in n or "column tenth" in n or "column r " in n for n in notes)


# ------------------------------------------------------------------------------ rounding


def test_noisy_floats_are_rounded_to_two_digits_of_their_half_width(staff: tuple[Policy, Backend]) -> None:
    engine = _engine(staff)
    session = Session("alice", epsilon=1.0)
    sql = "SELECT dept, COUNT(*), AVG(overtime), SUM(overtime) FROM staff GROUP BY dept"
    rounded = engine.execute(sql, session)
    for row, widths in zip(rounded.rows, rounded.accuracy, strict=True):
        assert isinstance(row[1], int)  # counts untouched
        for value, width in ((row[2], widths[2]), (row[3], widths[3])):
            if value is None:
                continue
            assert width is not None
            step = 10.0 ** (math.floor(math.log10(width)) - 1)
            assert abs(value / step - round(value / step)) < 1e-6, (value, width)
            assert len(repr(width).replace(".", "").strip("0")) <= 3  # ±0.67, not ±0.664992
    session.apply("dpsql.round", False, "off")
    raw = engine.execute(sql.replace("dept,", "dept, 1 AS one,"), session)  # another query: not cached
    assert any(isinstance(v, float) and len(repr(v)) > 10 for row in raw.rows for v in row[3:]), (
        raw.rows
    )  # raw noisy values keep every digit


def test_rounding_rules() -> None:
    assert round_value(57.48083, 0.664992) == 57.48 and round_width(0.664992) == 0.67
    assert round_value(1234567.891, 12345.6) == 1235000.0 and round_width(12345.6) == 13000.0
    assert round_value(3.0, 0.0) == 3.0 and round_value(7, 0.5) == 7  # exact cells and ints as they are
    assert round_value(0.123456789, None) == 0.123457  # no interval: six significant digits
    assert round_width(0.5) == 0.5 and round_width(0.0) == 0.0
    columns = [OutputColumn("k", "text", noisy=False), OutputColumn("avg", "double precision", noisy=True)]
    result = round_result(Result(columns, [("a", 25.123456), ("b", None)], [(None, 0.0432), (None, None)], 1.0, 0))
    assert result.rows == [("a", 25.123), ("b", None)] and result.accuracy == [(None, 0.044), (None, None)]


def test_round_setting_is_a_dpsql_setting() -> None:
    from dpsql.session import parse_setting

    assert parse_setting("dpsql.round", "off") is False and parse_setting("DPSQL.ROUND", "on") is True
    with pytest.raises(Exception, match=r"dpsql\.round"):
        parse_setting("dpsql.round", "sometimes")
