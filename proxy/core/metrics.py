"""Prometheus metrics, one registry per app. Labels are bounded: never a version, provider
name, os or arch. Every series an alert reads exists from the start, at 0, for each label
value the code can produce: increase() and rate() see the first failure. With several worker
processes (proxy.core.shared_metrics), /metrics covers them all."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from proxy import __version__
from proxy.core.access import METHODS, REFUSAL_KINDS, RESULTS
from proxy.core.errors import INTEGRITY_KINDS
from proxy.core.shared_metrics import (
    WorkerProcesses,
    WorkerRestarts,
    service_pids,
    shared_directory,
)
from proxy.core.tree_memory import ProcessTreeMemory

__all__ = ["ABORT_REASONS", "CACHE_LOOKUPS", "CONTENT_TYPE_LATEST", "DISK_FULL_KINDS",
           "UPSTREAM_OUTCOMES", "Metrics"]

# The label values the code produces, by counter (each started at 0).
_HIT_MISS = ("hit", "miss")
_REFRESHED = ("hit", "miss", "revalidate", "stale")  # documents that expire (freshness.py)
CACHE_LOOKUPS = {"package": _HIT_MISS, "sums": _HIT_MISS, "archive": _HIT_MISS,
                 "module": _HIT_MISS, "versions": _REFRESHED, "module_versions": _REFRESHED}
UPSTREAM_OUTCOMES = ("ok", "client_error", "server_error", "error", "timeout")
ABORT_REASONS = ("integrity", "upstream", "io", "internal")  # proxy.web.responses
DISK_FULL_KINDS = ("package", "module", "index")  # proxy.store.disk_space
# How the workers' values of a gauge combine: livesum for what each process holds (open
# connections, fills), mostrecent for what every process sees alike (the shared cache).
_Combine = Literal["livesum", "mostrecent", "max"]


class SampledGauge(Gauge):
    """A gauge whose value a function gives at each scrape (set_function). The files that
    workers share hold stored values only: there, the scraping process stores it first."""

    _function: Callable[[], float] | None = None

    def set_function(self, f: Callable[[], float]) -> None:
        """Read f() at each scrape."""
        self._function = f
        super().set_function(f)

    def sample(self) -> None:
        """Store the function's current value."""
        if self._function is not None:
            self.set(self._function())


class _BuildInfo(Collector):
    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("tfproxy_build_info", "The running tf-registry-proxy "
                                   "version (always 1).", labels=["version"])
        family.add_metric([__version__], 1)
        return [family]


class _UpstreamMode(Collector):
    """1 when the proxy is offline (upstream.mode): alerts and dashboards that read only
    Prometheus can tell an offline instance's misses from failures."""

    def __init__(self, offline: bool) -> None:
        self._offline = offline

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("tfproxy_upstream_offline", "1 when upstream.mode is "
                                   "offline (upstream is never contacted), else 0.")
        family.add_metric([], 1 if self._offline else 0)
        return [family]


