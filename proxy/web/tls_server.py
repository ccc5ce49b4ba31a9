"""HTTPS listening that reports failed TLS handshakes. The event loop's own TLS server drops
them silently (asyncio and uvloop log them only in debug mode), so a client that does not
trust the proxy's CA would leave no trace. This site accepts connections itself and has the
loop run each handshake (connect_accepted_socket), so a failure comes back with the address.
It also bounds what a client may hold (proxy.web.connections): the handshake's duration, and how
many connections are open."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from proxy.config import ServerConfig
from proxy.core.metrics import Metrics
from proxy.web.connections import (
    SPARE_DESCRIPTORS,
    Connection,
    OpenConnections,
    raise_descriptor_limit,
)

log = logging.getLogger(__name__)

# OpenSSL's reasons (ssl.SSLError.reason), grouped into the few kinds an operator acts on;
# these are also the metric's only label values.
_UNTRUSTED = frozenset({"TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE",
                        "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "SSLV3_ALERT_CERTIFICATE_EXPIRED",
                        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE"})
_PROTOCOL = frozenset({"UNSUPPORTED_PROTOCOL", "NO_SHARED_CIPHER", "WRONG_VERSION_NUMBER",
                       "VERSION_TOO_LOW", "NO_PROTOCOLS_AVAILABLE", "TLSV1_ALERT_PROTOCOL_VERSION",
                       "SSLV3_ALERT_HANDSHAKE_FAILURE", "NO_SUITABLE_SIGNATURE_ALGORITHM"})

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def classify(exc: ssl.SSLError) -> tuple[str, str]:
    """(metric label, explanation for the log) of a failed handshake."""
    reason = exc.reason or ""
    if reason in _UNTRUSTED:
        if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
            return "untrusted_certificate", "the client says this proxy's certificate expired"
        return "untrusted_certificate", "the client does not trust this proxy's certificate"
    if reason == "HTTP_REQUEST":
        return "plain_http", "the client sent plain HTTP to the HTTPS port (use https://)"
    if reason in _PROTOCOL:
        return "protocol_mismatch", ("the client and the proxy share no TLS version or cipher "
                                     "(the proxy needs TLS 1.2 or later)")
    if isinstance(exc, ssl.SSLEOFError):
        return "other", "the client closed the connection during the handshake"
    return "other", "the TLS handshake failed"


class LogThrottle:
    """Lets at most one log line through per interval and counts the ones it holds back, so
    a flood of events (a misconfigured fleet, a slow-loris) cannot flood the log."""

    def __init__(self, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def admit(self) -> int | None:
        """None: leave this line out; else log it, saying how many were left out before."""
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return None
        suppressed, self._last, self._suppressed = self._suppressed, now, 0
        return suppressed


class HandshakeFailures:
    """Counts failed handshakes and logs them at WARNING, at most one line per interval (the
    next line says how many were not logged), so a misconfigured fleet cannot flood the log."""

    def __init__(self, counter: Counter, trust_hint: str, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter
        self._trust_hint = trust_hint
        self._throttle = LogThrottle(interval, clock)

    def record(self, peer: object, exc: ssl.SSLError) -> None:
        """Count one failure and log it unless a line was logged within the interval."""
        kind, explanation = classify(exc)
        self._counter.labels(reason=kind).inc()
        suppressed = self._throttle.admit()
        if suppressed is None:
            return
        hint = f"; {self._trust_hint}" if kind == "untrusted_certificate" else ""
        more = (f" ({suppressed} more failed handshakes not logged since the last line)"
                if suppressed else "")
        log.warning("TLS handshake with %s failed: %s (%s)%s%s", _address(peer), explanation,
                    (exc.reason or str(exc)).lower().replace("_", " "), hint, more)


_CUT_REASONS = {
    "handshake_timeout": "no TLS handshake within server.tls_handshake_timeout",
    "head_timeout": "no complete request head within server.request_head_timeout",
}


class ConnectionReports:
    """Counts and logs (rate-limited) connections cut for being too slow, and the times the
    connection limit stops accepting."""

    def __init__(self, cut_counter: Counter, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cut_counter = cut_counter
        self._cuts = LogThrottle(interval, clock)
        self._fulls = LogThrottle(interval, clock)

    def cut(self, peer: object, reason: str) -> None:
        """Count a connection closed for reason (a key of _CUT_REASONS); log it, at most
        one line per interval."""
        self._cut_counter.labels(reason=reason).inc()
        suppressed = self._cuts.admit()
        if suppressed is not None:
            more = (f" ({suppressed} more slow connections closed since the last line)"
                    if suppressed else "")
            log.info("closed the connection from %s: %s%s", _address(peer),
                     _CUT_REASONS[reason], more)

    def full(self, open_count: int) -> None:
        """Log that accepting paused at the limit, at most one line per interval."""
        suppressed = self._fulls.admit()
        if suppressed is not None:
            more = f" ({suppressed} more times since the last line)" if suppressed else ""
            log.warning("%d client connections are open (server.max_connections): new ones "
                        "wait in the listen backlog until one closes%s", open_count, more)


def open_connections(server: ServerConfig, metrics: Metrics) -> OpenConnections:
    """This process's connection registry, with server's limits, reporting to metrics and
    the log; shared by all of the process's sites. Raises the open-file limit to fit."""
    wanted = server.max_connections + SPARE_DESCRIPTORS
    if (files := raise_descriptor_limit(wanted)) < wanted:
        log.warning("server.max_connections is %d, but this process may open only %d files "
                    "(ulimit -n): raise that limit, or lower max_connections",
                    server.max_connections, files)
    reports = ConnectionReports(metrics.connections_cut)
    metrics.max_connections.set(server.max_connections)
    return OpenConnections(server.max_connections, server.tls_handshake_timeout,
                           server.request_head_timeout, open_gauge=metrics.open_connections,
                           limit_waits=metrics.connection_limit_waits, on_cut=reports.cut,
                           on_full=reports.full)


