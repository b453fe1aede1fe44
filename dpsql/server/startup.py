"""Connection startup: SSL/GSSENC negotiation, cancel requests, StartupMessage, SCRAM or trust.

Every refusal here is FATAL (the session ends): PostgreSQL's own codes and wording, and the same
SCRAM exchange for unknown roles as for wrong passwords so the answer never tells them apart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import TYPE_CHECKING

from dpsql.errors import (
    AuthFailed,
    Error,
    FeatureNotSupported,
    InvalidAuthorization,
    InvalidPassword,
    ProtocolViolation,
    ScramProtocolError,
)
from dpsql.session import Session

from . import protocol as pq
from .answers import REPORTED, Settings, default_gucs
from .auth import ScramExchange, Verifier, mock_exchange, parse_sasl_initial
from .protocol import WireViolation

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("dpsql.server")

#: The most one password exchange may take once admitted (it holds one of its (analyst, address)'s few places).
TURN_SECONDS = 5.0
#: StartupMessage parameters that are not settings.
_NOT_SETTINGS = frozenset({"user", "database", "replication", "options", "application_name"})


async def startup(conn: Connection) -> bool:
    """Negotiate encryption and authenticate; False when the connection only carried a cancel."""
    while True:
        payload = await pq.read_startup(conn.reader)
        msg = pq.parse_startup(payload)
        if isinstance(msg, pq.SSLRequest | pq.GSSEncRequest):
            conn.negotiating()
        if isinstance(msg, pq.SSLRequest):
            await _negotiate_tls(conn)
        elif isinstance(msg, pq.GSSEncRequest):
            conn.replies.send(b"N")
            await conn.replies.flush()
        elif isinstance(msg, pq.CancelRequest):
            conn.ctx.cancel(msg.pid, msg.secret)
            return False
        else:
            break
    await _start_session(conn, msg)
    return True


async def _negotiate_tls(conn: Connection) -> None:
    if conn.ctx.ssl_context is None or conn.tls:
        conn.replies.send(b"N")
        await conn.replies.flush()
        return
    # Data pipelined after SSLRequest would be read as if it came over TLS (CVE-2021-23214).
    if len(getattr(conn.reader, "_buffer", b"")):
        raise WireViolation("received unencrypted data after SSL request")
    conn.replies.send(b"S")
    await conn.replies.flush()
    await conn.writer.start_tls(conn.ctx.ssl_context)
    conn.tls = True


async def _start_session(conn: Connection, msg: pq.StartupMessage) -> None:
    ctx = conn.ctx
    conn.startup_received()
    if msg.major != 3:
        raise FeatureNotSupported(
            f"unsupported frontend protocol {msg.major}.{msg.minor}: server supports 3.0 to 3.0"
        ).fatal()
    params = msg.params
    unknown_options = [k for k in params if k.startswith("_pq_.")]
    if msg.minor > 0 or unknown_options:
        conn.replies.send(pq.negotiate_protocol_version(0, unknown_options))
    if params.get("replication", "false").lower() not in ("false", "off", "no", "0"):
        raise FeatureNotSupported("replication connections are not supported by dpsql").fatal()
    user = params.get("user", "")
    if not user:
        raise InvalidAuthorization("no PostgreSQL user name specified in startup packet").fatal()
    if ctx.options.require_tls and not conn.tls:  # as a hostssl-only pg_hba.conf: before any password
        raise InvalidAuthorization(
            f'no pg_hba.conf entry for host "{conn.address}", user "{user}", '
            f'database "{params.get("database", user)}", no encryption',
            hint="This server accepts TLS connections only: connect with sslmode=require (or stronger).",
        ).fatal()
    await _authenticate(conn, user)
    conn.authenticated()  # from now on it counts as a session, no longer against the pre-auth budget
    try:
        ctx.admit(user)  # 53300 beyond --max-connections / --max-connections-per-analyst
    except Error as exc:
        log.info("connection refused analyst=%s peer=%s: %s", user, conn.peer, exc.message)
        exc.detail = exc.hint = None  # as before: the refusal's message only
        raise exc.fatal() from None
    conn.admitted = True
    conn.user = user
    conn.session = Session(analyst=user)
    gucs = default_gucs(ctx.server_version, user, params.get("application_name", ""), ctx.defaults)
    gucs["statement_timeout"] = str(ctx.default_statement_timeout_ms)
    idle_tx = ctx.options.idle_in_transaction_timeout
    gucs["idle_in_transaction_session_timeout"] = str(round((idle_tx or 0) * 1000))
    opts = ctx.options
    settings = Settings(conn.session, gucs, max_custom=opts.max_settings, max_length=opts.max_setting_length)
    conn.settings = conn.commands.settings = settings
    _apply_startup_settings(settings, params)
    for name in REPORTED:
        conn.replies.send(pq.parameter_status(name, settings.values.get(name, "")))
    conn.pid = ctx.register(conn)
    conn.replies.send(pq.backend_key_data(conn.pid, conn.secret))
    conn.replies.send(pq.ready_for_query(conn.commands.tx))
    await conn.replies.flush()
    log.info("connection analyst=%s pid=%d peer=%s tls=%s", user, conn.pid, conn.peer, conn.tls)


def _apply_startup_settings(settings: Settings, params: dict[str, str]) -> None:
    pairs = [(k, v) for k, v in params.items() if k not in _NOT_SETTINGS and not k.startswith("_pq_.")]
    pairs += re.findall(r"(?:-c\s*|--)([A-Za-z_.]+)=(\S+)", params.get("options", ""))
    for key, value in pairs:
        try:
            settings.set(key, value)
        except Error as exc:
            exc.detail = None  # as before: message and hint only
            raise exc.fatal() from None


async def _authenticate(conn: Connection, user: str) -> None:
    policy = conn.ctx.policy
    analyst = policy.analyst(user)
    if policy.auth.trust:
        # As PostgreSQL under trust: authentication succeeds, then the role lookup fails (a known
        # name simply logs in, so no answer could hide which names exist).
        conn.replies.send(pq.auth_ok())
        if analyst is None:
            raise InvalidAuthorization(f'role "{user}" does not exist').fatal()
        return
    failed = InvalidPassword(f'password authentication failed for user "{user}"').fatal()
    _refuse_if_locked(conn, user)
    if analyst is not None and analyst.password is not None:
        exchange = ScramExchange(Verifier.parse(analyst.password))
        reason = "wrong password"
    else:  # unknown role or no verifier: the same exchange, doomed to fail at the same point
        exchange = mock_exchange(conn.ctx.engine, user)
        reason = "unknown role" if analyst is None else "no password set"
    # the pair's exchanges take one of its few places (in arrival order) and are checked at once; a wrong
    # password keeps its place and its reply for the pair's delay, a correct one leaves at once; a client
    # holding a place without finishing the exchange (a real one needs milliseconds) is cut off
    async with conn.ctx.logins.turn(user, conn.address, conn.startup_paused) as turn:
        conn.replies.send(pq.auth_sasl(["SCRAM-SHA-256"]))
        await conn.replies.flush()
        try:
            async with asyncio.timeout(TURN_SECONDS):
                mechanism, first = parse_sasl_initial(await _read_password(conn))
                if mechanism != "SCRAM-SHA-256":
                    raise ScramProtocolError("client selected an invalid SASL authentication mechanism")
                conn.replies.send(pq.auth_sasl_continue(exchange.first(first)))
                await conn.replies.flush()
                proof = await _read_password(conn)
            _refuse_if_locked(conn, user)  # again: parallel attempts must not all get their guess checked
            final = exchange.final(proof)
        except TimeoutError:  # only the turn's own deadline: the startup deadline cancels, it is not caught here
            turn.failed()  # it held one of the pair's places: counted as a guess
            raise ProtocolViolation("canceling authentication due to timeout").fatal() from None
        except AuthFailed:
            turn.failed()
            log.info("authentication failed analyst=%s peer=%s reason=%s", user, conn.peer, reason)
            raise failed from None
        except ScramProtocolError as exc:
            raise exc.fatal() from None
        conn.ctx.logins.succeeded(user, conn.address)
    conn.replies.send(pq.auth_sasl_final(final))
    conn.replies.send(pq.auth_ok())


def _refuse_if_locked(conn: Connection, user: str) -> None:
    """FATAL 28000 while the login limiter locks ``user``'s account or this address (never where ``user``
    logged in before): no password is checked. Unknown names are limited alike, so the refusal tells
    nothing about which names exist."""
    left = conn.ctx.logins.locked(user, conn.address)
    if left > 0:
        log.info("login refused analyst=%s peer=%s: locked for %.1fs after failed attempts", user, conn.peer, left)
        raise InvalidAuthorization(
            f'too many failed authentication attempts for user "{user}"',
            hint=f"Retry in {math.ceil(left)} s.",
        ).fatal()


async def _read_password(conn: Connection) -> bytes:
    options = conn.ctx.options
    type_, payload = await asyncio.wait_for(
        pq.read_message(conn.reader, options.max_message_size), options.startup_timeout
    )
    if type_ != "p":
        raise WireViolation(f"expected SASL response, got message type {ord(type_)}")
    return payload
