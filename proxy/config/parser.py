"""Validation of the raw configuration tables into Config, collecting every problem."""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.config.auth_parser import parse_auth
from proxy.config.policy_parser import parse_policy
from proxy.config.settings import (
    ENV_KEYS,
    KNOWN_SERVICES,
    CacheConfig,
    Config,
    ConfigError,
    FiltersConfig,
    ModulesConfig,
    ReleasesConfig,
    S3Config,
    Secret,
    ServerConfig,
    UpstreamConfig,
    UpstreamHostConfig,
    default_cache_dir,
    default_state_dir,
    parse_size,
)
from proxy.core.cpus import process_cpus
from proxy.core.digits import is_decimal
from proxy.core.errors import BadRequest
from proxy.core.models import normalize_hostname
from proxy.core.redaction import excerpt

# S3's rules for a bucket name: 3-63 lowercase letters, digits, dots and hyphens.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_tables(raw: dict[str, Any], problems: list[str]) -> Config:
    """Config from the raw TOML tables; raises ConfigError listing every problem."""
    return _Parser(raw, problems).config()


class _Parser:
    """Walks the raw TOML, collecting every problem before failing."""

    def __init__(self, raw: dict[str, Any], problems: list[str]) -> None:
        self.raw = raw
        self.problems = list(problems)

    def config(self) -> Config:
        self.unknown(self.raw, "", ("server", "cache", "upstream", "modules", "filters",
                                     "auth", "releases", "policy"))
        server = self._server(self._table(self.raw, "server"))
        cache_table = self._table(self.raw, "cache")
        self.unknown(cache_table, "cache.", (*ENV_KEYS["cache"], "s3"))
        max_size = None
        if cache_table.get("max_size") not in (None, "", 0, "0"):
            max_size = self._size("cache.max_size", cache_table, "max_size", 0) or None
        cache = CacheConfig(dir=self.path("cache.dir", cache_table, "dir")
                            or default_cache_dir(), max_size=max_size,
                            lease_seconds=self.number("cache.lease_seconds", cache_table,
                                                       "lease_seconds",
                                                       CacheConfig.lease_seconds),
                            s3=self._s3(self._table(cache_table, "s3")))
        if server.state_dir.resolve().is_relative_to(cache.dir.resolve()):
            self.problems.append(f"server.state_dir: {str(server.state_dir)!r} is inside "
                                 f"cache.dir {str(cache.dir)!r}; keep it apart (clearing the "
                                 "cache would delete the CA that clients trust)")
        upstream = self._upstream(self._table(self.raw, "upstream"))
        modules = self._modules(self._table(self.raw, "modules"), upstream)
        filters = self._filters(self._table(self.raw, "filters"))
        auth = parse_auth(self._table(self.raw, "auth"), self)
        releases = self._releases(self._table(self.raw, "releases"))
        policy = parse_policy(self._table(self.raw, "policy"), self.problems)
        if self.problems:
            raise ConfigError(self.problems)
        return Config(server=server, cache=cache, upstream=upstream, modules=modules,
                      filters=filters, auth=auth, releases=releases, policy=policy)

    def _releases(self, table: dict[str, Any]) -> ReleasesConfig:
        self.unknown(table, "releases.", ENV_KEYS["releases"])
        defaults = ReleasesConfig()

        def url(key: str, directory: bool) -> str:
            value = self._str(f"releases.{key}", table, key)
            if value is None:
                return str(getattr(defaults, key))
            if value and not _is_https_url(value):
                self.problems.append(f"releases.{key}: expected an https:// URL (or \"\" to "
                                     f"serve none), got {excerpt(value, 100)!r}")
            return value + "/" if directory and value and not value.endswith("/") else value

        def keys(key: str) -> Path | None:
            path = self.path(f"releases.{key}", table, key)
            if path is not None and not path.is_file():
                self.problems.append(f"releases.{key}: {str(path)!r} is not a readable file "
                                     "of armored OpenPGP public keys")
            return path

        return ReleasesConfig(
            terraform_url=url("terraform_url", True), opentofu_url=url("opentofu_url", True),
            opentofu_list_url=url("opentofu_list_url", False),
            terraform_keys=keys("terraform_keys"), opentofu_keys=keys("opentofu_keys"))

    def _s3(self, table: dict[str, Any]) -> S3Config | None:
        self.unknown(table, "cache.s3.", ENV_KEYS["cache.s3"])
        bucket = self._str("cache.s3.bucket", table, "bucket")
        if not bucket:
            if any(table.get(key) for key in table):
                self.problems.append("cache.s3.bucket: required when [cache.s3] is used")
            return None
        if not _BUCKET.fullmatch(bucket):
            self.problems.append(f"cache.s3.bucket: {bucket!r} is not an S3 bucket name")
        defaults = S3Config(bucket)
        endpoint = self._str("cache.s3.endpoint_url", table, "endpoint_url") or None
        if endpoint is not None:
            try:
                parts = urlsplit(endpoint)
                valid = parts.scheme in ("http", "https") and bool(parts.hostname) \
                    and not parts.username and not parts.password and not parts.query
                parts.port  # noqa: B018 (raises ValueError for a bad port)
            except ValueError:
                valid = False
            if not valid:
                # Credentials never go in the URL: they come from the AWS chain.
                self.problems.append("cache.s3.endpoint_url: expected an http(s) URL such as "
                                     "\"https://s3.example.internal\", without credentials")
                endpoint = None
        region = self._str("cache.s3.region", table, "region") or defaults.region
        prefix = self._str("cache.s3.prefix", table, "prefix")
        if prefix is None:
            prefix = defaults.prefix
        elif prefix and not prefix.endswith("/"):
            prefix += "/"
        if prefix and any(part in ("", ".", "..") for part in prefix[:-1].split("/")):
            self.problems.append(f"cache.s3.prefix: {prefix!r} has an empty, . or .. segment")
        serve = (self._str("cache.s3.serve", table, "serve") or defaults.serve).lower()
        if serve not in ("stream", "redirect"):
            self.problems.append(f"cache.s3.serve: expected stream or redirect, got {serve!r}")
            serve = defaults.serve
        return S3Config(bucket=bucket, endpoint_url=endpoint, region=region, prefix=prefix,
                        serve=serve)

    def _filters(self, table: dict[str, Any]) -> FiltersConfig:
        keys = ("providers", "exclude_providers", "modules", "exclude_modules", "platforms")
        self.unknown(table, "filters.", keys)
        lists: dict[str, tuple[str, ...]] = {}
        for key in keys:
            value = table.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                self.problems.append(f"filters.{key}: expected a list of glob patterns")
                value = []
            lists[key] = tuple(value)
        return FiltersConfig(**lists)

    def _modules(self, table: dict[str, Any], upstream: UpstreamConfig) -> ModulesConfig:
        self.unknown(table, "modules.", ENV_KEYS["modules"])
        defaults = ModulesConfig()
        default_host = defaults.default_host
        raw_host = self._str("modules.default_host", table, "default_host")
        if raw_host:
            default_host = self._hostname("modules.default_host", raw_host) or default_host
            if default_host not in upstream.all_hosts:
                self.problems.append(f"modules.default_host: {default_host} is not an "
                                     "allowed upstream host")
        elif default_host not in upstream.all_hosts and upstream.allowed_hosts:
            default_host = upstream.allowed_hosts[0]
        return ModulesConfig(
            default_host=default_host,
            max_archive_size=self._size("modules.max_archive_size", table, "max_archive_size",
                                        defaults.max_archive_size),
            git_timeout=self.number("modules.git_timeout", table, "git_timeout",
                                     defaults.git_timeout))

    def _server(self, table: dict[str, Any]) -> ServerConfig:
        self.unknown(table, "server.", ENV_KEYS["server"])
        defaults = ServerConfig()
        host, port = defaults.host, defaults.port
        listen = table.get("listen")
        if listen is not None:
            parsed = _parse_listen(listen)
            if parsed is None:
                self.problems.append(f"server.listen: expected \"host:port\" with a port "
                                     f"from 1 to 65535, got {listen!r}")
            else:
                host, port = parsed
        cert = self.path("server.tls_cert", table, "tls_cert")
        key = self.path("server.tls_key", table, "tls_key")
        if (cert is None) != (key is None):
            self.problems.append("server.tls_cert and server.tls_key: set both or neither")
        for name, path in (("server.tls_cert", cert), ("server.tls_key", key)):
            if path is not None and not path.is_file():
                self.problems.append(f"{name}: no such file {str(path)!r}")
        public_url = self._str("server.public_url", table, "public_url")
        if public_url:
            try:
                parts = urlsplit(public_url)
                valid = parts.scheme == "https" and bool(parts.hostname) and parts.port != 0
            except ValueError:
                valid = False
            if not valid or parts.query or parts.fragment:
                self.problems.append(f"server.public_url: expected an https URL such as "
                                     f"\"https://mirror.example:8443/\", got {public_url!r}")
            elif parts.path not in ("", "/"):
                self.problems.append("server.public_url: a path prefix is not supported; serve "
                                     "the proxy at the root of its URL")
        level = (self._str("server.log_level", table, "log_level") or defaults.log_level).lower()
        if level not in ("debug", "info", "warning", "error"):
            self.problems.append(
                f"server.log_level: expected debug, info, warning or error, got {level!r}")
        access_log = (self._str("server.access_log", table, "access_log") or "plain").lower()
        if access_log not in ("plain", "json", "off"):
            self.problems.append(f"server.access_log: expected plain, json or off, got "
                                 f"{access_log!r}")
            access_log = "plain"
        audit_log = self._audit_log(table)
        log_format = (self._str("server.log_format", table, "log_format") or "text").lower()
        if log_format not in ("text", "json"):
            self.problems.append(f"server.log_format: expected text or json, got {log_format!r}")
            log_format = "text"
        workers, workers_why = self._workers(table)
        event_loop = (self._str("server.event_loop", table, "event_loop") or "uvloop").lower()
        if event_loop not in ("uvloop", "asyncio"):
            self.problems.append(f"server.event_loop: expected uvloop or asyncio, got "
                                 f"{event_loop!r}")
            event_loop = "uvloop"
        shutdown_timeout = self.number("server.shutdown_timeout", table, "shutdown_timeout",
                                        defaults.shutdown_timeout)
        state_dir = self.path("server.state_dir", table, "state_dir") or default_state_dir()

        def seconds(key: str) -> float:
            return self.number(f"server.{key}", table, key, getattr(defaults, key))

        return ServerConfig(host=host, port=port, tls_cert=cert, tls_key=key,
                            public_url=public_url or None, log_level=level,
                            access_log=access_log, audit_log=audit_log,
                            log_format=log_format, workers=workers, workers_why=workers_why,
                            event_loop=event_loop,
                            shutdown_timeout=shutdown_timeout, state_dir=state_dir,
                            tls_handshake_timeout=seconds("tls_handshake_timeout"),
                            request_head_timeout=seconds("request_head_timeout"),
                            keepalive_timeout=seconds("keepalive_timeout"),
                            max_connections=self._whole("server.max_connections", table,
                                                        "max_connections",
                                                        defaults.max_connections))

    def _upstream(self, table: dict[str, Any]) -> UpstreamConfig:
        self.unknown(table, "upstream.", ("allowed_hosts", "hosts", "allowed_networks",
                                           "internal_zones",
                                           *ENV_KEYS["upstream"]))
        networks = []
        raw_networks = table.get("allowed_networks", [])
        if not isinstance(raw_networks, list):
            raw_networks = [raw_networks]
        for raw in raw_networks:
            try:
                networks.append(ipaddress.ip_network(str(raw), strict=False))
            except ValueError:
                self.problems.append(f"upstream.allowed_networks: {raw!r} is not a network "
                                     "such as \"10.0.0.0/8\"")
        mode = self._str("upstream.mode", table, "mode") or "online"
        if mode not in ("online", "offline"):
            self.problems.append(f"upstream.mode: expected \"online\" or \"offline\", "
                                 f"got {mode!r}")
            mode = "online"
        max_fills = self._whole("upstream.max_concurrent_fills", table,
                                "max_concurrent_fills", 8)
        defaults = UpstreamConfig()
        ca_bundle = self.path("upstream.ca_bundle", table, "ca_bundle")
        if ca_bundle is not None:
            if not ca_bundle.is_file():
                self.problems.append(f"upstream.ca_bundle: no such file {str(ca_bundle)!r}")
            else:
                try:
                    ssl.create_default_context().load_verify_locations(cafile=str(ca_bundle))
                except (ssl.SSLError, OSError) as exc:
                    self.problems.append(f"upstream.ca_bundle: {str(ca_bundle)!r} holds no "
                                         f"usable PEM CA certificate ({exc})")
        allowed = defaults.allowed_hosts
        raw_allowed = table.get("allowed_hosts")
        if raw_allowed is not None:
            if not isinstance(raw_allowed, list) \
                    or not all(isinstance(h, str) for h in raw_allowed):
                self.problems.append("upstream.allowed_hosts: expected a list of hostnames")
            else:
                allowed = tuple(h for h in (self._hostname("upstream.allowed_hosts", h)
                                            for h in raw_allowed) if h)
        hosts = self._hosts(table.get("hosts", {}))
        def seconds(key: str) -> float:
            return self.number(f"upstream.{key}", table, key, getattr(defaults, key))

        max_size = self._size("upstream.max_archive_size", table, "max_archive_size",
                              defaults.max_archive_size)
        return UpstreamConfig(
            ca_bundle=ca_bundle, allowed_hosts=allowed, hosts=hosts,
            discovery_ttl=seconds("discovery_ttl"), versions_ttl=seconds("versions_ttl"),
            connect_timeout=seconds("connect_timeout"),
            metadata_timeout=seconds("metadata_timeout"),
            download_timeout=seconds("download_timeout"), max_archive_size=max_size,
            mode=mode, max_concurrent_fills=max_fills, allowed_networks=tuple(networks),
            internal_zones=self._zones(table.get("internal_zones", [])))

    def _zones(self, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list) or not all(isinstance(z, str) for z in raw):
            self.problems.append("upstream.internal_zones: expected a list of DNS zones such "
                                 "as [\"corp.example.com\"]")
            return ()
        zones = []
        for zone in raw:
            name = self._hostname("upstream.internal_zones", zone.strip().strip("."))
            if name is not None and ":" in name:
                self.problems.append(f"upstream.internal_zones: {zone!r} is a zone, it takes "
                                     "no port")
            elif name is not None:
                zones.append(name)
        return tuple(zones)

    def _hosts(self, raw: object) -> dict[str, UpstreamHostConfig]:
        if not isinstance(raw, dict):
            self.problems.append("upstream.hosts: expected a table of hosts")
            return {}
        hosts: dict[str, UpstreamHostConfig] = {}
        for name, entry in raw.items():
            where = f"upstream.hosts.{name!r}"
            hostname = self._hostname(where, name)
            if not isinstance(entry, dict):
                self.problems.append(f"{where}: expected a table")
                continue
            self.unknown(entry, f"{where}.", ("services", "token"))
            services = entry.get("services", {})
            if not isinstance(services, dict):
                self.problems.append(f"{where}.services: expected a table of URLs")
                continue
            token = entry.get("token")
            if token is not None and (not isinstance(token, str) or not token
                                      or not token.isprintable()):
                self.problems.append(f"{where}.token: expected a non-empty string")
                token = None
            checked: dict[str, str] = {}
            for service, url in services.items():
                if service not in KNOWN_SERVICES:
                    self.problems.append(
                        f"{where}.services: unknown service {service!r} "
                        f"(known: {', '.join(KNOWN_SERVICES)})")
                elif not isinstance(url, str) or urlsplit(url).scheme != "https" \
                        or not urlsplit(url).hostname:
                    self.problems.append(f"{where}.services.{service}: expected an https URL")
                else:
                    checked[service] = url if url.endswith("/") else url + "/"
            if hostname:
                hosts[hostname] = UpstreamHostConfig(
                    services=checked, token=Secret(token) if token else None)
        return hosts

    # Small typed readers: each records a problem and returns a fallback on bad input.

    def _table(self, raw: dict[str, Any], key: str) -> dict[str, Any]:
        value = raw.get(key, {})
        if not isinstance(value, dict):
            self.problems.append(f"{key}: expected a table")
            return {}
        return value

    def unknown(self, table: dict[str, Any], prefix: str, known: tuple[str, ...]) -> None:
        for key in table:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
                self.problems.append(f"{prefix}{key}: unknown key{hint}")

    def _str(self, where: str, table: dict[str, Any], key: str) -> str | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            self.problems.append(f"{where}: expected a string, got {type(value).__name__}")
            return None
        return value

    def path(self, where: str, table: dict[str, Any], key: str) -> Path | None:
        value = self._str(where, table, key)
        return Path(value).expanduser() if value else None

    def _hostname(self, where: str, value: str) -> str | None:
        try:
            return normalize_hostname(value)
        except BadRequest as exc:
            self.problems.append(f"{where}: {exc.message}")
            return None

    def number(self, where: str, table: dict[str, Any], key: str, default: float) -> float:
        value = table.get(key, default)
        try:
            if isinstance(value, str) and not value.isascii():
                raise ValueError(value)  # float() reads other scripts' digits ("٣" as 3)
            number = float(value)
        except (TypeError, ValueError):
            self.problems.append(f"{where}: expected a number of seconds, got {value!r}")
            return default
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            self.problems.append(f"{where}: expected a positive number, got {value!r}")
            return default
        return number

    def _audit_log(self, table: dict[str, Any]) -> str | None:
        """server.audit_log: a file path, "-" for stdout; unset or "" (the default): off."""
        value = self._str("server.audit_log", table, "audit_log")
        if not value or value == "-":
            return value or None
        path = Path(value).expanduser().absolute()
        if path.is_dir():
            self.problems.append(f"server.audit_log: {str(path)!r} is a directory; expected "
                                 "a file path or \"-\" (stdout)")
        elif not path.parent.is_dir():
            self.problems.append(f"server.audit_log: no such directory {str(path.parent)!r}")
        return str(path)

    def _workers(self, table: dict[str, Any]) -> tuple[int, str]:
        """server.workers: a whole number, or "auto" (the default): one per CPU this process
        can use (affinity mask, cgroup quota); and why that many."""
        value = table.get("workers", "auto")
        if isinstance(value, str) and value.strip().lower() == "auto":
            usable = process_cpus()
            return usable.count, f'server.workers "auto": {usable.why}'
        if isinstance(value, bool) or not is_decimal(str(value).strip()) or int(value) < 1:
            self.problems.append(f'server.workers: expected "auto" or a whole number of at '
                                 f"least 1, got {value!r}")
            return 1, ""
        return int(value), ""  # as configured: nothing to explain

    def _whole(self, where: str, table: dict[str, Any], key: str, default: int) -> int:
        value = table.get(key, default)
        try:
            number = int(value)
            if isinstance(value, bool) or number < 1 or str(number) != str(value).strip():
                raise ValueError
        except (TypeError, ValueError):
            self.problems.append(f"{where}: expected a whole number of at least 1, "
                                 f"got {value!r}")
            return default
        return number

    def _size(self, where: str, table: dict[str, Any], key: str, default: int) -> int:
        value = table.get(key, default)
        size = parse_size(value)
        if size is None or size <= 0:
            self.problems.append(f"{where}: expected a size such as \"512MiB\", got {value!r}")
            return default
        return size


def _parse_listen(value: object) -> tuple[str, int] | None:
    if not isinstance(value, str):
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not is_decimal(port) or not 0 < int(port) <= 65535:
        return None
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def _is_https_url(value: str) -> bool:
    """An https:// URL with a host, and without credentials (they would show in logs)."""
    try:
        parts = urlsplit(value)
        return parts.scheme == "https" and bool(parts.hostname) and not parts.username \
            and parts.port != 0
    except ValueError:
        return False
