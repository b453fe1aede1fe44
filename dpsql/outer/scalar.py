"""A filter on a DP aggregate: ``WHERE age > (SELECT AVG(age) FROM adult)`` (adaptive composition).

The subquery is an aggregate of protected rows, not a constant: it is answered as two DP queries in
sequence. The *inner* (``SELECT AVG(age) FROM adult``) is released first, exactly as if sent alone;
its noisy value is then public and becomes a constant of the *outer* query (``… WHERE age > 38.6``),
an ordinary DP query. The privacy argument is the series limit's (:mod:`dpsql.outer.series`):

1. both are validated and priced before anything is charged — the outer with a stand-in constant; a
   constant in WHERE sets no sensitivity, so its cost does not depend on the value (checked again);
2. both costs are reserved together, durably, once (sequential composition);
3. the outer is a DP mechanism chosen from a released value: adaptive composition, ε_in + ε_out.

Only an uncorrelated subquery of one aggregate qualifies (its columns all its own tables'); one that
reads the outer row (TPC-H Q17's average per part) is refused by the analyzer with what works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.errors import InternalError
from dpsql.outer.explain import CompositeExplanation, SubPlan
from dpsql.outer.host import Host
from dpsql.outer.shapes import own_aggregates
from dpsql.plan.sources import ident_name
from dpsql.policy import Policy
from dpsql.release.accuracy import confidence as confidence_level
from dpsql.session import Result, Session
from dpsql.step import Notice, Part, Step

__all__ = ["ScalarFilter", "answer_scalar", "explain_scalar", "split_scalar"]

_COMPARISONS = (exp.EQ, exp.NEQ, exp.LT, exp.LTE, exp.GT, exp.GTE)


@dataclass(frozen=True, slots=True)
class ScalarFilter:
    """A statement whose WHERE compares with an aggregate subquery of protected rows."""

    #: The subquery as a DP query of its own (PostgreSQL syntax).
    inner: str
    #: The statement, the subquery's place marked by :meth:`outer_sql`.
    template: exp.Select
    #: Its path in ``template`` (``find`` of the marker).
    marker: str

    def outer_sql(self, value: Any) -> str:
        """The outer query with the released value as its constant (NULL when nothing was released)."""
        tree = self.template.copy()
        node = next(n for n in tree.find_all(exp.Placeholder) if n.name == self.marker)
        node.replace(_literal(value))
        return tree.sql(dialect="postgres")


def _literal(value: Any) -> exp.Expression:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return exp.Null()
    text = repr(float(value)) if isinstance(value, float) else str(value)
    number = exp.Literal.number(text.lstrip("-"))
    return exp.Neg(this=number) if text.startswith("-") else number


def _uncorrelated(select: exp.Select, policy: Policy) -> bool:
    """Whether every column the subquery names is one of its own tables': qualified by one of their
    aliases, or unqualified and a column of one of them (else it reads the outer row: correlated)."""
    tables = list(select.find_all(exp.Table))
    own = {ident_name(t.args["alias"].this) if t.alias else ident_name(t.this) for t in tables}
    names: set[str] = set()
    for table in tables:
        declared = policy.table(ident_name(table.this))
        names |= set(declared.columns) if declared is not None else set()
    return all(
        ident_name(c.args.get("table")) in own if c.table else ident_name(c.this) in names
        for c in select.find_all(exp.Column)
    )


def split_scalar(tree: exp.Expression, policy: Policy) -> ScalarFilter | None:
    """The statement's one comparison with an uncorrelated aggregate subquery over protected rows, or None."""
    if not isinstance(tree, exp.Select) or tree.args.get("where") is None:
        return None
    found = []
    for node in tree.args["where"].find_all(*_COMPARISONS):
        for side in (node.this, node.expression):
            if isinstance(side, exp.Subquery) and isinstance(side.this, exp.Select):
                found.append(side)
    if len(found) != 1:
        return None
    sub = found[0]
    select = sub.this
    tables = [policy.table(ident_name(t.this)) for t in select.find_all(exp.Table)]
    private = any(t is not None and not t.public for t in tables)
    if not private or not own_aggregates(select) or select.args.get("group") or len(select.expressions) != 1:
        return None
    if not _uncorrelated(select, policy):
        return None
    template = tree.copy()
    marker = "dpsql_scalar"
    target = next(
        n
        for n in template.args["where"].find_all(exp.Subquery)
        if n.this == select  # the same subquery
    )
    target.replace(exp.Placeholder(this=marker))
    return ScalarFilter(select.sql(dialect="postgres"), template, marker)


def answer_scalar(engine: Host, split: ScalarFilter, session: Session, sql: str) -> Result:
    """Price both, reserve both at once, release the inner, then the outer with its value."""
    inner = engine.prepare(split.inner, session)
    stand_in = engine.prepare(split.outer_sql(0), session)
    confidence = confidence_level(engine.policy, session)
    step = engine.step
    first = step.lookup(inner, confidence)
    parts = [first, Part(stand_in)]
    cost = step.total(parts)
    with step.reserved(cost, session, engine.fingerprint(sql)) as charge:
        released = step.release(first, confidence)
        value = released.rows[0][0] if released.rows and released.rows[0] else None
        outer = engine.prepare(split.outer_sql(value), session)
        if outer.budgeting.cost != stand_in.budgeting.cost:  # priced before the charge: must not change
            raise InternalError("the filtered query's cost changed with the released value")
        parts[1] = step.lookup(outer, confidence)
        answered = step.release(parts[1], confidence)
    result = Result(list(answered.columns), list(answered.rows), list(answered.accuracy), 0.0, 0.0)
    result.notices.extend(n for n in map(Notice.of, answered.notices) if not n.budget)
    step.notice(result, cost, charge, session, parts)
    shown = "NULL" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
    what = f"dpsql: the subquery ({split.inner}) was released first (a DP query of its own)"
    result.notices.append(Notice(f"{what} and its value {shown} used as a constant"))
    return result


def explain_scalar(engine: Host, split: ScalarFilter, session: Session) -> CompositeExplanation:
    """EXPLAIN: the subquery and the filtered query (with a stand-in constant), priced; nothing run."""
    inner = engine.prepare(split.inner, session)
    outer = engine.prepare(split.outer_sql(0), session)
    cost = Step.total([Part(inner), Part(outer)])
    subplans = [
        SubPlan("DP sub-query, released first", engine.explain(split.inner, session)),
        SubPlan("DP query filtered by its released value", engine.explain(split.outer_sql(0), session)),
    ]
    return CompositeExplanation(
        "Filter on a released value", cost.epsilon if cost else 0.0, cost.delta if cost else 0.0, subplans, ""
    )
