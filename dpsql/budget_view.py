"""Analyst self-service: ``SHOW dpsql.budget`` and the ``dpsql_budget`` relation.

Both give the *connected* analyst one row about their own budget: ε and δ spent, remaining and
in total (the policy's budget plus the curator's grants), how many charged queries, and whether the
curator froze them. Privacy argument: every figure is a function of the analyst's own charges and
the curator's levers on them — never of the data, never of another analyst's spending and never of
the dataset's total (which would reveal what the others spent). It reads the ledger only and
charges nothing. Remaining ε is the accountant's own figure (:func:`dpsql.accountant.remaining_budget`),
the one the ledger checks against, capped by what the dataset has left (:func:`dpsql.ledger.min_remaining`):
what the analyst can really spend. The cap says no more about the others' spending than the free
53P01 refusal of a query beyond it would.

``SELECT … FROM dpsql_budget`` (what a BI tool sends; the relation also exists, empty, in the
shadow catalog so schema sync lists it) is answered by plain Python over that one row, for a fixed
set of shapes read off the parse tree: ``*``, columns, constants, ``COUNT``, and ``SUM``/``AVG``/``MIN``/
``MAX`` of a column (with aliases); a WHERE of AND/OR/NOT over comparisons, IS [NOT] NULL/TRUE/FALSE, IN
and BETWEEN of columns and constants; GROUP BY columns; ORDER BY; LIMIT/OFFSET (what a BI tool's chart
over the relation sends, issue #38). Any other node is refused (0A000) before anything is evaluated,
and no part of the statement is ever turned into code: the statement can only pick, filter and
rename values of that row (an earlier version translated the tree to Python source and ran it, so a
quoted identifier became server code — issue #26). Errors depend on the statement and the column
types, never on the row's values.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

import sqlglot
from sqlglot import exp

from dpsql.accountant import Spent, remaining_budget, shown
from dpsql.analyze.parse import too_complex
from dpsql.errors import (
    DatatypeMismatch,
    FeatureNotSupported,
    GroupingError,
    InvalidColumnReference,
    InvalidTextRepresentation,
    UndefinedColumn,
    UndefinedFunction,
    UndefinedTable,
)
from dpsql.ledger import Ledger, min_remaining
from dpsql.pgtypes import PgType, parse_bool
from dpsql.session import OutputColumn, Result

if TYPE_CHECKING:
    from dpsql.policy import Policy

#: The relation's name (in ``public``, as a BI tool sees it).
BUDGET_RELATION = "dpsql_budget"
#: The one row's columns, in order, with their PostgreSQL types.
BUDGET_COLUMNS: tuple[tuple[str, PgType], ...] = (
    ("analyst", "text"),
    ("epsilon_spent", "double precision"),
    ("epsilon_remaining", "double precision"),
    ("epsilon_total", "double precision"),
    ("delta_spent", "double precision"),
    ("delta_remaining", "double precision"),
    ("delta_total", "double precision"),
    ("queries", "bigint"),
    ("frozen", "boolean"),
)
_TYPES: dict[str, PgType] = dict(BUDGET_COLUMNS)


def own_budget(ledger: Ledger, policy: Policy, analyst: str) -> tuple[Any, ...]:
    """The analyst's own row (see :data:`BUDGET_COLUMNS`)."""
    dataset, accounting = policy.dataset, policy.budget.accounting
    levers = ledger.levers(dataset, analyst)
    limit = levers.limit(policy.analyst_budget(analyst))
    spent = next((row.spent for row in ledger.summary(dataset) if row.analyst == analyst), Spent())
    left = remaining_budget(spent, limit, accounting)
    left = min_remaining(left, remaining_budget(ledger.spent(dataset), policy.budget.dataset, accounting))
    epsilon_spent = spent.privacy_loss(accounting, limit.delta)[0]
    delta_spent = spent.delta if accounting == "pure" else spent.selection_delta
    return (  # figures people read: 4 significant digits, spent rounded up and what is left down
        analyst,
        shown(epsilon_spent, up=True),
        shown(left.epsilon, down=True),
        limit.epsilon,
        shown(delta_spent, up=True),
        shown(left.delta, down=True),
        limit.delta,
        spent.queries,
        levers.frozen,
    )


