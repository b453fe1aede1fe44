"""Benchmark 3: noise throughput of the exact CSPRNG samplers and of ``release``.

The baseline is reading the same number of 64-bit words from the OS CSPRNG (``os.urandom``):
the samplers cannot be faster than their entropy source, so "× urandom" says how much work
exact sampling adds on top of it, independent of the machine.
"""

from __future__ import annotations

import os

import numpy as np
from common import Section, time_calls

from dpsql.release import discrete_laplace, laplace_spec, release

SCALE = 10.0  # e.g. a SUM of sensitivity 10 at ε = 1


def run(quick: bool) -> Section:
    section = Section(
        "noise",
        f"noise throughput (discrete Laplace, scale {SCALE:g})",
        ["what", "size", "p50 ms", "p99 ms", "samples/s", "× urandom(8·size)"],
    )
    reps = {1: 2000 if quick else 10000, 1000: 200 if quick else 1000, 10**6: 3 if quick else 15}
    for size, n_reps in reps.items():
        st = time_calls(lambda size=size: discrete_laplace(SCALE, size), reps=n_reps, budget_s=3 if quick else 8)
        base = time_calls(lambda size=size: os.urandom(8 * size), reps=n_reps, budget_s=1)
        rate = size / (st.p50_us / 1e6)
        ratio = st.p50_us / base.p50_us
        section.rows.append(["discrete_laplace", size, st.p50_us / 1e3, st.p99_us / 1e3, rate, ratio])
        section.data[f"discrete_laplace_{size}"] = {
            **st.as_dict(),
            "samples_per_s": rate,
            "urandom_p50_us": base.p50_us,
            "ratio_vs_urandom": ratio,
        }
    cells = 10**6
    int_values = np.arange(cells, dtype=np.int64) % 1000
    real_values = (np.arange(cells, dtype=np.float64) % 1000) * 123.456
    specs = {
        "release int COUNT": (int_values, laplace_spec(1.0, 1.0, integer=True)),
        "release real SUM": (real_values, laplace_spec(200000.0, 1.0, integer=False)),
    }
    for what, (values, spec) in specs.items():
        st = time_calls(lambda values=values, spec=spec: release(values, spec), reps=3 if quick else 15, warmup=1)
        base = time_calls(lambda: os.urandom(8 * cells), reps=3, warmup=1)
        rate = cells / (st.p50_us / 1e6)
        section.rows.append([what, cells, st.p50_us / 1e3, st.p99_us / 1e3, rate, st.p50_us / base.p50_us])
        section.data[what.replace(" ", "_")] = {
            **st.as_dict(),
            "cells_per_s": rate,
            "scale": spec.scale,
            "grid": spec.grid,
            "ratio_vs_urandom": st.p50_us / base.p50_us,
        }
    section.notes.append("size 1 goes through the scalar sampler; larger sizes through the vectorised one.")
    return section
