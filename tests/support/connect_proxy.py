"""A minimal HTTPS_PROXY (HTTP CONNECT tunnel) that records where it was asked to go."""

from __future__ import annotations

import asyncio
import contextlib

import pytest


class ConnectProxy:
    """Runs in the caller's event loop on 127.0.0.1. `routes` maps host names to the address
    the proxy connects to instead (its own DNS, as an egress proxy has)."""

    def __init__(self, routes: dict[str, str] | None = None) -> None:
        self.targets: list[str] = []
        # The Proxy-Authorization header of each CONNECT (None when there was none).
        self.authorizations: list[str | None] = []
        self.routes = routes or {}
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> ConnectProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = (await reader.readline()).decode("latin-1").split()
            authorization = None
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "proxy-authorization":
                    authorization = value.strip()
            if len(request) < 2 or request[0] != "CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                return
            self.targets.append(request[1])
            self.authorizations.append(authorization)
            host, _, port = request[1].rpartition(":")
            host = self.routes.get(host, host)
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def use_https_proxy(monkeypatch: pytest.MonkeyPatch, proxy: ConnectProxy) -> None:
    """Send this process's outbound traffic through proxy (HTTPS_PROXY, no NO_PROXY)."""
    for name in ("NO_PROXY", "no_proxy", "https_proxy", "HTTP_PROXY", "http_proxy",
                 "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
