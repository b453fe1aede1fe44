"""What psql and psycopg users read: the accuracy NOTICEs and EXPLAIN's plan text, exact.

At ε = 1000 every noisy choice below is certain for all practical purposes (a count's noise is 0
with probability 1 − 2e⁻³³³, MIN/MAX pick the one cell holding all the values), so the texts are
fixed; the per-row DETAIL at ε = 1 is checked against the rows it describes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import psycopg
import pytest

from .conftest import Running

PSQL = shutil.which("psql")


def _psql(server: Running, user: str, *commands: str) -> tuple[str, list[str]]:
    """psql's stdout and its NOTICE/DETAIL lines (stderr), each command a ``-c``."""
    assert PSQL is not None, "psql is needed (scripts/setup.sh test installs it)"
    args = [PSQL, "-X", "-h", server.host, "-p", str(server.port), "-U", user, "-d", "health"]
    for command in commands:
        args += ["-c", command]
    out = subprocess.run(
        args, capture_output=True, text=True, timeout=60, env={"PGCONNECT_TIMEOUT": "10", "PATH": "/usr/bin:/bin"}
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr.splitlines()


CHARGED = re.compile(r'NOTICE:  dpsql: charged ε=1000; remaining ε=[0-9.e+]+ for analyst "dave"')


def test_psql_notices_for_quantiles_bounds_modes_and_null_averages(dp_server: Running) -> None:
    _, notices = _psql(
        dp_server,
        "dave",
        "SET dpsql.epsilon = 1000",
        "SELECT MAX(zip) FROM patients WHERE zip >= 2199",
        "SELECT sex, MIN(visits) FROM patients WHERE visits <= 0 GROUP BY sex",
        "SELECT problem, COUNT(*), AVG(age) FROM patients WHERE age > 200 GROUP BY problem",
        "SELECT mode() WITHIN GROUP (ORDER BY problem) FROM patients",
    )
    bias = [line for line in notices if "covers the noise only" in line]  # the AVG query's clamping
    assert len(bias) == 1 and bias[0].startswith("NOTICE:  dpsql: ±95% covers the noise only; the estimated"), bias
    assert "age beyond [0, 110]" in bias[0]  # each row is one person: nothing cut, values clamped
    notices = [line for line in notices if line not in bias]
    assert all(CHARGED.fullmatch(line) for line in [*notices[::3][:2], notices[6], notices[9]]), notices
    assert [line for line in notices if "charged" not in line] == [
        "NOTICE:  dpsql: max: 2199 (the declared bound) at 95% (noise only; bounds [2100, 2199] clamp zip); no DP "
        "mechanism finds the exact maximum: at 95% at most 2 of the group's values lie above 2199; it means little "
        "unless the group holds well over 2 values (add COUNT(*) to see)",
        "NOTICE:  dpsql: max is capped at the declared upper bound 2199 of zip: values are clamped to "
        "[2100, 2199] before the choice",
        "NOTICE:  dpsql: min: between 0 and ~each row's value at 95% (noise only; bounds [0, 50] clamp visits); no "
        "DP mechanism finds the exact minimum: at 95% at most 2 of a group's values lie below its value; it means "
        "little unless the group holds well over 2 values (add COUNT(*) to see)",
        "NOTICE:  dpsql: min is floored at the declared lower bound 0 of visits (in 2 of 2 rows): values are "
        "clamped to [0, 50] before the choice",
        "NOTICE:  dpsql: 95% CI half-widths: count ±0",
        "NOTICE:  dpsql: avg is NULL in 7 of 7 rows: its noisy count is <= 0 (the group looks empty)",
        "NOTICE:  dpsql: mode has no ± interval (report-noisy-max among 7 public values): at 95% the chosen "
        "value's count is within 0.004942 of the most frequent value's count",
    ]


def test_psql_explain_is_one_plan_line_per_row(dp_server: Running) -> None:
    out, _ = _psql(
        dp_server,
        "dave",
        "SET dpsql.epsilon = 1000",
        "EXPLAIN SELECT sex, COUNT(*), AVG(age), median(age) FROM patients WHERE problem = 'Asthma' GROUP BY sex",
    )
    plan = out.split("\n", 1)[1]  # after psql's "SET"
    lines = [line.rstrip() for line in plan.splitlines()]
    assert lines[0].strip() == "QUERY PLAN" and set(lines[1]) == {"-"}
    assert lines[2:] == [
        " DP Aggregate  (mechanism=laplace epsilon=1000 delta=0)",
        "   Privacy unit: one row (each row is one person)",
        "   Group keys: public domain: sex",
        "   Intervals: noise and the clamp bias estimated under DP (ε=200 of this query's ε=1000)",
        "   Output sex: group key",
        "   Output count: COUNT(*)  sensitivity=1 scale=0.00625 epsilon=160 ci95=±0",
        "   Output avg: AVG = centre + noisy centred SUM / noisy COUNT  sensitivity=55 scale=0.34375 "
        "epsilon=320 ci95 per row (depends on the noisy count)",
        "   Output median: QUANTILE(0.5) OF clamp(age, 0, 110): exponential mechanism over 111 integers; its 95% "
        "value interval: one more for each end, over 111 integers  epsilon=480 rank error <= 0.09632 at 95%",
        "   ->  Backend SQL:",
        '         SELECT "patients"."sex" AS k0, COUNT(*) AS m0, COALESCE(SUM(CASE WHEN "patients"."age" < 0',
        '             THEN 0 WHEN "patients"."age" > 110 THEN 110 ELSE "patients"."age" END), 0) AS m1,',
        "             COUNT(*) AS m2, COUNT(*) AS m3, COUNT(*) AS m4, COUNT(*) AS z1",
        '         FROM "patients" AS "patients"',
        '         WHERE "patients"."problem" = \'Asthma\'',
        '         GROUP BY "patients"."sex"',
        "(15 rows)",
        "",
    ]


def test_psql_per_row_intervals_in_a_detail(dp_server: Running) -> None:
    """AVG's half-width differs per group: a summary NOTICE, then one DETAIL line per row, which
    names the row by its key and repeats the value psql shows."""
    out, notices = _psql(dp_server, "dave", "SELECT problem, COUNT(*), AVG(age) FROM patients GROUP BY problem")
    rows = {
        cells[0].strip(): float(cells[2])
        for line in out.splitlines()[2:-2]
        if len(cells := line.split("|")) == 3 and cells[2].strip()
    }
    assert len(rows) == 7
    summary = next(i for i, line in enumerate(notices) if "CI half-widths" in line)
    match = re.fullmatch(
        r"NOTICE:  dpsql: 95% CI half-widths: count ±(\S+), avg ±(\S+)–(\S+) \(differs by row: DETAIL\)",
        notices[summary],
    )
    assert match, notices
    low, high = float(match.group(2)), float(match.group(3))
    detail = notices[summary + 1 : summary + 8]
    assert detail[0].startswith("DETAIL:  ")
    detail[0] = detail[0].removeprefix("DETAIL:  ")
    seen = {}
    for line in detail:
        parsed = re.fullmatch(r"(.+): avg (\S+) ±(\S+)", line)
        assert parsed, line
        seen[parsed.group(1)] = float(parsed.group(2))
        assert low <= float(parsed.group(3)) <= high
    assert seen.keys() == rows.keys()
    assert all(seen[k] == pytest.approx(rows[k], rel=1e-5) for k in rows)


def test_psycopg_detail_field_and_interval_columns(dp_server: Running) -> None:
    """The DETAIL is a NoticeResponse field (psycopg's ``message_detail``); with the ``_ci95``
    columns on, it is left out and the summary points at them."""
    notices: list[tuple[str, str | None]] = []  # a Diagnostic is only readable inside the handler

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        notices.append((diag.message_primary or "", diag.message_detail))

    with psycopg.connect(dp_server.dsn("dave"), autocommit=True) as conn:
        conn.add_notice_handler(keep)
        sql = "SELECT sex, AVG(bmi) FROM patients GROUP BY sex"
        rows = conn.execute(sql).fetchall()
        message, detail = next(n for n in notices if "CI half-widths" in n[0])
        assert message.endswith("(differs by row: DETAIL)")
        low, high = map(float, re.findall(r"avg ±([0-9.e+-]+)–([0-9.e+-]+)", message)[0])
        lines = (detail or "").split("\n")
        assert [line.rsplit(" ±", 1)[0] for line in lines] == [f"{sex}: avg {avg:.6g}" for sex, avg in rows]
        assert all(low <= float(line.rsplit("±", 1)[1]) <= high for line in lines)
        notices.clear()
        conn.execute("SET dpsql.show_intervals = on")
        cur = conn.execute(sql)
        assert [d.name for d in cur.description or []] == ["sex", "avg", "avg_ci95"]
        widths = [row[2] for row in cur.fetchall()]
        message, detail = next(n for n in notices if "CI half-widths" in n[0])
        assert message == (
            f"dpsql: 95% CI half-widths: avg ±{min(widths):.4g}–{max(widths):.4g} (per row in the _ci95 columns)"
        )
        assert detail is None


def test_explain_json_is_unchanged(dp_server: Running) -> None:
    """``EXPLAIN (FORMAT JSON)`` stays one row holding the whole document; its Backend SQL is the
    text plan's, only the line breaks differ."""
    sql = "SELECT sex, COUNT(*), AVG(age) FROM patients WHERE problem = 'Asthma' GROUP BY sex"
    with psycopg.connect(dp_server.dsn("dave"), autocommit=True) as conn:
        rows = conn.execute(f"EXPLAIN (FORMAT JSON) {sql}").fetchall()
        text = [r[0] for r in conn.execute(f"EXPLAIN {sql}").fetchall()]
    assert len(rows) == 1
    plan = json.loads(rows[0][0])[0]["Plan"]
    assert plan["Node Type"] == "DP Aggregate" and "\n" not in plan["Backend SQL"]
    shown = text[text.index("  ->  Backend SQL:") + 1 :]
    assert re.sub(r"\s+", "", "".join(shown)) == re.sub(r"\s+", "", plan["Backend SQL"])
