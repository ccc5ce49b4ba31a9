"""Prometheus metrics, one registry per app. Labels are bounded: never a version, provider
name, os or arch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    """Every metric the proxy exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "tfproxy_http_requests", "Client requests by route and status class.",
            ["route", "status_class"], registry=self.registry)
        self.cache_lookups = Counter(
            "tfproxy_cache_lookups", "Cache lookups by kind and result (hit, miss, stale).",
            ["kind", "result"], registry=self.registry)
        self.upstream_requests = Counter(
            "tfproxy_upstream_requests", "Upstream requests by origin host and outcome.",
            ["host", "outcome"], registry=self.registry)
        self.upstream_latency = Histogram(
            "tfproxy_upstream_request_duration_seconds", "Upstream request latency.",
            ["host"], registry=self.registry)
        self.upstream_bytes = Counter(
            "tfproxy_upstream_fetched_bytes", "Bytes fetched from upstream.",
            ["kind"], registry=self.registry)
        self.integrity_failures = Counter(
            "tfproxy_integrity_failures", "Upstream artifacts that failed verification.",
            ["kind"], registry=self.registry)
        self.served_bytes = Counter(
            "tfproxy_served_bytes", "Package and module bytes sent to clients.",
            ["kind"], registry=self.registry)
        self.aborted_responses = Counter(
            "tfproxy_aborted_responses", "Responses cut off after their headers were sent "
            "(connection reset), by route and reason (integrity, upstream, io, internal).",
            ["route", "reason"], registry=self.registry)
        self.bad_requests = Counter(
            "tfproxy_bad_requests", "Requests refused by the HTTP parser before any routing "
            "(method, request_line, url, header, too_long, framing, http2, other).",
            ["reason"], registry=self.registry)
        self.cache_files = Gauge(
            "tfproxy_cache_files", "Packages and modules in the cache.",
            registry=self.registry)
        self.cache_max_bytes = Gauge(
            "tfproxy_cache_max_size_bytes", "The cache's size limit (0: none).",
            registry=self.registry)
        self.evictions = Counter(
            "tfproxy_cache_evictions", "Files deleted to keep the cache under its size limit.",
            registry=self.registry)
        self.cache_bytes = Gauge(
            "tfproxy_cache_size_bytes", "Bytes of packages and modules in the cache.",
            registry=self.registry)
        self.tls_handshake_failures = Counter(
            "tfproxy_tls_handshake_failures", "Failed client TLS handshakes by kind "
            "(untrusted_certificate, plain_http, protocol_mismatch, other).", ["reason"],
            registry=self.registry)
        self.disk_full = Counter(
            "tfproxy_cache_disk_full", "Writes into the cache that found its disk full "
            "(ENOSPC, EDQUOT), or files refused as too large for the space left, by kind "
            "(package, module, index).", ["kind"], registry=self.registry)
        self.open_connections = Gauge(
            "tfproxy_open_connections", "Client connections open in this process, TLS "
            "handshakes under way included.", registry=self.registry)
        self.max_connections = Gauge(
            "tfproxy_max_connections", "server.max_connections: beyond it, new connections "
            "wait in the listen backlog.", registry=self.registry)
        self.connection_limit_waits = Counter(
            "tfproxy_connection_limit_waits", "Times this process stopped accepting "
            "connections because server.max_connections were open.", registry=self.registry)
        self.connections_cut = Counter(
            "tfproxy_connections_cut", "Client connections closed because the client was too "
            "slow (handshake_timeout, head_timeout).", ["reason"], registry=self.registry)
        self.fills_in_flight = Gauge(
            "tfproxy_fills_in_flight", "Upstream fills under way.", registry=self.registry)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
