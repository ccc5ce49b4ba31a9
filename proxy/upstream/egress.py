"""Where outbound connections may go. Registry hosts the operator named (allowed_hosts,
configured service URLs) are trusted as configured, on their configured port (443 when none)
only; any other target an upstream answer points to (redirects, discovered services, download
URLs, module sources, git redirects and submodules) must resolve to public addresses, or to
networks listed in `upstream.allowed_networks`. This keeps a hostile registry from aiming the
proxy at loopback, link-local (cloud metadata) or private services. A target's name is checked
against DNS rules (IDNA, label and length limits) before anything resolves it.

Through an outbound proxy (HTTPS_PROXY) the proxy, not this machine, resolves the target, so
a target name is judged before the tunnel is asked for: address literals (also legacy forms
such as `127.1`) must be allowed addresses; names in internal zones (`localhost`, `.local`,
`.internal`, `home.arpa`, `localdomain`, the other never-public zones below and
`upstream.internal_zones`) and single-label names (`metadata`, which only a search domain
completes) must resolve here to addresses inside `upstream.allowed_networks`; any other name
that resolves here must resolve only to allowed addresses; a name that does not resolve here
is left to the outbound proxy.

No credential from ~/.netrc or $NETRC is ever used: its `default` entry would go to any host
that asks. The outbound proxy's credentials come from its URL only, as in Terraform.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import re
import socket
import urllib.request
from collections.abc import Iterable

import idna
from aiohttp import BasicAuth
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.core.digits import is_decimal
from proxy.core.errors import UpstreamError
from proxy.core.executors import dns
from proxy.core.redaction import excerpt

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Endpoint = tuple[str, int]  # a normalized host and a port
# Special-use names that never name a public host: RFC 6761 (localhost), RFC 6762 (local),
# RFC 8375 (home.arpa), ICANN's private-use TLD (internal), the common localdomain, the
# private TLDs RFC 6762 appendix G found in use (none is delegated in the root), and svc,
# Kubernetes' service names (`kubernetes.default.svc`, completed by the search domains).
RESERVED_INTERNAL_ZONES = ("localhost", "local", "internal", "home.arpa", "localdomain",
                           "intranet", "private", "corp", "home", "lan", "svc")
# What getaddrinfo and an outbound proxy accept as a name: labels of letters, digits, `-` and
# `_` (not valid in host names, but in real DNS names), at most 63 each, 253 in all.
_LABEL = re.compile(r"[a-z0-9_-]{1,63}")
_MAX_NAME = 253
# A target name that does not answer here within this time is left to the outbound proxy.
LOCAL_LOOKUP_SECONDS = 2.0


async def lookup(host: str, port: int) -> list[IPAddress]:
    """The addresses this machine's resolver gives for host (the one place the policy
    resolves names itself), looked up in the DNS pool."""
    infos = await dns(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0]) for info in infos]


async def open_by_name(host: str, port: int
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to host (a name or an address) and port, its name looked up in the DNS
    pool: asyncio would look it up in the default executor."""
    literal = address_literal(normal_host(host))
    addresses = [literal] if literal is not None else await lookup(host, port)
    failure = OSError(f"{excerpt(host, 200)} has no address")
    for address in addresses:
        try:
            return await asyncio.open_connection(str(address), port)
        except OSError as exc:
            failure = exc
    raise failure


def _resolve(host: str, port: int, family: socket.AddressFamily) -> list[ResolveResult]:
    """getaddrinfo in aiohttp's form, as its threaded resolver makes it (blocking)."""
    infos = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM,
                               flags=socket.AI_ADDRCONFIG)
    results = []
    for found_family, _type, proto, _name, address in infos:
        found_host, found_port = str(address[0]), int(address[1])
        if found_family == socket.AF_INET6:
            if len(address) < 3:
                continue  # IPv6 that this Python cannot use
            if address[3]:  # a scope (link-local): only getnameinfo writes it with its zone
                found_host, numeric_port = socket.getnameinfo(
                    (found_host, found_port, address[2], address[3]),
                    socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)
                found_port = int(numeric_port)
        elif found_family != socket.AF_INET:
            continue
        results.append(ResolveResult(hostname=host, host=found_host, port=found_port,
                                     family=found_family, proto=proto,
                                     flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV))
    return results


def outbound_proxy(url: str) -> tuple[URL, BasicAuth | None] | None:
    """The HTTPS_PROXY that carries a request to url (NO_PROXY honored) and the credentials
    in its URL; None for a direct connection. Every outbound request passes it explicitly."""
    try:
        target = URL(url)
    except ValueError:
        return None
    if not target.host:
        return None
    return _outbound_proxy(target.scheme, target.host, _proxy_settings(target.scheme))


