"""The Superset datasets and chart-data requests tests/bi/test_superset.py sends through Superset.

Two Superset databases point at the same ``dpsql serve``: ``postgresql`` (Superset's PostgreSQL engine
spec, ``postgresql+psycopg2://``) and ``dpsql`` (contrib/superset's ``DpsqlEngineSpec``, ``dpsql://``),
plus ``dpsql_exhausted``, an analyst whose ε per query exceeds its whole budget (53P01), and
``dpsql_intervals``/``pg_intervals``, the two URIs with ``dpsql.show_intervals`` on. A dataset
names its database (default ``postgresql``) and, when physical, its table (default: its name); a case
names its dataset.

Each query object is what the Superset 6.1 frontend's ``buildQuery`` for that chart type posts to
``/api/v1/chart/data`` (x-axis as a BASE_AXIS column, the TEMPORAL_RANGE filter of a time range, the
pivot/contribution/histogram post-processing that Superset applies to the rows dpsql returns). Kept as
plain data so the probe (Superset's venv) and the test (dpsql's venv) share one definition.
"""

from __future__ import annotations

from typing import Any

#: Chart time range (Superset's "Custom" range, start inclusive, end exclusive).
TIME_RANGE = "2021-01-01T00:00:00 : 2022-01-01T00:00:00"

VIRTUAL_ROWS_SQL = "SELECT department, cost, visit_date FROM visits WHERE cost > 50"

#: Datasets registered in Superset: a physical table and two virtual (SQL) datasets.
DATASETS: dict[str, dict[str, Any]] = {
    "visits": {"temporal": ["visit_date"], "main_dttm_col": "visit_date"},
    # a virtual dataset that only selects and filters rows: Superset wraps it as a FROM-subquery, and
    # learns its columns by running it with LIMIT 1 (PostgresEngineSpec.get_column_description_limit_size)
    "visits_sql": {"sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"]},
    # the same, synced as an engine spec returning 0 there would make Superset do it: "<sql> LIMIT 0"
    "visits_sql_limit0": {"sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"], "column_probe_limit": 0},
    # a virtual dataset that is itself a DP aggregate: charts over it are outer queries over DP results
    # (its LIMIT 1 column probe is an aggregate query, answered and charged)
    "department_counts": {"sql": "SELECT department, COUNT(*) AS visits FROM visits GROUP BY department"},
    # through dpsql:// (DpsqlEngineSpec): the physical table, the row-level SQL dataset synced as Superset
    # does it (the spec makes the probe LIMIT 0), and the table for an analyst without budget left
    "dpsql_visits": {"database": "dpsql", "table": "visits", "temporal": ["visit_date"], "main_dttm_col": "visit_date"},
    "dpsql_visits_sql": {"database": "dpsql", "sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"]},
    # a row-level SQL dataset (Superset keeps one physical "visits" per metadata database): its LIMIT 0
    # column probe is answered even without budget left, since it spends nothing
    "exhausted_visits": {"database": "dpsql_exhausted", "sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"]},
    # through dpsql://…?show_intervals=on: every noisy column of a chart gets its <col>_ci95 column
    "intervals_visits": {"database": "dpsql_intervals", "sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"]},
    # through dpsql://…?accuracy=100 (issue #38 item 4): ε per chart is the least that meets ±100
    "accuracy_visits": {"database": "dpsql_accuracy", "sql": VIRTUAL_ROWS_SQL, "temporal": ["visit_date"]},
}

_EXTRAS: dict[str, Any] = {"having": "", "where": ""}

#: An ad-hoc SQL metric (a SQL dataset has no saved "count" metric).
_COUNT: dict[str, Any] = {"expressionType": "SQL", "sqlExpression": "COUNT(*)", "label": "count"}


def _axis(column: str, grain: str | None = None) -> dict[str, Any]:
    axis: dict[str, Any] = {
        "columnType": "BASE_AXIS",
        "sqlExpression": column,
        "label": column,
        "expressionType": "SQL",
    }
    if grain:
        axis["timeGrain"] = grain
    return axis


