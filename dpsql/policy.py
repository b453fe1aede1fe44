"""Typed privacy policy loaded from ``schemas/*.yaml``.

The policy is the curator's contract: which tables and columns exist, what bounds
hold, who a "person" is, and how much privacy may be spent. Everything the
analyzer and the mechanisms rely on for correctness is declared here, validated
once at load, and reported with file, line and key path when wrong.
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import re
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from dpsql import pld
from dpsql.accountant import Accounting
from dpsql.errors import PolicyError
from dpsql.localdp import RandomizedResponse
from dpsql.noise.names import Mechanism
from dpsql.session import PgType
from dpsql.units import UnitError, UnitPath, resolve_units

ColumnType = Literal["int", "float", "text", "date", "timestamp", "boolean"]

_TYPE_ALIASES: dict[str, ColumnType] = {
    "int": "int",
    "integer": "int",
    "bigint": "int",
    "smallint": "int",
    "float": "float",
    "double": "float",
    "double precision": "float",
    "real": "float",
    "numeric": "float",
    "text": "text",
    "string": "text",
    "varchar": "text",
    "date": "date",
    "timestamp": "timestamp",
    "boolean": "boolean",
    "bool": "boolean",
}

Scalar = int | float | str | bool | dt.date | dt.datetime | None

#: The PostgreSQL type each policy type is exposed as (catalog, result columns, messages).
PG_TYPE_NAMES: dict[str, PgType] = {
    "int": "bigint",
    "float": "double precision",
    "text": "text",
    "date": "date",
    "timestamp": "timestamp",
    "boolean": "boolean",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalPrivacy(_Strict):
    """``randomized_response: {epsilon: …}`` on a column."""

    epsilon: Annotated[float, Field(gt=0, le=20)]


class PolicyPathError(ValueError):
    """A validation error about a key path other than the validator's own (reported at ``loc``)."""

    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def did_you_mean(name: str, candidates: Iterator[str] | Mapping[str, Any] | list[str]) -> str:
    """`` (did you mean "x"?)`` for the closest of ``candidates`` to a misspelt ``name``, else ``""``."""
    close = difflib.get_close_matches(name, [str(c) for c in candidates], n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


class DomainReference(_Strict):
    """``domain: {table: departments, column: name}``: borrow a public table column's declared domain.

    Resolved once at load to that column's *declared* values, never to what the table holds: the
    released key set then depends on the policy alone (no query, the same on every backend, and
    nothing read at all, so nothing data-dependent on any table, protected or not). A value the
    public table holds but does not declare is never released, as with any declared domain.
    """

    table: str
    column: str


def _domain_kind(value: Any) -> str:
    return "tagged-reference" if isinstance(value, dict | DomainReference) else "tagged-values"


#: A listed domain or a reference; errors name ``domain.table``/``domain.column`` (the tags are not shown).
_Domain = Annotated[
    Annotated[tuple[Scalar, ...], Tag("tagged-values")] | Annotated[DomainReference, Tag("tagged-reference")],
    Discriminator(_domain_kind),
]


class ColumnPolicy(_Strict):
    """One column: its type, declared bounds and whether its values may be released."""

    type: ColumnType
    lower: Scalar = None
    upper: Scalar = None
    domain: _Domain | None = Field(
        default=None,
        description="Public set of values: GROUP BY releases exactly these keys. Either listed, or "
        "{table, column}: the declared domain of a public table's column (resolved at load).",
    )
    nullable: bool = True
    identifier: bool = Field(default=False, description="Direct identifier: never queryable.")
    randomized_response: LocalPrivacy | None = Field(
        default=None, description="Collected under local DP: stored values are perturbed on write at this ε."
    )
    writable: bool = Field(
        default=False,
        description="An analyst's INSERT may give this column's value (stored as given). Never an identifier.",
    )
    description: str | None = None
    #: ``domain: {table, column}`` naming a public column that lists no values: its stored values (public
    #: data), read by the engine when a query groups by this column (:attr:`stored_domain`).
    _stored_domain: DomainReference | None = PrivateAttr(default=None)

    @property
    def stored_domain(self) -> DomainReference | None:
        return self._stored_domain

    @field_validator("type", mode="before")
    @classmethod
    def _normalise_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in _TYPE_ALIASES:
            return _TYPE_ALIASES[value.lower()]
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> ColumnPolicy:
        if (self.lower is None) != (self.upper is None):
            raise ValueError("declare both 'lower' and 'upper', or neither")
        if self.lower is not None:
            if self.type in ("text", "boolean"):
                raise ValueError(f"bounds make no sense on a {self.type} column; declare a 'domain' instead")
            if self.type in ("int", "float"):
                for name, value in (("lower", self.lower), ("upper", self.upper)):
                    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                        raise ValueError(f"'{name}' must be a finite number")
                if self.type == "int" and not (isinstance(self.lower, int) and isinstance(self.upper, int)):
                    raise ValueError("an int column needs integer 'lower' and 'upper'")
            elif self.type in ("date", "timestamp"):
                for name, value in (("lower", self.lower), ("upper", self.upper)):
                    if not isinstance(value, dt.date):
                        raise ValueError(f"'{name}' must be a {self.type} (YYYY-MM-DD), not {value!r}")
                if type(self.lower) is not type(self.upper):
                    raise ValueError("'lower' and 'upper' must both be dates or both timestamps")
            if self.lower > self.upper:  # type: ignore[operator]
                raise ValueError(f"'lower' ({self.lower}) is greater than 'upper' ({self.upper})")
        if isinstance(self.domain, tuple) and len(set(self.domain)) != len(self.domain):
            raise ValueError("'domain' lists a value twice")
        if self.writable and self.identifier:
            raise ValueError("an identifier column cannot be 'writable' (its presence would be an oracle)")
        if self.randomized_response is not None:
            if self.type != "boolean" and not self.domain:
                raise ValueError("a randomized_response column needs type boolean or a 'domain' of values")
            if self.nullable:
                raise ValueError("a randomized_response column must be 'nullable: false' (NULL is not an answer)")
        return self

    def local_mechanism(self) -> RandomizedResponse | None:
        """The randomized-response mechanism values of this column are stored through, if any."""
        if self.randomized_response is None:
            return None
        values = self.values
        return RandomizedResponse(self.randomized_response.epsilon, values if values else (False, True))

    @property
    def values(self) -> tuple[Scalar, ...] | None:
        """The declared domain's values (a reference is resolved when the policy loads)."""
        if isinstance(self.domain, DomainReference):
            raise ValueError(f"domain reference {self.domain.table}.{self.domain.column} was never resolved")
        return self.domain

    @property
    def numeric(self) -> bool:
        return self.type in ("int", "float")

    @property
    def bounded(self) -> bool:
        return self.lower is not None

    def release_domain(self) -> tuple[Scalar, ...] | None:
        """Group keys that may be released without partition selection (NULL if nullable): the
        declared domain, listed or borrowed from a public table's column."""
        declared = self.values
        if declared is None:
            if self.type == "boolean":
                return (False, True, None) if self.nullable else (False, True)
            return None
        values = tuple(declared)
        if self.nullable and None not in values:
            values = (*values, None)
        return values


class Reference(_Strict):
    """How a table reaches its privacy unit through a foreign key (``visits.patient_id → patients.id``)."""

    column: str
    table: str
    to: str


class TablePolicy(_Strict):
    """A table exposed to analysts."""

    source: str | None = Field(default=None, description="Backend table name, if it differs.")
    public: bool = Field(default=False, description="Holds no personal data: no noise needed to read keys.")
    privacy_unit: str | None = Field(
        default=None, description="Column identifying the protected unit; None means one row per person."
    )
    references: Reference | None = None
    max_rows_per_unit: Annotated[int, Field(ge=1)] = 1
    max_groups_per_unit: Annotated[int, Field(ge=1)] | None = None
    published_rows_cut: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        default=None,
        description="Share of this table's rows its max_rows_per_unit leaves out, published by the curator (who "
        "owns that disclosure): queries at the policy's caps widen their ± by it instead of estimating it under DP.",
    )
    columns: dict[str, ColumnPolicy]
    description: str | None = None

    @model_validator(mode="after")
    def _check_unit(self) -> TablePolicy:
        if self.privacy_unit is not None and self.privacy_unit not in self.columns:
            raise PolicyPathError(
                ("privacy_unit",),
                f"'{self.privacy_unit}' is not a declared column" + did_you_mean(self.privacy_unit, self.columns),
            )
        if self.references is not None and self.references.column not in self.columns:
            column = self.references.column
            raise PolicyPathError(
                ("references", "column"), f"'{column}' is not a declared column" + did_you_mean(column, self.columns)
            )
        return self