def _proxy_settings(scheme: str) -> tuple[str | None, ...]:
    """The variables that choose an outbound proxy for scheme, as set in practice: the key
    under which the choice is kept (a setting changed while the proxy runs takes effect)."""
    return tuple(os.environ.get(name) for name in (
        f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "no_proxy", "NO_PROXY"))


@functools.lru_cache(maxsize=1024)
def _outbound_proxy(scheme: str, host: str, _settings: tuple[str | None, ...]
                    ) -> tuple[URL, BasicAuth | None] | None:
    """outbound_proxy's choice for host, made once per host and settings: urllib reads the
    whole environment on every call (about 70 us; twice per upstream request)."""
    try:
        if urllib.request.proxy_bypass(host):
            return None
        configured = urllib.request.getproxies().get(scheme)
        proxy = URL(configured) if configured else None
    except ValueError:
        return None
    # Plain-http proxies only (the CONNECT tunnel carries the TLS), as aiohttp and the
    # git gate speak to them.
    if proxy is None or proxy.scheme != "http" or not proxy.host:
        return None
    return proxy.with_user(None), BasicAuth.from_url(proxy)


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


def target_host(host: str) -> str:
    """The comparison form of a host an upstream answer named, checked before anything
    resolves it: an address literal, or a name in IDNA ASCII form within DNS limits.
    UpstreamError (502) names an invalid one."""
    name = normal_host(host)
    if address_literal(name) is not None:
        return name
    problem = None
    if not name.isascii():
        try:
            name = idna.encode(name, uts46=True).decode("ascii").lower()
        except (idna.IDNAError, UnicodeError) as exc:
            problem = f"not a valid international name ({exc})"
    if problem is None:
        problem = _name_problem(name)
    if problem is not None:
        raise UpstreamError(f"refusing to connect to {excerpt(host, 200)!r}: it is not a "
                            f"valid host name ({excerpt(problem, 200)})")
    return name


def _name_problem(name: str) -> str | None:
    if not name:
        return "empty"
    if len(name) > _MAX_NAME:
        return f"over {_MAX_NAME} characters"
    for label in name.split("."):
        if not label or len(label) > 63:
            return "a label is empty or over 63 characters"
        if not _LABEL.fullmatch(label):
            return "only letters, digits, '-' and '_' may make up a label"
    return None


def endpoint(text: str, default_port: int) -> Endpoint:
    """The host and port of a `host`, `host:port` or `[v6]:port` entry."""
    host, sep, port = text.rpartition(":")
    if sep and is_decimal(port) and (host.startswith("[") or ":" not in host):
        return normal_host(host), int(port)
    return normal_host(text), default_port