def _pivot(index: str, metric: str = "count") -> list[dict[str, Any]]:
    return [
        {
            "operation": "pivot",
            "options": {
                "index": [index],
                "columns": [],
                "aggregates": {metric: {"operator": "mean"}},
                "drop_missing_columns": False,
            },
        },
        {"operation": "flatten"},
    ]


#: name, Superset chart type, dataset, and either chart-data ``queries`` or a filter-values request.
CASES: list[dict[str, Any]] = [
    {
        "name": "big_number",
        "chart": "Big Number (big_number_total): COUNT(*)",
        "dataset": "visits",
        "kind": "chart",
        "queries": [{"metrics": ["count"], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}],
    },
    {
        "name": "big_number_reload",
        "chart": "The same Big Number again (a dashboard reload): the exact repeat of its SQL",
        "dataset": "visits",
        "kind": "chart",
        "queries": [{"metrics": ["count"], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}],
    },
    {
        "name": "bar",
        "chart": "Bar chart (echarts_timeseries_bar): COUNT(*) by department",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": [_axis("department")],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
                "series_columns": [],
                "series_limit": 0,
                "order_desc": True,
                "post_processing": _pivot("department"),
            }
        ],
    },
    {
        "name": "line_monthly",
        "chart": "Line chart (echarts_timeseries_line): COUNT(*) by month of visit_date, 2021",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "time_range": TIME_RANGE,
                "columns": [_axis("visit_date", "P1M")],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [{"col": "visit_date", "op": "TEMPORAL_RANGE", "val": TIME_RANGE}],
                "extras": {**_EXTRAS, "time_grain_sqla": "P1M"},
                "row_limit": 10000,
                "series_columns": [],
                "series_limit": 0,
                "order_desc": True,
                "post_processing": _pivot("visit_date"),
            }
        ],
    },
    {
        "name": "pie",
        "chart": "Pie chart (pie): COUNT(*) by department",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 100,
            }
        ],
    },
    {
        "name": "table_percent",
        "chart": "Table (table): COUNT(*) and % of total by department",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 1000,
                "post_processing": [
                    {"operation": "contribution", "options": {"columns": ["count"], "rename_columns": ["%count"]}}
                ],
            }
        ],
    },
    {
        "name": "histogram",
        "chart": "Histogram (histogram_v2): distribution of cost",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["cost"],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
                "post_processing": [
                    {
                        "operation": "histogram",
                        "options": {"column": "cost", "groupby": [], "bins": 10, "cumulative": False},
                    }
                ],
            }
        ],
    },
    {
        "name": "histogram_buckets",
        "chart": "Histogram as a bar chart over a bucket expression: COUNT(*) by FLOOR(cost / 200)",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": [_axis("FLOOR(cost / 200) * 200")],
                "metrics": ["count"],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
            }
        ],
    },
    {
        "name": "filter_values",
        "chart": "Filter value list (datasource column values, adhoc filter dropdown): SELECT DISTINCT",
        "dataset": "visits",
        "kind": "values",
        "column": "department",
    },
    {
        "name": "native_filter",
        "chart": "Native select filter (filter_select): department values, GROUP BY without a metric",
        "dataset": "visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": [],
                "orderby": [["department", True]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 1000,
            }
        ],
    },
    {
        "name": "virtual_rows",
        "chart": "Bar chart on a virtual dataset (SELECT … FROM visits WHERE cost > 50)",
        "dataset": "visits_sql",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
            }
        ],
    },
    {
        "name": "virtual_rows_limit0",
        "chart": "The same bar chart, the virtual dataset synced with a LIMIT 0 column probe (engine spec)",
        "dataset": "visits_sql_limit0",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
            }
        ],
    },
    {
        "name": "virtual_aggregate",
        "chart": "Table on a virtual dataset that is a DP aggregate (SUM(visits) by department)",
        "dataset": "department_counts",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": [{"expressionType": "SQL", "sqlExpression": "SUM(visits)", "label": "visits"}],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 1000,
            }
        ],
    },
    # --- the same charts through dpsql:// and DpsqlEngineSpec ---------------------------------------
    {
        "name": "dpsql_big_number",
        "chart": "Big Number through dpsql:// (DpsqlEngineSpec)",
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [{"metrics": ["count"], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}],
    },
    {
        "name": "dpsql_bar",
        "chart": "Bar chart through dpsql://: COUNT(*) by department",
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [
            {
                "columns": [_axis("department")],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
                "series_columns": [],
                "series_limit": 0,
                "order_desc": True,
                "post_processing": _pivot("department"),
            }
        ],
    },
    {
        "name": "dpsql_line_monthly",
        "chart": "Line chart through dpsql://: COUNT(*) by month (the spec's DATE_TRUNC grain), 2021",
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [
            {
                "time_range": TIME_RANGE,
                "columns": [_axis("visit_date", "P1M")],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [{"col": "visit_date", "op": "TEMPORAL_RANGE", "val": TIME_RANGE}],
                "extras": {**_EXTRAS, "time_grain_sqla": "P1M"},
                "row_limit": 10000,
                "series_columns": [],
                "series_limit": 0,
                "order_desc": True,
                "post_processing": _pivot("visit_date"),
            }
        ],
    },
    {
        "name": "dpsql_virtual_rows",
        "chart": "Bar chart on the row-level virtual dataset through dpsql:// (synced by Superset: LIMIT 0)",
        "dataset": "dpsql_visits_sql",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": ["count"],
                "orderby": [["count", False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
            }
        ],
    },
    {
        "name": "dpsql_histogram",
        "chart": "Histogram through dpsql:// (raw values): refused, with the spec's message",
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["cost"],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 10000,
                "post_processing": [
                    {
                        "operation": "histogram",
                        "options": {"column": "cost", "groupby": [], "bins": 10, "cumulative": False},
                    }
                ],
            }
        ],
    },
    {
        "name": "dpsql_hourly",
        "chart": "Line chart through dpsql:// by hour over the whole date range: 54000, the spec's message",
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [
            {
                "columns": [_axis("visit_date", "PT1H")],
                "metrics": ["count"],
                "filters": [],
                "extras": {**_EXTRAS, "time_grain_sqla": "PT1H"},
                "row_limit": 10000,
            }
        ],
    },
    {
        "name": "dpsql_minute_sqllab",
        "chart": "A minute bucket typed in SQL Lab (a grain the spec does not offer): 0A000, the spec's message",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT DATE_TRUNC('minute', visit_date) AS t, COUNT(*) FROM visits GROUP BY 1",
    },
    {
        "name": "dpsql_budget_exhausted",
        "chart": "Big Number for an analyst whose budget cannot cover the query: 53P01, the spec's message",
        "dataset": "exhausted_visits",
        "kind": "chart",
        "queries": [{"metrics": [_COUNT], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}],
    },
    {
        "name": "dpsql_budget_exhausted_sqllab",
        "chart": "The same refusal as SQL Lab reports it (engine spec's extract_errors / custom_errors)",
        "dataset": "exhausted_visits",
        "kind": "sqllab",
        "sql": "SELECT COUNT(*) AS count FROM visits",
    },
    {
        "name": "dpsql_bad_date_sqllab",
        "chart": "A refusal without a message of the spec's own (22008) in SQL Lab: dpsql's text and SQLSTATE",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT COUNT(*) AS count FROM visits WHERE visit_date > MAKE_DATE(2022, 13, 1)",
    },
    {
        "name": "dpsql_sqllab_answered",
        "chart": "An aggregate run in SQL Lab through dpsql:// (SQL Lab adds its row LIMIT): answered",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT urgent, COUNT(*) AS count FROM visits GROUP BY urgent",
    },
    {
        "name": "dpsql_virtual_payload",
        "chart": "The SQL dataset's payload (Explore, dataset API): its select_star names no real table",
        "dataset": "dpsql_visits_sql",
        "kind": "dataset_payload",
    },
    {
        "name": "dpsql_preview",
        "chart": "SQL Lab's table preview (engine spec's select_star): the synced columns, LIMIT 0",
        "dataset": "dpsql_visits",
        "kind": "select_star",
    },
    {
        "name": "dpsql_estimate",
        "chart": "SQL Lab's estimate cost (QueryEstimationCommand): dpsql's EXPLAIN, free",
        "dataset": "dpsql_visits",
        "kind": "estimate",
        "sql": "SELECT department, COUNT(*) AS count FROM public.visits GROUP BY department",
    },
    # accuracy in the result itself (Superset drops NOTICEs): dpsql.show_intervals set in the URI. A chart
    # keeps only as many columns as it asked for (helpers.py, assign_column_label), positionally: with two
    # metrics, count_ci95 arrives under the second metric's name (the hazard docs/bi.md warns about)
    {
        "name": "dpsql_intervals_table",
        "chart": "Table (table) through dpsql://…?show_intervals=on: COUNT(*) and AVG(cost) by department",
        "dataset": "intervals_visits",
        "kind": "chart",
        "queries": [
            {
                "columns": ["department"],
                "metrics": [_COUNT, {"expressionType": "SQL", "sqlExpression": "AVG(cost)", "label": "avg_cost"}],
                "orderby": [[_COUNT, False]],
                "filters": [],
                "extras": _EXTRAS,
                "row_limit": 1000,
            }
        ],
        "keep_data": True,
    },
    # issue #38 item 4: accuracy-first in Superset, as docs/bi.md says to set it
    {
        "name": "dpsql_accuracy_chart",
        "chart": "Big Number through dpsql://…?accuracy=100: charged the least ε meeting ±100, not ?epsilon=",
        "dataset": "accuracy_visits",
        "kind": "chart",
        "queries": [{"metrics": [_COUNT], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}],
    },
    {
        "name": "dpsql_accuracy_sqllab_set",
        "chart": "SQL Lab run of `SET dpsql.accuracy = '±100';` and a query (statements of one run, one connection)",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SET dpsql.accuracy = '±100';\n"
        "SELECT urgent, COUNT(*) AS count FROM visits WHERE cost > 100 GROUP BY urgent",
    },
    {
        "name": "dpsql_accuracy_sqllab_next",
        "chart": "The next SQL Lab run, without the SET: the URI's ε again (a SET does not carry over)",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT urgent, COUNT(*) AS count FROM visits WHERE cost > 150 GROUP BY urgent",
    },
    # issue #38 item 4: the budget view answers the aggregates a BI tool sends, free
    {
        "name": "dpsql_budget_total_sqllab",
        "chart": "A Big Number's SQL over dpsql_budget in SQL Lab: SUM(epsilon_remaining)",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT SUM(epsilon_remaining) AS rem FROM public.dpsql_budget LIMIT 100",
    },
    {
        "name": "dpsql_budget_grouped_sqllab",
        "chart": "A bar chart's SQL over dpsql_budget in SQL Lab: SUM(epsilon_spent) by analyst",
        "dataset": "dpsql_visits",
        "kind": "sqllab",
        "sql": "SELECT analyst AS analyst, SUM(epsilon_spent) AS spent FROM public.dpsql_budget GROUP BY analyst "
        "ORDER BY spent DESC LIMIT 100",
    },
    {
        "name": "pg_intervals_sqllab",
        "chart": "SQL Lab through postgresql+psycopg2://…?options=-c%20dpsql.show_intervals%3Don: count_ci95",
        "dataset": "intervals_visits",
        "database": "pg_intervals",
        "kind": "sqllab",
        "sql": "SELECT urgent, COUNT(*) AS count FROM visits GROUP BY urgent",
    },
]


