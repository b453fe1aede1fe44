"""Result cache: an exactly repeated query returns the answer already released, at no cost.

The privacy argument and design notes: docs/internals.md, section dpsql/cache/__init__.py.
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
