"""The configuration's shape: typed, frozen dataclasses with their defaults (no I/O)."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proxy.core.cpus import available_cpus
from proxy.core.digits import is_decimal

CONFIG_ENV = "TF_REGISTRY_PROXY_CONFIG"
# TF_REGISTRY_PROXY_<SECTION>_<KEY> overrides a scalar key, e.g. TF_REGISTRY_PROXY_CACHE_DIR.
ENV_PREFIX = "TF_REGISTRY_PROXY_"
DEFAULT_ALLOWED_HOSTS = ("registry.terraform.io", "registry.opentofu.org")
KNOWN_SERVICES = ("providers.v1", "modules.v1")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE | re.ASCII)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(Exception):
    """One or more configuration problems, each naming its key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def default_cache_dir() -> Path:
    """A per-user cache directory (XDG_CACHE_HOME honored)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tf-registry-proxy"


def default_state_dir() -> Path:
    """A per-user state directory (XDG_STATE_HOME honored): kept apart from the cache, which
    may be deleted at any time."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tf-registry-proxy"


@dataclass(frozen=True)
class ServerConfig:
    """How the proxy listens and how clients reach it."""

    host: str = "127.0.0.1"
    port: int = 8443
    tls_cert: Path | None = None
    tls_key: Path | None = None
    public_url: str | None = None
    log_level: str = "info"
    log_format: str = "text"  # the application log: "text" or "json" (one object per line)
    access_log: str = "plain"  # "plain", "json" or "off"
    audit_log: str | None = None  # a file path, "-" (stdout), or None: off
    # Processes serving one port (SO_REUSEPORT), sharing the cache; "auto": one per CPU this
    # process can use (affinity mask and cgroup quota), and why that many (the start-up log).
    workers: int = field(default_factory=available_cpus)
    workers_why: str = field(default="", compare=False)
    event_loop: str = "uvloop"  # or "asyncio"; uvloop is used only where installed
    # Seconds responses under way get to finish on SIGTERM before they are cut.
    shutdown_timeout: float = 30.0
    # Bounds on clients that connect and then stall (a slow-loris), far above what a real
    # client needs: Terraform's own HTTP client gives up a TLS handshake after 10 s.
    tls_handshake_timeout: float = 10.0  # also bounds the TLS close exchange
    request_head_timeout: float = 20.0  # a request line and headers, from their first byte
    keepalive_timeout: float = 75.0  # idle between requests (above load balancers' 60 s)
    max_connections: int = 1000  # per process; beyond it new ones wait in the listen backlog
    # The generated CA, the server certificate and the URL-signing key: state that clients
    # depend on, so never under cache.dir.
    state_dir: Path = field(default_factory=default_state_dir)

    @property
    def base_url(self) -> str:
        """The https URL clients use, always ending in `/`."""
        if self.public_url:
            return self.public_url if self.public_url.endswith("/") else self.public_url + "/"
        host = "localhost" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{self.port}/"


@dataclass(frozen=True)
class S3Config:
    """An S3 bucket that holds the cache for every replica (credentials: the standard AWS
    chain, never the configuration)."""

    bucket: str
    endpoint_url: str | None = None  # None: AWS's own endpoint for the region
    region: str = "us-east-1"
    prefix: str = "tfproxy/"  # every object key starts with it
    serve: str = "stream"  # or "redirect": archive GETs answer 302 to a presigned URL


@dataclass(frozen=True)
class CacheConfig:
    """Where verified artifacts and metadata live, and how much room they may take."""

    dir: Path = field(default_factory=default_cache_dir)
    # Bytes of packages and modules on local disk; None: no limit. With s3, the bound of the
    # local copies of hits (the bucket itself is not bounded here).
    max_size: int | None = None
    s3: S3Config | None = None  # set: the cache is this bucket, cache.dir holds hot copies
    # How long a fill lease in a shared store lasts unrenewed (renewed every third of it):
    # a replica that dies mid-fill is taken over after at most this.
    lease_seconds: float = 30.0


