"""Where numeric constants are folded, and where not (tests/analyze/test_fold_postgres.py checks values)."""

from __future__ import annotations

import pytest

from dpsql.analyze.fold import fold_constants
from dpsql.analyze.parse import parse_statement

pytestmark = pytest.mark.unit

CASES = [
    # a bare GROUP BY / ORDER BY item stays an expression: folded, it would become an ordinal
    ("SELECT x, COUNT(*) FROM t GROUP BY CAST(1 AS INT)", "SELECT x, COUNT(*) FROM t GROUP BY CAST(1 AS INT)"),
    ("SELECT x FROM t GROUP BY 2 - 1 ORDER BY 1 + 0", "SELECT x FROM t GROUP BY 2 - 1 ORDER BY 1 + 0"),
    # a select item's cast keeps its name (int4); arithmetic items, WHERE, HAVING and LIMIT fold
    (
        "SELECT 1 + 1 AS a, CAST(2.5 AS INT), COUNT(*) FROM t WHERE y > CAST(2.5 AS INT) HAVING COUNT(*) > 2 * 5 "
        "LIMIT 5 + 5",
        "SELECT 2 AS a, CAST(2.5 AS INT), COUNT(*) FROM t WHERE y > 3 HAVING COUNT(*) > 10 LIMIT 10",
    ),
    # inside expressions over columns: the constant part only
    ("SELECT SUM(x * (1 - 0.05)) FROM t WHERE x / (2 + 2) > 1", "SELECT SUM(x * (0.95)) FROM t WHERE x / (4) > 1"),
    ("SELECT COUNT(*) FROM t WHERE x BETWEEN 0.06 - 0.01 AND 0.06 + 0.01", None),
]


@pytest.mark.parametrize(("sql", "expected"), CASES, ids=[c[0][:60] for c in CASES])
def test_where_constants_fold(sql: str, expected: str | None) -> None:
    folded = fold_constants(parse_statement(sql)).sql(dialect="postgres")
    assert folded == (expected or "SELECT COUNT(*) FROM t WHERE x BETWEEN 0.05 AND 0.07")
