"""corr, covar_pop/covar_samp, regr_slope/regr_intercept/regr_r2 from noisy centred sums.

PostgreSQL's ``f(Y, X)`` over the pairs where both are non-NULL. With ``x' = clamp(X) − cx`` and
``y' = clamp(Y) − cy`` (centres: the bounds' midpoints) dpsql measures Σx'y', Σx', Σy', Σx'², Σy'²
and the pair count N, each a clamped sum or count with its own sensitivity (|x'y'| ≤ rx·ry per row,
rx, ry the half-ranges; centring shrinks every sensitivity 2–4×). The statistic is computed from
the noisy sums after release: pure post-processing, so its privacy is that of the measures it reads,
which the calibrator charges like any other. Moments shared with AVG/variance in the same query are
measured once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

from sqlglot import exp

from dpsql.aggregates.base import Aggregate, Operand, Recognised, Scope, measure_var
from dpsql.errors import FeatureNotSupported
from dpsql.pgtypes import PgType
from dpsql.plan import OutputItem

#: sqlglot node → (PostgreSQL's name, the moments it reads: xy, x, y, xx, yy, n).
_FAMILY: dict[type[exp.Expr], tuple[str, tuple[str, ...]]] = {
    exp.CovarPop: ("covar_pop", ("xy", "x", "y", "n")),
    exp.CovarSamp: ("covar_samp", ("xy", "x", "y", "n")),
    exp.Corr: ("corr", ("xy", "x", "y", "xx", "yy", "n")),
    exp.RegrSlope: ("regr_slope", ("xy", "x", "y", "xx", "n")),
    exp.RegrIntercept: ("regr_intercept", ("xy", "x", "y", "xx", "n")),
    exp.RegrR2: ("regr_r2", ("xy", "x", "y", "xx", "yy", "n")),
}


def dp_bivariate(function: str, xy: Any, x: Any, y: Any, xx: Any, yy: Any, n: Any, cx: Any, cy: Any) -> float | None:
    """The statistic from noisy centred moments; NULL where PostgreSQL's would be (too few pairs,
    zero variance). Noise can push a variance below 0 or |corr| above 1: floored and clamped."""
    count = float(n)
    if count < 1 or (function == "covar_samp" and count < 2):
        return None
    mx, my = float(x) / count, float(y) / count
    covariance = float(xy) / count - mx * my
    if function == "covar_pop":
        return covariance
    if function == "covar_samp":
        return covariance * count / (count - 1)
    var_x = float(xx) / count - mx * mx
    if var_x <= 0:
        return None
    if function == "regr_slope":
        return covariance / var_x
    if function == "regr_intercept":
        return (float(cy) + my) - covariance / var_x * (float(cx) + mx)
    var_y = float(yy) / count - my * my
    if var_y <= 0:
        return None if function == "corr" else 1.0  # PostgreSQL: regr_r2 is 1 when Y is constant
    r = max(-1.0, min(1.0, covariance / math.sqrt(var_x * var_y)))
    return r if function == "corr" else r * r


class Bivariate(Aggregate):
    kind = "bivariate"
    filterable = False
    recognises = tuple(_FAMILY)
    functions: ClassVar[dict[str, Callable[..., Any]]] = {"dp_bivariate": dp_bivariate}

    def recognise(self, node: exp.Expression, scope: Scope) -> Recognised:

        name, moments = _FAMILY[type(node)]
        y_arg, x_arg = _column(node.this, name), _column(node.expression, name)
        y_col, x_col = scope.operand(y_arg), scope.operand(x_arg)
        for operand in (y_col, x_col):
            scope.bounded_sum(operand, name, centred=False)  # numeric and bounded, or the usual refusal
        both = exp.and_(
            exp.Not(this=exp.Is(this=x_arg.copy(), expression=exp.Null())),
            exp.Not(this=exp.Is(this=y_arg.copy(), expression=exp.Null())),
        )

        def paired(argument: exp.Column, operand: Operand) -> exp.Expression:
            """The argument where the other one is non-NULL too (only pairs count, as in PostgreSQL)."""
            if not (x_col.policy.nullable or y_col.policy.nullable):
                return argument.copy()
            return exp.Case(ifs=[exp.If(this=both.copy(), true=argument.copy())])

        x_sum = scope.bounded_sum(scope.operand(paired(x_arg, x_col)), name, centred=True)
        y_sum = scope.bounded_sum(scope.operand(paired(y_arg, y_col)), name, centred=True)
        product = exp.Mul(
            this=exp.Paren(this=exp.Sub(this=x_arg.copy(), expression=exp.Literal.number(x_sum.centre))),
            expression=exp.Paren(this=exp.Sub(this=y_arg.copy(), expression=exp.Literal.number(y_sum.centre))),
        )
        xy_sum = scope.bounded_sum(scope.operand(product), name, centred=False)
        if xy_sum.integer and xy_sum.sensitivity >= 2.0**62:
            xy_sum = dataclasses.replace(xy_sum, integer=False)

        def square(measure: Any) -> Any:
            squared = dataclasses.replace(measure, square=True)
            return dataclasses.replace(squared, integer=False) if squared.sensitivity >= 2.0**62 else squared

        built = {
            "xy": xy_sum,
            "x": x_sum,
            "y": y_sum,
            "xx": square(x_sum),
            "yy": square(y_sum),
            "n": scope.count_of(scope.operand(paired(x_arg, x_col))),
        }
        indices = {moment: scope.measure(built[moment]) for moment in moments}
        arguments: list[exp.Expression] = [exp.Literal.string(name)]
        for moment in ("xy", "x", "y", "xx", "yy", "n"):
            arguments.append(measure_var(indices[moment]) if moment in indices else exp.Null())
        arguments += [exp.Literal.number(x_sum.centre), exp.Literal.number(y_sum.centre)]
        call = exp.Anonymous(this="dp_bivariate", expressions=arguments)
        return Recognised(call, self.kind, tuple(indices.values()))

    def output_name(self, node: exp.Expr) -> str | None:
        return _FAMILY[type(node)][0]

    def output_type(self, scope: Any, measures: tuple[int, ...], expr: exp.Expression | None = None) -> PgType | None:
        return "double precision"

    def accuracy(self, out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
        return None  # a ratio of noisy sums: no closed-form interval (EXPLAIN shows each moment's)


def _column(argument: exp.Expression | None, function: str) -> exp.Column:
    while isinstance(argument, exp.Paren):
        argument = argument.this
    if not isinstance(argument, exp.Column):
        raise FeatureNotSupported(
            f"{function} over an expression is not supported yet", hint="Pass two declared numeric columns."
        )
    return argument