class Budget(_Strict):
    """A total privacy budget, in (ε, δ)."""

    epsilon: Annotated[float, Field(gt=0)]
    delta: Annotated[float, Field(ge=0, lt=1)] = 0.0


class Analyst(_Strict):
    name: str
    password: str | None = Field(
        default=None, description="SCRAM-SHA-256 verifier as PostgreSQL stores it; never plaintext."
    )
    budget: Budget | None = None

    @field_validator("password")
    @classmethod
    def _verifier_only(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("SCRAM-SHA-256$"):
            raise ValueError(
                "must be a SCRAM-SHA-256 verifier ('SCRAM-SHA-256$<iter>:<salt>$<stored>:<server>'), "
                "never a plaintext password; generate one with `dpsql passwd`"
            )
        return value


class Defaults(_Strict):
    """Per-query defaults an analyst may override per session (within budget)."""

    epsilon: Annotated[float, Field(gt=0)] = 1.0
    delta: Annotated[float, Field(ge=0, lt=1)] = 1e-6
    mechanism: Mechanism = "laplace"
    confidence: Annotated[float, Field(gt=0, lt=1)] = 0.95
    #: Rows one person adds to a query after its joins, for every query: None (each table's
    #: ``max_rows_per_unit``, joins by foreign key multiplying nothing), a number, or ``auto`` (chosen
    #: under DP per query at a share of its ε). ``SET dpsql.max_rows_per_unit`` overrides it.
    max_rows_per_unit: Annotated[int, Field(ge=1, le=1_000_000)] | Literal["auto"] | None = None


class Budgets(_Strict):
    dataset: Budget
    analyst: Budget = Field(description="Default total for each analyst without a budget of their own.")
    accounting: Accounting = "pure"
    max_query_delta: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=1e-3,
        description="Under zcdp accounting, the largest δ one query may use (SET dpsql.delta above it, "
        "or at/above the dataset's δ budget, is refused with 22023 before any charge).",
    )

    @field_validator("accounting")
    @classmethod
    def _pld_installed(cls, value: Accounting) -> Accounting:
        # refused at load, not at the first query: a policy that cannot be accounted is no policy
        if value == "pld" and not pld.available():
            raise ValueError(
                "pld accounting needs Google's dp-accounting package: install dpsql with the pld extra "
                "(pip install 'dpsql[pld]')"
            )
        return value