class EgressPolicy:
    """Decides whether an address may be connected to for a given host name and port."""

    def __init__(self, trusted_hosts: Iterable[str], allowed_networks: Iterable[Network],
                 internal_zones: Iterable[str] = (), proxy_hosts: Iterable[str] = ()) -> None:
        # `host[:port]` entries: a trusted host on 443 unless it names its port, an
        # outbound proxy on 80 (the http default) unless it names its port.
        self.trusted = frozenset(endpoint(h, 443) for h in trusted_hosts)
        self.proxies = frozenset(endpoint(h, 80) for h in proxy_hosts)
        self.proxy_names = frozenset(host for host, _port in self.proxies)
        self.allowed_networks = tuple(allowed_networks)
        self.internal_zones = tuple(normal_host(z).strip(".") for z in
                                    (*RESERVED_INTERNAL_ZONES, *internal_zones))

    @classmethod
    def from_config(cls, config: UpstreamConfig, urls: Iterable[str] = ()) -> EgressPolicy:
        """Trust the configured registry hosts, service URL hosts and the hosts of urls
        (other configured upstreams: the CLI releases), each on its own port; the outbound
        proxy is trusted as a place to connect to, not as a target."""
        hosts = set(config.all_hosts)  # `host` or `host:port`, as normalized by the config
        for host_config in config.hosts.values():
            for url in host_config.services.values():
                hosts.add(_url_endpoint(url))
        hosts.update(_url_endpoint(url) for url in urls)
        proxies = {_url_endpoint(proxy) for scheme, proxy in urllib.request.getproxies().items()
                   if scheme == "https"}  # the one every outbound request may use
        hosts.discard("")
        proxies.discard("")
        return cls(hosts, config.allowed_networks, config.internal_zones, proxies)

    def allows(self, host: str, port: int, address: IPAddress) -> bool:
        """Whether connecting to address and port, reached under host, is acceptable."""
        target = (normal_host(host), port)
        if target in self.trusted or target in self.proxies:
            return True
        return self._address_allowed(address)

    def _address_allowed(self, address: IPAddress) -> bool:
        return address.is_global or self._in_allowed_networks(address)

    def _in_allowed_networks(self, address: IPAddress) -> bool:
        return any(address in network for network in self.allowed_networks)

    def in_internal_zone(self, host: str) -> bool:
        """Whether host is, or is under, an internal zone, or is a single-label name (which
        only the resolver's search domains, or the outbound proxy's, complete)."""
        name = normal_host(host)
        return "." not in name or any(name == zone or name.endswith("." + zone)
                                      for zone in self.internal_zones)

    async def check_target(self, url: str) -> None:
        """Refuse the host of a URL an upstream answer named before anything connects to it
        (checked on every hop: redirects, downloads, git connections)."""
        try:
            parts = URL(url)
        except ValueError:
            raise UpstreamError(f"refusing the invalid URL {excerpt(url, 200)!r}") from None
        host = target_host(parts.raw_host or "")
        port = parts.port or 443
        if (host, port) in self.trusted:
            return
        address = address_literal(host)
        if address is not None:
            if not self._address_allowed(address):
                raise _refusal(host, "not a public address")
            return
        internal = self.in_internal_zone(host)
        proxied = outbound_proxy(url) is not None
        if not (internal or proxied or host in self.proxy_names):
            return  # a direct connection: GuardedResolver checks every address it connects to
        addresses = await _lookup_here(host, port)
        if internal:
            if not addresses or not all(self._in_allowed_networks(a) for a in addresses):
                raise _refusal(host, "it is in an internal zone, reached only where it "
                                     "resolves here to allowed networks")
        elif not all(self._address_allowed(a) for a in addresses):  # [] : the proxy resolves
            raise _refusal(host, "it resolves to non-public addresses")

    async def connectable(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of host that a direct connection may use, resolved once here so that
        what is checked is what is connected to."""
        name = target_host(host)
        literal = address_literal(name)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = await lookup(name, port)
            except (OSError, ValueError) as exc:  # ValueError: what IDNA encoding raises
                raise UpstreamError(f"cannot resolve {excerpt(name, 200)}: "
                                    f"{excerpt(str(exc), 200)}") from None
        allowed = list(dict.fromkeys(a for a in addresses if self.allows(name, port, a)))
        if not allowed:
            raise _refusal(name, "it resolves only to non-public addresses")
        return allowed


async def _lookup_here(host: str, port: int) -> list[IPAddress]:
    try:
        return await asyncio.wait_for(lookup(host, port), LOCAL_LOOKUP_SECONDS)
    except (OSError, TimeoutError, ValueError):
        return []


def _url_endpoint(url: str) -> str:
    """`host:port` of a URL (`[v6]:port` for an IPv6 literal); "" when it names no host."""
    try:
        parts = URL(url)
    except ValueError:
        return ""
    host = parts.raw_host or ""
    if not host or parts.port is None:
        return ""
    return f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"


def _refusal(host: str, reason: str) -> UpstreamError:
    return UpstreamError(f"refusing to connect to {host[:200]}: {reason} "
                         "(see upstream.allowed_networks)")


class GuardedResolver(AbstractResolver):
    """aiohttp's threaded resolver, run in the DNS pool, with the addresses the policy refuses
    removed."""

    def __init__(self, policy: EgressPolicy) -> None:
        self._policy = policy

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        # OSError is how a resolver fails in aiohttp (a connection error, then a 502);
        # anything else would escape as an internal error.
        try:
            name = target_host(host)
            results = await dns(_resolve, host, port, family)
        except UpstreamError as exc:
            raise OSError(exc.message) from None
        except ValueError as exc:  # UnicodeError from IDNA encoding, should a name get here
            raise OSError(f"cannot resolve {excerpt(host, 200)}: {exc}") from None
        allowed = [r for r in results
                   if self._policy.allows(name, port, ipaddress.ip_address(r["host"]))]
        if not allowed:
            raise OSError(f"refusing to connect to {excerpt(host, 200)}: it resolves only to "
                          "non-public addresses (see upstream.allowed_networks)")
        return allowed

    async def close(self) -> None:
        """Nothing to release: lookups run in the shared DNS pool."""
