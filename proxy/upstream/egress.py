"""Where outbound connections may go. Registry hosts the operator named (allowed_hosts,
configured service URLs) and the outbound proxy are trusted as configured; any other host an
upstream answer points to (redirects, discovered services, download URLs, module sources) must
resolve to public addresses, or to networks listed in `upstream.allowed_networks`. This keeps
a hostile registry from aiming the proxy at loopback, link-local (cloud metadata) or private
services."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.request
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class EgressPolicy:
    """Decides whether an address may be connected to for a given host name."""

    def __init__(self, trusted_hosts: Iterable[str],
                 allowed_networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]
                 ) -> None:
        self.trusted_hosts = frozenset(h.lower().strip("[]") for h in trusted_hosts)
        self.allowed_networks = tuple(allowed_networks)

    @classmethod
    def from_config(cls, config: UpstreamConfig) -> EgressPolicy:
        """Trust the configured registry hosts and service URL hosts and the proxy."""
        hosts = {h.rsplit(":", 1)[0] if h.count(":") == 1 else h for h in config.all_hosts}
        for host_config in config.hosts.values():
            for url in host_config.services.values():
                hosts.add(urlsplit(url).hostname or "")
        for proxy in urllib.request.getproxies().values():
            hosts.add(urlsplit(proxy).hostname or "")
        hosts.discard("")
        return cls(hosts, config.allowed_networks)

    def allows(self, host: str, address: IPAddress) -> bool:
        """Whether connecting to address, reached under host, is acceptable."""
        if host.lower().strip("[]") in self.trusted_hosts:
            return True
        if address.is_global:
            return True
        return any(address in network for network in self.allowed_networks)

    def check_url(self, url: str) -> None:
        """Refuse a URL whose host is an address literal we may not connect to (literals are
        never resolved, so the resolver cannot catch them)."""
        host = urlsplit(url).hostname or ""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return
        if not self.allows(host, address):
            raise UpstreamError(f"refusing to connect to {host}: not a public address "
                                "(see upstream.allowed_networks)")

    async def check_host(self, url: str) -> None:
        """Resolve the URL's host here and apply the policy (for tools such as git that
        connect by themselves)."""
        self.check_url(url)
        host = urlsplit(url).hostname or ""
        if host.lower() in self.trusted_hosts:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, 443,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            raise UpstreamError(f"cannot resolve {host}: {exc}") from None
        addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
        if not any(self.allows(host, a) for a in addresses):
            raise UpstreamError(f"refusing to connect to {host}: it resolves only to "
                                "non-public addresses (see upstream.allowed_networks)")


class GuardedResolver(AbstractResolver):
    """The default resolver, with the addresses the policy refuses removed."""

    def __init__(self, policy: EgressPolicy) -> None:
        self._policy = policy
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results
                   if self._policy.allows(host, ipaddress.ip_address(r["host"]))]
        if not allowed:
            raise OSError(f"refusing to connect to {host}: it resolves only to non-public "
                          "addresses (see upstream.allowed_networks)")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