def is_budget_query(sql: str, policy: Policy) -> bool:
    """Whether ``sql`` is a SELECT reading only ``dpsql_budget`` (and the policy has no such table)."""
    return may_read_budget(sql, policy) and reads_only_budget(_parse(sql))


def may_read_budget(sql: str, policy: Policy) -> bool:
    """Whether ``sql`` names ``dpsql_budget`` and the policy has no such table (a text test: no parse)."""
    return BUDGET_RELATION in sql.lower() and policy.table(BUDGET_RELATION) is None


def reads_only_budget(tree: exp.Expr | None) -> bool:
    """Whether the parsed ``tree`` (of a text :func:`may_read_budget` passes) is a SELECT reading only
    ``dpsql_budget``."""
    if not isinstance(tree, exp.Select):
        return False
    tables = list(tree.find_all(exp.Table))
    return bool(tables) and all(
        t.name.lower() == BUDGET_RELATION and t.db.lower() in ("", "public") and not t.catalog for t in tables
    )


def answer(sql: str, row: tuple[Any, ...], tree: exp.Expr | None = None) -> Result:
    """Evaluate a SELECT over ``dpsql_budget`` holding just ``row``; free (no charge, no noise).
    ``tree``: ``sql`` already parsed (the engine's statement), else it is parsed here.

    Only the shapes in the module docstring are answered, by walking the parse tree; the statement
    is data to be checked, never code to be run.
    """
    tree = _parse(sql) if tree is None else tree
    if not isinstance(tree, exp.Select):
        raise _unsupported("this statement")
    try:
        return _answer(tree, row)
    except RecursionError:
        raise too_complex() from None


# --- evaluation -----------------------------------------------------------------------------------

_HINT = (
    f"Over {BUDGET_RELATION}: SELECT *, columns, constants, COUNT, or SUM/AVG/MIN/MAX of a column [AS name] "
    f"FROM {BUDGET_RELATION} [WHERE comparisons (=, <>, <, <=, >, >=, IN, BETWEEN, IS [NOT] NULL/TRUE/FALSE) "
    "of columns and constants, joined by AND/OR/NOT] [GROUP BY columns] [ORDER BY columns, aggregates or "
    "positions] [LIMIT n] [OFFSET n]; or SHOW dpsql.budget."
)
#: Clauses of a SELECT the budget view answers (others, when present, are refused by name).
_ALLOWED_CLAUSES = frozenset({"expressions", "from_", "where", "group", "order", "limit", "offset", "distinct"})
_CLAUSE_NAMES = {
    "with_": "WITH",
    "joins": "JOIN",
    "laterals": "LATERAL",
    "having": "HAVING",
    "windows": "WINDOW",
    "locks": "FOR UPDATE/SHARE",
    "into": "SELECT INTO",
    "sample": "TABLESAMPLE",
    "qualify": "QUALIFY",
}
_NUMBERS = frozenset({"smallint", "integer", "bigint", "double precision", "numeric"})
_INTEGERS = frozenset({"smallint", "integer", "bigint"})
#: The type of a quoted constant or NULL: it takes the type of what it meets, as in PostgreSQL.
_UNKNOWN = None
_DIGITS = re.compile(r"[0-9]+")
_INTEGER_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")
_COMPARISONS: dict[type[exp.Expression], tuple[str, Callable[[Any, Any], bool]]] = {
    exp.EQ: ("=", operator.eq),
    exp.NEQ: ("<>", operator.ne),
    exp.LT: ("<", operator.lt),
    exp.LTE: ("<=", operator.le),
    exp.GT: (">", operator.gt),
    exp.GTE: (">=", operator.ge),
}


@dataclass(frozen=True)
class _Value:
    """A column's or a constant's value with its type (:data:`_UNKNOWN`: a quoted constant or NULL)."""

    value: Any
    type: PgType | None


@dataclass(frozen=True)
class _Output:
    """One output column: its name and type, its value on the row, and where it came from."""

    name: str
    type: PgType
    value: Any
    column: str | None = None  # a bare column reference (a grouping error next to COUNT)
    count: bool = False  # COUNT(…): ``value`` is the row's contribution (0 or 1)
    aggregate: bool = False  # SUM/AVG/MIN/MAX(column): ``value`` is the row's (NULL over no row)


#: The aggregates of a column answered over the one row, by their sqlglot class.
_AGGREGATES: dict[type[exp.Expression], str] = {exp.Sum: "sum", exp.Avg: "avg", exp.Min: "min", exp.Max: "max"}


