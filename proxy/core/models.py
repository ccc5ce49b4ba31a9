"""Pure values and parsing: hostnames, provider addresses, versions, platforms.

Everything that comes from a client or from upstream passes through here before it is used as
a cache key, a file name or part of an upstream URL.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

import idna

from proxy.core.digits import is_decimal
from proxy.core.errors import BadRequest

_MAX_HOSTNAME = 253
# Semantic Versioning 2.0.0 as Terraform's version parser accepts it: three numeric parts, no
# leading zeros, no "v" prefix, optional pre-release and build metadata.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$",
    re.ASCII,  # \d is Unicode's otherwise: "1٣.0.0" would pass
)
# Provider namespaces and types: letters, digits and single dashes (Terraform's provider part).
_PROVIDER_PART = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_PLATFORM_PART = re.compile(r"^[a-z0-9]{1,32}$")
# Module registry address parts keep their case (Terraform's module address rules).
_MODULE_PART = re.compile(r"^[0-9A-Za-z](?:[0-9A-Za-z_-]{0,62}[0-9A-Za-z])?$")
_MODULE_SYSTEM = re.compile(r"^[0-9a-z]{1,64}$")
# Module versions are parsed by clients with hashicorp/go-version, which is laxer than semver
# ("v1.2", "1.2.0.1" pass); this keeps to that while staying safe as a path segment.
_MODULE_VERSION = re.compile(
    r"^v?\d{1,9}(?:\.\d{1,9}){0,3}(?:-?[0-9A-Za-z][0-9A-Za-z-]*(?:\.[0-9A-Za-z-]+)*)?"
    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$", re.ASCII)
_MAX_PART = 64
_MAX_VERSION = 128


@functools.lru_cache(maxsize=4096)  # per request on every route: IDNA is not cheap
def normalize_hostname(text: str) -> str:
    """Return the comparison form of a registry hostname: IDNA ASCII, lowercase, `:port` kept
    unless it is the default 443. Raises BadRequest when the name is not a valid hostname."""
    if not text or len(text) > _MAX_HOSTNAME + 6:
        raise BadRequest(f"invalid hostname {text[:80]!r}")
    if any(c in text for c in "/\\@?#%[] \t\r\n\0") or not text.isprintable():
        raise BadRequest(f"invalid hostname {text[:80]!r}")
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, ""
    elif not is_decimal(port) or not 0 < int(port) <= 65535 or port.startswith("0"):
        raise BadRequest(f"invalid port in hostname {text[:80]!r}")
    if not host or host.startswith(".") or host.endswith(".") or ".." in host:
        raise BadRequest(f"invalid hostname {text[:80]!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        raise BadRequest(f"IP addresses are not registry hostnames: {text[:80]!r}")
    try:
        ascii_host = idna.encode(host, uts46=True).decode("ascii").lower()
    except (idna.IDNAError, UnicodeError) as exc:
        raise BadRequest(f"invalid hostname {text[:80]!r}: {exc}") from None
    if len(ascii_host) > _MAX_HOSTNAME:
        raise BadRequest(f"hostname too long: {text[:80]!r}")
    if port and port != "443":
        return f"{ascii_host}:{port}"
    return ascii_host


def parse_version(text: str) -> str:
    """Validate a semantic version string and return it unchanged."""
    if len(text) > _MAX_VERSION or not _SEMVER.fullmatch(text):
        raise BadRequest(f"invalid version {text[:80]!r}")
    return text


def is_valid_version(text: object) -> bool:
    """True for a version string a Terraform client will accept."""
    return isinstance(text, str) and len(text) <= _MAX_VERSION and bool(_SEMVER.fullmatch(text))


def version_sort_key(version: str) -> tuple[int, int, int, int, tuple[tuple[int, int | str], ...]]:
    """Semver precedence as a sort key (build metadata ignored, pre-releases sort first)."""
    match = _SEMVER.fullmatch(version)
    if match is None:
        raise ValueError(version)
    major, minor, patch, pre, _build = match.groups()
    if pre is None:
        return (int(major), int(minor), int(patch), 1, ())
    idents = tuple((0, int(p)) if p.isdigit() else (1, p) for p in pre.split("."))
    return (int(major), int(minor), int(patch), 0, idents)


def parse_provider_part(text: str, what: str) -> str:
    """Validate a provider namespace or type; returns its lowercase form."""
    lowered = text.lower()
    if len(lowered) > _MAX_PART or not _PROVIDER_PART.fullmatch(lowered):
        raise BadRequest(f"invalid provider {what} {text[:80]!r}")
    return lowered


@dataclass(frozen=True, order=True)
class Platform:
    """An os/arch pair such as linux_amd64."""

    os: str
    arch: str

    @classmethod
    def parse(cls, os: str, arch: str) -> Platform:
        """Validate os and arch separately."""
        if not _PLATFORM_PART.fullmatch(os) or not _PLATFORM_PART.fullmatch(arch):
            raise BadRequest(f"invalid platform {os[:40]!r}_{arch[:40]!r}")
        return cls(os, arch)

    @classmethod
    def from_key(cls, key: str) -> Platform:
        """Parse the `os_arch` form used in mirror documents."""
        os, sep, arch = key.partition("_")
        if not sep:
            raise BadRequest(f"invalid platform {key[:80]!r}")
        return cls.parse(os, arch)

    @property
    def key(self) -> str:
        """The `os_arch` form."""
        return f"{self.os}_{self.arch}"


@dataclass(frozen=True)
class ProviderAddress:
    """A provider at its origin registry: hostname/namespace/type, all normalized."""

    hostname: str
    namespace: str
    type: str

    @classmethod
    def parse(cls, hostname: str, namespace: str, type_: str) -> ProviderAddress:
        """Normalize and validate the three parts."""
        return _provider_address(hostname, namespace, type_)

    def __str__(self) -> str:
        return f"{self.hostname}/{self.namespace}/{self.type}"

    def archive_filename(self, version: str, platform: Platform) -> str:
        """The name under which the mirror serves a package (what `terraform providers
        mirror` writes too)."""
        return f"terraform-provider-{self.type}_{version}_{platform.key}.zip"

    def parse_archive_filename(self, filename: str) -> tuple[str, Platform]:
        """Inverse of archive_filename: the version and platform a served file name names."""
        prefix = f"terraform-provider-{self.type}_"
        if not filename.startswith(prefix) or not filename.endswith(".zip"):
            raise BadRequest(f"not a provider package name: {filename[:120]!r}")
        parts = filename[len(prefix) : -len(".zip")].rsplit("_", 2)
        if len(parts) != 3:
            raise BadRequest(f"not a provider package name: {filename[:120]!r}")
        version, os, arch = parts
        return parse_version(version), Platform.parse(os, arch)


def is_valid_module_version(text: object) -> bool:
    """True for a module version string a client accepts."""
    return isinstance(text, str) and len(text) <= _MAX_VERSION \
        and bool(_MODULE_VERSION.fullmatch(text))


def parse_module_version(text: str) -> str:
    """Validate a module version string and return it unchanged."""
    if not is_valid_module_version(text):
        raise BadRequest(f"invalid module version {text[:80]!r}")
    return text


@functools.lru_cache(maxsize=4096)  # per request on every provider route
def _provider_address(hostname: str, namespace: str, type_: str) -> ProviderAddress:
    return ProviderAddress(normalize_hostname(hostname),
                           parse_provider_part(namespace, "namespace"),
                           parse_provider_part(type_, "type"))


@dataclass(frozen=True)
class ModuleAddress:
    """A registry module at its origin registry: hostname/namespace/name/system."""

    hostname: str
    namespace: str
    name: str
    system: str

    @classmethod
    def parse(cls, hostname: str, namespace: str, name: str, system: str) -> ModuleAddress:
        """Normalize the hostname, validate the rest (case preserved)."""
        for part, what in ((namespace, "namespace"), (name, "name")):
            if not _MODULE_PART.fullmatch(part):
                raise BadRequest(f"invalid module {what} {part[:80]!r}")
        if not _MODULE_SYSTEM.fullmatch(system):
            raise BadRequest(f"invalid module system {system[:80]!r}")
        return cls(normalize_hostname(hostname), namespace, name, system)

    @property
    def path(self) -> str:
        """`namespace/name/system`, as in registry URLs."""
        return f"{self.namespace}/{self.name}/{self.system}"

    def __str__(self) -> str:
        return f"{self.hostname}/{self.path}"
