"""What the ``dpsql`` commands share without opening an engine: the ``--policy`` curator commands require,
who acts, and psql-style tables and JSON numbers. Light on purpose (issue #37): ``dpsql budget`` and
``dpsql audit`` import this, not :mod:`dpsql.commands`, which loads the whole pipeline."""

from __future__ import annotations

import argparse
import getpass
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def require_policy(args: argparse.Namespace, command: str) -> Path | None:
    """The ``--policy`` a curator command acts on; None (after saying so) when it was not given.

    Curator commands never fall back to the demo's policy: a grant, a check or a cache clear
    silently applied to the demo dataset instead of the curator's own would mislead exactly when
    it matters. ``dpsql serve``/``query`` keep the demo default (the README's first command)."""
    policy = getattr(args, "policy", None)
    if policy:
        return Path(policy)
    why = "curator commands act on the dataset a policy names"
    print(f"ERROR:  dpsql {command} needs --policy: {why}", file=sys.stderr)
    print("HINT:  For the demo, give --policy schemas/health.yaml.", file=sys.stderr)
    return None


def os_user() -> str:
    """Who a curator's action is recorded as by default (``--by`` overrides it)."""
    try:
        return getpass.getuser()
    except Exception:  # no login name (containers): still record something
        return "unknown"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """psql-style aligned table."""
    cells = [[("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [" " + " | ".join(c.center(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("-" + "-+-".join("-" * w for w in widths) + "-")
    lines += [" " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def json_default(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def json_number(value: object) -> object:
    """A corrupt total reads as inf: null in JSON (Infinity is not JSON)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
