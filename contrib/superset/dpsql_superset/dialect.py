"""SQLAlchemy dialect ``dpsql``: PostgreSQL's psycopg2 dialect under a name of its own.

dpsql speaks PostgreSQL's wire protocol, so psycopg2 and SQLAlchemy's PostgreSQL dialect work
unchanged. The dialect exists only so that a URI can *say* it points at dpsql
(``dpsql://analyst:pw@host:6543/dataset``): Superset picks its engine spec from the URI's backend
name, and ``postgresql://`` must keep meaning plain PostgreSQL (Superset's ``PostgresEngineSpec``).

One convenience on top: ``?epsilon=0.5`` (and ``?delta=1e-7``, ``?accuracy=10`` for accuracy-first,
``?max_widening=2``, ``?max_share=0.25``, ``?confirm_epsilon=3``) in the URI become the startup option
``-c dpsql.epsilon=0.5``, the per-connection setting that docs/bi.md otherwise spells as
``?options=-c%20dpsql.epsilon%3D0.5``. The value is parsed as a finite positive number here, so it
cannot smuggle further ``-c`` settings into the startup packet; dpsql validates its range itself.
The same holds for the display switches ``?show_intervals=on`` (a ``<col>_ci95`` column after each
noisy column: Superset drops NOTICEs, so this is how a chart or SQL Lab shows the accuracy),
``?round=off`` and ``?trim_time=on``: each must be one of on/off/true/false/1/0 and is sent as
``-c dpsql.<name>=on|off``.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.engine.url import URL

#: URI query parameters turned into dpsql session settings at connection start: numbers …
SETTINGS = {name: f"dpsql.{name}" for name in ("epsilon", "delta", "accuracy", "max_widening", "max_share")}
SETTINGS["confirm_epsilon"] = "dpsql.confirm_epsilon"
#: … and on/off switches (how results are shown; none changes what is charged).
SWITCHES = {"show_intervals": "dpsql.show_intervals", "round": "dpsql.round", "trim_time": "dpsql.trim_time"}
_ON, _OFF = {"on", "true", "1", "yes"}, {"off", "false", "0", "no"}


def _number(name: str, raw: Any) -> str:
    """A finite positive number as text, or ValueError (no spaces, no further options)."""
    text = raw[-1] if isinstance(raw, (list, tuple)) else raw
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"dpsql URI parameter {name}={text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"dpsql URI parameter {name}={text!r} must be a finite number > 0")
    return repr(value)


def _switch(name: str, raw: Any) -> str:
    """``on`` or ``off``, or ValueError (a fixed word: nothing else reaches the startup packet)."""
    text = raw[-1] if isinstance(raw, (list, tuple)) else raw
    word = str(text).strip().lower()
    if word in _ON:
        return "on"
    if word in _OFF:
        return "off"
    raise ValueError(f"dpsql URI parameter {name}={text!r} must be on or off")


class DpsqlDialect(PGDialect_psycopg2):
    """psycopg2 to ``dpsql serve``; ``name`` is what Superset matches ``DpsqlEngineSpec.engine`` on."""

    name = "dpsql"
    supports_statement_cache = True

    def create_connect_args(self, url: URL) -> tuple[list[Any], dict[str, Any]]:
        wanted = {SETTINGS[key]: _number(key, url.query[key]) for key in SETTINGS if key in url.query}
        wanted |= {SWITCHES[key]: _switch(key, url.query[key]) for key in SWITCHES if key in url.query}
        args, kwargs = super().create_connect_args(url.difference_update_query([*SETTINGS, *SWITCHES]))
        if wanted:
            extra = " ".join(f"-c {name}={value}" for name, value in wanted.items())
            kwargs["options"] = f"{kwargs['options']} {extra}" if kwargs.get("options") else extra
        return args, kwargs
