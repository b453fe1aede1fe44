"""IN lists shrunk right after parsing, before any copy of the tree: duplicates, and values outside a
column's public domain.

A 168 kB ``department IN (…12,000 constants…)`` cost about a second on every free path (EXPLAIN, a
``LIMIT 0`` probe, a synopsis answer), most of it copying and rendering the tree (issue #41 item 4). What
such a list selects is decided by far fewer values:

* a constant listed twice selects nothing more (``1`` and ``1.0`` are one number, ``'a'`` twice one text);
* over a text column whose every declaration in the policy has a public domain, a value outside that
  domain selects no row the policy describes: the list keeps the domain's values it names and, so that
  ``NOT IN`` and an all-outside list keep their meaning, the first value it names outside the domain.

So the statement is analysed, priced and answered as if it listed those only; on data inside the declared
domains it selects the same rows (a domain is what the policy says a column holds: ``dpsql policy check``
reports values outside it, and GROUP BY never releases one). Anything but a plain constant (a cast, a
parameter, a column, a sub-query) is kept as written, so every refusal the analysis would give is still
given. Reads the SQL and the policy only.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from sqlglot import exp

from dpsql.policy import Policy


def _domains(policy: Policy, column: exp.Column) -> frozenset[str] | None:
    """The union of the text domains of every policy column ``column`` may name (None: some has none)."""
    identifier = column.this
    if not isinstance(identifier, exp.Identifier):
        return None
    name = identifier.name
    quoted = bool(identifier.args.get("quoted"))
    found: set[str] = set()
    any_match = False
    for table in policy.tables.values():
        for declared, spec in table.columns.items():
            if declared != name and (quoted or declared.lower() != name.lower()):
                continue
            any_match = True
            values = spec.domain if isinstance(spec.domain, tuple) else None
            if spec.type != "text" or not values:
                return None
            found.update(str(v) for v in values)
    return frozenset(found) if any_match else None


def _constant_key(node: exp.Expression) -> tuple[str, object] | None:
    """What a plain constant compares as (None: not a plain constant; kept as written)."""
    if not isinstance(node, exp.Literal):
        return None
    if node.is_string:
        return ("text", node.this)
    try:
        return ("number", Decimal(node.this))
    except (InvalidOperation, ValueError):
        return None


def _shrunk(values: list[exp.Expression], domain: frozenset[str] | None) -> list[exp.Expression]:
    kept: list[exp.Expression] = []
    seen: set[tuple[str, object]] = set()
    outside = False
    for value in values:
        key = _constant_key(value)
        if key is None:
            kept.append(value)
            continue
        if key in seen:
            continue
        if domain is not None and key[0] == "text" and key[1] not in domain:
            if outside:
                continue  # one value outside the domain stands for all of them
            outside = True
        seen.add(key)
        kept.append(value)
    return kept


def shrink_in_lists(tree: exp.Expression, policy: Policy) -> None:
    """Shrink every constant IN list of ``tree`` in place (see the module docstring)."""
    for node in list(tree.find_all(exp.In)):
        values = node.expressions
        if len(values) < 2 or node.args.get("query") is not None:
            continue
        domain = _domains(policy, node.this) if isinstance(node.this, exp.Column) else None
        kept = _shrunk(values, domain)
        if len(kept) < len(values):
            node.set("expressions", kept)
