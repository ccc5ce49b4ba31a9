"""A CONNECT proxy on loopback that git is pointed at (`http.proxy`), so that every connection
git makes (to the source, to each redirect target, to each submodule, at any depth) passes the
egress policy first. A direct connection goes to an address the policy has just checked, so
git never resolves a name itself (no window for DNS rebinding); under HTTPS_PROXY the tunnel
is asked of the outbound proxy after the same target check the proxy's own requests pass.

Each clone gets its own credentials (the gate serves nobody else on the machine) and its own
list of refusals, so that a refused hop is reported as such instead of as git's "CONNECT
tunnel failed".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import BasicAuth
from yarl import URL

from proxy.core.digits import is_decimal
from proxy.core.errors import UpstreamError
from proxy.upstream.egress import EgressPolicy, normal_host, open_by_name, outbound_proxy

log = logging.getLogger(__name__)

_MAX_HEAD = 16 * 1024  # request or response head; git sends a few hundred bytes
_CHUNK = 1 << 16
_FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_AUTH_REQUIRED = (b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                  b'Proxy-Authenticate: Basic realm="tf-registry-proxy"\r\n'
                  b"Content-Length: 0\r\nConnection: close\r\n\r\n")


@dataclass
class GateSession:
    """One clone's way through the gate: the proxy URL git uses and the hops refused."""

    proxy_url: str = field(repr=False)  # holds the credentials
    token: str = field(repr=False)
    refusals: list[str] = field(default_factory=list)


class EgressGate:
    """Started on first use, on 127.0.0.1; closed with the app."""

    def __init__(self, policy: EgressPolicy, connect_timeout: float) -> None:
        self._policy = policy
        self._timeout = connect_timeout
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()
        self._sessions: dict[str, GateSession] = {}
        self._connections: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def session(self) -> AsyncIterator[GateSession]:
        """A proxy URL with credentials valid for the duration of the block."""
        port = await self._port()
        user, token = secrets.token_hex(8), secrets.token_urlsafe(24)
        session = GateSession(f"http://{user}:{token}@127.0.0.1:{port}", token)
        self._sessions[user] = session
        try:
            yield session
        finally:
            del self._sessions[user]

    async def close(self) -> None:
        """Stop listening and cut the tunnels still open."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _port(self) -> int:
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0,
                                                          limit=_MAX_HEAD)
            port: int = self._server.sockets[0].getsockname()[1]
            return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._tunnel(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._timeout)
        request, headers = _parse_head(head)
        session = self._authenticated(headers.get("proxy-authorization", ""))
        if session is None:
            writer.write(_AUTH_REQUIRED)
            return
        parts = request.split(" ")
        target = _target(parts[1]) if len(parts) == 3 and parts[0] == "CONNECT" else None
        if target is None:
            writer.write(_BAD_REQUEST)
            return
        host, port = target
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            upstream = await self._open(host, port, authority)
        except UpstreamError as exc:
            session.refusals.append(exc.message)
            log.warning("git connection to %s not made: %s", authority[:200], exc.message)
            writer.write(_FORBIDDEN)
            return
        up_reader, up_writer = upstream
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await _relay(reader, writer, up_reader, up_writer)
        finally:
            up_writer.close()

    def _authenticated(self, header: str) -> GateSession | None:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, _, token = base64.b64decode(encoded.strip(), validate=True).decode(
                "latin-1").partition(":")
        except (binascii.Error, ValueError):
            return None
        session = self._sessions.get(user)
        if session is None or not secrets.compare_digest(session.token, token):
            return None
        return session

    async def _open(self, host: str, port: int, authority: str
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = f"https://{authority}/"
        await self._policy.check_target(url)
        proxy = outbound_proxy(url)
        if proxy is not None:
            return await self._through_proxy(proxy[0], proxy[1], authority)
        last_error: OSError | None = None
        for address in await self._policy.connectable(host, port):
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(address), port),
                                              self._timeout)
            except (OSError, TimeoutError) as exc:
                last_error = exc if isinstance(exc, OSError) else OSError("timed out")
        raise UpstreamError(f"cannot connect to {authority[:200]}: {last_error}")

    async def _through_proxy(self, proxy: URL, auth: BasicAuth | None, authority: str
                             ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.wait_for(
                open_by_name(proxy.host or "", proxy.port or 80), self._timeout)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot reach the outbound proxy {proxy.host}: "
                                f"{exc or 'timed out'}") from None
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if auth is not None:
            lines.append(f"Proxy-Authorization: {auth.encode()}")
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._timeout)
            status = head.split(b"\r\n", 1)[0].decode("latin-1")
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status = "no answer"
        if status.split(" ")[1:2] != ["200"]:
            writer.close()
            raise UpstreamError(f"the outbound proxy did not open a tunnel to "
                                f"{authority[:200]}: {status[:100]}")
        return reader, writer


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _target(authority: str) -> tuple[str, int] | None:
    """host and port of a CONNECT target, or None when it is not one."""
    host, sep, port = authority.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not is_decimal(port) or not 0 < int(port) <= 65535:
        return None
    if any(c in host for c in "/\\@?#% \t\0") or not host.isprintable():
        return None
    return normal_host(host), int(port)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
    """Copy both ways until either side is done."""
    copies = [asyncio.create_task(_copy(reader, up_writer)),
              asyncio.create_task(_copy(up_reader, writer))]
    try:
        await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for copy in copies:
            copy.cancel()
        await asyncio.gather(*copies, return_exceptions=True)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
