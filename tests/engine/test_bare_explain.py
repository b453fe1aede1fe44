"""A bare EXPLAIN through the Python API is PostgreSQL's 42601, never a Python IndexError (issue #27 item 11)."""

from __future__ import annotations

import pytest

from dpsql.engine import Engine
from dpsql.errors import SyntaxError_
from dpsql.session import Session


@pytest.mark.parametrize(
    "sql", ["EXPLAIN", "EXPLAIN;", "EXPLAIN   ", "EXPLAIN (FORMAT JSON)", "EXPLAIN (FORMAT TEXT) ;"]
)
def test_bare_explain(engine: Engine, sql: str) -> None:
    with pytest.raises(SyntaxError_, match="syntax error at end of input"):
        engine.execute(sql, Session("alice"))
