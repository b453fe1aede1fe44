"""What every GROUP BY key handler shares: the derived key, the handler's context, the domain cap,
literals and PostgreSQL's numeric typing.

A handler computes its key's SQL over clamped columns and, when it is finite, its domain from the
policy and the SQL text only (never from data), so which groups are released cannot depend on any
person. :func:`finite_domain` enforces :data:`MAX_DERIVED_GROUPS` on every domain it builds.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.analyze.expressions import _exponent
from dpsql.errors import FeatureNotSupported, ProgramLimitExceeded, UndefinedFunction
from dpsql.pgtypes import PgType
from dpsql.policy import ColumnPolicy, Scalar

#: Largest derived domain one GROUP BY key may release (documented in the README).
MAX_DERIVED_GROUPS = 10_000

Resolve = Callable[[exp.Column], tuple[exp.Column, ColumnPolicy]]
CheckPredicate = Callable[[exp.Expression], exp.Expression]


@dataclass(frozen=True, slots=True)
class KeyExpr:
    """A GROUP BY expression: its SQL (columns qualified and clamped) and what it can take.

    ``values`` is the finite derived domain (``None`` included when the key can be NULL) or
    ``None`` when the domain is infinite or unknown; then ``lower``/``upper`` bound a numeric key.
    """

    sql: exp.Expression
    type: PgType
    values: tuple[Scalar, ...] | None
    nullable: bool
    lower: float | None = None
    upper: float | None = None
    #: log2 of a lower bound on every non-zero magnitude (doubles): products that could underflow are
    #: refused, as inside aggregates (PostgreSQL raises "underflow" where DuckDB returns 0).
    tiny: int = 0

    @property
    def numeric(self) -> bool:
        return self.type in ("bigint", "integer", "smallint", "double precision", "numeric")


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What a handler is given besides its node: column resolution (qualified, WHERE-narrowed policy),
    the predicate checker, and the dispatcher, through which it derives its operands (:meth:`derive`)."""

    resolve: Resolve
    check_predicate: CheckPredicate
    dispatch: Callable[[exp.Expression, KeyContext], KeyExpr]

    def derive(self, node: exp.Expression) -> KeyExpr:
        return self.dispatch(node, self)


#: A key function: its node (of the class it is registered for) and the context → the derived key.
Handler = Callable[[exp.Expression, KeyContext], KeyExpr]


def too_many(node: exp.Expression, size: int) -> ProgramLimitExceeded:
    return ProgramLimitExceeded(
        f'GROUP BY key "{node.sql(dialect="postgres")}" would release {size} groups (more than {MAX_DERIVED_GROUPS})',
        hint="Coarsen the key (a wider DATE_TRUNC unit, a larger FLOOR step, fewer buckets) or narrow it with WHERE.",
    )


def finite_domain(node: exp.Expression, values: Iterable[Scalar | None], nullable: bool) -> tuple[Scalar, ...]:
    """Distinct non-NULL values in order, NULL last when nullable; refuses more than the cap."""
    out: list[Scalar] = []
    for value in dict.fromkeys(v for v in values if v is not None):
        out.append(value)
        if len(out) > MAX_DERIVED_GROUPS:
            raise too_many(node, len(out))
    out.sort(key=_order)
    return (*out, None) if nullable else tuple(out)


def _order(value: Scalar) -> tuple[bool, Any]:
    """Domain order: numbers, dates and booleans ascending, then text."""
    return isinstance(value, str), value


def int_range(node: exp.Expression, low: int, high: int, nullable: bool) -> tuple[Scalar, ...]:
    if high - low + 1 > MAX_DERIVED_GROUPS:
        raise too_many(node, high - low + 1)
    return finite_domain(node, range(low, high + 1), nullable)


def as_datetime(value: object) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value
    assert isinstance(value, dt.date)
    return dt.datetime(value.year, value.month, value.day)


# --- literals and numeric types ----------------------------------------------------------


