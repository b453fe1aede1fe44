"""Values that cross the engine boundary: who asks, with which settings, and what comes back.

Front doors (DB-API driver, CLI, wire server) build a :class:`Session` and receive a
:class:`Result`; they never see the rewritten SQL's raw output. The ``dpsql.*`` settings
grammar lives here too (:data:`DPSQL_SETTINGS`, :func:`parse_setting`), so ``SET dpsql.epsilon``
over the wire, ``connect(epsilon=…)`` and ``dpsql query --epsilon`` accept exactly the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from dpsql.errors import InvalidParameterValue, UndefinedObject
from dpsql.noise.names import Mechanism, mechanism_names
from dpsql.pgtypes import PG_TYPE_OIDS, PgType, parse_bool

#: The registered noise mechanisms' names (one registry: :data:`dpsql.noise.mechanisms.MECHANISMS`).
MECHANISM_NAMES: tuple[str, ...] = mechanism_names()

#: ε accepted by SET dpsql.epsilon: below, no noise could be calibrated; above, no privacy is left.
MIN_EPSILON, MAX_EPSILON = 1e-6, 1e6
#: Smallest non-zero δ accepted by SET dpsql.delta (smaller ones overflow the Gaussian calibration).
MIN_DELTA = 1e-30
#: Accuracy-first's guard by default: a query may take at most a quarter of the ε left, unless confirmed.
DEFAULT_MAX_SHARE = 0.25


def _fraction(value: str, low_open: bool, high: float, high_open: bool, low: float = 0.0) -> float:
    x = float(value)
    if not math.isfinite(x) or x < 0 or (low_open and x == 0) or x > high or (high_open and x == high):
        raise ValueError(value)
    if 0 < x < low:
        raise ValueError(value)
    return x


def _accuracy(value: str) -> float:
    """``'±10'``, ``'+-10'`` or ``'10'``: the wanted half-width, in the measure's own units.

    Relative targets (``'10%'``) are refused: the ε meeting one would be chosen from the true
    value, so the charge (shown to the analyst) would depend on the data, which is not private.
    """
    text = value.strip()
    if text.endswith("%"):
        raise InvalidParameterValue(
            f'invalid value for parameter "dpsql.accuracy": "{value}"',
            hint="A relative accuracy is not supported: choosing ε from the true value would make the ε "
            "(and so the charge) depend on the data, which is not private. Give an absolute half-width "
            "in the measure's units, e.g. SET dpsql.accuracy = '±10'.",
        )
    for sign in ("±", "+-", "+/-"):
        text = text.removeprefix(sign)
    x = float(text.strip())
    if not (math.isfinite(x) and x > 0):
        raise ValueError(value)
    return x


#: Largest per-person row cap SET dpsql.max_rows_per_unit accepts (sensitivity grows with it).
MAX_ROWS_PER_UNIT = 1_000_000
#: ``SET dpsql.max_rows_per_unit = auto``: the cap chosen under DP per query (:mod:`dpsql.release.cap`).
AUTO = "auto"


def _rows_per_unit(value: str) -> int | str:
    """A per-person row cap for this session's queries (an integer ≥ 1), or ``auto``."""
    text = value.strip().lower()
    if text == AUTO:
        return AUTO
    number = int(text)
    if not 1 <= number <= MAX_ROWS_PER_UNIT:
        raise ValueError(value)
    return number


def _factor(value: str) -> float:
    """A finite factor of at least 1."""
    x = float(value)
    if not (math.isfinite(x) and x >= 1):
        raise ValueError(value)
    return x


