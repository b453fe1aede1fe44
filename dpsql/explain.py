"""EXPLAIN: what a query would cost and how accurate it would be, without running it.

Everything shown is public: the policy's bounds, the calibrated scales, the generated SQL
(with the row-selection salt hidden). Nothing is read from the data and nothing is charged.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from dpsql.aggregates import OUTPUTS
from dpsql.analyze.parse import skip_comments
from dpsql.errors import FeatureNotSupported
from dpsql.plan import Plan
from dpsql.release.calibrate import Budgeting
from dpsql.session import OutputColumn, Result


@dataclass
class Explanation:
    """``dpsql explain`` / ``EXPLAIN``: what a query would cost and how accurate it would be."""

    sql: str
    epsilon: float
    delta: float
    mechanism: str
    columns: list[dict[str, Any]] = field(default_factory=list)
    keys: str = "none"
    unit: str = ""

    def as_json(self) -> str:
        """PostgreSQL's ``EXPLAIN (FORMAT JSON)`` shape: an array holding one ``{"Plan": …}`` object."""

        def finite(value: Any) -> Any:
            return value if not isinstance(value, float) or math.isfinite(value) else None

        plan = {
            "Node Type": "DP Aggregate",
            "Mechanism": self.mechanism,
            "Epsilon": self.epsilon,
            "Delta": self.delta,
            "Privacy Unit": self.unit,
            "Group Keys": self.keys,
            "Outputs": [{k: finite(v) for k, v in c.items()} for c in self.columns],
            "Backend SQL": self.sql,
        }
        return json.dumps([{"Plan": plan}], indent=2)

    def as_result(self, format: str = "text") -> Result:
        if format == "json":
            return Result(
                columns=[OutputColumn("QUERY PLAN", "text", noisy=False)],
                rows=[(self.as_json(),)],
                accuracy=[(None,)],
                epsilon_spent=0.0,
                delta_spent=0.0,
                command_tag="EXPLAIN",
            )
        lines = [
            f"DP Aggregate  (mechanism={self.mechanism} epsilon={self.epsilon:g} delta={self.delta:g})",
            f"  Privacy unit: {self.unit}",
            f"  Group keys: {self.keys}",
        ]
        for c in self.columns:
            if "rank_error95" in c:
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  epsilon={c['epsilon']:g} "
                    f"rank error <= {c['rank_error95']:.4g} at 95%"
                )
            elif c["noisy"] and math.isnan(c["ci"]):
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  sensitivity={c['sensitivity']:g} "
                    f"scale={c['scale']:g} epsilon={c['epsilon']:g}"
                )
            elif c["noisy"]:
                lines.append(
                    f"  Output {c['name']}: {c['measure']}  sensitivity={c['sensitivity']:g} "
                    f"scale={c['scale']:g} epsilon={c['epsilon']:g} ci95=±{c['ci']:.4g}"
                )
            else:
                lines.append(f"  Output {c['name']}: {c['measure']}")
        lines.append(f"  Backend SQL: {self.sql}")
        return Result(
            columns=[OutputColumn("QUERY PLAN", "text", noisy=False)],
            rows=[(line,) for line in lines],
            accuracy=[(None,) for _ in lines],
            epsilon_spent=0.0,
            delta_spent=0.0,
            command_tag="EXPLAIN",
        )


def explain(plan: Plan, budgeting: Budgeting, confidence: float, shown_sql: str) -> Explanation:
    """Cost, sensitivity, noise scale and expected error per output, from the plan and its calibration."""
    columns = []
    for out in plan.outputs:
        entry: dict[str, Any] = {"name": out.column.name, "type": out.column.type, "noisy": out.noisy}
        entry.update(OUTPUTS[out.kind].explain(out, plan, budgeting, confidence))
        columns.append(entry)
    if not plan.keys:
        keys = "none"
    elif plan.public_keys:
        keys = "public domain: " + ", ".join(k.column for k in plan.keys)
    else:
        counted = plan.measures[plan.selection_measure].label if plan.selection_measure is not None else "COUNT(*)"
        keys = (
            ", ".join(k.column for k in plan.keys)
            + f" (partition selection: noisy {counted} >= {budgeting.threshold}, δ={budgeting.selection_delta:g})"
        )
    unit = plan.sources.unit_description
    if plan.unit is not None:
        unit += f" (at most {plan.max_rows} rows and {plan.max_groups} groups per unit)"
    return Explanation(shown_sql, budgeting.epsilon, budgeting.delta, budgeting.mechanism, columns, keys, unit)


#: The one EXPLAIN option accepted: ``(FORMAT TEXT)`` or ``(FORMAT JSON)`` (pgcli sends the latter).
_FORMAT = re.compile(r"\(\s*format\s+(text|json)\s*\)", re.IGNORECASE)


def explain_format(sql: str) -> str:
    """``json`` for ``EXPLAIN (FORMAT JSON) …``, else ``text``."""
    stripped = skip_comments(sql)
    options = _FORMAT.match(skip_comments(stripped[7:])) if stripped[:7].upper() == "EXPLAIN" else None
    return options.group(1).lower() if options else "text"


def explain_target(sql: str) -> str | None:
    """The query inside ``EXPLAIN <query>``; EXPLAIN ANALYZE is refused (it reveals timings and row counts)."""
    stripped = skip_comments(sql)
    if stripped[:7].upper() != "EXPLAIN" or stripped[7:8].isalnum() or stripped[7:8] == "_":
        return None
    rest = skip_comments(stripped[7:])
    if (options := _FORMAT.match(rest)) is not None:
        return rest[options.end() :]
    if rest[:1] == "(" or rest.split(None, 1)[0].upper() in ("ANALYZE", "ANALYSE", "VERBOSE"):
        raise FeatureNotSupported(
            "EXPLAIN options are not supported",
            hint="EXPLAIN ANALYZE would reveal exact row counts and timings; use plain EXPLAIN.",
        )
    return rest
