"""Honest time buckets (#40 item 3): a bucket that only the upper bound's own instant opens — the bound
falls exactly on its start — is not part of a derived key's domain, so a bound of 2026-01-01 adds no
January 2026 and no year 2026, and ``WHERE ts < '2025-12-29'`` releases no week of 2025-12-29. A date
column's bound is a whole day: its day bucket stays. Policy and SQL constants only."""

from __future__ import annotations

import datetime as dt

import pytest

from dpsql.analyze import analyze
from dpsql.policy import parse_policy
from tests.policies import policy_yaml, table_yaml

TS = "ts: {type: timestamp, lower: 2024-01-01, upper: 2026-01-01, nullable: false}\n"
COLUMNS = """
d: {type: date, lower: 2024-01-01, upper: 2026-01-01, nullable: false}
late: {type: timestamp, lower: 2024-01-01 00:00:00, upper: 2025-06-30 12:30:00, nullable: false}
"""
POLICY = parse_policy(policy_yaml("buckets", table_yaml("t", TS + COLUMNS)))


def _keys(sql: str) -> list[object]:
    domain = analyze(sql, POLICY).keys[0].domain
    assert domain is not None
    return list(domain)


def _at(*parts: int) -> dt.datetime:
    return dt.datetime(*parts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "first", "last", "count"),
    [
        ("DATE_TRUNC('month', ts)", _at(2024, 1, 1), _at(2025, 12, 1), 24),
        ("DATE_TRUNC('year', ts)", _at(2024, 1, 1), _at(2025, 1, 1), 2),
        ("DATE_TRUNC('quarter', ts)", _at(2024, 1, 1), _at(2025, 10, 1), 8),
        ("DATE_TRUNC('day', ts)", _at(2024, 1, 1), _at(2025, 12, 31), 731),
        ("DATE_TRUNC('month', d)", _at(2024, 1, 1), _at(2025, 12, 1), 24),
        ("DATE_TRUNC('year', d)", _at(2024, 1, 1), _at(2025, 1, 1), 2),
        ("DATE_TRUNC('day', d)", _at(2024, 1, 1), _at(2026, 1, 1), 732),  # a date bound is a whole day
        ("date_bin('1 day', ts, TIMESTAMP '2000-01-01')", _at(2024, 1, 1), _at(2025, 12, 31), 731),
        ("date_bin('7 days', d, TIMESTAMP '2024-01-01')", _at(2024, 1, 1), _at(2025, 12, 29), 105),
        ("DATE_TRUNC('hour', late)", _at(2025, 6, 30), _at(2025, 6, 30, 12), 13),  # 12:00 holds 12:00–12:30
    ],
)
def test_no_bucket_starts_at_the_upper_bound(
    key: str, first: dt.datetime, last: dt.datetime, count: int | None
) -> None:
    if "hour" in key:
        sql = f"SELECT {key}, COUNT(*) FROM t WHERE late >= '2025-06-30' GROUP BY 1"
    else:
        sql = f"SELECT {key}, COUNT(*) FROM t GROUP BY 1"
    keys = _keys(sql)
    assert keys[0] == first and keys[-1] == last, (keys[0], keys[-1])
    assert len(keys) == count


def test_extract_year_stops_before_a_bound_on_new_year() -> None:
    assert _keys("SELECT EXTRACT(year FROM ts), COUNT(*) FROM t GROUP BY 1") == [2024, 2025]
    assert _keys("SELECT EXTRACT(year FROM d), COUNT(*) FROM t GROUP BY 1") == [2024, 2025]
    assert _keys("SELECT EXTRACT(year FROM late), COUNT(*) FROM t GROUP BY 1") == [2024, 2025]


def test_no_bucket_wholly_outside_where() -> None:
    """A weekly chart limited to ts < 2025-12-29 (a Monday): its last week is that of 2025-12-22."""
    weeks = _keys("SELECT DATE_TRUNC('week', ts), COUNT(*) FROM t WHERE ts < '2025-12-29' GROUP BY 1")
    assert weeks[-1] == _at(2025, 12, 22)
    days = _keys(
        "SELECT DATE_TRUNC('day', ts), COUNT(*) FROM t WHERE ts >= '2025-03-01' AND ts < '2025-03-08' GROUP BY 1"
    )
    assert days == [_at(2025, 3, d) for d in range(1, 8)]
    inclusive = _keys("SELECT DATE_TRUNC('month', ts), COUNT(*) FROM t WHERE ts <= '2025-06-01 00:00:01' GROUP BY 1")
    assert inclusive[-1] == _at(2025, 6, 1)  # the bound lies inside June: June holds a real second


def test_a_bucket_that_is_the_whole_range_stays() -> None:
    """WHERE pins the range to the bound's instant: its one bucket is the only one, and stays."""
    assert _keys("SELECT DATE_TRUNC('month', ts), COUNT(*) FROM t WHERE ts >= '2026-01-01' GROUP BY 1") == [
        _at(2026, 1, 1)
    ]


def test_check_warns_of_a_bound_that_starts_a_bucket() -> None:
    """``policy check`` says which buckets charts stop before (a separate finding, no database needed)."""
    from dpsql.curator.check import check_text

    columns = """
    d: {type: date, lower: 2024-01-01, upper: 2025-12-31, nullable: false}
    w: {type: date, lower: 2024-01-01, upper: 2025-12-29, nullable: false}
    """
    text = "\n" + policy_yaml("buckets", table_yaml("t", TS + columns))  # line 1 empty, as the assertions count
    warnings = [w for w in check_text(text, "p.yaml").warnings if ".upper: " in w]
    assert warnings == [
        "p.yaml:8: tables.t.columns.ts.upper: warning: upper bound 2026-01-01 starts a day/month/quarter/year: "
        "GROUP BY DATE_TRUNC/date_bin/EXTRACT releases no day, month, quarter or year starting at it (only the "
        "bound itself could fall there); values after it are clamped to it: write the last day or instant the "
        "data hold",
        "p.yaml:10: tables.t.columns.w.upper: warning: upper bound 2025-12-29 starts a week: GROUP BY "
        "DATE_TRUNC/date_bin/EXTRACT releases no week starting at it (only the bound itself could fall there); "
        "values after it are clamped to it: write the last day or instant the data hold",
    ], warnings