class Auth(_Strict):
    trust: bool = Field(default=False, description="Accept any declared analyst without a password (demos).")


class Writes(_Strict):
    """The opt-in write path: INSERTs that store randomized-response columns perturbed."""

    randomized_response: bool = False


class Synopsis(_Strict):
    """A curator's noisy view (``synopses:``): released once, charged once to the dataset, then every query
    it answers is post-processing of that release, free for every analyst.

    ``keys`` are GROUP BY expressions with public domains (a declared domain, or a time grain such as
    ``DATE_TRUNC('month', visit_date)`` of a bounded column); ``measures`` are ``COUNT(*)`` and ``SUM(col)``
    of bounded columns. ``marginals`` are the key sets measured, each at an equal share of (ε, δ) (default:
    every key alone, and all keys together); a query is answered from the synopsis when its keys and
    filter columns fall inside one measured marginal (coarser time grains allowed). ``filters`` are
    public-domain columns every chart may filter on: each is a key of the cube inside every marginal.
    ``continual``: a refresh releases only the time buckets after the last one released (the time key's
    column bound extended), charged once each; answers span all of them.
    """

    table: str
    keys: Annotated[tuple[str, ...], Field(min_length=1)]
    measures: Annotated[tuple[str, ...], Field(min_length=1)] = ("COUNT(*)",)
    marginals: tuple[tuple[str, ...], ...] | None = None
    filters: tuple[str, ...] = ()
    continual: bool = False
    epsilon: Annotated[float, Field(gt=0)]
    delta: Annotated[float, Field(ge=0, lt=1)] = 0.0
    mechanism: Mechanism | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _check_marginals(self) -> Synopsis:
        if len(set(self.axes)) != len(self.axes):
            raise ValueError("a synopsis key or filter column is listed twice")
        for marginal in self.marginals or ():
            unknown = [k for k in marginal if k not in self.keys]
            if unknown:
                raise ValueError(f"marginal key {unknown[0]!r} is not one of the synopsis keys")
        return self

    @property
    def axes(self) -> tuple[str, ...]:
        """The cube's keys: the declared keys, then the filter columns."""
        return self.keys + self.filters

    @property
    def measured(self) -> tuple[tuple[int, ...], ...]:
        """The measured marginals as indices into :attr:`axes` (default: each key alone, then all keys
        together), each with every filter column."""
        filters = tuple(range(len(self.keys), len(self.axes)))
        if self.marginals is not None:
            return tuple(tuple(sorted({self.keys.index(k) for k in m} | set(filters))) for m in self.marginals)
        alone = tuple((i, *filters) for i in range(len(self.keys)))
        return alone + ((tuple(range(len(self.axes))),) if len(self.keys) > 1 else ())