def _answer(tree: exp.Select, row: tuple[Any, ...]) -> Result:
    for key, value in tree.args.items():
        if value and key not in _ALLOWED_CLAUSES:
            raise _unsupported(_CLAUSE_NAMES.get(key, key.strip("_").upper()))
    distinct = tree.args.get("distinct")
    if distinct is not None and (distinct.args.get("on") or distinct.args.get("expressions")):
        raise _unsupported("DISTINCT ON")  # plain DISTINCT: nothing to do on at most one row
    scope = _Scope(tree.args.get("from_"), row)
    outputs = [out for node in tree.expressions for out in _outputs(node, scope)]
    where = tree.args.get("where")
    kept = where is None or _predicate(where.this, scope, "WHERE") is True
    grouped = _grouped(tree.args.get("group"), outputs, scope)
    aggregate = grouped is not None or any(o.count or o.aggregate for o in outputs)
    if aggregate:
        bare = next((o.column for o in outputs if o.column is not None and o.column not in (grouped or ())), None)
        if bare is not None:
            raise _grouping(scope, bare)
        if grouped is not None and not kept:
            rows = []  # no row, no group
        else:  # one group: the row, or (without GROUP BY) none, where COUNT is 0 and the others NULL
            rows = [tuple(o.value if kept else (0 if o.count else None) for o in outputs)]
    else:
        rows = [tuple(o.value for o in outputs)] if kept else []
    _check_order(tree.args.get("order"), outputs, scope, aggregate, grouped or ())
    offset = _row_count(tree.args.get("offset"), "OFFSET") or 0
    limit = _row_count(tree.args.get("limit"), "LIMIT")
    rows = rows[offset:] if limit is None else rows[offset : offset + limit]
    columns = [OutputColumn(o.name, o.type) for o in outputs]
    return Result(
        columns=columns,
        rows=rows,
        accuracy=[tuple(None for _ in columns) for _ in rows],
        epsilon_spent=0.0,
        delta_spent=0.0,
    )


class _Scope:
    """The FROM clause: the one row, and the name (table or alias) its columns answer to."""

    def __init__(self, source: Any, row: tuple[Any, ...]) -> None:
        table = source.this if isinstance(source, exp.From) else None
        if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
            raise _unsupported(f"a FROM clause other than {BUDGET_RELATION}")
        if table.args.get("catalog") or any(v for k, v in table.args.items() if k not in ("this", "db", "alias")):
            raise _unsupported(f"a FROM clause other than {BUDGET_RELATION}")
        alias = table.args.get("alias")
        if alias is not None and (alias.args.get("columns") or not isinstance(alias.this, exp.Identifier)):
            raise _unsupported("column aliases in FROM")
        self.table = _ident(table.this)
        self.alias = _ident(alias.this) if alias is not None else None
        self.values = dict(zip((name for name, _ in BUDGET_COLUMNS), row, strict=True))

    @property
    def qualifier(self) -> str:
        return self.alias or self.table

    def column(self, node: exp.Column) -> str:
        """The name of the column ``node`` refers to (qualified by the table or its alias, or not)."""
        if node.args.get("catalog") or node.args.get("join_mark") or not isinstance(node.this, exp.Identifier):
            raise _unsupported("this column reference")
        self.check_qualifier(node)
        name = _ident(node.this)
        if name not in self.values:
            raise UndefinedColumn(
                f'column "{name}" does not exist',
                hint=f"{BUDGET_RELATION} has the columns {', '.join(n for n, _ in BUDGET_COLUMNS)}.",
            )
        return name

    def check_qualifier(self, node: exp.Column) -> None:
        table, db = node.args.get("table"), node.args.get("db")
        if table is None:
            return
        if not isinstance(table, exp.Identifier) or (db is not None and not isinstance(db, exp.Identifier)):
            raise _unsupported("this column reference")
        name = _ident(table)
        if db is not None:
            ok = self.alias is None and _ident(db) == "public" and name == self.table
        else:
            ok = name == self.qualifier
        if not ok:
            raise UndefinedTable(f'missing FROM-clause entry for table "{name}"')

    def operand(self, node: exp.Expression, where: str) -> _Value:
        """A column's value or a constant; anything else is refused."""
        if isinstance(node, exp.Paren):
            return self.operand(node.this, where)
        if isinstance(node, exp.Column):
            name = self.column(node)
            return _Value(self.values[name], _TYPES[name])
        constant = _constant(node)
        if constant is None:
            raise _unsupported(f"this expression in {where}")
        return constant


