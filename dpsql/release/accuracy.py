"""Accuracy: the half-width of each released cell's confidence interval, from the noise used.

Counts and sums read their spec's exact tail (``half_width``); AVG and VARIANCE combine their
measures' independent noises by the delta method. Intervals are post-processing of public
scales and released values: they cost nothing.
"""

from __future__ import annotations

from typing import Any

from dpsql.aggregates import OUTPUTS
from dpsql.errors import InvalidParameterValue
from dpsql.plan import OutputItem
from dpsql.policy import Policy
from dpsql.session import Session


def confidence(policy: Policy, session: Session) -> float:
    """The session's CI level (or the policy's), checked: a bad one fails before any charge."""
    level = session.confidence if session.confidence is not None else policy.defaults.confidence
    if not 0 < level < 1:  # NaN fails too
        raise InvalidParameterValue(
            f"dpsql.confidence must be between 0 and 1 (exclusive), got {level:g}",
            hint="For example SET dpsql.confidence = 0.95.",
        )
    return level


def accuracy(out: OutputItem, env: dict[str, Any], widths: list[float | None]) -> float | None:
    """Half-width of the confidence interval of one released cell, from the scales used (each
    aggregate's own: the spec's tail for counts and sums, the delta method for AVG and VARIANCE)."""
    return OUTPUTS[out.kind].accuracy(out, env, widths)