class Policy(_Strict):
    """A whole policy file."""

    dataset: str
    description: str | None = None
    defaults: Defaults = Defaults()
    budget: Budgets
    analysts: tuple[Analyst, ...] = ()
    auth: Auth = Auth()
    writes: Writes = Writes()
    tables: dict[str, TablePolicy]
    synopses: dict[str, Synopsis] = {}
    #: (id of the ``tables`` dict they were resolved from, each table's unit path)
    _units: tuple[int, dict[str, UnitPath | None]] = PrivateAttr(default=(0, {}))

    @model_validator(mode="before")
    @classmethod
    def _inherit_delta(cls, data: Any) -> Any:
        """A budget without ``delta`` inherits the enclosing one's: an analyst's from ``budget.analyst``,
        ``budget.analyst`` from ``budget.dataset``. A δ budget silently 0 would refuse every
        partition-selection and Gaussian query as exhausted; inheriting never exceeds the dataset's δ,
        which caps all analysts together anyway."""
        if not isinstance(data, dict) or not isinstance(data.get("budget"), dict):
            return data
        budget = dict(data["budget"])
        dataset, default = budget.get("dataset"), budget.get("analyst")
        if isinstance(default, dict) and "delta" not in default and isinstance(dataset, dict) and "delta" in dataset:
            budget["analyst"] = default = {**default, "delta": dataset["delta"]}
        data = {**data, "budget": budget}
        analysts = data.get("analysts")
        if isinstance(default, dict) and "delta" in default and isinstance(analysts, list | tuple):
            data["analysts"] = [
                {**a, "budget": {**a["budget"], "delta": default["delta"]}}
                if isinstance(a, dict) and isinstance(a.get("budget"), dict) and "delta" not in a["budget"]
                else a
                for a in analysts
            ]
        return data

    @model_validator(mode="after")
    def _check_refs(self) -> Policy:
        for name, table in self.tables.items():
            ref = table.references
            if ref is None:
                continue
            target = self.tables.get(ref.table)
            at = ("tables", name, "references")
            if target is None:
                raise PolicyPathError(
                    (*at, "table"), f"table '{ref.table}' is not declared" + did_you_mean(ref.table, self.tables)
                )
            if ref.to not in target.columns:
                raise PolicyPathError(
                    (*at, "to"),
                    f"'{ref.to}' is not a column of '{ref.table}'" + did_you_mean(ref.to, target.columns),
                )
        try:
            self._units = (id(self.tables), resolve_units(self.tables))
        except UnitError as exc:
            raise PolicyPathError(exc.loc, str(exc)) from None
        names = [a.name for a in self.analysts]
        if len(set(names)) != len(names):
            raise ValueError("an analyst is declared twice")
        for name, synopsis in self.synopses.items():
            if self.table(synopsis.table) is None:
                raise ValueError(f"synopsis '{name}': table '{synopsis.table}' is not declared")
            if synopsis.epsilon > self.budget.dataset.epsilon or synopsis.delta > self.budget.dataset.delta:
                raise ValueError(f"synopsis '{name}': its (ε, δ) exceeds the dataset's budget")
        self._resolve_domains()
        return self

    def _resolve_domains(self) -> None:
        """Replace every ``domain: {table, column}`` by the referenced column's declared values.

        The target must be a declared column of a ``public`` table (a private column's values are
        not public knowledge), not an identifier, of the same type, and declare a listed domain itself
        (no chains). Errors name the referring key path.
        """
        for name, table in self.tables.items():
            resolved: dict[str, ColumnPolicy] = {}
            for column_name, column in table.columns.items():
                ref = column.domain
                if not isinstance(ref, DomainReference):
                    continue
                at = ("tables", name, "columns", column_name, "domain")
                target = self.tables.get(ref.table)
                if target is None:
                    raise PolicyPathError((*at, "table"), f"table '{ref.table}' is not declared")
                if not target.public:
                    raise PolicyPathError(
                        (*at, "table"),
                        f"table '{ref.table}' is not public: only a public table's values may be a domain",
                    )
                source = target.columns.get(ref.column)
                if source is None:
                    raise PolicyPathError((*at, "column"), f"'{ref.column}' is not a column of '{ref.table}'")
                where = f"'{ref.table}.{ref.column}'"
                if source.identifier:
                    raise PolicyPathError((*at, "column"), f"{where} is an identifier")
                if source.type != column.type:
                    raise PolicyPathError(
                        (*at, "column"), f"{where} is {source.type} but '{name}.{column_name}' is {column.type}"
                    )
                if isinstance(source.domain, DomainReference):
                    raise PolicyPathError((*at, "column"), f"{where} declares no list of values ('domain: [...]')")
                if source.domain is None:
                    # the public column's stored values, read by the engine when a query groups by it
                    unlisted = column.model_copy(update={"domain": None})
                    unlisted._stored_domain = ref
                    resolved[column_name] = unlisted
                    continue
                resolved[column_name] = column.model_copy(update={"domain": source.domain})
            if resolved:
                self.tables[name] = table.model_copy(update={"columns": {**table.columns, **resolved}})

    def table(self, name: str) -> TablePolicy | None:
        return self.tables.get(name.lower()) or self.tables.get(name)

    def unit_path(self, name: str) -> UnitPath | None:
        """How table ``name``'s rows reach their person (:mod:`dpsql.units`); None: public, or each row
        is one person. Resolved again for a copy with other tables (``model_copy(update=…)``)."""
        if self._units[0] != id(self.tables):
            self._units = (id(self.tables), resolve_units(self.tables))
        return self._units[1].get(name)

    def analyst(self, name: str) -> Analyst | None:
        return next((a for a in self.analysts if a.name == name), None)

    def analyst_budget(self, name: str) -> Budget:
        analyst = self.analyst(name)
        return analyst.budget if analyst and analyst.budget else self.budget.analyst