def _outputs(node: exp.Expression, scope: _Scope) -> list[_Output]:
    """The output columns one select-list item stands for (``*`` stands for all of them)."""
    if isinstance(node, exp.Star) or (isinstance(node, exp.Column) and isinstance(node.this, exp.Star)):
        if isinstance(node, exp.Column):
            scope.check_qualifier(node)
            star = node.this
        else:
            star = node
        if any(star.args.values()):
            raise _unsupported("* with EXCLUDE, REPLACE or RENAME")
        return [_Output(name, type_, scope.values[name], column=name) for name, type_ in BUDGET_COLUMNS]
    name = None
    if isinstance(node, exp.Alias):
        if not isinstance(node.args.get("alias"), exp.Identifier):
            raise _unsupported("this alias")
        name = _ident(node.args["alias"])
        node = node.this
    if isinstance(node, exp.Count):
        return [_count(node, scope, name or "count")]
    if type(node) in _AGGREGATES:
        return [_aggregate(node, scope, name)]
    if isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
        column = scope.column(node)
        return [_Output(name or column, _TYPES[column], scope.values[column], column=column)]
    constant = _constant(node)
    if constant is None:
        raise _unsupported("this expression in the select list")
    type_: PgType = "text" if constant.type is _UNKNOWN else constant.type
    default = "bool" if isinstance(node, exp.Boolean) else "?column?"  # PostgreSQL's names
    return [_Output(name or default, type_, constant.value)]


def _count(node: exp.Count, scope: _Scope, name: str) -> _Output:
    """``COUNT(*)``, ``COUNT(column)``, ``COUNT(constant)``: this row's contribution, 0 or 1."""
    if any(v for k, v in node.args.items() if k not in ("this", "big_int")):
        raise _unsupported("this COUNT")
    arg = node.this
    if isinstance(arg, exp.Star) and not any(arg.args.values()):
        return _Output(name, "bigint", 1, count=True)
    if isinstance(arg, exp.Column | exp.Literal | exp.Boolean | exp.Null | exp.Neg | exp.Paren):
        return _Output(name, "bigint", int(scope.operand(arg, "COUNT").value is not None), count=True)
    raise _unsupported("this COUNT")


def _aggregate(node: exp.Expression, scope: _Scope, name: str | None) -> _Output:
    """``SUM``/``AVG``/``MIN``/``MAX`` of a column: over the one row, its value, typed as PostgreSQL types
    the aggregate (an integer's SUM and AVG are numeric)."""
    kind = _AGGREGATES[type(node)]
    arg = node.this
    if any(v for k, v in node.args.items() if k != "this") or not isinstance(arg, exp.Column):
        raise _unsupported(f"{kind.upper()} of anything but a column")
    column = scope.column(arg)
    type_, value = _TYPES[column], scope.values[column]
    if (kind in ("sum", "avg") and type_ not in _NUMBERS) or (kind in ("min", "max") and type_ == "boolean"):
        raise UndefinedFunction(
            f"function {kind}({type_}) does not exist",
            hint="No function matches the given name and argument types. You might need to add explicit type casts.",
        )
    if kind in ("sum", "avg") and type_ in _INTEGERS:
        type_, value = "numeric", None if value is None else Decimal(value)
    return _Output(name or kind, type_, value, aggregate=True)


def _grouped(group: Any, outputs: list[_Output], scope: _Scope) -> set[str] | None:
    """The columns of GROUP BY (names, or positions of bare columns in the select list); None without one."""
    if group is None:
        return None
    if any(v for k, v in group.args.items() if k != "expressions"):
        raise _unsupported("GROUPING SETS, CUBE or ROLLUP")
    columns: set[str] = set()
    for item in group.expressions:
        if isinstance(item, exp.Literal) and not item.is_string and _DIGITS.fullmatch(item.this):
            position = int(item.this)
            if not 1 <= position <= len(outputs):
                raise InvalidColumnReference(f"GROUP BY position {position} is not in select list")
            if outputs[position - 1].column is None:
                raise _unsupported("GROUP BY an aggregate or a constant")
            columns.add(str(outputs[position - 1].column))
        elif isinstance(item, exp.Column) and isinstance(item.this, exp.Identifier):
            named = not item.args.get("table") and any(o.name == _ident(item.this) for o in outputs)
            output = next((o for o in outputs if named and o.name == _ident(item.this)), None)
            columns.add(str(output.column) if output is not None and output.column else scope.column(item))
        else:
            raise _unsupported("GROUP BY an expression")
    return columns


