"""Drive Apache Superset's own Python code against a running `dpsql serve`; run with the Superset venv.

Imported by nothing in dpsql: tests/bi/test_superset.py runs ``.superset-venv/bin/python
tests/bi/superset_probe.py`` with a JSON job on stdin (the Superset databases — name, SQLAlchemy URI of
the dpsql server, a prefix for their setup steps —, the datasets and chart cases, an output path) and
reads the JSON written there. Superset's metadata database is a copy of the SQLite file
scripts/superset.sh prepared (``superset db upgrade`` + ``init`` + an admin user); SUPERSET_CONFIG_PATH
points at it. Everything goes through Superset's own code: ``Database``, ``SqlaTable.fetch_metadata``
("Sync columns from source"), ``QueryContextFactory`` + ``ChartDataCommand`` (what ``POST
/api/v1/chart/data`` runs), ``values_for_column`` (the filter-value dropdown), ``Database.select_star``
(SQL Lab's table preview), ``QueryEstimationCommand`` (SQL Lab's "estimate cost") and the engine spec's
``extract_errors`` (how SQL Lab reports an error), so the SQL dpsql sees is the SQL a Superset user's
chart sends.

Only observation is added: psycopg2 connections get a cursor class that records every statement on the
wire with the SQLSTATE (``pgcode``) and primary message the server sent, since Superset replaces the
server's error with its own text, the NOTICEs (dpsql's "charged ε=…") and the rows Superset fetched;
and what the engine spec logged (its ``dpsql_superset`` logger) is kept per case.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import traceback
from typing import Any

WIRE: list[dict[str, Any]] = []
LOGGED: list[str] = []  # what dpsql_superset logged (DpsqlEngineSpec.execute: each statement's NOTICEs)


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGGED.append(record.getMessage())


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

    class RecordingCursor(psycopg2.extensions.cursor):  # type: ignore[misc]  # psycopg2 has no stubs here
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
            self._recorded = WIRE[-1]
            return result

        def fetchall(self) -> Any:
            return self._keep(super().fetchall())

        def fetchmany(self, size: Any = None) -> Any:
            return self._keep(super().fetchmany() if size is None else super().fetchmany(size))

        def _keep(self, rows: Any) -> Any:
            """The rows dpsql sent, as Superset's fetch_data reads them (before its post-processing)."""
            recorded = getattr(self, "_recorded", None)
            if recorded is not None:
                recorded.setdefault("rows", []).extend([list(r) for r in rows])
            return rows

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
    logging.getLogger("dpsql_superset").addHandler(_Keep())  # observe only: Superset's level and handlers stay
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
        out["engine_specs"] = _engine_specs()
        databases: dict[str, Database] = {}
        for entry in job["databases"]:
            database = Database(database_name=entry["name"], sqlalchemy_uri=entry["uri"], expose_in_sqllab=True)
            db.session.add(database)
            db.session.commit()
            databases[entry["name"]] = database
            spec = database.db_engine_spec
            out["engine_specs"][entry["name"]] = {
                "backend": database.backend,
                "spec": f"{spec.__module__}.{spec.__qualname__}",
                "engine_name": spec.engine_name,
                "time_grains": [g.duration for g in spec.get_time_grains()],
                "column_probe_limit": database.get_column_description_limit_size(),
            }
            prefix = entry.get("prefix", "")

            def test_connection(database: Database = database) -> bool:  # "Test connection" in the dialog
                from superset.commands.database.utils import ping

                with database.get_sqla_engine() as engine:
                    return bool(ping(engine))

            step(f"{prefix}test connection", test_connection)
            step(
                f"{prefix}connect: dialect probes",
                lambda database=database: database.get_all_table_names_in_schema(None, "public"),
            )

        tables: dict[str, SqlaTable] = {}
        for name, spec in job["datasets"].items():
            database = databases[spec.get("database", job["databases"][0]["name"])]
            prefix = next(e.get("prefix", "") for e in job["databases"] if e["name"] == database.database_name)
            table = SqlaTable(
                table_name=spec.get("table", name),  # a physical dataset is named after its table
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
                Database.get_column_description_limit_size = lambda self, n=limit: n
                try:
                    step(f"{prefix}sync columns: {name}", table.fetch_metadata)
                finally:
                    Database.get_column_description_limit_size = original
            else:
                step(f"{prefix}sync columns: {name}", table.fetch_metadata)
            for column in table.columns:
                if column.column_name in spec.get("temporal", []):
                    column.is_dttm = True
            db.session.commit()
            tables[name] = table
            out.setdefault("columns", {})[name] = sorted(c.column_name for c in table.columns)
            out.setdefault("metrics", {})[name] = {m.metric_name: m.expression for m in table.metrics}

        for case in job["cases"]:
            WIRE.clear()
            LOGGED.clear()
            table = tables[case["dataset"]]
            record: dict[str, Any] = {"name": case["name"], "chart": case["chart"]}
            try:
                if case["kind"] == "values":
                    values = table.values_for_column(case["column"], limit=case.get("limit", 1000))
                    record["rows"] = len(values)
                    record["sql"] = [w["sql"] for w in WIRE if w["sqlstate"] is not None][-1:]
                elif case["kind"] == "select_star":  # SQL Lab's data preview of a table
                    from superset.sql.parse import Table

                    sql = table.database.select_star(Table(table.table_name, table.schema), show_cols=False)
                    record["sql"] = [sql]
                    record["rows"] = [len(table.database.get_df(sql, None, table.schema))]
                elif case["kind"] == "estimate":  # SQL Lab's "estimate cost" button
                    from superset.commands.sql_lab.estimate import QueryEstimationCommand

                    params = {"database_id": table.database.id, "sql": case["sql"], "template_params": {}}
                    record["estimate"] = QueryEstimationCommand({**params, "catalog": None, "schema": "public"}).run()
                    record["sql"] = [case["sql"]]
                    record["rows"] = [len(record["estimate"])]
                elif case["kind"] == "sqllab":  # a statement run by SQL Lab's own task; errors as it reports them
                    # a case may name another database of the group (SQL Lab needs no dataset)
                    payload = _sqllab(databases[case.get("database", table.database.database_name)], case["sql"])
                    record["sql"] = [case["sql"]]
                    record["sqllab_status"] = str(payload.get("status"))
                    record["sqllab_columns"] = [c.get("column_name") for c in payload.get("columns") or []]
                    record["sqllab_extra"] = (payload.get("query") or {}).get("extra")
                    if payload.get("errors"):
                        record["sqllab_errors"] = [
                            {"type": str(e["error_type"]), "message": e["message"]} for e in payload["errors"]
                        ]
                    else:
                        record["rows"] = [len(payload.get("data") or [])]
                elif case["kind"] == "dataset_payload":  # what Explore and the dataset API load for a dataset
                    payload = table.data
                    record["sql"] = [payload["select_star"]]
                    record["rows"] = [len(payload["columns"])]
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
                    record["colnames"] = [q.get("colnames") for q in result["queries"]]
                    record["superset_errors"] = [q.get("error") for q in result["queries"] if q.get("error")]
                    keep = None if case.get("keep_data") else 3  # a whole chart's data only where asked
                    record["data"] = [q.get("data")[:keep] if q.get("data") else None for q in result["queries"]]
            except Exception as exc:
                record["exception"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
            record["wire"] = list(WIRE)
            record["logged"] = list(LOGGED)
            record.update(_outcome(WIRE))
            if record["outcome"] == "answered" and (record.get("exception") or record.get("superset_errors")):
                record.update(outcome="failed", sqlstate=None, message=record.get("exception"))
            out["cases"].append(record)
    return out


def _sqllab(database: Any, sql: str) -> dict[str, Any]:
    """Run ``sql`` as SQL Lab's "Run" does (a ``Query`` row, then the ``get_sql_results`` task, here
    synchronously): errors go through ``handle_query_error``, which hands the engine spec's
    ``extract_errors`` the *text* of the failure, as in a real SQL Lab."""
    from superset import db, security_manager
    from superset.models.sql_lab import Query
    from superset.sql_lab import get_sql_results

    admin = security_manager.find_user("admin")
    query = Query(
        database_id=database.id,
        sql=sql,
        schema="public",
        select_as_cta=False,
        limit=1000,
        status="pending",
        user_id=admin.id,
        client_id=secrets.token_hex(5),  # unique, at most 11 characters as SQL Lab's own
    )
    db.session.add(query)
    db.session.commit()
    payload = get_sql_results(query.id, sql, return_results=True, username="admin")
    return dict(payload or {})


def _engine_specs() -> dict[str, Any]:
    """How Superset finds dpsql's engine spec: by its entry point, for the backend of dpsql:// URIs."""
    from superset.db_engine_specs import get_available_engine_specs, get_engine_spec

    def name(spec: Any) -> str:
        return f"{spec.__module__}.{spec.__qualname__}"

    available = {name(spec): sorted(drivers) for spec, drivers in get_available_engine_specs().items()}
    uris: dict[str, Any] = {}  # the dialect's ?epsilon=: what psycopg2 would be given, or the refusal
    for uri in (
        "dpsql://a@h/db?epsilon=0.5",
        "dpsql://a@h/db?epsilon=0.5%20-c%20dpsql.mechanism%3Dgaussian",
        "dpsql://a@h/db?epsilon=0.5&show_intervals=on&round=off&trim_time=true",
        "dpsql://a@h/db?show_intervals=on%20-c%20dpsql.epsilon%3D9",
    ):
        from sqlalchemy.engine import make_url

        url = make_url(uri)
        try:
            uris[uri] = url.get_dialect()().create_connect_args(url)[1].get("options")
        except ValueError as exc:
            uris[uri] = f"ValueError: {exc}"
    return {
        "dialect_options": uris,
        "get_engine_spec(dpsql)": name(get_engine_spec("dpsql")),
        "get_engine_spec(dpsql, psycopg2)": name(get_engine_spec("dpsql", "psycopg2")),
        "get_engine_spec(postgresql, psycopg2)": name(get_engine_spec("postgresql", "psycopg2")),
        "available": {k: v for k, v in available.items() if "dpsql" in k or k.endswith(".PostgresEngineSpec")},
    }


if __name__ == "__main__":
    main()