# --- loading with file:line error reporting -----------------------------------------


def _line_index(node: yaml.Node, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], int]]:
    """Map every key path in a YAML document to its 1-based line number."""
    yield path, node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            key_path = (*path, key.value)
            yield key_path, key.start_mark.line + 1
            for sub_path, line in _line_index(value, key_path):
                if sub_path != key_path:
                    yield sub_path, line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _line_index(item, (*path, i))


def _unwrap(annotation: Any) -> Any:
    """The type under ``Annotated[…]`` and ``X | None`` (of a union, its first model, else its first member)."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in get_args(annotation) if a is not type(None)]
            models = [a for a in members if isinstance(_unwrap(a), type) and issubclass(_unwrap(a), BaseModel)]
            annotation = (models or members)[0]
        else:
            return annotation


def _settings_at(loc: tuple[Any, ...]) -> list[str]:
    """The setting names the mapping at key path ``loc`` may hold (for a "did you mean"), or none."""
    annotation: Any = Policy
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        elif get_origin(annotation) in (dict, tuple):
            annotation = get_args(annotation)[-1 if get_origin(annotation) is dict else 0]
        else:
            return []
    annotation = _unwrap(annotation)
    return list(annotation.model_fields) if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


_TYPE_WORDS = {
    "int": "a whole number",
    "float": "a number",
    "bool": "true or false",
    "string": "text",
    "date": "a date (YYYY-MM-DD)",
    "datetime": "a timestamp (YYYY-MM-DD HH:MM:SS)",
    "dict": "a mapping of settings (key: value)",
    "model": "a mapping of settings (key: value)",
    "model_attributes": "a mapping of settings (key: value)",
    "list": "a list",
    "tuple": "a list",
}


def _words(error: Mapping[str, Any], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str]:
    """One pydantic error in the policy's words: the key path to name and the message (pydantic's
    own wording, "Extra inputs are not permitted", means nothing to a curator)."""
    kind, ctx, value = str(error["type"]), error.get("ctx") or {}, error.get("input")
    given = f", not {value!r}" if isinstance(value, int | float | str | list | dict) else ""
    if kind == "extra_forbidden" and loc:
        key = str(loc[-1])
        return loc[:-1], f'unknown setting "{key}"' + did_you_mean(key, _settings_at(loc[:-1]))
    if kind == "missing" and loc:
        return loc[:-1], f'missing required setting "{loc[-1]}"'
    bounds = {
        "greater_than": "greater than {gt}",
        "greater_than_equal": "at least {ge}",
        "less_than": "less than {lt}",
        "less_than_equal": "at most {le}",
        "too_short": "a list of at least {min_length}",
        "too_long": "a list of at most {max_length}",
    }
    if kind in bounds:
        shown = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}
        return loc, "must be " + bounds[kind].format(**shown) + given
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        return loc, f"must be one of {', '.join(allowed)}{given}{hint}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return loc, "must be a list of values or {table: …, column: …}"
    if kind == "scalar_type":
        return loc, "must be one value (a number, text, true/false or a date)" + given
    if kind == "finite_number":
        return loc, "must be a finite number" + given
    base = kind.split("_")[0] if not kind.startswith("model_attributes") else "model_attributes"
    if kind.endswith(("_type", "_parsing", "_from_float", "_from_datetime_parsing")) and base in _TYPE_WORDS:
        return loc, f"must be {_TYPE_WORDS[base]}{given}"
    message = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return loc, message


#: How pydantic names the members of the ``Scalar`` union in an error's key path.
_SCALAR_MEMBERS = frozenset({"int", "float", "str", "bool", "date", "datetime"})


def _one_of(error: Mapping[str, Any], lines: dict[tuple[Any, ...], int]) -> Mapping[str, Any]:
    """A value fitting no member of a scalar union (``lower: [1]``) fails once per member, each at a
    key path ending in the member's name: one error at the key itself instead."""
    loc = tuple(error["loc"])
    if loc and loc[-1] in _SCALAR_MEMBERS and tuple(map(str, loc)) not in lines and tuple(map(str, loc[:-1])) in lines:
        return {**error, "loc": loc[:-1], "type": "scalar_type", "ctx": None}
    return error