# --- a dashboard answered from the clinic's declared synopsis (tests/bi/test_superset_synopsis.py) ------

#: The physical ``visits`` through ``dpsql://`` (DpsqlEngineSpec), in a Superset of its own.
SYNOPSIS_DATASETS: dict[str, dict[str, Any]] = {
    "dpsql_visits": {"database": "dpsql", "table": "visits", "temporal": ["visit_date"], "main_dttm_col": "visit_date"},
}

#: The department filter of the dashboard, changed five times (Superset's IN filter of an adhoc filter).
DEPARTMENT_FILTERS: list[list[str]] = [
    ["Oncology"],
    ["Oncology", "Cardiology"],
    ["Pediatrics", "Emergency", "Neurology"],
    ["Dermatology"],
    ["Cardiology", "Neurology"],
]

#: A second custom time range, aligned to months (the first half of 2022).
HALF_YEAR = "2022-01-01T00:00:00 : 2022-07-01T00:00:00"


def _department_bar(filters: list[dict[str, Any]], having: str = "") -> dict[str, Any]:
    """The bar chart's query object (echarts_timeseries_bar with department on the x-axis)."""
    return {
        "columns": [_axis("department")],
        "metrics": ["count"],
        "orderby": [["count", False]],
        "filters": filters,
        "extras": {**_EXTRAS, "having": having},
        "row_limit": 10000,
        "series_columns": [],
        "series_limit": 0,
        "order_desc": True,
        "post_processing": _pivot("department"),
    }


