"""The keys a unit chain relies on are unique, or no query reads through them.

A row two hops from its person (a transaction → its account → its customer) belongs to whoever owns
the row its key names. That is one person only while the key is unique: were ``accounts.account_id``
to repeat, a transaction would join every account holding that id and count for each owner, and one
person's rows (an account with someone else's id) could move other people's answers, however many.
The policy says the key is one (``references.to``, like SQL's foreign keys), ``dpsql policy check``
verifies it, and a database with a PRIMARY KEY or UNIQUE constraint on it enforces it. Where nothing
enforces it (a DuckDB file or a CSV load without constraints), it is checked again here once per data
stamp before any query through the chain is charged, and a repeat refuses the query (23505): outside
a valid database the guarantee would not hold, so no answer is given. The check reads one aggregate
of the referenced table; its outcome is the key's uniqueness, the constraint the policy declares.
"""

from __future__ import annotations

import threading

from dpsql.backends import Backend, quote_ident
from dpsql.errors import UniqueViolation
from dpsql.plan import Plan
from dpsql.policy import Policy


def chain_keys(plan: Plan) -> set[tuple[str, str]]:
    """(policy table, key column) of every hop the plan's sources reach their person through."""
    keys: set[tuple[str, str]] = set()
    for source in plan.sources.sources:
        for inner in (*source.inner, source):
            if inner.path is not None:
                keys.update((hop.target, hop.to) for hop in inner.path.hops)
    return keys


class KeyGuard:
    """Per backend: which chain keys the database enforces (read once), which were seen unique (per
    data stamp), and the refusal when one repeats."""

    def __init__(self, policy: Policy, backend: Backend) -> None:
        self._policy = policy
        self._backend = backend
        self._enforced: dict[str, set[str]] | None = None
        self._seen: dict[tuple[str, str], str] = {}  # key → the stamp it was last seen unique at
        self._lock = threading.Lock()

    def check(self, plan: Plan, stamp: str) -> None:
        """Refuse (23505) a query reading through a chain key that repeats on the data at ``stamp``."""
        for table, column in sorted(chain_keys(plan)):
            if self._seen.get((table, column)) == stamp or column in self._enforced_on(table):
                continue
            source = self._policy.tables[table].source or table
            col = quote_ident(column)
            _, rows = self._backend.execute(f"SELECT COUNT({col}) = COUNT(DISTINCT {col}) FROM {quote_ident(source)}")
            if not rows or not rows[0][0]:
                raise UniqueViolation(
                    f'key "{table}.{column}" repeats: rows that reach their person through it would belong to '
                    "several people",
                    hint="A references.to column must be the referenced table's key; fix the data or the policy "
                    "(dpsql policy check names the column).",
                )
            with self._lock:
                self._seen[(table, column)] = stamp

    def _enforced_on(self, table: str) -> set[str]:
        """Single-column keys the database itself keeps unique on ``table`` (PRIMARY KEY, UNIQUE)."""
        with self._lock:
            if self._enforced is None:
                self._enforced = _unique_constraints(self._backend)
            source = (self._policy.tables[table].source or table).lower()
            return self._enforced.get(source, set())


def _unique_constraints(backend: Backend) -> dict[str, set[str]]:
    if not backend.information_schema:
        return {}
    try:
        _, rows = backend.execute(
            "SELECT k.table_name, MIN(k.column_name), COUNT(*) FROM information_schema.table_constraints c "
            "JOIN information_schema.key_column_usage k ON k.constraint_name = c.constraint_name "
            "AND k.constraint_schema = c.constraint_schema AND k.table_name = c.table_name "
            "WHERE c.constraint_type IN ('PRIMARY KEY', 'UNIQUE') AND c.table_schema = current_schema() "
            "GROUP BY k.table_name, c.constraint_name"
        )
    except Exception:  # no catalog to read: every key is checked on the data instead
        return {}
    enforced: dict[str, set[str]] = {}
    for table, column, width in rows:
        if int(width) == 1:
            enforced.setdefault(str(table).lower(), set()).add(str(column))
    return enforced
