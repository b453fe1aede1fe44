"""Pure noise code, below every stage that knows about queries: exact CSPRNG integer samplers
(:mod:`~dpsql.noise.samplers`), noise calibration and release (:mod:`~dpsql.noise.mechanisms`) and the
exponential mechanism / report-noisy-max over public grids (:mod:`~dpsql.noise.exponential`).

Nothing here imports a plan, a policy or SQL: a privacy argument about noise can be checked
against these modules alone (they import only :mod:`dpsql.accountant`).
"""
