"""ARCHITECTURE.md stays true: its stage table is the layer check's, the files it names exist, and its
recipes work — a toy GROUP BY key function and a toy aggregate added by following them answer queries.

The toys are registered into the real registries for one test (``monkeypatch.setitem``, undone after it)
and run through the real engine on the health demo (DuckDB), charged and noised like any query.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlglot import exp

from dpsql import aggregates
from dpsql.aggregates.base import Aggregate, Recognised, Scope, measure_var
from dpsql.analyze import domains
from dpsql.analyze.keys.base import KeyContext, KeyExpr, finite_domain
from dpsql.backends import Backend
from dpsql.engine import Engine
from dpsql.errors import FeatureNotSupported, UndefinedFunction
from dpsql.ledger import Ledger
from dpsql.pgtypes import PgType
from dpsql.plan import MEASURE_AGGREGATES, Measure, OutputItem
from dpsql.session import Session
from tests.demos import demo_engine_fixture, demo_fixture

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_layers  # noqa: E402

MAP = (ROOT / "ARCHITECTURE.md").read_text()


def test_stage_table_is_the_layer_checks() -> None:
    rows = re.findall(r"^\| (\d+) \| (\w+) \| ([^|]+) \|", MAP, flags=re.MULTILINE)
    table = [(name, tuple(re.findall(r"`([\w.]+)`", modules))) for _, name, modules in rows]
    assert table == check_layers.STAGES


def test_every_file_named_exists() -> None:
    named = set(re.findall(r"\b((?:dpsql|tests|scripts)/[\w/]*\w(?:\.py)?/?)", MAP))
    assert len(named) > 60
    missing = sorted(p for p in named if "<" not in p and not (ROOT / p).exists())
    assert missing == []


health = demo_fixture("health", scope="module")
engine = demo_engine_fixture("health", "health")


# -- a GROUP BY key function: ABS(x) -------------------------------------------------------------


def absolute(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """``ABS(a)`` of a key with a finite domain: the absolute values of its domain (policy only)."""
    inner = keys.derive(node.this)
    if inner.values is None or not inner.numeric:
        raise FeatureNotSupported("ABS in GROUP BY needs a numeric key with a finite domain")
    values = (abs(v) for v in inner.values if isinstance(v, int | float))
    return KeyExpr(exp.Abs(this=inner.sql), inner.type, finite_domain(node, values, inner.nullable), inner.nullable)


GROUP_BY_ABS = "SELECT ABS(age - 50) AS d, COUNT(*) AS n FROM patients GROUP BY ABS(age - 50)"


def test_key_function_recipe(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    session = Session("alice")
    with pytest.raises(FeatureNotSupported, match="ABS is not supported in GROUP BY"):
        engine.execute(GROUP_BY_ABS, session)
    monkeypatch.setitem(domains.KEY_FUNCTIONS, exp.Abs, absolute)  # recipe step 2: one line in KEY_FUNCTIONS
    result = engine.execute(GROUP_BY_ABS, session)
    # age in [0, 110]: |age - 50| takes 0..60, every value of the derived domain released (no threshold)
    assert [row[0] for row in result.rows] == list(range(61))
    assert result.epsilon_spent == 1.0 and all(isinstance(row[1], int) for row in result.rows)


# -- an aggregate: COUNT_IF(condition) -------------------------------------------------------------


class CountIf(Aggregate):
    """``COUNT_IF(p)``: ``COUNT(CASE WHEN p THEN 1 END)``, a measure of its own kind. Sensitivity: one row
    adds at most 1 (the default ``row_sensitivity``), as COUNT(*) FILTER (WHERE p)."""

    kind = "toy_count_if"
    direct = True
    explain_ci = True
    recognises = (exp.CountIf,)

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:
        case = exp.Case(ifs=[exp.If(this=node.this.copy(), true=exp.Literal.number(1))])
        measure = replace(scope.count_of(scope.operand(case)), kind=self.kind)  # the condition checked as WHERE
        index = scope.measure(measure)
        return Recognised(measure_var(index), self.kind, (index,))

    def label(self, measure: Measure) -> str:
        return "COUNT_IF(…)"

    def raw_sql(self, measure: Measure, value: Callable[[], exp.Expression]) -> exp.Expression:
        return exp.Count(this=value(), big_int=True)

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "bigint"

    def coerce(self, out: OutputItem, value: Any) -> Any:
        return value if value is None else max(round(value), 0)

    def direct_values(self, values: list[Any], convert: Callable[[Any], Any]) -> list[Any]:
        return [max(round(v), 0) for v in values]

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return widths[out.measures[0]]


def register(monkeypatch: pytest.MonkeyPatch, aggregate: Aggregate) -> None:
    """Recipe step 2 at test time: what adding ``aggregate`` to the MEASURES and OUTPUTS tuples of
    dpsql/aggregates/__init__.py registers when the package is imported."""
    monkeypatch.setitem(aggregates.MEASURES, aggregate.kind, aggregate)
    monkeypatch.setitem(MEASURE_AGGREGATES, aggregate.kind, aggregate)
    monkeypatch.setitem(aggregates.OUTPUTS, aggregate.kind, aggregate)
    for node in aggregate.recognises:
        monkeypatch.setitem(aggregates.RECOGNISERS, node, aggregate)


def test_aggregate_recipe(engine: Engine, health: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    session = Session("alice")
    sql = "SELECT sex, COUNT_IF(age > 40) AS older FROM patients GROUP BY sex"
    with pytest.raises(UndefinedFunction, match=r"count_if\(\) does not exist"):
        engine.execute(sql, session)
    register(monkeypatch, CountIf())
    result = engine.execute(sql, session)
    assert [c.name for c in result.columns] == ["sex", "older"] and result.epsilon_spent == 1.0
    _, exact = health.execute("SELECT sex, COUNT(*) FROM patients WHERE age > 40 GROUP BY sex")
    truth = {sex: n for sex, n in exact}
    for (sex, older), (_, width) in zip(result.rows, result.accuracy, strict=True):
        assert width is not None and abs(older - truth.get(sex, 0)) <= 3 * width  # fails with p < 1e-3
    unregistered = Engine(engine.policy, health, Ledger.open("sqlite:///:memory:"))
    monkeypatch.undo()
    assert "toy_count_if" not in aggregates.MEASURES and exp.CountIf not in aggregates.RECOGNISERS
    with pytest.raises(UndefinedFunction):
        unregistered.execute(sql, session)
