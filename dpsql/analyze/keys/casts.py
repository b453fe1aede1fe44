"""CAST of a key: only casts that cannot fail and mean the same on every backend.

A cast that could fail on some rows (text to int, a double to an integer) would make whether the
query succeeds depend on data, so it is refused; an integer cast is range-checked on the domain.
"""

from __future__ import annotations

import datetime as dt

from sqlglot import exp

from dpsql.analyze.keys.base import KeyContext, KeyExpr, as_datetime, finite_domain, fits, is_integral
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType

#: Integer casts a key may take, and the PostgreSQL type each gives (computed in bigint, range-checked).
_INTEGER_CASTS: dict[exp.DType, PgType] = {
    exp.DataType.Type.BIGINT: "bigint",
    exp.DataType.Type.INT: "integer",
    exp.DataType.Type.SMALLINT: "smallint",
}

#: Casts of a key to its own type (no length modifier): the identity on every backend.
_SAME_TYPE: dict[PgType, tuple[exp.DType, ...]] = {
    "text": (exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR),
    "boolean": (exp.DataType.Type.BOOLEAN,),
}


def cast(node: exp.Expression, keys: KeyContext) -> KeyExpr:
    """Casts that cannot fail and mean the same on every backend: time buckets to date/timestamp,
    numbers to bigint (integers only), double precision or numeric."""
    assert isinstance(node, exp.Cast)
    inner = keys.derive(node.this)
    target = node.to.this
    values = inner.values
    if inner.type in ("timestamp", "timestamp with time zone", "date") and target in (
        exp.DataType.Type.DATE,
        exp.DataType.Type.TIMESTAMP,
    ):
        to_date = target == exp.DataType.Type.DATE
        pg_type: PgType = "date" if to_date else "timestamp"
        if values is not None:
            present = (v for v in values if v is not None)  # NULL stays NULL (finite_domain adds it back)
            values = finite_domain(node, (_to_day(v) if to_date else as_datetime(v) for v in present), inner.nullable)
        return KeyExpr(exp.cast(inner.sql, target), pg_type, values, inner.nullable)
    if inner.numeric and target in _INTEGER_CASTS and (is_integral(inner) or _whole(node.this, inner)):
        # whole numbers (EXTRACT's numeric, FLOOR/CEIL's double: ibis's CAST(FLOOR(x) AS BIGINT)) cast exactly
        sql = inner.sql if is_integral(inner) else exp.cast(inner.sql, exp.DataType.Type.BIGINT)
        if values is not None:
            values = tuple(None if v is None else int(v) for v in values)  # type: ignore[arg-type]
        integer = KeyExpr(sql, _INTEGER_CASTS[target], values, inner.nullable, inner.lower, inner.upper)
        return fits(node, integer)
    if target in _SAME_TYPE.get(inner.type, ()) and not node.to.expressions:  # Tableau's CAST(text_col AS TEXT)
        return inner
    if inner.numeric and (target in exp.DataType.REAL_TYPES or target == exp.DataType.Type.DECIMAL):
        pg_type = "numeric" if target == exp.DataType.Type.DECIMAL else "double precision"
        if values is not None:
            values = finite_domain(node, (float(v) for v in values if v is not None), inner.nullable)  # type: ignore[arg-type]
        return KeyExpr(exp.cast(inner.sql, exp.DataType.Type.DOUBLE), pg_type, values, inner.nullable, inner.lower,
                       inner.upper, inner.tiny)  # fmt: skip
    raise FeatureNotSupported(
        f"CAST of a {inner.type} key to {node.to.sql(dialect='postgres')} is not supported in GROUP BY",
        hint="Cast time buckets to date or timestamp, numbers to double precision or numeric.",
    )


def _whole(node: exp.Expression, key: KeyExpr) -> bool:
    """Whether every value of a numeric key is a whole number: a finite domain of them, or FLOOR/CEIL."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Floor | exp.Ceil):
        return True
    return key.values is not None and all(float(v).is_integer() for v in key.values if v is not None)  # type: ignore[arg-type]


def _to_day(value: object) -> dt.date:
    return value.date() if isinstance(value, dt.datetime) else value  # type: ignore[return-value]