def literal_value(node: exp.Expression) -> Scalar | type[exp.Expression] | None:
    """The Python value of a literal (``exp.Expression`` as a marker when ``node`` is none)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Neg):
        inner = literal_value(node.this)
        return -inner if isinstance(inner, int | float) and not isinstance(inner, bool) else exp.Expression
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.name
        number = float(node.name)
        if not math.isfinite(number):
            raise FeatureNotSupported("GROUP BY constants must be finite")
        return int(node.name) if node.name.lstrip("-").isdigit() else number
    return exp.Expression


def number_sql(value: float | int) -> exp.Expression:
    number = exp.Literal.number(abs(value))
    return exp.Neg(this=number) if value < 0 else number


#: PostgreSQL's integer types, narrowest first, with their ranges.
INTEGERS: dict[str, tuple[int, int]] = {
    "smallint": (-(2**15), 2**15 - 1),
    "integer": (-(2**31), 2**31 - 1),
    "bigint": (-(2**63), 2**63 - 1),
}


def literal_type(value: int | float) -> PgType:
    """How PostgreSQL types a numeric literal: integer when it fits in 32 bits, bigint, else numeric (``2.5``)."""
    if isinstance(value, float):
        return "numeric"
    return "integer" if INTEGERS["integer"][0] <= value <= INTEGERS["integer"][1] else "bigint"


def promote(left: PgType, right: PgType) -> PgType:
    """PostgreSQL's result type of ``left op right``: the wider integer, numeric over integers, double over all."""
    if "double precision" in (left, right):
        return "double precision"
    if left in INTEGERS and right in INTEGERS:
        return max(left, right, key=list(INTEGERS).index)
    return "numeric"


def is_integral(key: KeyExpr) -> bool:
    return key.type in INTEGERS


def fits(node: exp.Expression, key: KeyExpr) -> KeyExpr:
    """Refuses a smallint/integer key whose derived range exceeds its type (PostgreSQL raises 22003 on the rows
    that overflow, which would depend on data; the key is computed in bigint, so it is refused up front)."""
    if key.type not in ("smallint", "integer"):
        return key
    low, high = INTEGERS[key.type]
    values = [v for v in key.values if v is not None] if key.values is not None else [key.lower, key.upper]
    if any(v is None or not low <= v <= high for v in values):  # type: ignore[operator]
        raise FeatureNotSupported(
            f'GROUP BY key "{node.sql(dialect="postgres")}" can exceed the {key.type} range',
            hint="Cast it to bigint, or narrow the column's bounds.",
        )
    return key


def numeric_key(operand: exp.Expression, keys: KeyContext) -> KeyExpr:
    """An operand of arithmetic, FLOOR/CEIL or width_bucket: a numeric constant, or a numeric key."""
    constant = literal_value(operand)
    if isinstance(constant, int | float) and not isinstance(constant, bool):
        pg_type = literal_type(constant)
        return KeyExpr(number_sql(constant), pg_type, (constant,), False, tiny=_exponent(float(constant)))
    key = keys.derive(operand)
    if not key.numeric:
        raise UndefinedFunction(f"operator does not exist: arithmetic on {key.type}")
    return key


def magnitude_error() -> FeatureNotSupported:
    return FeatureNotSupported(
        "a GROUP BY expression can exceed 2^53 in magnitude", hint="Its bounds, derived from the policy, are too wide."
    )


def _as_float(value: Scalar) -> float:
    if not isinstance(value, int | float):
        raise UndefinedFunction("operator does not exist: arithmetic on a non-numeric key")
    return float(value)


def _present(key: KeyExpr) -> list[float]:
    """A finite domain's non-NULL values; refused when there are none (``WHERE x IS NULL``), which callers
    handle first (the result is NULL): this only keeps a missed case a clean refusal, not a crash."""
    present = [_as_float(v) for v in (key.values or ()) if v is not None]
    if not present:
        raise FeatureNotSupported(
            "a GROUP BY expression over a column that WHERE keeps only NULL is not supported here",
            hint="Group by the column itself, or drop the IS NULL condition.",
        )
    return present


def key_low(key: KeyExpr) -> float:
    """The least value of a numeric key (its domain's, else its lower bound; refused when unbounded)."""
    if key.values is not None:
        return min(_present(key))
    if key.lower is None:
        raise FeatureNotSupported("a GROUP BY expression needs bounded columns", hint="Declare lower/upper bounds.")
    return key.lower


def key_high(key: KeyExpr) -> float:
    """The greatest value of a numeric key (its domain's, else its upper bound; refused when unbounded)."""
    if key.values is not None:
        return max(_present(key))
    if key.upper is None:
        raise FeatureNotSupported("a GROUP BY expression needs bounded columns", hint="Declare lower/upper bounds.")
    return key.upper
