"""Drive Apache Superset's own Python code against a running `dpsql serve`; run with the Superset venv.

Imported by nothing in dpsql: tests/bi/test_superset.py runs ``.superset-venv/bin/python
tests/bi/superset_probe.py`` with a JSON job on stdin (the SQLAlchemy URI of the dpsql server, the
datasets and chart cases, an output path) and reads the JSON written there. Superset's metadata
database is a copy of the SQLite file scripts/superset.sh prepared (``superset db upgrade`` + ``init``
+ an admin user); SUPERSET_CONFIG_PATH points at it. Everything goes through Superset's own code:
``Database``, ``SqlaTable.fetch_metadata`` ("Sync columns from source"), ``QueryContextFactory`` +
``ChartDataCommand`` (what ``POST /api/v1/chart/data`` runs) and ``values_for_column`` (the filter-value
dropdown), so the SQL dpsql sees is the SQL a Superset user's chart sends.

Only observation is added: psycopg2 connections get a cursor class that records every statement on the
wire with the SQLSTATE (``pgcode``) and primary message the server sent, since Superset replaces the
server's error with its own text, and the NOTICEs (dpsql's "charged ε=…").
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

WIRE: list[dict[str, Any]] = []


def _record_error(sql: str, exc: BaseException) -> None:
    """Find the psycopg2 error under Superset's and SQLAlchemy's wrappers and keep its SQLSTATE."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(seen, "pgcode", None)
        if code:
            diag = getattr(seen, "diag", None)
            message = getattr(diag, "message_primary", None) or str(seen).strip()
            WIRE.append({"sql": sql, "sqlstate": code, "message": message})
            return
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    WIRE.append({"sql": sql, "sqlstate": None, "message": f"{type(exc).__name__}: {exc}"})


def _instrument() -> None:
    """Give every psycopg2 connection a cursor that records what it sends and the SQLSTATE it gets back.

    psycopg2.connect is where SQLAlchemy's dialect and Superset's raw connections both open their
    connections, so this sees everything: dialect probes, catalog sync, column-description queries,
    chart SQL and filter values.
    """
    import psycopg2
    import psycopg2.extensions

    class RecordingCursor(psycopg2.extensions.cursor):
        def execute(self, query: Any, vars: Any = None) -> Any:
            sql = query if isinstance(query, str) else query.decode()
            del self.connection.notices[:]
            try:
                result = super().execute(query, vars)
            except Exception as exc:
                _record_error(sql, exc)
                WIRE[-1]["notices"] = [n.strip() for n in self.connection.notices]
                raise
            notices = [n.strip() for n in self.connection.notices]
            WIRE.append({"sql": sql, "sqlstate": "00000", "message": None, "notices": notices})
            return result

    connect = psycopg2.connect

    def recording_connect(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cursor_factory", RecordingCursor)
        return connect(*args, **kwargs)

    psycopg2.connect = recording_connect


def _outcome(wire: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's verdict: the first refused statement, else answered."""
    for item in wire:
        if item["sqlstate"] != "00000":
            return {"outcome": "refused", "sqlstate": item["sqlstate"], "message": item["message"]}
    return {"outcome": "answered", "sqlstate": "00000", "message": None}


def main() -> None:
    job = json.load(sys.stdin)
    _instrument()
    from superset.app import create_app

    app = create_app()
    with app.app_context(), app.test_request_context():
        result = run(job)
    with open(job["output"], "w", encoding="utf-8") as out:
        json.dump(result, out, default=str, indent=1)


def run(job: dict[str, Any]) -> dict[str, Any]:
    from superset import db, security_manager
    from superset.commands.chart.data.get_data_command import ChartDataCommand
    from superset.common.query_context_factory import QueryContextFactory
    from superset.connectors.sqla.models import SqlaTable
    from superset.models.core import Database
    from superset.utils.core import override_user

    admin = security_manager.find_user("admin")
    out: dict[str, Any] = {"setup": [], "cases": []}

    def step(name: str, fn: Any) -> Any:
        WIRE.clear()
        value, error = None, None
        try:
            value = fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        out["setup"].append({"step": name, "error": error, "wire": list(WIRE), **_outcome(WIRE)})
        return value

    with override_user(admin):
        database = Database(database_name="dpsql", sqlalchemy_uri=job["uri"], expose_in_sqllab=True)
        db.session.add(database)
        db.session.commit()

        def test_connection() -> bool:  # what "Test connection" in the database dialog runs
            from superset.commands.database.utils import ping

            with database.get_sqla_engine() as engine:
                return bool(ping(engine))

        step("test connection", test_connection)
        step("connect: dialect probes", lambda: database.get_all_table_names_in_schema(None, "public"))

        tables: dict[str, SqlaTable] = {}
        for name, spec in job["datasets"].items():
            table = SqlaTable(
                table_name=name,
                schema=None if spec.get("sql") else "public",
                sql=spec.get("sql"),
                database=database,
                main_dttm_col=spec.get("main_dttm_col"),
            )
            db.session.add(table)
            db.session.commit()
            if "column_probe_limit" in spec:
                # what an engine spec overriding get_column_description_limit_size() would make Superset send
                original, limit = Database.get_column_description_limit_size, int(spec["column_probe_limit"])
                Database.get_column_description_limit_size = lambda self, n=limit: n  # type: ignore[method-assign]
                try:
                    step(f"sync columns: {name}", table.fetch_metadata)
                finally:
                    Database.get_column_description_limit_size = original  # type: ignore[method-assign]
            else:
                step(f"sync columns: {name}", table.fetch_metadata)
            for column in table.columns:
                if column.column_name in spec.get("temporal", []):
                    column.is_dttm = True
            db.session.commit()
            tables[name] = table
            out.setdefault("columns", {})[name] = sorted(c.column_name for c in table.columns)
            out.setdefault("metrics", {})[name] = {m.metric_name: m.expression for m in table.metrics}

        for case in job["cases"]:
            WIRE.clear()
            table = tables[case["dataset"]]
            record: dict[str, Any] = {"name": case["name"], "chart": case["chart"]}
            try:
                if case["kind"] == "values":
                    values = table.values_for_column(case["column"], limit=case.get("limit", 1000))
                    record["rows"] = len(values)
                    record["sql"] = [w["sql"] for w in WIRE if w["sqlstate"] is not None][-1:]
                else:
                    context = QueryContextFactory().create(
                        datasource={"id": table.id, "type": "table"},
                        queries=case["queries"],
                        form_data=case.get("form_data", {}),
                    )
                    command = ChartDataCommand(context)
                    command.validate()
                    result = command.run()
                    record["sql"] = [q.get("query") for q in result["queries"]]
                    record["rows"] = [q.get("rowcount") for q in result["queries"]]
                    record["superset_errors"] = [q.get("error") for q in result["queries"] if q.get("error")]
                    record["data"] = [q.get("data")[:3] if q.get("data") else None for q in result["queries"]]
            except Exception as exc:
                record["exception"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
            record["wire"] = list(WIRE)
            record.update(_outcome(WIRE))
            if record["outcome"] == "answered" and (record.get("exception") or record.get("superset_errors")):
                record.update(outcome="failed", sqlstate=None, message=record.get("exception"))
            out["cases"].append(record)
    return out


if __name__ == "__main__":
    main()