class Metrics:
    """Every metric the proxy exports. upstream_hosts and body_routes (routes that stream a
    file, whose responses can be cut off) name the label values of the series started at 0
    that depend on the configuration."""

    def __init__(self, upstream_hosts: Iterable[str] = (),
                 body_routes: Iterable[str] = (), offline: bool = False) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self._offline = offline
        self._sampled: list[SampledGauge] = []

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, labels, registry=registry)

        def gauge(name: str, text: str, combine: _Combine) -> Gauge:
            return Gauge(name, text, registry=registry, multiprocess_mode=combine)

        def sampled(name: str, text: str) -> SampledGauge:
            found = SampledGauge(name, text, registry=registry, multiprocess_mode="mostrecent")
            self._sampled.append(found)
            return found

        self.requests = counter("tfproxy_http_requests",
                                "Client requests by route and status class.",
                                "route", "status_class")
        self.cache_lookups = counter("tfproxy_cache_lookups", "Cache lookups by kind and "
                                     "result (hit, miss, stale, revalidate).",
                                     "kind", "result")
        self.upstream_requests = counter("tfproxy_upstream_requests",
                                         "Upstream requests by origin host and outcome.",
                                         "host", "outcome")
        self.upstream_latency = Histogram("tfproxy_upstream_request_duration_seconds",
                                          "Upstream request latency.", ["host"],
                                          registry=registry)
        self.connections_warmed = counter(
            "tfproxy_upstream_connections_warmed", "Connections to upstream opened ahead of a "
            "download a document announced (opened, failed).", "outcome")
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
        self.cache_files = sampled("tfproxy_cache_files", "Packages and modules in the cache.")
        self.cache_max_bytes = gauge("tfproxy_cache_max_size_bytes",
                                     "The cache's size limit (0: none).", "max")
        self.evictions = counter("tfproxy_cache_evictions",
                                 "Files deleted to keep the cache under its size limit.")
        self.cache_bytes = sampled("tfproxy_cache_size_bytes",
                                   "Bytes of packages and modules in the cache.")
        self.tls_handshake_failures = counter(
            "tfproxy_tls_handshake_failures", "Failed client TLS handshakes by kind "
            "(untrusted_certificate, plain_http, protocol_mismatch, other).", "reason")
        self.disk_full = counter(
            "tfproxy_cache_disk_full", "Writes into the cache that found its disk full "
            "(ENOSPC, EDQUOT), or files refused as too large for the space left, by kind "
            "(package, module, index).", "kind")
        self.open_connections = gauge(
            "tfproxy_open_connections", "Client connections open (in every worker process), "
            "TLS handshakes under way included.", "livesum")
        self.max_connections = gauge(
            "tfproxy_max_connections", "server.max_connections times the worker processes: "
            "beyond it, new connections wait in the listen backlog.", "livesum")
        self.connection_limit_waits = counter(
            "tfproxy_connection_limit_waits", "Times this process stopped accepting "
            "connections because server.max_connections were open.")
        self.connections_cut = counter(
            "tfproxy_connections_cut", "Client connections closed because the client was too "
            "slow (handshake_timeout, head_timeout).", "reason")
        self.fills_in_flight = gauge("tfproxy_fills_in_flight", "Upstream fills under way.",
                                     "livesum")
        self.fill_leases = counter(
            "tfproxy_fill_leases", "Fill leases in a shared store, by outcome: acquired, "
            "waited (for another replica's fill), taken_over (expired unrenewed), lost (not "
            "renewed in time).", "outcome")
        for outcome in ("acquired", "waited", "taken_over", "lost"):
            self.fill_leases.labels(outcome)
        self.policy_refusals = counter(
            "tfproxy_policy_refusals", "Direct requests the version policy refused, by reason "
            "(cooldown: too new; deny: a deny entry covers it).", "reason")
        for reason in REFUSAL_KINDS:
            self.policy_refusals.labels(reason)
        self.auth_requests = counter(
            "tfproxy_auth", "Client authentications by method (token, oidc, issued: an OCI "
            "token from /v2/token, signed_url) and result (ok, missing, invalid, expired, "
            "forbidden: the identity may not pull what it asked for).", "method", "result")
        for method in METHODS:
            for result in RESULTS:
                self.auth_requests.labels(method, result)
        self.store_operations = counter(
            "tfproxy_store_operations", "Requests to the storage backend by backend, operation "
            "(head, get, put, list, delete, ...) and outcome (ok, absent, conflict, error, "
            "unreachable).", "backend", "operation", "outcome")
        self.store_up = Gauge(
            "tfproxy_store_up", "1 while the shared store (cache.s3's bucket) answers, 0 while "
            "it is unreachable: probed every few seconds whatever the traffic (S3 only).",
            ["backend"], registry=registry, multiprocess_mode="livemin")
        self.store_latency = Histogram("tfproxy_store_operation_seconds",
                                       "Storage backend request latency.",
                                       ["backend", "operation"], registry=registry)

        self._start_at_zero(upstream_hosts, body_routes)
        self._exported = self._exported_registry()

    def _start_at_zero(self, upstream_hosts: Iterable[str], body_routes: Iterable[str]) -> None:
        """Create the series alerts read, at 0: a series that appears at 1 has no increase."""
        for integrity_kind in INTEGRITY_KINDS:
            self.integrity_failures.labels(integrity_kind)
        for lookup_kind, results in CACHE_LOOKUPS.items():
            for result in results:
                self.cache_lookups.labels(lookup_kind, result)
        for host in upstream_hosts:
            for outcome in UPSTREAM_OUTCOMES:
                self.upstream_requests.labels(host, outcome)
        for route in body_routes:
            for reason in ABORT_REASONS:
                self.aborted_responses.labels(route, reason)
        for disk_kind in DISK_FULL_KINDS:
            self.disk_full.labels(disk_kind)
        for outcome in ("opened", "failed"):
            self.connections_warmed.labels(outcome)

    def _exported_registry(self) -> CollectorRegistry:
        """What /metrics shows: this registry plus the version and this process's resources;
        or, as one of several workers, what every worker recorded and each one's resources."""
        directory = shared_directory()
        exported = self.registry
        if directory is None:
            ProcessCollector(registry=exported)
        else:
            exported = CollectorRegistry()
            MultiProcessCollector(exported, str(directory))  # type: ignore[no-untyped-call]
            exported.register(WorkerProcesses(directory))
        exported.register(WorkerRestarts(directory))  # at 0 for a single process
        exported.register(ProcessTreeMemory(lambda: service_pids(directory)))
        PlatformCollector(registry=exported)
        exported.register(_BuildInfo())
        exported.register(_UpstreamMode(self._offline))
        return exported

    def render(self) -> bytes:
        """The text exposition format."""
        if self._exported is not self.registry:
            for found in self._sampled:
                found.sample()
        return generate_latest(self._exported)
