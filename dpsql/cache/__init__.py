"""Result cache: an exactly repeated query returns the answer already released, at no cost.

Releasing the same noisy answer again is post-processing, so it costs no privacy; asking
again and getting *fresh* noise would cost ε again and let repeats be averaged. The key is
the normalised statement (sqlglot's canonical SQL, so whitespace, keyword case and
unquoted identifier case don't matter) with its bound parameters, the dataset, the
session's (ε, δ, mechanism) and its confidence level (``SET dpsql.confidence``: the stored
intervals, ``<name>_ci95`` columns and accuracy notes are computed at it). Every other ``dpsql.*``
setting is either in the key or only shapes the wire output from the stored result (``show_intervals``).

Beside each answer the released *measurements* are stored (noisy keys and measures before the output
post-processing) under :func:`stored_measurement_key`: a rephrasing that measures the same thing the
same way (another LIMIT, ORDER BY, HAVING, aliases or confidence level) is finished again from them
for free (:mod:`dpsql.step`, "Measurement reuse"). A rephrasing that measures something else (another
filter, another ε) has another measurement key and is charged normally.
Entries are shared by all analysts of a dataset (an answer one analyst paid for is public
to the others at no extra privacy cost). A SQLite file makes the cache survive restarts; a
PostgreSQL table (``ResultCache.open("postgresql://…")``, the default next to a PostgreSQL ledger)
shares it between every ``dpsql serve`` process of an installation, so an exact repeat answered by
one process is a free hit on all the others.

Concurrency: an entry is one row written by one ``INSERT … ON CONFLICT DO NOTHING`` in its own
transaction, so a reader sees either no entry or the whole entry, never a half-written one, and the
first writer's answer is the one every later reader gets. Two processes that miss the same key at the
same moment both compute it and both are charged (each reservation is exact in the ledger); the
second answer is then dropped in favour of the first. That costs budget, never privacy. An entry that
fails verification (see "entries as signed data" below) is a miss, and the fresh answer replaces exactly
the bad bytes that were read (a conditional UPDATE), so a concurrent valid entry is never overwritten.

The engine stores each result under :func:`result_key`: the query's key together with the
database's identity, its data version and a hash of the policy's content, so an answer
computed on another database (another file or server at the same URL), before a write, or
under a different policy is never served.

The package: :mod:`.codec` (an entry as signed, typed JSON data: what is stored and how it is read
back), :mod:`.keys` (what an entry is stored under: the query's and the measurement's keys, the database
identity and its data stamp, the policy hash) and :mod:`.stores` (the SQLite and PostgreSQL tables; the
PostgreSQL one holds one connection per thread in the ledger's holder,
:class:`dpsql.ledger.connections.ThreadConnections`).
"""

from __future__ import annotations

from dpsql.cache.codec import (
    ENTRY_TAG,
    MEASUREMENT_TAG,
    RESULT_FIELDS,
    UNSTORED_FIELDS,
    UnusableEntry,
    dump_result,
    load_result,
    measurement_result,
    measurements,
    result_cache_key,
    seal,
    unseal,
)
from dpsql.cache.keys import (
    UNSEEN_WRITES_WINDOW,
    cache_key,
    data_stamp,
    database_identity,
    measurement_key,
    policy_hash,
    result_key,
    stored_measurement_key,
)
from dpsql.cache.stores import MAX_ENTRY_BYTES, PostgresResultCache, ResultCache, default_cache_url

__all__ = [
    "ENTRY_TAG",
    "MAX_ENTRY_BYTES",
    "MEASUREMENT_TAG",
    "RESULT_FIELDS",
    "UNSEEN_WRITES_WINDOW",
    "UNSTORED_FIELDS",
    "PostgresResultCache",
    "ResultCache",
    "UnusableEntry",
    "cache_key",
    "data_stamp",
    "database_identity",
    "default_cache_url",
    "dump_result",
    "load_result",
    "measurement_key",
    "measurement_result",
    "measurements",
    "policy_hash",
    "result_cache_key",
    "result_key",
    "seal",
    "stored_measurement_key",
    "unseal",
]