def _monthly_line(time_range: str) -> dict[str, Any]:
    """The line chart's query object: visit_date at month grain on the x-axis, a custom time range."""
    return {
        "time_range": time_range,
        "columns": [_axis("visit_date", "P1M")],
        "metrics": ["count"],
        "orderby": [["count", False]],
        "filters": [{"col": "visit_date", "op": "TEMPORAL_RANGE", "val": time_range}],
        "extras": {**_EXTRAS, "time_grain_sqla": "P1M"},
        "row_limit": 10000,
        "series_columns": [],
        "series_limit": 0,
        "order_desc": True,
        "post_processing": _pivot("visit_date"),
    }


def _chart(name: str, chart: str, query: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "chart": chart,
        "dataset": "dpsql_visits",
        "kind": "chart",
        "queries": [query],
        "keep_data": True,
    }


#: A clinic dashboard of 14 charts, each a chart-data request as Superset 6.1 posts it.
SYNOPSIS_CASES: list[dict[str, Any]] = [
    _chart("bar", "Bar chart: COUNT(*) by department", _department_bar([])),
    _chart(
        "pie",
        "Pie chart: COUNT(*) by department",
        {
            "columns": ["department"],
            "metrics": ["count"],
            "orderby": [["count", False]],
            "filters": [],
            "extras": _EXTRAS,
            "row_limit": 100,
        },
    ),
    _chart(
        "table",
        "Table: COUNT(*) and % of total by department",
        {
            "columns": ["department"],
            "metrics": ["count"],
            "orderby": [["count", False]],
            "filters": [],
            "extras": _EXTRAS,
            "row_limit": 1000,
            "post_processing": [
                {"operation": "contribution", "options": {"columns": ["count"], "rename_columns": ["%count"]}}
            ],
        },
    ),
    _chart("line_2021", f"Line chart: COUNT(*) by month, custom range {TIME_RANGE}", _monthly_line(TIME_RANGE)),
    _chart("line_2022_h1", f"Line chart: COUNT(*) by month, custom range {HALF_YEAR}", _monthly_line(HALF_YEAR)),
    _chart(
        "big_number",
        "Big Number: COUNT(*)",
        {"metrics": ["count"], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000},
    ),
    _chart(
        "big_number_2021",
        f"Big Number with a custom time range: COUNT(*), {TIME_RANGE}",
        {
            "time_range": TIME_RANGE,
            "metrics": ["count"],
            "columns": [],
            "filters": [{"col": "visit_date", "op": "TEMPORAL_RANGE", "val": TIME_RANGE}],
            "extras": _EXTRAS,
            "row_limit": 10000,
        },
    ),
    *(
        _chart(
            f"bar_filter_{i}",
            f"The bar chart with the dashboard's department filter IN {chosen}",
            _department_bar([{"col": "department", "op": "IN", "val": chosen}]),
        )
        for i, chosen in enumerate(DEPARTMENT_FILTERS, 1)
    ),
    _chart(
        "bar_having",
        "The bar chart with a custom SQL HAVING filter: COUNT(*) > 100",
        _department_bar([], having="COUNT(*) > 100"),
    ),
    _chart(
        "month_table",
        "Table: COUNT(*) by month of visit_date (time grain P1M), every month",
        {
            "columns": [_axis("visit_date", "P1M")],
            "metrics": ["count"],
            "orderby": [["count", False]],
            "filters": [],
            "extras": {**_EXTRAS, "time_grain_sqla": "P1M"},
            "row_limit": 1000,
        },
    ),
]

