"""The client connections of one process: a registry of the open ones, a cap on how many
(beyond it, new ones wait in the kernel's listen backlog instead of taking descriptors and TLS
state), and the deadline for each request head, so a client that connects and then sends
nothing, or half a request, cannot hold a connection (a slow-loris)."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable, Iterator
from typing import cast

from prometheus_client import Counter, Gauge

CutReport = Callable[[object, str], None]  # (peer address, reason)

# Descriptors a process needs besides its client connections: upstream connections, cache
# files, git, logs.
SPARE_DESCRIPTORS = 256


class Connection:
    """One accepted client connection, from accept until it ends."""

    def __init__(self, registry: OpenConnections, peer: object) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None  # once TLS is established
        self._registry = registry

    def ended(self) -> None:
        """Forget the connection: it closed, or never got past its handshake."""
        self._registry._forget(self)


class OpenConnections:
    """This process's client connections, shared by its listeners. Iterating gives the open
    ones (with their transports once TLS is up), e.g. for a shutdown that must end them."""

    def __init__(self, limit: int, handshake_timeout: float, head_timeout: float, *,
                 open_gauge: Gauge, limit_waits: Counter, on_cut: CutReport,
                 on_full: Callable[[int], None]) -> None:
        self.limit = limit
        self.handshake_timeout = handshake_timeout
        self.head_timeout = head_timeout
        self._open: set[Connection] = set()
        # A place per connection, taken before accept: at the limit, nothing is accepted.
        self._places = asyncio.Semaphore(limit)
        self._open_gauge = open_gauge
        self._limit_waits = limit_waits
        self._on_cut = on_cut
        self._on_full = on_full

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self._open))

    async def reserve(self) -> None:
        """Wait for a free place (fewer than `limit` open) and take it for the next accept;
        give it back with `unreserve` if nothing is accepted."""
        if self._places.locked():
            self._limit_waits.inc()
            self._on_full(len(self._open))
        await self._places.acquire()

    def unreserve(self) -> None:
        """Give back a place taken by `reserve` that no connection used."""
        self._places.release()

    def opened(self, peer: object) -> Connection:
        """Register a connection just accepted into a reserved place."""
        connection = Connection(self, peer)
        self._open.add(connection)
        self._open_gauge.set(len(self._open))
        return connection

    def cut(self, connection: Connection, reason: str) -> None:
        """Close a connection whose client is too slow, and report it."""
        self._on_cut(connection.peer, reason)
        if connection.transport is not None:
            connection.transport.abort()  # not close(): a stalled client would not answer
        connection.ended()

    def guard(self, connection: Connection, http: asyncio.Protocol) -> asyncio.Protocol:
        """The protocol to serve connection with: http, behind the request head deadline."""
        return _HeadDeadline(self, connection, http)

    def _forget(self, connection: Connection) -> None:
        if connection in self._open:
            self._open.remove(connection)
            self._open_gauge.set(len(self._open))
            self._places.release()


class _HeadDeadline(asyncio.Protocol):
    """Passes everything between the transport and the HTTP protocol (aiohttp's, which
    bounds only the idle time between requests), and cuts the connection when a request head
    is not complete within head_timeout: of the handshake for the first request (a client
    connects to send one), of its first byte for later ones. Clients send GET and HEAD
    only, so the bytes after a head are the next head: no HTTP parsing is needed beyond
    finding the blank line that ends each head."""

    def __init__(self, registry: OpenConnections, connection: Connection,
                 http: asyncio.Protocol) -> None:
        self._registry = registry
        self._connection = connection
        self._http = http
        self._deadline: asyncio.TimerHandle | None = None  # set while a head is awaited
        self._tail = b""  # the last bytes of an unfinished head: "\r\n\r\n" may straddle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connection.transport = cast(asyncio.Transport, transport)  # a stream's
        self._arm()
        self._http.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._deadline is not None or not data.endswith(b"\r\n\r\n"):
            self._watch(data)
        # else whole heads, none awaited before or after: the usual request, at once
        self._http.data_received(data)

    def eof_received(self) -> bool | None:
        return self._http.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._connection.ended()
        self._http.connection_lost(exc)

    def pause_writing(self) -> None:
        self._http.pause_writing()

    def resume_writing(self) -> None:
        self._http.resume_writing()

    def _watch(self, data: bytes) -> None:
        seen = self._tail + data
        awaited, started = self._deadline is not None, False
        while True:
            if not awaited:
                seen = seen.lstrip(b"\r\n")  # stray line ends between requests are allowed
                if not seen:
                    break
                awaited = started = True
            end = seen.find(b"\r\n\r\n")
            if end < 0:
                break
            seen, awaited, started = seen[end + 4:], False, False
        self._tail = seen[-3:] if awaited else b""
        if not awaited:
            self._disarm()
        elif started:
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(
            self._registry.head_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        self._registry.cut(self._connection, "head_timeout")


def raise_descriptor_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files (ulimit -n) towards wanted, as far as
    the hard limit allows; the limit now in force (wanted, if it is unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
