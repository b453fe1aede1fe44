"""The dashboard's HTTP server: standard library only (``http.server``), one thread per request.

Security posture (an analyst may reach the port; only the curator has the password):

* Every path but ``/login`` needs a session: a page without one is redirected to ``/login`` (303),
  anything else (assets, POSTs, unknown paths) gets 401 with an empty body — routes are not even
  told apart before login.
* Static files come from a fixed allow-list read into memory at start (no path is ever joined
  with a request's text: no traversal).
* Every POST needs its CSRF token, and a foreign ``Origin`` is refused (403); cookies are
  ``HttpOnly; SameSite=Strict`` (``Secure`` under TLS). Responses forbid framing, sniffing,
  caching and cross-site referrers; the CSP allows no script at all.
* Bound to 127.0.0.1 unless ``--host`` says otherwise (``dpsql dashboard`` warns when it listens
  beyond loopback without TLS); TLS with ``--tls-cert/--tls-key`` (the handshake runs in the
  request's thread).
* The ``Host`` header must name this server: an IP literal, ``localhost``, the ``--host`` name or an
  ``--allowed-host``; any other name is 421 (a DNS-rebinding page reaches the port under its own
  name, so it never gets past this), a missing one 400.
* Slow clients cannot hold the door: a connection must deliver its whole request (TLS handshake,
  headers and body) within :data:`REQUEST_DEADLINE_S` or a reaper shuts it; one address holds at
  most :data:`MAX_CONNECTIONS_PER_ADDRESS` connections; when all :data:`MAX_CONNECTIONS` are taken
  a new connection evicts the one that has been sending its request the longest (a trickler), so
  32 trickling sockets delay the curator by a moment, not for minutes.
* It opens the ledger, never the data. It writes only the curator's levers (the same append-only
  rows as ``dpsql budget grant|freeze|unfreeze``, through :func:`dpsql.curator.lever_checks.apply_lever`).
* Request lines are logged without their query string; no cookie, token or password is logged.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import logging
import secrets
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from dpsql.dashboard import pages, views
from dpsql.dashboard.auth import DEVICE_TTL_S, Curator, SlowedDown, client_key, tokens_equal
from dpsql.errors import (
    ConfigurationLimitExceeded,
    Error,
    InsufficientPrivilege,
    InternalError,
    InvalidPassword,
)
from dpsql.ledger import Ledger
from dpsql.policy import Policy

log = logging.getLogger("dpsql.dashboard")

SESSION_COOKIE = "dpsql_session"
LOGIN_COOKIE = "dpsql_login"
DEVICE_COOKIE = "dpsql_device"
MAX_BODY = 64 * 1024
#: Connections served at once (one thread each); beyond that a new connection evicts a slow sender or
#: is closed, so a client opening idle sockets cannot grow the process without bound.
MAX_CONNECTIONS = 32
#: Connections one client address (an IPv6 /64) may have open at once; more are closed at once.
MAX_CONNECTIONS_PER_ADDRESS = 8
#: Whole time a connection has to send its request (TLS handshake, request line, headers, body).
REQUEST_DEADLINE_S = 10.0
#: A connection still sending its request after this long may be evicted when every slot is taken.
EVICT_AFTER_S = 2.0
#: Host names always served (with any IP literal); ``--host`` and ``--allowed-host`` add more.
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
#: Static assets, by URL: the only files ever served (read at start).
STATIC = {"/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
LOGIN_STYLE = (
    "body{font-family:system-ui,sans-serif;background:#1f2d3d;color:#222}"
    "main.login{max-width:340px;margin:80px auto;background:#fff;padding:24px;border-radius:6px}"
    "label,input,button{display:block;width:100%;margin:6px 0}"
    ".error{background:#fdd;border:1px solid #c66;padding:8px}"
)
PAGES = (("/", "Analysts"), ("/spend", "Spend over time"), ("/audit", "Audit trail"), ("/policy", "Policy"))


def _csp() -> str:
    digest = base64.b64encode(hashlib.sha256(LOGIN_STYLE.encode()).digest()).decode()
    return (
        f"default-src 'none'; style-src 'self' 'sha256-{digest}'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    )


class Dashboard:
    """What the handlers share: the policy, the ledger (behind one lock) and the curator's sessions."""

    def __init__(
        self,
        policy: Policy,
        ledger: Ledger,
        curator: Curator,
        *,
        by: str,
        tls: bool,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self.policy = policy
        self.ledger = ledger
        self.curator = curator
        self.by = by
        self.tls = tls
        #: Host names (besides IP literals and :data:`LOCAL_NAMES`) the Host header may carry.
        self.allowed_hosts = frozenset(_host_name(h) for h in allowed_hosts)
        self.lock = threading.Lock()
        self.csp = _csp()
        root = resources.files("dpsql.dashboard").joinpath("static")
        self.static = {url: (root.joinpath(name).read_bytes(), ctype) for url, (name, ctype) in STATIC.items()}
        self.page = views.template("page.html")
        self.login_page = views.template("login.html")


@dataclass
class _Connection:
    """A connection while it is still sending its request: the reaper's and the evictor's view."""

    sock: socket.socket
    address: str
    started: float
    deadline: float


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True
    # The port is this process's alone: no SO_REUSEADDR takeover of a live dashboard's port.
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], app: Dashboard, tls: ssl.SSLContext | None) -> None:
        self.app = app
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._guard = threading.Lock()
        self._per_address: dict[str, int] = {}
        self._reading: dict[int, _Connection] = {}  # by id of the accepted socket
        self._local = threading.local()
        self._stopping = threading.Event()
        super().__init__(address, Handler)
        if address[0] and not _is_ip(address[0]):  # listening on a name: that name is served
            app.allowed_hosts = app.allowed_hosts | {_host_name(address[0])}
        threading.Thread(target=self._reap, name="dpsql-dashboard-reaper", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, within the per-address and total caps (see the module's docstring)."""
        key = client_key(str(client_address[0]))
        now = time.monotonic()
        with self._guard:
            full = self._per_address.get(key, 0) >= MAX_CONNECTIONS_PER_ADDRESS
            if not full:
                self._per_address[key] = self._per_address.get(key, 0) + 1
                self._reading[id(request)] = _Connection(request, key, now, now + REQUEST_DEADLINE_S)
        if full:
            log.warning("dashboard: %s has %d connections open, closing a new one", key, MAX_CONNECTIONS_PER_ADDRESS)
            self.shutdown_request(request)
            return
        if not self.slots.acquire(blocking=False):
            evicted = self._evict_slowest(now)
            if evicted is None or not self.slots.acquire(timeout=2.0):
                log.warning("dashboard: %d connections open, closing a new one from %s", MAX_CONNECTIONS, key)
                self._forget(request, key)
                self.shutdown_request(request)
                return
        super().process_request(request, client_address)

    def _evict_slowest(self, now: float) -> _Connection | None:
        """Shut the connection that has been sending its request the longest (past :data:`EVICT_AFTER_S`)."""
        with self._guard:
            slow = [c for c in self._reading.values() if c.started < now - EVICT_AFTER_S]
            victim = min(slow, key=lambda c: c.started, default=None)
            if victim is not None:
                victim.deadline = 0.0
        if victim is not None:
            log.warning("dashboard: every slot taken, evicting a slow request from %s", victim.address)
            _shut(victim.sock)
        return victim

    def _reap(self) -> None:
        """Shut every connection past its request deadline (a trickle of bytes does not extend it)."""
        while not self._stopping.wait(0.25):
            now = time.monotonic()
            with self._guard:
                late = [c for c in self._reading.values() if c.deadline <= now]
            for conn in late:
                _shut(conn.sock)

    def request_read(self) -> None:
        """The handler has the whole request: its connection is no longer subject to the read deadline."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with self._guard:
                self._reading.pop(conn, None)

    def _forget(self, request: Any, key: str) -> None:
        with self._guard:
            self._reading.pop(id(request), None)
            left = self._per_address.get(key, 1) - 1
            if left > 0:
                self._per_address[key] = left
            else:
                self._per_address.pop(key, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self._local.conn = id(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request, client_key(str(client_address[0])))
            self.slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request.settimeout(Handler.timeout)
            try:
                wrapped = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
            with self._guard:
                conn = self._reading.get(id(request))
                if conn is not None:
                    conn.sock = wrapped  # the reaper shuts the TLS socket from now on
            request = wrapped
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection the reaper or the evictor shut, or one the client dropped: a log line, no traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("dashboard: connection from %s ended: %s", client_address[0], error)
            return
        log.exception("dashboard: unexpected error serving %s", client_address[0])

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()


def _shut(sock: socket.socket) -> None:
    """Shut a socket another thread is blocked on (its read returns at once); the base class's
    shutdown, so a TLS socket's state is left to its own thread."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def _host_name(host: str) -> str:
    """A Host header's (or ``--host``'s) name: without port or brackets, lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header names this server (see the module's docstring)."""
    if not header:
        return False
    name = _host_name(header)
    return _is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost") or name in allowed


def insecure_listen_warning(host: str, tls: bool) -> str | None:
    """The warning for a dashboard listening beyond this machine without TLS, else None."""
    if tls:
        return None
    name = _host_name(host)
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:
        if name in LOCAL_NAMES:
            return None
    return (
        f"the dashboard listens on {host} without TLS: the curator's password and session cookie cross "
        "the network in clear text. Give --tls-cert/--tls-key, or listen on 127.0.0.1 (the default) "
        "and reach it through an SSH tunnel."
    )


class Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "dpsql-dashboard"
    sys_version = ""
    timeout = 30

    # -- plumbing -------------------------------------------------------------------------------

    @property
    def app(self) -> Dashboard:
        return self.server.app

    def log_message(self, format: str, *args: Any) -> None:  # no query strings, cookies or bodies
        log.info("%s %s %s", self.client_address[0], self.command, urllib.parse.urlsplit(self.path).path)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log.info("%s %s %s %s", self.client_address[0], self.command, urllib.parse.urlsplit(self.path).path, code)

    def _cookies(self) -> SimpleCookie:
        cookies: SimpleCookie = SimpleCookie()
        with contextlib.suppress(CookieError):  # a malformed header is no session
            cookies.load(self.headers.get("Cookie", ""))
        return cookies

    def _cookie(self, name: str) -> str | None:
        morsel = self._cookies().get(name)
        return morsel.value if morsel is not None else None

    def _set_cookie(self, name: str, value: str, max_age: int | None = None) -> str:
        parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
        if max_age is not None:
            parts.append(f"Max-Age={max_age}")
        if self.app.tls:
            parts.append("Secure")
        return "; ".join(parts)

    def _send(
        self,
        status: int,
        body: bytes = b"",
        ctype: str = "text/html; charset=utf-8",
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", self.app.csp)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "same-origin")  # "no-referrer" makes browsers send Origin: null
        self.send_header("Cache-Control", "no-store")
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _redirect(self, where: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send(HTTPStatus.SEE_OTHER, headers=(("Location", where), *headers))

    def _form(self) -> dict[str, str] | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            return None
        raw = self.rfile.read(length).decode("utf-8", "replace")
        self.server.request_read()
        return {k: v[-1] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}

    def _same_origin(self) -> bool:
        """No ``Origin`` (not a browser's cross-site request) or this very host; ``null`` is foreign."""
        origin = self.headers.get("Origin")
        if origin is None:
            return True
        return urllib.parse.urlsplit(origin).netloc == self.headers.get("Host", "")

    # -- routing --------------------------------------------------------------------------------

    def parse_request(self) -> bool:
        """The request line and headers are read: check the Host header before any route (421/400)."""
        if not super().parse_request():
            return False
        host = self.headers.get("Host")
        if not host_allowed(host, self.app.allowed_hosts):
            status = HTTPStatus.BAD_REQUEST if not host else HTTPStatus.MISDIRECTED_REQUEST
            shown = (host or "")[:100].encode("ascii", "backslashreplace").decode("ascii")
            message = f'ERROR: 42501: host "{shown}" is not served here' if host else "ERROR: 08P01: no Host header"
            hint = "HINT: Use the dashboard's own address (127.0.0.1, localhost, or a name given with --allowed-host)."
            self.close_connection = True
            self._send(status, f"{message}\n{hint}\n".encode(), "text/plain; charset=utf-8")
            return False
        if self.command != "POST":  # a POST's body is still to come: read by _form, then released
            self.server.request_read()
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        try:
            self._get()
        except Exception:  # a page's failure is a 500 page, never a dropped connection
            log.exception("dashboard: internal error on GET %s", urllib.parse.urlsplit(self.path).path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, _error(internal_error()).encode())

    def _get(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/login":
            if self.app.curator.session(self._cookie(SESSION_COOKIE)) is not None:
                return self._redirect("/")
            return self._login_page()
        session = self.app.curator.session(self._cookie(SESSION_COOKIE))
        if session is None:
            if url.path in dict(PAGES):
                return self._redirect("/login")
            return self._send(HTTPStatus.UNAUTHORIZED)
        if url.path in self.app.static:
            asset, ctype = self.app.static[url.path]
            return self._send(HTTPStatus.OK, asset, ctype)
        pages: dict[str, Callable[[dict[str, list[str]]], tuple[str, str]]] = {
            "/": self._analysts,
            "/spend": self._spend,
            "/audit": self._audit,
            "/policy": self._policy,
        }
        render = pages.get(url.path)
        if render is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain; charset=utf-8")
        query = urllib.parse.parse_qs(url.query)
        status, message = HTTPStatus.OK, ""
        try:
            with self.app.lock:
                title, body = render(query)
        except Error as exc:
            status, message = HTTPStatus.BAD_REQUEST, _error(exc)
            title, body = dict(PAGES)[url.path], ""
        self._page(status, url.path, title, body, session.csrf, message)

    def do_POST(self) -> None:
        try:
            self._post()
        except Exception:  # as for GET: a 500 page, never a dropped connection
            log.exception("dashboard: internal error on POST %s", urllib.parse.urlsplit(self.path).path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, _error(internal_error()).encode())

    def _post(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/login":
            return self._login()
        session = self.app.curator.session(self._cookie(SESSION_COOKIE))
        if session is None:
            return self._send(HTTPStatus.UNAUTHORIZED)
        form = self._form()
        if form is None:
            return
        if not self._same_origin() or not tokens_equal(form.get("csrf"), session.csrf):
            return self._forbidden()
        if path == "/logout":
            self.app.curator.logout(self._cookie(SESSION_COOKIE))
            return self._redirect("/login", (("Set-Cookie", self._set_cookie(SESSION_COOKIE, "", 0)),))
        if path != "/levers":
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain; charset=utf-8")
        status, message = HTTPStatus.OK, ""
        try:
            message = self._lever(form)
        except Error as exc:
            status, message = HTTPStatus.BAD_REQUEST, _error(exc)
        with self.app.lock:
            title, body = self._analysts({})
        self._page(status, "/", title, body, session.csrf, message)

    def do_PUT(self) -> None:
        self._send(HTTPStatus.UNAUTHORIZED if self.app.curator.session(self._cookie(SESSION_COOKIE)) is None else 405)

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    # -- login ------------------------------------------------------------------------------------

    def _login_page(self, status: int = HTTPStatus.OK, error: str = "") -> None:
        token = secrets.token_urlsafe(32)
        body = self.app.login_page.substitute(style=LOGIN_STYLE, error=error, csrf=token)
        self._send(status, body.encode(), headers=(("Set-Cookie", self._set_cookie(LOGIN_COOKIE, token)),))

    def _login(self) -> None:
        client = self.client_address[0]
        curator = self.app.curator
        device = curator.device(self._cookie(DEVICE_COOKIE))  # a browser that logged in before
        form = self._form()
        if form is None:
            return
        if curator.throttled(client, device):
            where = "this browser" if device else "this address"
            exc: Error = ConfigurationLimitExceeded(
                f"too many failed logins from {where}", hint="Wait a few minutes before trying again."
            )
            return self._login_page(HTTPStatus.TOO_MANY_REQUESTS, _error(exc))
        if not self._same_origin() or not tokens_equal(form.get("csrf"), self._cookie(LOGIN_COOKIE)):
            return self._login_page(HTTPStatus.FORBIDDEN, _error(_csrf_error()))
        try:
            token = curator.login(client, form.get("password", ""), device)
        except SlowedDown:
            exc = ConfigurationLimitExceeded(
                "too many failed logins for the curator: password checks are spaced out",
                hint="Try again in a minute, or from a browser that logged in before.",
            )
            return self._login_page(HTTPStatus.TOO_MANY_REQUESTS, _error(exc))
        if token is None:
            log.warning("failed dashboard login from %s%s", client, " (known browser)" if device else "")
            return self._login_page(
                HTTPStatus.UNAUTHORIZED, _error(InvalidPassword("password authentication failed for the curator"))
            )
        log.info("curator logged in from %s", client)
        cookies = [("Set-Cookie", self._set_cookie(SESSION_COOKIE, token))]
        if device is None:  # this browser now has its own allowance of failed logins
            cookies.append(("Set-Cookie", self._set_cookie(DEVICE_COOKIE, curator.new_device(), DEVICE_TTL_S)))
        self._redirect("/", tuple(cookies))

    def _forbidden(self) -> None:
        session = self.app.curator.session(self._cookie(SESSION_COOKIE))
        with self.app.lock:
            title, body = self._analysts({})
        self._page(HTTPStatus.FORBIDDEN, "/", title, body, session.csrf if session else "", _error(_csrf_error()))

    # -- pages ------------------------------------------------------------------------------------

    def _page(self, status: int, path: str, title: str, body: str, csrf: str, message: str = "") -> None:
        current = ' class="current"'
        nav = "".join(
            f'<a href="{href}"{current if href == path else ""}>{views.esc(name)}</a>' for href, name in PAGES
        )
        html = self.app.page.substitute(
            title=views.esc(title),
            dataset=views.esc(self.app.policy.dataset),
            nav=nav,
            csrf=views.esc(csrf),
            message=message,
            body=body,
        )
        self._send(status, html.encode())

    def _csrf(self) -> str:
        session = self.app.curator.session(self._cookie(SESSION_COOKIE))
        return session.csrf if session is not None else ""

    def _analysts(self, query: dict[str, list[str]]) -> tuple[str, str]:
        return pages.analysts(self.app.policy, self.app.ledger, self._csrf())

    def _lever(self, form: dict[str, str]) -> str:
        return pages.apply_lever_form(self.app.ledger, self.app.policy, self.app.by, self.app.lock, form)

    def _spend(self, query: dict[str, list[str]]) -> tuple[str, str]:
        return pages.spend(self.app.ledger, self.app.policy, query)

    def _audit(self, query: dict[str, list[str]]) -> tuple[str, str]:
        return pages.audit(self.app.ledger, self.app.policy, query)

    def _policy(self, query: dict[str, list[str]]) -> tuple[str, str]:
        return pages.policy_page(self.app.policy)


def _error(exc: Error) -> str:
    hint = f"<br>HINT: {views.esc(exc.hint)}" if exc.hint else ""
    return f'<p class="error" id="error">ERROR: {views.esc(exc.sqlstate)}: {views.esc(exc.message)}{hint}</p>'


def internal_error() -> InternalError:
    return InternalError("internal error", hint="The dashboard's log has the details.")


def _csrf_error() -> InsufficientPrivilege:
    return InsufficientPrivilege("invalid or missing CSRF token", hint="Reload the page and submit the form again.")


def make_server(
    app: Dashboard, host: str = "127.0.0.1", port: int = 8080, tls: ssl.SSLContext | None = None
) -> DashboardServer:
    """A listening dashboard server (``port`` 0: any free port); call ``serve_forever``."""
    return DashboardServer((_host_name(host) if host.startswith("[") else host, port), app, tls)