def _describe(error: Mapping[str, Any], where: str, lines: dict[tuple[Any, ...], int]) -> str:
    cause = (error.get("ctx") or {}).get("error")
    raw_loc = (*error["loc"], *cause.loc) if isinstance(cause, PolicyPathError) else error["loc"]
    loc = tuple(p for p in raw_loc if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
    probe = loc
    while probe and tuple(map(str, probe)) not in lines:
        probe = probe[:-1]
    line = lines.get(tuple(map(str, probe)), 1)
    shown, message = _words(error, loc)
    key_path = ".".join(str(p) for p in shown) or "<top>"
    return f"{where}:{line}: {key_path}: {message}"


def parse_policy(text: str, where: str = "<policy>") -> Policy:
    """Validate policy YAML text; raise :class:`PolicyError` naming file:line and key path."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise PolicyError(f"{where}:{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except ValueError as exc:  # a scalar YAML reads as a date but is none (2020-13-01): no mark
        raise PolicyError(f"{where}:1: not valid YAML: {exc} (in a date)") from None
    if not isinstance(raw, dict) or node is None:
        raise PolicyError(f"{where}:1: a policy must be a YAML mapping with 'dataset', 'budget' and 'tables'")
    lines = {tuple(map(str, p)): n for p, n in _line_index(node)}
    try:
        return Policy.model_validate(raw)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_describe(_one_of(e, lines), where, lines) for e in exc.errors()))
        raise PolicyError(
            problems[0],
            detail="\n".join(problems[1:]) or None,
            hint="See schemas/README.md for the policy format.",
        ) from None


def load_policy(path: str | Path) -> Policy:
    """Load and validate a policy file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read policy file: {exc.strerror}") from None
    return parse_policy(text, str(path))