#: The chart shapes issue #38 found charged or unflagged beside the dashboard above: SUM/AVG of a measure the
#: synopsis does not hold, a filter on a column that is not a synopsis key, coarser grains (quarters, years:
#: answered, wider), a time range off the month edges. Each is recorded with its charge and any widening.
_AVG_COST: dict[str, Any] = {
    "expressionType": "SIMPLE",
    "column": {"column_name": "cost"},
    "aggregate": "AVG",
    "label": "AVG(cost)",
}
_SUM_COST: dict[str, Any] = {**_AVG_COST, "aggregate": "SUM", "label": "SUM(cost)"}
OFF_EDGE_RANGE = "2021-01-15T00:00:00 : 2021-07-15T00:00:00"


def _line(grain: str, time_range: str) -> dict[str, Any]:
    line = _monthly_line(time_range)
    line["columns"] = [_axis("visit_date", grain)]
    line["extras"] = {**_EXTRAS, "time_grain_sqla": grain}
    if time_range == "No filter":
        line["filters"] = []
    return line


def _measure_bar(metric: dict[str, Any]) -> dict[str, Any]:
    bar = _department_bar([])
    bar.update(metrics=[metric], orderby=[[metric, False]], post_processing=_pivot("department", metric["label"]))
    return bar


SYNOPSIS_MORE_CASES: list[dict[str, Any]] = [
    _chart("avg_cost_bar", "Bar chart: AVG(cost) by department", _measure_bar(_AVG_COST)),
    _chart("sum_cost_bar", "Bar chart: SUM(cost) by department", _measure_bar(_SUM_COST)),
    _chart(
        "bar_urgent",
        "The bar chart with a filter on urgent (not a synopsis key)",
        _department_bar([{"col": "urgent", "op": "==", "val": True}]),
    ),
    _chart("line_quarterly_2021", f"Line chart: COUNT(*) by quarter, {TIME_RANGE}", _line("P3M", TIME_RANGE)),
    _chart("line_yearly", "Line chart: COUNT(*) by year, no time range", _line("P1Y", "No filter")),
    _chart("line_off_edges", f"Line chart: COUNT(*) by month, {OFF_EDGE_RANGE}", _line("P1M", OFF_EDGE_RANGE)),
]


