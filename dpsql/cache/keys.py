"""What a result cache entry is stored under: the query's key (:func:`cache_key`), its measurement's
(:func:`measurement_key`), and the database, data version and policy they were released on
(:func:`result_key`, :func:`stored_measurement_key`): an answer is never served for another database,
other data, another policy or another confidence level."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from dpsql.backends import Backend


def cache_key(dataset: str, normalised_sql: str, params: Any, settings: tuple[Any, ...]) -> str:
    material = "\x1f".join([dataset, normalised_sql, repr(params), repr(settings)])
    return hashlib.sha256(material.encode()).hexdigest()


def measurement_key(dataset: str, measurement_sql: str, histograms: Any, params: Any, plan: Any, budgeting: Any) -> str:
    """The key of a query's *measurement*, whatever its output post-processing (see :mod:`dpsql.step`):
    the rewritten DP query as rendered (table, filters, keys, bounds, clamps, the salted physical
    choices), its histogram queries, its bound parameters, what the plan measures (``plan``: the keys
    with their domains, the measures with their bounds, quantiles and candidates, the selection count)
    and the budgeting (ε, δ, mechanism, every noise spec and share, the selection threshold): everything
    that sets the distribution of the released measurements. Output expressions, aliases, HAVING,
    ORDER BY and LIMIT/OFFSET are not in it: they are applied after the noise, never in the SQL."""
    parts = [dataset, measurement_sql, repr(histograms), repr(params), repr(plan), repr(budgeting)]
    material = "\x1f".join(["measurement", *parts])
    return hashlib.sha256(material.encode()).hexdigest()


def stored_measurement_key(measurement: str, database: str, data_stamp: str, policy_hash: str) -> str:
    """The stored key of released measurements: the measurement's key on this database, at this data
    version, under this policy (the rules of :func:`result_key`). No confidence level: the intervals
    are recomputed from the noise specs at the asking query's level. Domain-separated from result keys."""
    material = "\x1f".join(["released measurements", measurement, database, data_stamp, policy_hash])
    return hashlib.sha256(material.encode()).hexdigest()


def result_key(query_key: str, database: str, data_stamp: str, policy_hash: str, confidence: float) -> str:
    """The stored key of a released result: the query's key, on this database, at this data version,
    under this policy, at this confidence level. An answer is never served for another database, other
    data or another policy, nor with intervals computed at another confidence."""
    material = "\x1f".join([query_key, database, data_stamp, policy_hash, repr(float(confidence))])
    return hashlib.sha256(material.encode()).hexdigest()


def policy_hash(policy: Any) -> str:
    """The policy's content (every field: bounds, budgets, analysts, units), hashed."""
    return hashlib.sha256(policy.model_dump_json().encode()).hexdigest()


def database_identity(backend: Backend) -> str:
    """Which database a backend reads, as stable as it can be told apart cheaply (:meth:`Backend.identity`:
    a DuckDB file's resolved path, a PostgreSQL cluster and database; otherwise a token per backend
    object, so nothing is shared across processes)."""
    return backend.identity()


#: How long an answer is served for a backend whose stamp cannot see writes made outside dpsql
#: (``sees_outside_writes = False``: Spark), in seconds. The stamp then also names the current window,
#: so a repeat in the next window misses and is charged again: a stale answer is bounded in age,
#: never served indefinitely.
UNSEEN_WRITES_WINDOW = 60


def data_stamp(backend: Backend) -> str:
    """A stamp that changes whenever the data may have (:meth:`Backend.data_stamp`): the backend's write
    counter, plus for a DuckDB file its size and modification time (and its WAL's), for PostgreSQL the
    next transaction id. For a backend that cannot see outside writes, also the current time window."""
    stamp = backend.data_stamp()
    if not backend.sees_outside_writes:
        stamp += f":w{int(time.time() // UNSEEN_WRITES_WINDOW)}"
    return stamp
