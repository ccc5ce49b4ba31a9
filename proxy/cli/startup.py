"""What `serve` says once when it starts (in the parent, whatever the number of workers): the
mode, where it listens, what it may contact, where it caches and within which limits, and
whether clients must authenticate. Never a credential: tokens are counted or named by host,
URLs are masked."""

from __future__ import annotations

import logging
from pathlib import Path

from proxy import __version__
from proxy.config import Config
from proxy.core.redaction import mask_secrets

log = logging.getLogger("proxy")


def startup_lines(config: Config, generated_ca: Path | None) -> list[str]:
    """The start-up log, one line per topic."""
    server, upstream = config.server, config.upstream
    workers = f"{server.workers} worker process{'es' if server.workers > 1 else ''}" + (
        f" ({server.workers_why})" if server.workers_why else "")
    mode = ("offline: upstream is never contacted, only cached artifacts are served"
            if upstream.offline else "online")
    host = f"[{server.host}]" if ":" in server.host else server.host
    # Not yet "listening": the port is bound after this (a port in use is a failure).
    lines = [f"tf-registry-proxy {__version__} starting, {mode}; server.listen "
             f"{host}:{server.port}, clients use {server.base_url}, {workers}"]
    if generated_ca is not None:
        # SSL_CERT_FILE replaces the system trust store: point it at a bundle, not the CA alone.
        lines.append(f"serving with a generated certificate: clients add the CA {generated_ca} "
                     "to their trust (a bundle with the system CAs, for SSL_CERT_FILE; see "
                     "`tf-registry-proxy client-config`)")
    lines.append(f"upstream hosts allowed: {', '.join(sorted(upstream.all_hosts)) or 'none'}"
                 + "".join(f"; {_host_services(name, config)}"
                           for name in sorted(upstream.hosts)))
    credentials = sorted(set(upstream.tokens) | {name for name, entry in upstream.hosts.items()
                                                 if entry.token is not None})
    if credentials:
        lines.append(f"upstream credentials configured for: {', '.join(credentials)}")
    lines.append(_cache_line(config))
    lines.append(
        f"limits: {server.max_connections} connections and {upstream.max_concurrent_fills} "
        f"upstream fills at once per worker; packages up to "
        f"{_size(upstream.max_archive_size)}, modules up to "
        f"{_size(config.modules.max_archive_size)}")
    tokens = len(config.auth.tokens)
    lines.append("client authentication: " + (
        f"on ({tokens} token{'s' if tokens > 1 else ''}; signed archive URLs valid "
        f"{config.auth.signed_url_ttl:g} s)" if config.auth.enabled else "off"))
    lines.append(f"access log: {server.access_log}; audit log: {_audit_log(config)}")
    return lines


def log_startup(config: Config, generated_ca: Path | None) -> None:
    """Log the start-up lines at INFO."""
    for line in startup_lines(config, generated_ca):
        log.info("%s", line)


def _host_services(name: str, config: Config) -> str:
    services = config.upstream.hosts[name].services
    if not services:
        return f"{name}: discovered"
    listed = ", ".join(f"{service} {mask_secrets(url)}" for service, url in
                       sorted(services.items()))
    return f"{name}: {listed}"


def _cache_line(config: Config) -> str:
    cache = config.cache
    limit = f"at most {_size(cache.max_size)}" if cache.max_size else "no size limit"
    if cache.s3 is None:
        return f"cache: directory {cache.dir} ({limit})"
    s3 = cache.s3
    endpoint = mask_secrets(s3.endpoint_url) if s3.endpoint_url else "AWS"
    return (f"cache: S3 bucket {s3.bucket}, prefix {s3.prefix!r}, endpoint {endpoint} "
            f"(region {s3.region}), archives served by {s3.serve}; local copies in "
            f"{cache.dir} ({limit})")


def _audit_log(config: Config) -> str:
    # server.audit_log: a path, "-" for stdout, or unset.
    target = config.server.audit_log
    if not target:
        return "off"
    return "stdout" if target == "-" else str(target)


def _size(size: int | None) -> str:
    if size is None:
        return "no limit"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"
