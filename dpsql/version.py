"""The installed package's version, from one source: its metadata (pyproject.toml)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dpsql")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