class Secret:
    """A credential: usable through .value, never shown by repr or str (logs, errors)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


@dataclass(frozen=True)
class UpstreamHostConfig:
    """A configured upstream host: its service URLs replace remote discovery (when given);
    its token authenticates the proxy to it."""

    services: Mapping[str, str] = field(default_factory=dict)
    token: Secret | None = None


@dataclass(frozen=True)
class UpstreamConfig:
    """Which registries the proxy may contact, and how."""

    ca_bundle: Path | None = None
    allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS
    hosts: Mapping[str, UpstreamHostConfig] = field(default_factory=dict)
    discovery_ttl: float = 3600.0
    versions_ttl: float = 600.0
    # Terraform gives a mirror 10 s per request; an upstream answer must come well before.
    connect_timeout: float = 5.0
    metadata_timeout: float = 8.0
    download_timeout: float = 1800.0
    max_archive_size: int = 2 * 2**30
    mode: str = "online"  # "offline": never contact upstream, serve what is cached
    max_concurrent_fills: int = 8
    # Non-public networks that hosts named by upstream answers may resolve to.
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    # DNS zones of the operator's own networks (besides localhost, local, internal, home.arpa,
    # localdomain): hosts in them are reached only at addresses in allowed_networks.
    internal_zones: tuple[str, ...] = ()
    # Credentials from TF_TOKEN_* variables (they win over tokens in [upstream.hosts]).
    tokens: Mapping[str, Secret] = field(default_factory=dict)

    @property
    def offline(self) -> bool:
        """Whether upstream must never be contacted."""
        return self.mode == "offline"

    @property
    def all_hosts(self) -> frozenset[str]:
        """Every upstream host the proxy serves: allowed_hosts plus configured hosts."""
        return frozenset(self.allowed_hosts) | frozenset(self.hosts)

    def serves(self, hostname: str) -> bool:
        """Whether the proxy serves (and may contact) this normalized upstream hostname."""
        return hostname in self.allowed_hosts or hostname in self.hosts

    def token_for(self, hostname: str) -> str | None:
        """The credential the proxy presents to this registry host, if any."""
        token = self.tokens.get(hostname)
        if token is None:
            host = self.hosts.get(hostname)
            token = host.token if host is not None else None
        return token.value if token is not None else None


@dataclass(frozen=True)
class ModulesConfig:
    """How registry modules are fetched and served."""

    default_host: str = "registry.terraform.io"
    max_archive_size: int = 512 * 2**20
    git_timeout: float = 300.0


@dataclass(frozen=True)
class OidcRule:
    """Which verified tokens of a provider it admits (every claim matches its glob), and what
    they may pull (proxy.core.access)."""

    claims: Mapping[str, str]
    allow: tuple[str, ...]


@dataclass(frozen=True)
class OidcProvider:
    """An OIDC issuer whose tokens identify clients (`[[auth.oidc]]`): CI jobs, pods."""

    name: str  # shown in audit lines and metrics
    issuer: str
    audiences: tuple[str, ...]
    jwks_file: Path | None = None  # the issuer's keys: a file (re-read when it changes)...
    jwks_url: str | None = None  # ... or a URL (fetched through the egress policy, kept)
    leeway: float = 60.0  # seconds of clock skew allowed on exp, nbf and iat
    rules: tuple[OidcRule, ...] = ()


@dataclass(frozen=True)
class AuthConfig:
    """Optional client authentication: bearer tokens (static, or OIDC identities) for
    metadata, signed archive URLs."""

    tokens: tuple[Secret, ...] = ()
    signed_url_ttl: float = 3600.0
    # What logs call each token (by position; "token-N" for one given no name): the audit
    # log names who asked, never the token.
    token_names: tuple[str, ...] = ()
    # What each token may pull (by position; None: everything): allow patterns.
    token_allow: tuple[tuple[str, ...] | None, ...] = ()
    oidc: tuple[OidcProvider, ...] = ()

    def allow_of(self, index: int) -> tuple[str, ...] | None:
        """What the token at index may pull (None: everything)."""
        return self.token_allow[index] if index < len(self.token_allow) else None

    def name_of(self, index: int) -> str:
        """The name of the token at index in tokens."""
        if index < len(self.token_names) and self.token_names[index]:
            return self.token_names[index]
        return f"token-{index + 1}"

    @property
    def enabled(self) -> bool:
        """Whether clients must authenticate."""
        return bool(self.tokens) or bool(self.oidc)


@dataclass(frozen=True)
class FiltersConfig:
    """Optional globs limiting what is served (see proxy.config.filters)."""

    providers: tuple[str, ...] = ()
    exclude_providers: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    platforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReleasesConfig:
    """Where the Terraform and OpenTofu CLI releases come from (a URL set to "" serves none
    of that product), and the keys their SHA256SUMS must be signed by (None: the key the
    proxy ships for that product)."""

    terraform_url: str = "https://releases.hashicorp.com/"
    opentofu_url: str = "https://github.com/opentofu/opentofu/releases/download/"
    # OpenTofu's release list in the TofuDL mirror format (versions and their files).
    opentofu_list_url: str = "https://get.opentofu.org/tofu/api.json"
    terraform_keys: Path | None = None
    opentofu_keys: Path | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        """Every upstream URL configured (the hosts the proxy may fetch releases from)."""
        return tuple(u for u in (self.terraform_url, self.opentofu_url,
                                 self.opentofu_list_url) if u)


@dataclass(frozen=True)
class PolicyRule:
    """A more specific cooldown for the addresses `match` selects (`[[policy.rules]]`)."""

    match: str  # a HOST/NAMESPACE/NAME glob, or releases/PRODUCT
    min_release_age: float  # seconds


@dataclass(frozen=True)
class PolicyException:
    """A `[[policy.deny]]` or `[[policy.allow]]` entry: versions of the addresses `match`
    selects (a Terraform version constraint; None: every version), and why."""

    match: str
    versions: str | None
    reason: str


@dataclass(frozen=True)
class PolicyConfig:
    """Which versions may be served, and from when (`[policy]`)."""

    min_release_age: float = 0.0  # seconds; 0: no cooldown
    rules: tuple[PolicyRule, ...] = ()
    deny: tuple[PolicyException, ...] = ()
    allow: tuple[PolicyException, ...] = ()

    @property
    def active(self) -> bool:
        """Whether it can hide anything at all (else every version is served as listed)."""
        return bool(self.min_release_age > 0 or self.deny
                    or any(rule.min_release_age > 0 for rule in self.rules))


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    modules: ModulesConfig = field(default_factory=ModulesConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    releases: ReleasesConfig = field(default_factory=ReleasesConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The file it was read from (None: defaults only): SIGHUP reads [policy] from it again.
    source: Path | None = field(default=None, compare=False)


# The scalar keys, by table, that TF_REGISTRY_PROXY_<TABLE>_<KEY> may set (a nested table's
# dots are underscores: TF_REGISTRY_PROXY_CACHE_S3_BUCKET).
ENV_KEYS = {
    "server": ("listen", "tls_cert", "tls_key", "public_url", "log_level", "access_log",
               "audit_log",
               "workers", "event_loop", "shutdown_timeout", "state_dir", "tls_handshake_timeout",
               "request_head_timeout", "keepalive_timeout", "max_connections", "log_format"),
    "cache": ("dir", "max_size", "lease_seconds"),
    "cache.s3": ("bucket", "endpoint_url", "region", "prefix", "serve"),
    "upstream": ("ca_bundle", "mode", "discovery_ttl", "versions_ttl", "connect_timeout",
                 "metadata_timeout", "download_timeout", "max_archive_size",
                 "max_concurrent_fills"),
    "modules": ("default_host", "max_archive_size", "git_timeout"),
    "releases": ("terraform_url", "opentofu_url", "opentofu_list_url", "terraform_keys",
                 "opentofu_keys"),
}


_DURATION = re.compile(r"(\d+)([smhdw])", re.ASCII)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: object) -> float | None:
    """Parse `"72h"`, `"30m"`, `"7d"`, `"0"` (or a number of seconds) into seconds; None
    when malformed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if value >= 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if is_decimal(text):
        return float(text)
    match = _DURATION.fullmatch(text)
    return None if match is None else float(int(match.group(1)) * _DURATION_UNITS[match.group(2)])


def parse_size(value: object) -> int | None:
    """Parse `123`, `"512MiB"`, `"2GB"` into bytes; None when malformed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    match = _SIZE.fullmatch(value)
    if not match:
        return None
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