class TlsSite(web.BaseSite):
    """An HTTPS TCP site (like web.TCPSite with an ssl_context) that accepts connections
    itself and hands each to the event loop with its TLS context (connect_accepted_socket),
    so a failed handshake comes back to it, with the peer's address, for HandshakeFailures.
    It accepts only while connections has room, and bounds each handshake."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, context: ssl.SSLContext,
                 failures: HandshakeFailures, connections: OpenConnections, *,
                 reuse_port: bool | None = None, backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=context, backlog=backlog)
        self._host, self._port = host, port
        self._context = context
        self._failures = failures
        self._connections = connections
        self._reuse_port = bool(reuse_port)
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        """The site's URL."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"https://{host}:{self._port}"

    async def start(self) -> None:
        """Bind and listen (OSError when the address cannot be bound), then accept."""
        await super().start()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host or None, self._port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, _type, proto, _name, address in dict.fromkeys(infos):
                listener = socket.socket(family, socket.SOCK_STREAM, proto)
                self._listeners.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self._reuse_port:
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:  # as asyncio does: "::" is IPv6 only
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                listener.bind(address)
                listener.listen(self._backlog)
                listener.setblocking(False)
        except OSError:
            self._close_listeners()
            raise
        for listener in self._listeners:
            self._spawn(self._accept(listener))

    async def stop(self) -> None:
        """Stop accepting, and abandon handshakes under way."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_listeners()
        await super().stop()

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # At the limit, wait here: new connections queue in the kernel's backlog.
            await self._connections.reserve()
            try:
                connection, peer = await loop.sock_accept(listener)
            except OSError as exc:
                self._connections.unreserve()
                if exc.errno in _OUT_OF_RESOURCES:  # wait for some to be freed, as asyncio does
                    log.error("cannot accept connections: %s", exc.strerror)
                    await asyncio.sleep(1)
                continue  # the client gave up before we accepted: nothing to do
            except Exception:  # never let the listener die quietly: that is an outage
                self._connections.unreserve()
                log.exception("accepting a connection failed")
                await asyncio.sleep(1)
                continue
            except BaseException:  # cancelled: the site stops
                self._connections.unreserve()
                raise
            self._spawn(self._serve(connection, self._connections.opened(peer)))

    async def _serve(self, sock: socket.socket, connection: Connection) -> None:
        server = self._runner.server
        if server is None:
            sock.close()
            connection.ended()
            return
        connections = self._connections
        try:
            async with asyncio.timeout(connections.handshake_timeout):
                await asyncio.get_running_loop().connect_accepted_socket(
                    lambda: connections.guard(connection, server()), sock, ssl=self._context,
                    # ours above reports the timeout; the loop's own one is a backstop
                    ssl_handshake_timeout=connections.handshake_timeout + 1,
                    # a client that does not answer our TLS close keeps its place no longer
                    ssl_shutdown_timeout=connections.handshake_timeout)
        except TimeoutError:
            connections.cut(connection, "handshake_timeout")
        except ssl.SSLError as exc:
            connection.ended()
            self._failures.record(connection.peer, exc)
        except OSError as exc:  # reset during the handshake: nothing to tell
            connection.ended()
            log.debug("TLS handshake with %s ended: %r", _address(connection.peer), exc)
        except BaseException:
            connection.ended()
            raise


def _address(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "an unknown address"