def _alternatives(names: tuple[str, ...]) -> str:
    """``'a'``, ``'a' or 'b'``, ``'a', 'b' or 'c'``: a hint's list, generated from a registry."""
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _mechanism(value: str) -> Mechanism:
    name = value.strip().lower()
    if name not in MECHANISM_NAMES:
        raise ValueError(value)
    return cast(Mechanism, name)


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One ``dpsql.*`` setting: its parser (ValueError when invalid) and the hint shown when it is."""

    parse: Callable[[str], Any]
    hint: str


DPSQL_SETTINGS: dict[str, SettingSpec] = {
    "dpsql.epsilon": SettingSpec(
        lambda v: _fraction(v, True, MAX_EPSILON, False, MIN_EPSILON),
        f"dpsql.epsilon must be between {MIN_EPSILON:g} and {MAX_EPSILON:g}, e.g. 0.5.",
    ),
    "dpsql.delta": SettingSpec(
        lambda v: _fraction(v, False, 1.0, True, MIN_DELTA), f"dpsql.delta must be 0 or in [{MIN_DELTA:g}, 1)."
    ),
    "dpsql.confidence": SettingSpec(
        lambda v: _fraction(v, True, 1.0 - 1e-9, False, 1e-9), "dpsql.confidence must be in (0, 1), e.g. 0.95."
    ),
    # the wanted CI half-width of each noisy measure: ε is then the least that meets it (release.calibrate)
    "dpsql.accuracy": SettingSpec(
        _accuracy, "dpsql.accuracy is a positive half-width in the measure's units, e.g. '±10' (or DEFAULT: none)."
    ),
    "dpsql.mechanism": SettingSpec(_mechanism, f"dpsql.mechanism is {_alternatives(MECHANISM_NAMES)}."),
    # rows one person adds to a query after its joins (the policy's caps by default; any cap is private:
    # the noise follows it, rows beyond it are left out); auto: chosen under DP at a share of the ε
    "dpsql.max_rows_per_unit": SettingSpec(
        _rows_per_unit,
        f"dpsql.max_rows_per_unit is a whole number of rows from 1 to {MAX_ROWS_PER_UNIT:,}, or auto "
        "(chosen under DP for each query), or DEFAULT (the policy's caps).",
    ),
    # accuracy-first's guard: a query whose chosen ε is more than this share of the ε left is refused …
    "dpsql.max_share": SettingSpec(
        lambda v: _fraction(v, True, 1.0, False), "dpsql.max_share is a share of the remaining ε in (0, 1], e.g. 0.25."
    ),
    # … unless its ε is at most this (the ε the refusal named, confirmed)
    "dpsql.confirm_epsilon": SettingSpec(
        lambda v: _fraction(v, True, MAX_EPSILON, False, MIN_EPSILON),
        "dpsql.confirm_epsilon is the ε you accept for an accuracy-first query, e.g. the one its refusal named.",
    ),
    # a synopsis answer whose ± is more than this many times a fresh answer's: a fresh, charged one instead
    "dpsql.max_widening": SettingSpec(
        _factor,
        "dpsql.max_widening is a factor of at least 1, e.g. 2 (or DEFAULT: synopsis answers whatever their width).",
    ),
    # ± covers the cap/clamp bias estimated under DP at a share of the query's ε (dpsql.release.bias)
    "dpsql.bias": SettingSpec(
        parse_bool,
        "dpsql.bias is on (± covers noise and the cap/clamp bias estimated under DP at a fifth of the query's ε) "
        "or off (± covers the noise only).",
    ),
    "dpsql.show_intervals": SettingSpec(parse_bool, "dpsql.show_intervals is on or off."),
    # noisy floats rounded to two significant digits of their half-width (dpsql.release.rounding)
    "dpsql.round": SettingSpec(parse_bool, "dpsql.round is on (noisy values rounded to their interval) or off."),
    # leading/trailing time buckets indistinguishable from 0 dropped (dpsql.postprocess.trim)
    "dpsql.trim_time": SettingSpec(parse_bool, "dpsql.trim_time is on (time series trimmed to the data) or off."),
}
#: The settings that are fields of :class:`Session` (the others only shape the wire output).
SESSION_FIELDS: tuple[str, ...] = ("epsilon", "delta", "confidence", "mechanism", "accuracy", "max_rows_per_unit")
SESSION_FIELDS += ("max_widening", "max_share", "confirm_epsilon", "bias")


def parse_setting(name: str, value: str) -> Any:
    """The value of ``SET <name> = <value>`` for a ``dpsql.*`` setting; 42704 or 22023 (with a hint)."""
    key = name.lower()
    spec = DPSQL_SETTINGS.get(key)
    if spec is None:
        raise UndefinedObject(f'unrecognized configuration parameter "{name}"')
    try:
        return spec.parse(value)
    except (ValueError, KeyError):
        raise InvalidParameterValue(f'invalid value for parameter "{key}": "{value}"', hint=spec.hint) from None


def ci_label(confidence: float) -> str:
    """``95`` for 0.95: how front doors name interval columns (``n_ci95``, ``n ±95%``)."""
    return f"{round(confidence * 100):d}"


__all__ = ["PG_TYPE_OIDS", "OutputColumn", "PgType", "Result", "Session"]  # the type tables: dpsql.pgtypes


@dataclass(frozen=True, slots=True)
class OutputColumn:
    """One released column, named as PostgreSQL would name it."""

    name: str
    type: PgType
    #: Whether the value is released with noise (the plan's ``OutputItem.noisy``); None: not said.
    noisy: bool | None = field(default=None, compare=False)

    @property
    def type_oid(self) -> int:
        return PG_TYPE_OIDS[self.type]


@dataclass(slots=True)
class Session:
    """Per-connection state: the analyst and the dpsql settings they chose (``SET dpsql.…``)."""

    analyst: str
    epsilon: float | None = None
    delta: float | None = None
    mechanism: Mechanism | None = None
    confidence: float | None = None
    #: Accuracy-first: the wanted half-width of every noisy measure at the session's confidence; when
    #: set, ε is the least that meets it (overrides ``epsilon``). Absolute only: a relative target
    #: would choose ε from the true value, which is not private.
    accuracy: float | None = None
    #: Rows one person adds to each query after its joins: a number, ``auto`` (chosen under DP), or None
    #: (the policy's caps, or its ``defaults.max_rows_per_unit``).
    max_rows_per_unit: int | str | None = None
    #: A synopsis answer wider than this many times a fresh answer is replaced by a fresh, charged one.
    max_widening: float | None = None
    #: Accuracy-first's guard: the largest share of the analyst's remaining ε one query may take (None: the
    #: default, :data:`DEFAULT_MAX_SHARE`), unless its ε is at most ``confirm_epsilon``.
    max_share: float | None = None
    confirm_epsilon: float | None = None
    #: ``dpsql.bias``: whether ± covers the cap/clamp bias estimated under DP (None: on, the default).
    bias: bool | None = None
    settings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def configure(
        cls,
        analyst: str,
        *,
        epsilon: float | None = None,
        delta: float | None = None,
        mechanism: str | None = None,
        confidence: float | None = None,
        accuracy: float | str | None = None,
        max_rows_per_unit: int | str | None = None,
        bias: bool | str | None = None,
    ) -> Session:
        """A session whose settings went through the same checks as ``SET dpsql.…`` (22023 if invalid)."""
        session = cls(analyst)
        given = {
            "epsilon": epsilon,
            "delta": delta,
            "mechanism": mechanism,
            "confidence": confidence,
            "accuracy": accuracy,
            "max_rows_per_unit": max_rows_per_unit,
            "bias": None if bias is None else ("on" if bias is True else "off" if bias is False else bias),
        }
        for name, value in given.items():
            if value is not None:
                key = f"dpsql.{name}"
                text = str(value)
                session.apply(key, parse_setting(key, text), text)
        return session

    def apply(self, key: str, parsed: Any, text: str | None) -> None:
        """Record a parsed ``dpsql.*`` setting (None: back to the policy's default)."""
        attr = key.removeprefix("dpsql.")
        if attr in SESSION_FIELDS:
            setattr(self, attr, parsed)
        if parsed is None or text is None:
            self.settings.pop(key, None)
        else:
            self.settings[key] = text


@dataclass(slots=True)
class Result:
    """A released answer: noisy rows plus what the analyst needs to judge them."""

    columns: list[OutputColumn]
    rows: list[tuple[Any, ...]]
    #: 95% (or session confidence) half-width per cell; None for group keys and exact values.
    accuracy: list[tuple[float | None, ...]]
    epsilon_spent: float
    delta_spent: float
    remaining_epsilon: float | None = None
    notices: list[str] = field(default_factory=list)
    command_tag: str = "SELECT"
    #: Per row, each cell's released value interval (low, high) when it has one that is not a ± (a
    #: quantile's, at the policy's confidence); empty when no cell has one. Not kept by the result cache
    #: (the notes that state them are).
    intervals: list[tuple[tuple[float, float] | None, ...]] = field(default_factory=list)

    @property
    def rowcount(self) -> int:
        return len(self.rows)
