"""Post-processing of released values: output expressions, HAVING, DISTINCT, ORDER BY, LIMIT.

``expressions`` interprets expressions over released values with PostgreSQL semantics;
``finish.finish`` turns released rows into the query's result. Both read only noisy values.
"""

from dpsql.postprocess.expressions import compile_expression, evaluate, order_rows

__all__ = ["compile_expression", "evaluate", "order_rows"]