# --- the health and adult demos' dashboards over their declared synopses (tests/bi/test_superset_demos.py) ---


def _metric(aggregate: str, column: str) -> dict[str, Any]:
    """Superset's SIMPLE ad-hoc metric (the metric popover's column + aggregate)."""
    return {
        "expressionType": "SIMPLE",
        "column": {"column_name": column},
        "aggregate": aggregate,
        "label": f"{aggregate}({column})",
    }


def _grouped(
    name: str, dataset: str, columns: list[str], metric: Any = "count", filters: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A bar (one column on the x-axis) or a table (several columns) of one metric, as Superset posts it."""
    label = metric if isinstance(metric, str) else metric["label"]
    query: dict[str, Any] = {
        "columns": [_axis(columns[0])] if len(columns) == 1 else columns,
        "metrics": [metric],
        "orderby": [[metric, False]],
        "filters": filters or [],
        "extras": _EXTRAS,
        "row_limit": 10000,
        "order_desc": True,
    }
    if len(columns) == 1:
        query.update(series_columns=[], series_limit=0, post_processing=_pivot(columns[0], label))
    chart = f"{'Bar chart' if len(columns) == 1 else 'Table'}: {label} by {', '.join(columns)}"
    if filters:
        chart += " where " + ", ".join(f"{f['col']} {f['op']} {f['val']}" for f in filters)
    return {"name": name, "chart": chart, "dataset": dataset, "kind": "chart", "queries": [query], "keep_data": True}


def _total(name: str, dataset: str, metric: Any = "count") -> dict[str, Any]:
    label = metric if isinstance(metric, str) else metric["label"]
    query = {"metrics": [metric], "columns": [], "filters": [], "extras": _EXTRAS, "row_limit": 10000}
    return {"name": name, "chart": f"Big Number: {label}", "dataset": dataset, "kind": "chart", "queries": [query]}


#: Per demo: its Superset dataset (the physical table through dpsql://) and its charts. ``outside`` names the
#: charts its synopsis does not hold (a key or measure it lacks): fresh queries, charged the chart's ε.
DEMO_DASHBOARDS: dict[str, dict[str, Any]] = {
    "health": {
        "datasets": {"dpsql_patients": {"database": "dpsql", "table": "patients"}},
        "cases": [
            _grouped("problem_bar", "dpsql_patients", ["problem"]),
            _grouped("ethnicity_bar", "dpsql_patients", ["ethnicity"]),
            _grouped("marital_bar", "dpsql_patients", ["marital_status"]),
            _grouped("problem_ethnicity_table", "dpsql_patients", ["problem", "ethnicity"]),
            _grouped("avg_age_by_problem", "dpsql_patients", ["problem"], _metric("AVG", "age")),
            _grouped("sum_age_by_ethnicity", "dpsql_patients", ["ethnicity"], _metric("SUM", "age")),
            _grouped(
                "problem_bar_filtered",
                "dpsql_patients",
                ["problem"],
                filters=[{"col": "ethnicity", "op": "IN", "val": ["Asian", "Black"]}],
            ),
            _total("total", "dpsql_patients"),
            _grouped("sex_bar", "dpsql_patients", ["sex"]),  # sex is not a key of patients_dashboard
            _grouped("avg_bmi_by_problem", "dpsql_patients", ["problem"], _metric("AVG", "bmi")),
        ],
        "outside": ["sex_bar", "avg_bmi_by_problem"],
    },
    "adult": {
        "datasets": {"dpsql_adult": {"database": "dpsql", "table": "adult"}},
        "cases": [
            _grouped("education_bar", "dpsql_adult", ["education"]),
            _grouped("race_bar", "dpsql_adult", ["race"]),
            _grouped("sex_income_table", "dpsql_adult", ["sex", "income"]),
            _grouped("avg_hours_by_sex", "dpsql_adult", ["sex"], _metric("AVG", "hours_per_week")),
            _grouped(
                "race_bar_rich",
                "dpsql_adult",
                ["race"],
                filters=[{"col": "income", "op": "IN", "val": [">50K"]}],
            ),
            _total("total", "dpsql_adult"),
            _grouped("avg_age_by_sex", "dpsql_adult", ["sex"], _metric("AVG", "age")),  # age is not measured
        ],
        "outside": ["avg_age_by_sex"],
    },
}
