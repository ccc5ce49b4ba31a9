"""Where outbound connections may go. Registry hosts the operator named (allowed_hosts,
configured service URLs) are trusted as configured; any other host an upstream answer points
to (redirects, discovered services, download URLs, module sources, git redirects and
submodules) must resolve to public addresses, or to networks listed in
`upstream.allowed_networks`. This keeps a hostile registry from aiming the proxy at loopback,
link-local (cloud metadata) or private services.

Through an outbound proxy (HTTPS_PROXY) the proxy, not this machine, resolves the target, so
a target name is judged before the tunnel is asked for: address literals (also legacy forms
such as `127.1`) must be allowed addresses; names in internal zones (`localhost`, `.local`,
`.internal`, `home.arpa`, `localdomain` and `upstream.internal_zones`) must resolve here to
addresses inside `upstream.allowed_networks`; any other name that resolves here must resolve
only to allowed addresses; a name that does not resolve here is left to the outbound proxy.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.request
from collections.abc import Iterable
from typing import Any

from aiohttp import BasicAuth
from aiohttp.abc import AbstractResolver
from aiohttp.helpers import get_env_proxy_for_url
from aiohttp.resolver import DefaultResolver
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamError
from proxy.executors import quick

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Special-use names that never name a public host: RFC 6761 (localhost), RFC 6762 (local),
# RFC 8375 (home.arpa), ICANN's private-use TLD (internal), and the common localdomain.
RESERVED_INTERNAL_ZONES = ("localhost", "local", "internal", "home.arpa", "localdomain")
# A target name that does not answer here within this time is left to the outbound proxy.
LOCAL_LOOKUP_SECONDS = 2.0


async def lookup(host: str, port: int) -> list[IPAddress]:
    """The addresses this machine's resolver gives for host (the one place the policy
    resolves names itself)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0]) for info in infos]


async def outbound_proxy(url: str) -> tuple[URL, BasicAuth | None] | None:
    """The HTTPS_PROXY that carries a request to url (NO_PROXY honored), chosen exactly as the
    outbound aiohttp session chooses it; None for a direct connection."""
    try:
        # In a thread: the choice may read ~/.netrc for the proxy's credentials.
        return await quick(get_env_proxy_for_url, URL(url))
    except (LookupError, ValueError):
        return None


def address_literal(host: str) -> IPAddress | None:
    """The address a host names literally, legacy IPv4 forms included (`127.1`, `0x7f.1`,
    `2130706433`), which resolvers and outbound proxies accept as addresses too."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def normal_host(host: str) -> str:
    """The form hosts are compared in: lowercase, no brackets, no trailing dot."""
    return host.lower().strip("[]").rstrip(".")


class EgressPolicy:
    """Decides whether an address may be connected to for a given host name."""

    def __init__(self, trusted_hosts: Iterable[str], allowed_networks: Iterable[Network],
                 internal_zones: Iterable[str] = (), proxy_hosts: Iterable[str] = ()) -> None:
        self.trusted_hosts = frozenset(normal_host(h) for h in trusted_hosts)
        self.proxy_hosts = frozenset(normal_host(h) for h in proxy_hosts)
        self.allowed_networks = tuple(allowed_networks)
        self.internal_zones = tuple(normal_host(z).strip(".") for z in
                                    (*RESERVED_INTERNAL_ZONES, *internal_zones))

    @classmethod
    def from_config(cls, config: UpstreamConfig) -> EgressPolicy:
        """Trust the configured registry hosts and service URL hosts; the outbound proxy is
        trusted as a place to connect to, not as a target."""
        hosts = {h.rsplit(":", 1)[0] if h.count(":") == 1 else h for h in config.all_hosts}
        for host_config in config.hosts.values():
            for url in host_config.services.values():
                hosts.add(URL(url).raw_host or "")
        proxies = {URL(proxy).raw_host or "" for proxy in urllib.request.getproxies().values()}
        hosts.discard("")
        proxies.discard("")
        return cls(hosts, config.allowed_networks, config.internal_zones, proxies)

    def allows(self, host: str, address: IPAddress) -> bool:
        """Whether connecting to address, reached under host, is acceptable."""
        name = normal_host(host)
        if name in self.trusted_hosts or name in self.proxy_hosts:
            return True
        return self._address_allowed(address)

    def _address_allowed(self, address: IPAddress) -> bool:
        return address.is_global or self._in_allowed_networks(address)

    def _in_allowed_networks(self, address: IPAddress) -> bool:
        return any(address in network for network in self.allowed_networks)

    def in_internal_zone(self, host: str) -> bool:
        """Whether host is, or is under, an internal zone."""
        name = normal_host(host)
        return any(name == zone or name.endswith("." + zone) for zone in self.internal_zones)

    async def check_target(self, url: str) -> None:
        """Refuse the host of a URL an upstream answer named before anything connects to it
        (checked on every hop: redirects, downloads, git connections)."""
        try:
            parts = URL(url)
        except ValueError:
            raise UpstreamError(f"refusing the invalid URL {url[:200]!r}") from None
        host = normal_host(parts.raw_host or "")
        if host in self.trusted_hosts:
            return
        address = address_literal(host)
        if address is not None:
            if not self._address_allowed(address):
                raise _refusal(host, "not a public address")
            return
        internal = self.in_internal_zone(host)
        proxied = await outbound_proxy(url) is not None
        if not (internal or proxied or host in self.proxy_hosts):
            return  # a direct connection: GuardedResolver checks every address it connects to
        addresses = await _lookup_here(host, parts.port or 443)
        if internal:
            if not addresses or not all(self._in_allowed_networks(a) for a in addresses):
                raise _refusal(host, "it is in an internal zone, reached only where it "
                                     "resolves here to allowed networks")
        elif not all(self._address_allowed(a) for a in addresses):  # [] : the proxy resolves
            raise _refusal(host, "it resolves to non-public addresses")

    async def connectable(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of host that a direct connection may use, resolved once here so that
        what is checked is what is connected to."""
        literal = address_literal(normal_host(host))
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = await lookup(host, port)
            except OSError as exc:
                raise UpstreamError(f"cannot resolve {host}: {exc}") from None
        allowed = list(dict.fromkeys(a for a in addresses if self.allows(host, a)))
        if not allowed:
            raise _refusal(host, "it resolves only to non-public addresses")
        return allowed


async def _lookup_here(host: str, port: int) -> list[IPAddress]:
    try:
        return await asyncio.wait_for(lookup(host, port), LOCAL_LOOKUP_SECONDS)
    except (OSError, TimeoutError, UnicodeError):
        return []


def _refusal(host: str, reason: str) -> UpstreamError:
    return UpstreamError(f"refusing to connect to {host[:200]}: {reason} "
                         "(see upstream.allowed_networks)")


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