def _constant(node: exp.Expression) -> _Value | None:
    """A literal number, string, boolean or NULL (a number may carry a minus sign); else None."""
    if isinstance(node, exp.Paren):
        return _constant(node.this)
    if isinstance(node, exp.Null):
        return _Value(None, _UNKNOWN)
    if isinstance(node, exp.Boolean):
        return _Value(bool(node.this), "boolean")
    negate = isinstance(node, exp.Neg)
    literal = node.this if negate else node
    if not isinstance(literal, exp.Literal) or not isinstance(literal.this, str):
        return None
    if literal.is_string:
        return None if negate else _Value(literal.this, _UNKNOWN)
    text = literal.this
    value: int | Decimal
    type_: PgType
    if _DIGITS.fullmatch(text) and int(text) < 2**63:  # PostgreSQL: int4 if it fits, else int8, else numeric
        value, type_ = int(text), "integer" if int(text) < 2**31 else "bigint"
    else:
        try:
            value, type_ = Decimal(text), "numeric"
        except InvalidOperation:
            return None
    return _Value(-value if negate else value, type_)


def _predicate(node: exp.Expression, scope: _Scope, context: str) -> bool | None:
    """SQL's three-valued truth of a WHERE condition on the row (every branch checked, none skipped);
    ``context`` names what a non-boolean argument would be the argument of."""
    where = "WHERE"
    if isinstance(node, exp.Paren):
        return _predicate(node.this, scope, context)
    if isinstance(node, exp.And | exp.Or):
        left = _predicate(node.this, scope, "AND" if isinstance(node, exp.And) else "OR")
        right = _predicate(node.expression, scope, "AND" if isinstance(node, exp.And) else "OR")
        if isinstance(node, exp.And):
            return False if False in (left, right) else None if None in (left, right) else True
        return True if True in (left, right) else None if None in (left, right) else False
    if isinstance(node, exp.Not):
        inner = _predicate(node.this, scope, "NOT")
        return None if inner is None else not inner
    if type(node) in _COMPARISONS:
        return _compare(type(node), scope.operand(node.this, where), scope.operand(node.expression, where))
    if isinstance(node, exp.Is):
        return _is(node, scope, where)
    if isinstance(node, exp.In):
        if any(v for k, v in node.args.items() if k not in ("this", "expressions")):
            raise _unsupported("IN (subquery)")
        value = scope.operand(node.this, where)
        found = [_compare(exp.EQ, value, scope.operand(item, where)) for item in node.expressions]
        return True if True in found else None if None in found else False
    if isinstance(node, exp.Between):
        if node.args.get("symmetric"):
            raise _unsupported("BETWEEN SYMMETRIC")
        value = scope.operand(node.this, where)
        low = _compare(exp.GTE, value, scope.operand(node.args["low"], where))
        high = _compare(exp.LTE, value, scope.operand(node.args["high"], where))
        return False if False in (low, high) else None if None in (low, high) else True
    return _boolean(scope.operand(node, where), f"argument of {context}")


def _is(node: exp.Is, scope: _Scope, where: str) -> bool:
    """``IS [NOT] NULL``, ``IS [NOT] TRUE``, ``IS [NOT] FALSE``: never unknown."""
    value, target = scope.operand(node.this, where), node.expression
    if isinstance(target, exp.Null):
        result = value.value is None
    elif isinstance(target, exp.Boolean):
        result = _boolean(value, f"argument of IS {'TRUE' if target.this else 'FALSE'}") is bool(target.this)
    else:
        raise _unsupported(f"this IS in {where}")
    return not result if node.args.get("negate") else result


def _boolean(value: _Value, what: str) -> bool | None:
    if value.type is _UNKNOWN:
        cast: bool | None = _cast(value.value, "boolean")
        return cast
    if value.type != "boolean":
        raise DatatypeMismatch(f"{what} must be type boolean, not type {value.type}")
    boolean: bool | None = value.value
    return boolean


