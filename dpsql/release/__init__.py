"""The release stage: noise applied to measured rows. Re-exports the noise primitives of
:mod:`dpsql.noise` under their historical names (``from dpsql.release import release``)."""

from dpsql.noise.mechanisms import (
    NoiseSpec,
    cdp_delta,
    check_samplable,
    epsilon_to_rho,
    gaussian_spec,
    half_width,
    laplace_spec,
    noise_tail,
    partition_threshold,
    release,
    release_many,
    rho_to_epsilon,
    sample_noise,
    snap,
)
from dpsql.noise.samplers import discrete_gaussian, discrete_laplace, laplace_rational_scale

__all__ = [
    "NoiseSpec",
    "cdp_delta",
    "check_samplable",
    "discrete_gaussian",
    "discrete_laplace",
    "epsilon_to_rho",
    "gaussian_spec",
    "half_width",
    "laplace_rational_scale",
    "laplace_spec",
    "noise_tail",
    "partition_threshold",
    "release",
    "release_many",
    "rho_to_epsilon",
    "sample_noise",
    "snap",
]
