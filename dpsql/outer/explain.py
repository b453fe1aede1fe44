"""EXPLAIN of a composite statement: each DP query with its cost, and the post-processing SQL; charges nothing.

Built from the same pricing the execution uses (every DP part prepared, nothing run or reserved), so
what EXPLAIN shows is what a first execution would be charged: the sum of the parts (sequential
composition). The post-processing is shown as the SQL the sandbox would run over the released rows;
for a series limit, the outer DP query is shown with a one-key stand-in for the list the ranking
will release (its cost does not depend on that list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dpsql.accountant import fmt
from dpsql.explain import Explanation, sql_lines
from dpsql.session import OutputColumn, Result


@dataclass
class SubPlan:
    """One DP query of the statement: its role (``released as __dpsql_released_1``) and its EXPLAIN."""

    role: str
    explanation: Explanation | CompositeExplanation


@dataclass
class CompositeExplanation:
    """``EXPLAIN`` of post-processing over DP sub-queries or of a series limit."""

    node: str
    epsilon: float
    delta: float
    subplans: list[SubPlan] = field(default_factory=list)
    #: The post-processing statement run over the released rows (none for a series limit).
    outer_sql: str = ""
    mechanism: str = "sequential composition"

    def as_json(self) -> str:
        """PostgreSQL's shape: one ``{"Plan": …}`` whose ``Plans`` are the DP queries' own plans."""
        plans = []
        for sub in self.subplans:
            (child,) = json.loads(sub.explanation.as_json())
            plans.append({"Parent Relationship": sub.role, **child["Plan"]})
        plan: dict[str, Any] = {"Node Type": self.node, "Epsilon": self.epsilon, "Delta": self.delta}
        if self.outer_sql:
            plan["Post-processing SQL"] = self.outer_sql
        plan["Plans"] = plans
        return json.dumps([{"Plan": plan}], indent=2)

    def lines(self) -> list[str]:
        queries = len(self.subplans)
        lines = [
            f"{self.node}  (epsilon={fmt(self.epsilon)} delta={fmt(self.delta)}; {queries} DP quer"
            + ("y" if queries == 1 else "ies")
            + ", reserved together; post-processing is free)"
        ]
        if self.outer_sql:
            lines.append("  Post-processing SQL (over the released rows, in a sandbox):")
            lines.extend(sql_lines(self.outer_sql, indent=6))
        for sub in self.subplans:
            lines.append(f"  ->  {sub.role}:")
            lines.extend("        " + str(row[0]) for row in sub.explanation.as_result().rows)
        return lines

    def as_result(self, format: str = "text") -> Result:
        rows = [(self.as_json(),)] if format == "json" else [(line,) for line in self.lines()]
        return Result(
            columns=[OutputColumn("QUERY PLAN", "text", noisy=False)],
            rows=rows,
            accuracy=[(None,) for _ in rows],
            epsilon_spent=0.0,
            delta_spent=0.0,
            command_tag="EXPLAIN",
        )
