"""The installed package's version, from one source: its metadata (pyproject.toml).

Read from the first ``dpsql`` distribution's metadata file on ``sys.path`` (the order
:mod:`importlib.metadata` searches), without importing :mod:`importlib.metadata` (~0.1 s of
``email``, ``zipfile`` and friends at every ``dpsql`` command's start; issue #37); that module answers
when no plain file is found (a zipped or otherwise unusual install).
"""

from __future__ import annotations

import os
import sys

_SUFFIXES = (".dist-info", ".egg-info")


def _from_files() -> str | None:
    """``Version:`` of the first ``dpsql`` ``*.dist-info/METADATA`` or ``*.egg-info/PKG-INFO`` on the path."""
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            stem, _, suffix = name.rpartition(".")
            if "." + suffix not in _SUFFIXES or stem.split("-")[0].lower() != "dpsql":
                continue
            meta = os.path.join(entry or ".", name, "METADATA" if suffix == "dist-info" else "PKG-INFO")
            try:
                with open(meta, encoding="utf-8") as handle:
                    for line in handle:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():
                            break  # the headers end
            except OSError:
                continue
    return None


_found = _from_files()
if _found is None:  # the rare fallback
    from importlib.metadata import PackageNotFoundError, version

    try:
        _found = version("dpsql")
    except PackageNotFoundError:  # running from a source tree that was never installed
        _found = "0.0.0+unknown"
__version__: str = _found

#: The port ``dpsql serve`` listens on unless told otherwise (PostgreSQL's 5432 is left alone). Here, at the
#: base, so the curator's ``dpsql reload`` finds a server's pid file without importing the server.
DEFAULT_PORT = 6543
