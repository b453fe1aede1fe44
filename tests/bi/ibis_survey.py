"""ibis survey (issue #17): ~25 typical ibis expressions against a running ``dpsql serve`` on the clinic demo.

Not collected by pytest (no ``test_`` prefix) and not a project dependency. Run it with ibis in a
throwaway environment::

    python3 -m venv /tmp/ibisvenv && /tmp/ibisvenv/bin/pip install 'ibis-framework[postgres]'
    dpsql serve --policy schemas/clinic.yaml --port 55432 &
    /tmp/ibisvenv/bin/python tests/bi/ibis_survey.py --port 55432

Prints one line per expression (answered, or the error's SQLSTATE and message) and, with ``--sql``,
the SQL ibis sent. ε per statement is set in the connection options, so the survey fits a budget.
It needs the server's schema-only catalog (``con.table`` reads ``pg_attribute``). ``con.sql(sql)``
without ``schema=`` probes with ``CREATE TEMPORARY VIEW`` and is refused (25006); the survey passes a
schema. tests/bi/test_ibis.py pins the SQL ibis 12 sends for ``.mutate()``/``.filter()`` wrappers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def expressions(con: Any) -> list[tuple[str, Callable[[], Any]]]:
    """(name, a function building the ibis expression); the runner executes it (to_pyarrow: via Arrow)."""
    import ibis
    from ibis import _

    v = con.table("visits")
    p = con.table("patients")
    d = con.table("departments")
    return [
        ("count", lambda: v.count()),
        ("group_by.aggregate count", lambda: v.group_by("department").aggregate(n=v.count())),
        ("group_by.aggregate mean", lambda: v.group_by("department").aggregate(c=v.cost.mean())),
        ("filter + aggregate", lambda: v.filter(v.urgent).aggregate(n=_.count(), s=_.cost.sum())),
        ("filter + group_by", lambda: v.filter(v.urgent).group_by("department").aggregate(n=_.count())),
        (
            "order_by after aggregate",
            lambda: v.group_by("department").aggregate(n=v.count()).order_by(ibis.desc("n")),
        ),
        ("limit after aggregate", lambda: v.group_by("department").aggregate(n=v.count()).limit(3)),
        ("distinct", lambda: v.select("department").distinct()),
        ("nunique", lambda: v.department.nunique()),
        ("mean", lambda: v.cost.mean()),
        ("std", lambda: v.cost.std()),
        ("var", lambda: v.cost.var()),
        ("min/max", lambda: v.aggregate(lo=v.cost.min(), hi=v.cost.max())),
        ("median", lambda: v.cost.median()),
        ("describe-like union", lambda: v.cost.describe() if hasattr(v.cost, "describe") else v.describe()),
        ("value_counts", lambda: v.department.value_counts()),
        (
            "join public table + aggregate",
            lambda: v.join(d, v.department == d.name).group_by("building").aggregate(n=_.count()),
        ),
        (
            "aggregate then join public",
            lambda: v.group_by("department").aggregate(n=v.count()).join(d, ibis._.department == d.name),
        ),
        (
            "truncate('M')",
            lambda: v.group_by(m=v.visit_date.truncate("M")).aggregate(n=v.count()),
        ),
        (
            "truncate('Y') + order",
            lambda: v.group_by(y=v.visit_date.truncate("Y")).aggregate(n=v.count()).order_by("y"),
        ),
        ("year()", lambda: v.group_by(y=v.visit_date.year()).aggregate(n=v.count())),
        ("bucket/histogram", lambda: v.group_by(b=(v.cost / 200).floor() * 200).aggregate(n=v.count())),
        (
            "case bands",
            lambda: v.group_by(band=ibis.cases((v.cost > 1000, "high"), else_="low")).aggregate(n=v.count()),
        ),
        ("to_pyarrow", lambda: v.group_by("department").aggregate(n=v.count())),
        ("patients sex counts", lambda: p.group_by("sex").aggregate(n=p.count())),
        ("mutate + group_by", lambda: v.mutate(big=v.cost > 1000).group_by("big").aggregate(n=_.count())),
        (
            "mutate + mean",
            lambda: v.select("department", "cost").mutate(c=_.cost + 1).group_by("department").aggregate(m=_.c.mean()),
        ),
        (
            "con.sql(schema=) + filter",
            lambda: (
                con.sql(
                    "SELECT department, cost FROM visits WHERE urgent",
                    schema={"department": "string", "cost": "float64"},
                )
                .filter(_.cost > 10)
                .group_by("department")
                .aggregate(n=_.count())
            ),
        ),
        ("con.sql() schema probe", lambda: con.sql("SELECT department, COUNT(*) AS n FROM visits GROUP BY 1")),
        (
            "percent of total (window)",
            lambda: v.group_by("department").aggregate(n=v.count()).mutate(pct=ibis._.n / ibis._.n.sum()),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=55432)
    parser.add_argument("--user", default="analyst")
    parser.add_argument("--database", default="clinic")
    parser.add_argument("--epsilon", default="0.05")
    parser.add_argument("--sql", action="store_true", help="print the SQL ibis sent for failures")
    args = parser.parse_args()
    import ibis

    con = ibis.postgres.connect(
        host=args.host,
        port=args.port,
        user=args.user,
        database=args.database,
        options=f"-c dpsql.epsilon={args.epsilon}",
    )
    answered = 0
    cases = expressions(con)
    for name, run in cases:
        expr = None
        try:
            expr = run()  # con.sql() without a schema sends its probe here
            expr.to_pyarrow() if name == "to_pyarrow" else expr.execute()
        except Exception as exc:  # a survey: every failure is reported
            state = getattr(getattr(exc, "diag", None), "sqlstate", None) or type(exc).__name__
            message = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else repr(exc)
            print(f"FAIL  {name:32} {state}: {message}")
            if args.sql and expr is not None:
                print("      " + str(ibis.to_sql(expr, dialect="postgres")).replace("\n", "\n      "))
            continue
        answered += 1
        print(f"ok    {name}")
    print(f"ibis survey: {answered} of {len(cases)} answered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
