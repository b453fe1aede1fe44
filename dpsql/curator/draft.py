"""``dpsql policy draft``: a starting policy written from a table's schema, for the curator to finish.

The draft is written from the schema (names, types) plus, per text column, whether it holds at most
:data:`MAX_DOMAIN` distinct values — in which case those values are proposed as a ``domain``,
*marked for review* in a comment. Listing stored values is acceptable because the curator owns the
data and the file is theirs; but a domain is published to every analyst (GROUP BY releases exactly
its keys), so a rare value (one person's diagnosis) must not stay in it unless it is public knowledge.
Nothing else is read: no counts, no minima or maxima. Bounds are left as ``TODO`` comments, since a
bound read from the data would itself reveal the most extreme person's value.

Identifier-looking columns (``id``, ``*_id``, names, e-mails, …) are proposed ``identifier: true``.
The draft loads as it is (``dpsql policy check`` passes once the TODOs are decided).
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import yaml

from dpsql.backends import quote_ident

from . import introspect

#: Text columns with at most this many distinct values get a proposed domain (for review).
MAX_DOMAIN = 20

_IDENTIFIER = re.compile(
    r"^(id|uuid|guid|ssn|email|e_mail|phone|telephone|mobile|name|first_?name|last_?name|surname|full_?name|"
    r"address|street|ip|ip_address|passport|iban|account)$|_id$|_uuid$|_email$|_phone$|_ssn$",
    re.IGNORECASE,
)


def looks_like_identifier(column: str) -> bool:
    return bool(_IDENTIFIER.search(column))


def _scalar(value: Any) -> str:
    """One YAML flow scalar (quoted when YAML would read it as something else)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _domain(backend: Any, table: str, column: str) -> list[Any] | None:
    """The column's stored values when there are at most MAX_DOMAIN of them (NULL excluded)."""
    col, src = quote_ident(column), quote_ident(table)
    _, rows = backend.execute(
        f"SELECT DISTINCT {col} FROM {src} WHERE {col} IS NOT NULL ORDER BY 1 LIMIT {MAX_DOMAIN + 1}"
    )
    if len(rows) > MAX_DOMAIN or not rows:
        return None
    return [r[0] for r in rows]


def _column_lines(backend: Any, table: str, column: str, stored: str) -> list[str]:
    type_name = introspect.family(stored)
    policy_type = type_name if type_name != "other" else "text"
    key = _scalar(column)
    if looks_like_identifier(column):
        return [f"      {key}: {{type: {policy_type}, identifier: true}}   # looks like an identifier: never queryable"]
    if type_name == "other":
        return [f"      {key}: {{type: text}}   # TODO: stored as {stored}; check the type, or remove the column"]
    if type_name in ("int", "float", "date", "timestamp"):
        example = {"int": "0, upper: 100", "float": "0.0, upper: 100.0"}.get(type_name, "2000-01-01, upper: 2030-12-31")
        return [
            f"      {key}: {{type: {policy_type}}}",
            f"        # TODO bounds: e.g. {{type: {policy_type}, lower: {example}}} — from domain knowledge, not",
            "        # from the data's min/max (those are someone's exact values); SUM/AVG/quantiles need them",
        ]
    if type_name == "text":
        values = _domain(backend, table, column)
        if values is not None:
            listed = ", ".join(_scalar(v) for v in values)
            return [
                "      # REVIEW domain: these are the values stored today (read by `dpsql policy draft`). A domain is",
                "      # published: GROUP BY releases exactly these keys to every analyst, so keep only values that",
                "      # are public knowledge (drop a rare one held by a single person), and add any that are missing.",
                f"      {key}: {{type: text, domain: [{listed}]}}",
            ]
        return [f"      {key}: {{type: text}}   # many values: GROUP BY on it goes through DP partition selection"]
    return [f"      {key}: {{type: {policy_type}}}"]


def draft_policy(backend: Any, tables: list[str], dataset: str) -> str:
    """The draft policy YAML for ``tables`` of ``backend`` (each must exist)."""
    today = dt.date.today().isoformat()
    out = [
        f"# Drafted by `dpsql policy draft` on {today}: review every line before serving it.",
        "# Check it with: dpsql policy check --policy <this file> --database <url>",
        f"dataset: {_scalar(dataset)}",
        "",
        "defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}",
        "",
        "budget:",
        "  # TODO: the total privacy loss you accept, for all analysts together and for each",
        "  dataset: {epsilon: 10.0, delta: 1.0e-5}",
        "  analyst: {epsilon: 5.0, delta: 1.0e-6}",
        "",
        "auth: {trust: false}",
        "analysts:",
        "  - name: analyst",
        "    # password: a SCRAM-SHA-256 verifier from `dpsql passwd` (never plaintext)",
        "",
        "tables:",
    ]
    for table in tables:
        stored = introspect.columns(backend, table)
        if stored is None:
            from dpsql.errors import UndefinedTable

            raise UndefinedTable(f'relation "{table}" does not exist')
        name = table.split(".")[-1].lower()
        out.append(f"  {_scalar(name)}:")
        if name != table:
            out.append(f"    source: {_scalar(table)}")
        units = [c for c in stored if c.lower().endswith("_id")]
        hint = f" (one of: {', '.join(units)}?)" if units else ""
        out += [
            "    # TODO privacy_unit: the identifier column naming the person each row belongs to" + hint + ";",
            "    # null means one row per person. With several rows per person set max_rows_per_unit too.",
            "    privacy_unit: null",
            "    max_rows_per_unit: 1",
            "    columns:",
        ]
        for column, type_name in stored.items():
            out += _column_lines(backend, table, column, type_name)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
