"""Remote service discovery: which registry services an upstream host offers.

https://developer.hashicorp.com/terraform/internals/remote-service-discovery
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from urllib.parse import urljoin, urlsplit

from proxy.config import KNOWN_SERVICES, UpstreamConfig
from proxy.config.filters import Filters
from proxy.core.errors import NotFound, UpstreamError
from proxy.core.singleflight import SingleFlight
from proxy.upstream.http import MAX_JSON_BYTES, UpstreamHTTP

log = logging.getLogger(__name__)
# After discovery failed, the last good answer is used without asking again for this long.
FAILURE_BACKOFF_SECONDS = 30.0


class Discovery:
    """Resolves a hostname to its service base URLs. Configured hosts skip the network."""

    def __init__(self, http: UpstreamHTTP, config: UpstreamConfig, filters: Filters) -> None:
        self._http = http
        self._config = config
        self._filters = filters
        self._cache: dict[str, tuple[float, Mapping[str, str]]] = {}
        self._flights: SingleFlight[Mapping[str, str]] = SingleFlight()
        self._failed_until: dict[str, float] = {}

    async def service_url(self, hostname: str, service: str) -> str:
        """The base URL (ending in `/`) of `service` on `hostname`; NotFound if not offered."""
        self._filters.require_host(hostname)
        services = await self.services(hostname)
        url = services.get(service)
        if url is None:
            raise NotFound(f"host {hostname} offers no {service} service")
        return url

    async def services(self, hostname: str) -> Mapping[str, str]:
        """The services of an allowed host: configured, cached (TTL) or discovered."""
        override = self._config.hosts.get(hostname)
        if override is not None and override.services:
            return override.services
        cached = self._cache.get(hostname)
        now = time.monotonic()
        if cached is not None and (now - cached[0] < self._config.discovery_ttl
                                   or self._failed_until.get(hostname, 0.0) > now):
            return cached[1]
        try:
            services = await self._flights.run(hostname, lambda: self._discover(hostname))
        except UpstreamError:
            if cached is not None:
                log.warning("discovery for %s failed; using the stale answer", hostname)
                self._http.activity.stale_answer(hostname)
                self._failed_until[hostname] = now + FAILURE_BACKOFF_SECONDS
                return cached[1]
            raise
        self._failed_until.pop(hostname, None)
        self._cache[hostname] = (time.monotonic(), services)
        return services

    async def _discover(self, hostname: str) -> Mapping[str, str]:
        url = f"https://{hostname}/.well-known/terraform.json"
        fetched = await self._http.get(url, hostname, MAX_JSON_BYTES, authenticate=True)
        if fetched.status == 404:
            log.info("discovery on %s answered 404: no services", hostname)
            return {}
        if fetched.status != 200:
            raise UpstreamError(f"discovery on {hostname} answered {fetched.status}")
        services = parse_discovery(fetched.body, fetched.content_type, fetched.url)
        if services is None:
            # A captive portal or a broken proxy, not an answer: not cached, stale stays valid.
            raise UpstreamError(f"discovery on {hostname} did not answer a JSON object")
        return services


def parse_discovery(body: bytes, content_type: str, final_url: str) -> dict[str, str] | None:
    """Services from a discovery document: application/json, a JSON object; relative URLs
    resolve against the final URL. None when the body is not such a document."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, absurd numbers or nesting
        return None
    if not isinstance(document, dict):
        return None
    services: dict[str, str] = {}
    for name in KNOWN_SERVICES:
        value = document.get(name)
        if not isinstance(value, str) or not value:
            continue
        try:
            url = urljoin(final_url, value)
            if urlsplit(url).scheme != "https" or not urlsplit(url).hostname:
                continue
        except ValueError:  # e.g. "//[x": an invalid IPv6 literal
            continue
        # Clients do not add the trailing slash; neither may we drop path segments.
        services[name] = url if url.endswith("/") else url + "/"
    return services
