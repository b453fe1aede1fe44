"""A prepared statement: what the engine keeps per query text and settings, and what describing one yields.

Planning (analysis, rewrite, calibration) happens once per text, parameters, privacy settings and
data version; the :class:`Prepared` is then reused by every execution until evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpsql.analyze.randomized import LocalQuery
from dpsql.plan import Plan
from dpsql.release.apply import ReleaseCache
from dpsql.release.bias import BiasEstimate
from dpsql.release.calibrate import Budgeting
from dpsql.release.cap import CapChoice
from dpsql.session import OutputColumn


@dataclass(frozen=True, slots=True)
class Description:
    """What a query would return, known without running it or spending budget."""

    columns: list[OutputColumn]
    param_types: list[str]


@dataclass(slots=True)
class Prepared:
    """A planned query: its plan, generated SQL and budgeting, cached per text and settings."""

    plan: Plan
    sql: str
    budgeting: Budgeting
    fingerprint: str
    #: (measure index, SQL) of the histogram each quantile measure is selected from.
    histograms: list[tuple[int, str]] = field(default_factory=list)
    #: Result-cache key: the normalised statement, its parameters and the session's privacy settings.
    cache_key: str = ""
    #: Set when the query only counts a randomized-response column: answered from stored values, at no cost.
    local: LocalQuery | None = None
    #: The backend's data version the clamp proofs (``plan.physical.proven``) were read at.
    data_version: int = 0
    #: Measurement key (:func:`dpsql.cache.measurement_key`): what is measured and how it is noised,
    #: whatever the outputs, aliases, HAVING, ORDER BY and LIMIT; queries sharing it share one release.
    measurement_key: str = ""
    #: Compiled post-processing and the public-key grid, built on first release.
    cache: ReleaseCache = field(default_factory=ReleaseCache)
    #: ``dpsql.max_rows_per_unit = auto``: how the cap is chosen when it runs (the plan, SQL and budgeting
    #: above are at the largest candidate, for EXPLAIN and the charge); None: the plan's cap as it is.
    cap: CapChoice | None = None
    #: ``dpsql.bias``: how the cap/clamp bias is estimated under DP when it runs (its ε share is in the
    #: budgeting's charge); None: no estimate (off, or nothing can be cut).
    bias: BiasEstimate | None = None