def _compare(kind: type[exp.Expression], left: _Value, right: _Value) -> bool | None:
    """``left <op> right`` with PostgreSQL's typing: a quoted constant takes the other side's type."""
    symbol, compare = _COMPARISONS[kind]
    a, b = left.value, right.value
    if left.type is _UNKNOWN and right.type is not _UNKNOWN:
        a = _cast(a, right.type)
    elif right.type is _UNKNOWN and left.type is not _UNKNOWN:
        b = _cast(b, left.type)
    elif left.type != right.type and not (left.type in _NUMBERS and right.type in _NUMBERS):
        raise UndefinedFunction(
            f"operator does not exist: {left.type} {symbol} {right.type}",
            hint="No operator matches the given name and argument types. You might need to add explicit type casts.",
        )
    return None if a is None or b is None else compare(a, b)


def _cast(text: str | None, type_: PgType) -> Any:
    """A quoted constant read as ``type_`` (22P02 when it is not one)."""
    if text is None or type_ == "text":
        return text
    try:
        if type_ == "boolean":
            return parse_bool(text)
        if type_ in _INTEGERS:
            if not _INTEGER_TEXT.fullmatch(text):
                raise ValueError(text)
            return int(text)
        if type_ == "numeric":
            return Decimal(text.strip())
        return float(text)
    except (ValueError, InvalidOperation):
        raise InvalidTextRepresentation(f'invalid input syntax for type {type_}: "{text}"') from None


def _check_order(order: Any, outputs: list[_Output], scope: _Scope, aggregate: bool, grouped: Any = ()) -> None:
    """ORDER BY output names, columns or positions: checked as PostgreSQL would, a no-op on ≤ 1 row."""
    if order is None:
        return
    for item in order.expressions:
        if not isinstance(item, exp.Ordered) or item.args.get("with_fill"):
            raise _unsupported("this ORDER BY")
        key = item.this
        if isinstance(key, exp.Literal) and not key.is_string and _DIGITS.fullmatch(key.this):
            if not 1 <= int(key.this) <= len(outputs):
                raise InvalidColumnReference(f"ORDER BY position {key.this} is not in select list")
        elif isinstance(key, exp.Column) and isinstance(key.this, exp.Identifier):
            named = not key.args.get("table") and any(o.name == _ident(key.this) for o in outputs)
            if not named:
                column = scope.column(key)
                if aggregate and column not in grouped:
                    raise _grouping(scope, column)
        elif isinstance(key, exp.Count) and aggregate:
            _count(key, scope, "count")  # ORDER BY COUNT(*) next to COUNT(*): one row either way
        elif type(key) in _AGGREGATES and aggregate:
            _aggregate(key, scope, None)
        else:
            raise _unsupported("ORDER BY an expression")


def _row_count(node: Any, clause: str) -> int | None:
    """The integer of LIMIT n / OFFSET n (LIMIT ALL and LIMIT NULL: None)."""
    if node is None:
        return None
    if not isinstance(node, exp.Limit | exp.Offset) or any(v for k, v in node.args.items() if k != "expression"):
        raise _unsupported(f"this {clause}")
    value = node.expression
    if isinstance(value, exp.Null) or (isinstance(value, exp.Var) and value.name.upper() == "ALL"):
        return None
    if isinstance(value, exp.Literal) and not value.is_string and _DIGITS.fullmatch(value.this):
        return int(value.this)
    raise _unsupported(f"{clause} other than a non-negative integer")


def _grouping(scope: _Scope, column: str) -> GroupingError:
    return GroupingError(
        f'column "{scope.qualifier}.{column}" must appear in the GROUP BY clause or be used in an aggregate function'
    )


def _unsupported(what: str) -> FeatureNotSupported:
    return FeatureNotSupported(f"{what} is not supported over {BUDGET_RELATION}", hint=_HINT)


def _ident(node: exp.Identifier) -> str:
    """An identifier as PostgreSQL resolves it: folded to lower case unless quoted."""
    name = str(node.this)
    return name if node.quoted else name.lower()


def parse(sql: str) -> Any:
    """``sql`` parsed as the budget view reads it (None: it does not parse)."""
    return _parse(sql)


def _parse(sql: str) -> Any:
    try:
        return sqlglot.parse_one(sql, read="postgres")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError, RecursionError):
        return None
