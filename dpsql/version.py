"""The installed package's version, from one source: its metadata (pyproject.toml); and the port it serves on."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dpsql")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

#: The port ``dpsql serve`` listens on unless told otherwise (PostgreSQL's 5432 is left alone). Here, at the
#: base, so the curator's ``dpsql reload`` finds a server's pid file without importing the server.
DEFAULT_PORT = 6543
