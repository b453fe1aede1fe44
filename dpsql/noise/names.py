"""The registered noise mechanisms' names, without their samplers: what a policy and a session setting
validate against, importable without NumPy (issue #37: ``dpsql budget`` loads the policy, not the noise
code). :mod:`dpsql.noise.mechanisms` checks at import that its registry holds exactly these, in this order."""

from __future__ import annotations

from typing import Literal, get_args

#: The registered mechanisms' names as a type (policies validate against it).
Mechanism = Literal["laplace", "gaussian"]


def mechanism_names() -> tuple[str, ...]:
    """The registered mechanisms' names, in registration order (for choices and error hints)."""
    return tuple(str(name) for name in get_args(Mechanism))
