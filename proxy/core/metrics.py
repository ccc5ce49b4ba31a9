"""Prometheus metrics, one registry per app. Labels are bounded: never a version, provider
name, os or arch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    """Every metric the proxy exports."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, labels, registry=registry)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, registry=registry)

        self.requests = counter("tfproxy_http_requests",
                                "Client requests by route and status class.",
                                "route", "status_class")
        self.cache_lookups = counter("tfproxy_cache_lookups",
                                     "Cache lookups by kind and result (hit, miss, stale).",
                                     "kind", "result")
        self.upstream_requests = counter("tfproxy_upstream_requests",
                                         "Upstream requests by origin host and outcome.",
                                         "host", "outcome")
        self.upstream_latency = Histogram("tfproxy_upstream_request_duration_seconds",
                                          "Upstream request latency.", ["host"],
                                          registry=registry)
        self.upstream_bytes = counter("tfproxy_upstream_fetched_bytes",
                                      "Bytes fetched from upstream.", "kind")
        self.integrity_failures = counter("tfproxy_integrity_failures",
                                          "Upstream artifacts that failed verification.", "kind")
        self.served_bytes = counter("tfproxy_served_bytes",
                                    "Package and module bytes sent to clients.", "kind")
        self.aborted_responses = counter(
            "tfproxy_aborted_responses", "Responses cut off after their headers were sent "
            "(connection reset), by route and reason (integrity, upstream, io, internal).",
            "route", "reason")
        self.bad_requests = counter(
            "tfproxy_bad_requests", "Requests refused by the HTTP parser before any routing "
            "(method, request_line, url, header, too_long, framing, http2, other).", "reason")
        self.cache_files = gauge("tfproxy_cache_files", "Packages and modules in the cache.")
        self.cache_max_bytes = gauge("tfproxy_cache_max_size_bytes",
                                     "The cache's size limit (0: none).")
        self.evictions = counter("tfproxy_cache_evictions",
                                 "Files deleted to keep the cache under its size limit.")
        self.cache_bytes = gauge("tfproxy_cache_size_bytes",
                                 "Bytes of packages and modules in the cache.")
        self.tls_handshake_failures = counter(
            "tfproxy_tls_handshake_failures", "Failed client TLS handshakes by kind "
            "(untrusted_certificate, plain_http, protocol_mismatch, other).", "reason")
        self.disk_full = counter(
            "tfproxy_cache_disk_full", "Writes into the cache that found its disk full "
            "(ENOSPC, EDQUOT), or files refused as too large for the space left, by kind "
            "(package, module, index).", "kind")
        self.open_connections = gauge(
            "tfproxy_open_connections", "Client connections open in this process, TLS "
            "handshakes under way included.")
        self.max_connections = gauge(
            "tfproxy_max_connections", "server.max_connections: beyond it, new connections "
            "wait in the listen backlog.")
        self.connection_limit_waits = counter(
            "tfproxy_connection_limit_waits", "Times this process stopped accepting "
            "connections because server.max_connections were open.")
        self.connections_cut = counter(
            "tfproxy_connections_cut", "Client connections closed because the client was too "
            "slow (handshake_timeout, head_timeout).", "reason")
        self.fills_in_flight = gauge("tfproxy_fills_in_flight", "Upstream fills under way.")
        self.fill_leases = counter(
            "tfproxy_fill_leases", "Fill leases in a shared store, by outcome: acquired, "
            "waited (for another replica's fill), taken_over (expired unrenewed), lost (not "
            "renewed in time).", "outcome")
        for outcome in ("acquired", "waited", "taken_over", "lost"):
            self.fill_leases.labels(outcome)
        self.store_operations = counter(
            "tfproxy_store_operations", "Requests to the storage backend by backend, operation "
            "(head, get, put, list, delete, ...) and outcome (ok, absent, conflict, error, "
            "unreachable).", "backend", "operation", "outcome")
        self.store_latency = Histogram("tfproxy_store_operation_seconds",
                                       "Storage backend request latency.",
                                       ["backend", "operation"], registry=registry)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
