"""The proxy app behind a TLS listener set up the way `serve` sets it up, and a raw HTTP/1.1
client that shows exactly which bytes it sent and how the connection ended, where an HTTP
library would hide both (it stops reading at Content-Length, or raises and drops what it
read)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import trustme
from aiohttp import web

from proxy.web.http_server import ProxyRunner

_T = TypeVar("_T")


@dataclass(frozen=True)
class RawAnswer:
    """Everything one request received, up to the end of the connection."""

    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes              # every byte after the header block, whatever it is
    ended: str               # "eof" (a clean close), "reset" (RST) or "idle" (still open)

    @property
    def content_length(self) -> int:
        """The announced body length."""
        return int(self.headers["content-length"])


@dataclass(frozen=True)
class Served:
    """Where a test server listens, and how clients trust it."""

    host: str
    port: int
    client_tls: ssl.SSLContext

    def url(self, path: str) -> str:
        """The https URL of path."""
        return f"https://{self.host}:{self.port}{path}"

    async def raw_get(self, path: str, idle: float = 2.0, version: str = "1.1") -> RawAnswer:
        """GET path raw (see `raw_get`)."""
        return await asyncio.to_thread(raw_get, self.host, self.port, path, self.client_tls,
                                       idle, version)

    async def raw_request(self, request: bytes, idle: float = 2.0) -> RawAnswer:
        """Send request bytes as they are (see `raw_request`)."""
        return await asyncio.to_thread(raw_request, self.host, self.port, request,
                                       self.client_tls, idle)

    async def text(self, path: str) -> str:
        """GET path with an ordinary client; the body as text."""
        async with aiohttp.ClientSession() as session, \
                session.get(self.url(path), ssl=self.client_tls) as response:
            return await response.text()


@asynccontextmanager
async def served(app: web.Application, ca: trustme.CA) -> AsyncIterator[Served]:
    """The app on 127.0.0.1 over TLS with a certificate from ca, run like `serve` runs it
    (unlike aiohttp's test server, handlers go on when a client hangs up)."""
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    runner = ProxyRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield Served(host, port, client_tls)
    finally:
        await runner.cleanup()


def raw_get(host: str, port: int, path: str, tls: ssl.SSLContext | None = None,
            idle: float = 2.0, version: str = "1.1") -> RawAnswer:
    """Send one GET (HTTP/1.1 asks to keep the connection open) and read until the server ends the
    connection or sends nothing more for `idle` seconds (less, once the announced body is
    complete). TLS runs over memory buffers, so a
    reset (RST) is told apart from a close (FIN) as on plain TCP. Blocking: use a thread."""
    keep_alive = "Connection: keep-alive\r\n" if version == "1.1" else ""
    return raw_request(host, port, f"GET {path} HTTP/{version}\r\nHost: {host}:{port}\r\n"
                                   f"{keep_alive}\r\n".encode(), tls, idle)


def raw_request(host: str, port: int, request: bytes, tls: ssl.SSLContext | None = None,
                idle: float = 2.0, then: bytes = b"") -> RawAnswer:
    """Send request exactly as given (malformed ones too) and read the answer as `raw_get`
    does; with `then`, send that once the first answer is complete, on the same connection,
    and read on (the body then holds the second answer too). Blocking: use a thread."""
    received = bytearray()
    ended = "idle"
    with socket.create_connection((host, port), timeout=idle) as sock:
        channel = _Channel(sock, tls, host)
        channel.send(request)
        while True:
            if then and _complete(received):
                channel.send(then)
                then = b""
            try:
                data = channel.recv()
            except TimeoutError:
                break
            except ConnectionResetError:
                ended = "reset"
                break
            if not data:
                ended = "eof"
                break
            received += data
            # Once the answer is complete, anything more would be garbage: wait a little for it.
            if _complete(received) and not then:
                sock.settimeout(min(idle, 0.2))
    head, separator, body = bytes(received).partition(b"\r\n\r\n")
    assert separator, f"no complete header block in {bytes(received[:200])!r} ({ended})"
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip()
               for name, _, value in (line.partition(":") for line in lines[1:])}
    return RawAnswer(int(lines[0].split(" ", 2)[1]), headers, body, ended)


class PausedDownload:
    """A GET whose client stops reading after the first bytes of the body: the server is left
    in the middle of sending it (its socket full) until `finish` reads the rest. A small
    receive buffer keeps what the kernel takes in for the client small. Blocking."""

    def __init__(self, host: str, port: int, path: str, tls: ssl.SSLContext,
                 first: int = 1 << 16) -> None:
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        raw.settimeout(30)
        raw.connect((host, port))
        self._sock = tls.wrap_socket(raw, server_hostname=host)
        self._sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                           "Connection: close\r\n\r\n".encode())
        self._received = bytearray()
        while len(self._received.partition(b"\r\n\r\n")[2]) < first:
            data = self._sock.recv(1 << 14)
            assert data, f"the answer ended early: {bytes(self._received[:200])!r}"
            self._received += data

    def finish(self) -> tuple[int, bytes]:
        """Read to the end of the answer; its status and body."""
        with self._sock:
            while data := self._sock.recv(1 << 16):
                self._received += data
        head, _, body = bytes(self._received).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body


def _complete(received: bytearray) -> bool:
    head, separator, body = bytes(received).partition(b"\r\n\r\n")
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if separator and name.strip().lower() == "content-length":
            return len(body) >= int(value)
    return False


class _Channel:
    """A socket, or TLS over it through memory buffers: socket errors stay visible."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLContext | None, host: str) -> None:
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = None if tls is None else tls.wrap_bio(
            self._incoming, self._outgoing, server_hostname=host)
        if self._tls is not None:
            self._until_done(self._tls.do_handshake)

    def send(self, data: bytes) -> None:
        """Send all of data."""
        if self._tls is None:
            self._sock.sendall(data)
            return
        self._tls.write(data)
        self._flush()

    def recv(self) -> bytes:
        """The next bytes; b"" at the end; raises what the socket raises."""
        if self._tls is None:
            return self._sock.recv(1 << 16)
        tls = self._tls
        try:
            return self._until_done(lambda: tls.read(1 << 16))
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return b""  # closed, with or without close_notify

    def _until_done(self, step: Callable[[], _T]) -> _T:
        while True:
            try:
                result = step()
            except ssl.SSLWantReadError:
                self._flush()
                data = self._sock.recv(1 << 16)
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()
                continue
            self._flush()
            return result

    def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            self._sock.sendall(pending)
