"""HTTPS listening that reports failed TLS handshakes. The event loop's own TLS server drops
them silently (asyncio and uvloop log them only in debug mode), so a client that does not
trust the proxy's CA would leave no trace. This site accepts connections itself and has the
loop run each handshake (connect_accepted_socket), so a failure comes back with the address."""

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


class HandshakeFailures:
    """Counts failed handshakes and logs them at WARNING, at most one line per interval (the
    next line says how many were not logged), so a misconfigured fleet cannot flood the log."""

    def __init__(self, counter: Counter, trust_hint: str, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = counter
        self._trust_hint = trust_hint
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def record(self, peer: object, exc: ssl.SSLError) -> None:
        """Count one failure and log it unless a line was logged within the interval."""
        kind, explanation = classify(exc)
        self._counter.labels(reason=kind).inc()
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return
        hint = f"; {self._trust_hint}" if kind == "untrusted_certificate" else ""
        more = (f" ({self._suppressed} more failed handshakes not logged since the last line)"
                if self._suppressed else "")
        log.warning("TLS handshake with %s failed: %s (%s)%s%s", _address(peer), explanation,
                    (exc.reason or str(exc)).lower().replace("_", " "), hint, more)
        self._last, self._suppressed = now, 0


class TlsSite(web.BaseSite):
    """An HTTPS TCP site (like web.TCPSite with an ssl_context) that accepts connections
    itself and hands each to the event loop with its TLS context (connect_accepted_socket),
    so a failed handshake comes back to it, with the peer's address, for HandshakeFailures."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, context: ssl.SSLContext,
                 failures: HandshakeFailures, *, reuse_port: bool | None = None,
                 backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=context, backlog=backlog)
        self._host, self._port = host, port
        self._context = context
        self._failures = failures
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
            try:
                connection, peer = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:  # wait for some to be freed, as asyncio does
                    log.error("cannot accept connections: %s", exc.strerror)
                    await asyncio.sleep(1)
                continue  # the client gave up before we accepted: nothing to do
            except Exception:  # never let the listener die quietly: that is an outage
                log.exception("accepting a connection failed")
                await asyncio.sleep(1)
                continue
            self._spawn(self._serve(connection, peer))

    async def _serve(self, connection: socket.socket, peer: object) -> None:
        server = self._runner.server
        if server is None:
            connection.close()
            return
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                server, connection, ssl=self._context)
        except ssl.SSLError as exc:
            self._failures.record(peer, exc)
        except OSError as exc:  # reset or timed out during the handshake: nothing to tell
            log.debug("TLS handshake with %s ended: %r", _address(peer), exc)


def _address(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "an unknown address"
