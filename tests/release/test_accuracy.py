"""Rendering of accuracy for analysts: the interval NOTICE and its per-row DETAIL, EXPLAIN's SQL
lines, the notes kept on a cache hit, and AVG's NULL from the noisy count (no database needed)."""

from __future__ import annotations

import re

from dpsql.aggregates.avg import dp_avg
from dpsql.aggregates.variance import dp_variance
from dpsql.explain import sql_lines
from dpsql.postprocess.finish import from_cache
from dpsql.server.results import DETAIL_ROWS, interval_summary, result_notices
from dpsql.session import OutputColumn, Result

KEY = OutputColumn("problem", "text", noisy=False)
COUNT = OutputColumn("count", "bigint", noisy=True)
AVG = OutputColumn("avg", "double precision", noisy=True)


def _result(rows: list[tuple], accuracy: list[tuple], columns: list[OutputColumn] | None = None) -> Result:
    return Result(columns or [KEY, COUNT, AVG], rows, accuracy, 1.0, 0.0, remaining_epsilon=9.0)


def test_equal_widths_give_one_line() -> None:
    result = _result([("a", 10, 5.0), ("b", 12, 6.0)], [(None, 3.0, 0.5), (None, 3.0, 0.5)])
    summary = interval_summary(result, 0.95)
    assert summary is not None and summary.detail is None
    assert summary.message == "dpsql: 95% CI half-widths: count ±3, avg ±0.5"


def test_widths_that_differ_get_a_detail_line_per_row() -> None:
    result = _result(
        [("Asthma", 992, 57.48083), ("None", 0, None), ("Obesity", 1495, 57.9271)],
        [(None, 12.0, 0.664992), (None, 12.0, None), (None, 12.0, 0.441428)],
    )
    summary = interval_summary(result, 0.9)
    assert summary is not None
    assert summary.message == "dpsql: 90% CI half-widths: count ±12, avg ±0.4414–0.665 (differs by row: DETAIL)"
    assert summary.detail == "Asthma: avg 57.4808 ±0.665\nNone: avg NULL\nObesity: avg 57.9271 ±0.4414"


def test_detail_is_cut_after_twenty_rows_and_unkeyed_rows_are_numbered() -> None:
    rows = [(float(i),) for i in range(DETAIL_ROWS + 5)]
    accuracy = [(1.0 + i,) for i in range(DETAIL_ROWS + 5)]
    summary = interval_summary(_result(rows, accuracy, [AVG]), 0.95)
    assert summary is not None and summary.detail is not None
    lines = summary.detail.split("\n")
    assert lines[0] == "row 1: avg 0 ±1" and lines[DETAIL_ROWS - 1] == "row 20: avg 19 ±20"
    assert lines[DETAIL_ROWS:] == ["… 5 more rows (SET dpsql.show_intervals = on: a _ci95 column per row)"]


def test_notice_order_charge_then_intervals_then_notes() -> None:
    result = _result([("a", 10, None)], [(None, 3.0, None)])
    result.notices = [
        "dpsql: avg is NULL: its noisy count is <= 0 (the group looks empty)",
        'dpsql: charged ε=1; remaining ε=9 for analyst "alice"',
    ]
    assert [n.message for n in result_notices(result, 0.95)] == [
        'dpsql: charged ε=1; remaining ε=9 for analyst "alice"',
        "dpsql: 95% CI half-widths: count ±3",
        "dpsql: avg is NULL: its noisy count is <= 0 (the group looks empty)",
    ]


def test_a_cache_hit_keeps_the_accuracy_notes_not_the_charge() -> None:
    cached = _result([("a", 10, 1.0)], [(None, 3.0, 0.5)])
    cached.notices = ["dpsql: max is capped at the declared upper bound 110 of age", "dpsql: charged ε=1"]
    again = from_cache(cached, 0.0)
    assert again.notices[0].startswith("dpsql: answered from the result cache (first computed at 1970-01-01")
    assert again.notices[1:] == ["dpsql: max is capped at the declared upper bound 110 of age"]


def test_sql_lines_change_only_whitespace() -> None:
    sql = (
        "WITH __a AS (SELECT x, 'a FROM b (SELECT' AS s FROM t WHERE y > 1), __b AS (SELECT *, "
        'ROW_NUMBER() OVER (PARTITION BY "u" ORDER BY h) AS n FROM __a) SELECT COUNT(*) AS m0 FROM __b '
        "WHERE n <= 3 GROUP BY x ORDER BY 1"
    )
    lines = sql_lines(sql, indent=2)
    assert lines == [
        "  WITH __a AS (",
        "    SELECT x, 'a FROM b (SELECT' AS s",
        "    FROM t",
        "    WHERE y > 1),",
        "  __b AS (",
        '    SELECT *, ROW_NUMBER() OVER (PARTITION BY "u" ORDER BY h) AS n',
        "    FROM __a)",
        "  SELECT COUNT(*) AS m0",
        "  FROM __b",
        "  WHERE n <= 3",
        "  GROUP BY x",
        "  ORDER BY 1",
    ]
    assert re.sub(r"\s+", "", "".join(lines)) == re.sub(r"\s+", "", sql)
    long = "SELECT " + ", ".join(f"COUNT(*) AS m{i}" for i in range(20)) + " FROM t"
    assert all(len(line) <= 100 for line in sql_lines(long, indent=8))


def test_avg_and_variance_are_null_when_the_noisy_count_is_not_positive() -> None:
    assert dp_avg(5, 0, 50) is None and dp_avg(-7, -3, 50) is None
    assert dp_avg(10, 2, 50) == 55.0
    assert dp_variance(4, 0, 0, False, False) is None and dp_variance(4, 2, -1, False, True) is None
    assert dp_variance(8, 0, 2, False, False) == 4.0
