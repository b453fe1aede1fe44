"""What composite statements need of the engine, as a protocol: :mod:`dpsql.outer` is called by the
engine and calls back only these public members, so neither imports the other's internals."""

from __future__ import annotations

from typing import Protocol

from sqlglot import exp

from dpsql.analyze.parse import Params
from dpsql.analyze.statement import Statements
from dpsql.backends import Backend
from dpsql.explain import Explanation
from dpsql.outer.explain import CompositeExplanation
from dpsql.policy import Policy
from dpsql.prepared import Prepared
from dpsql.session import Session
from dpsql.step import Step


class Host(Protocol):
    """The engine as :mod:`dpsql.outer` sees it (:class:`dpsql.engine.Engine` in practice)."""

    policy: Policy
    backend: Backend
    #: Parsed statements, and which texts are known to be plain single queries.
    statements: Statements
    #: The DP step every DP part of a composite statement is released by.
    step: Step

    def prepare(
        self, sql: str, session: Session, params: Params = None, tree: exp.Expression | None = None
    ) -> Prepared: ...

    def explain(
        self, sql: str, session: Session, params: Params = None, *, actual: bool = True
    ) -> Explanation | CompositeExplanation: ...

    def fingerprint(self, sql: str) -> str: ...
