"""Parsing of upstream provider registry documents (pure: no I/O).

Upstream answers are untrusted: every field is type-checked, every URL resolved against the
document's final URL and required to be https, every file name checked before it is used.
Reference: https://developer.hashicorp.com/terraform/internals/provider-registry-protocol
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from proxy.core.errors import BadRequest, UpstreamError
from proxy.core.models import Platform, is_valid_version

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SAFE_FILENAME = re.compile(r"^[A-Za-z0-9._+-]{1,255}$")
_MAX_PLATFORMS = 64
_MAX_KEYS = 16


@dataclass(frozen=True)
class VersionEntry:
    """One version from an upstream versions list, with the platforms it claims."""

    version: str
    protocols: tuple[str, ...]
    platforms: tuple[Platform, ...]


@dataclass(frozen=True)
class DownloadInfo:
    """An upstream download document for one version and platform, URLs made absolute."""

    platform: Platform
    filename: str
    shasum: str
    download_url: str
    shasums_url: str
    shasums_signature_url: str
    signing_keys: tuple[str, ...]
    document: dict[str, Any] = field(default_factory=dict)  # as published, for passing on


UPSTREAM_URL_FIELDS = ("download_url", "shasums_url", "shasums_signature_url")


def without_upstream_urls(document: dict[str, Any]) -> dict[str, Any]:
    """The download document minus upstream's three URLs: they may be presigned (tokens in
    the query), and whoever passes the document on puts its own URLs there anyway."""
    return {k: v for k, v in document.items() if k not in UPSTREAM_URL_FIELDS}


def parse_versions(document: object) -> list[VersionEntry]:
    """Parse `GET :ns/:type/versions`. Entries with an invalid version are dropped (a client
    rejects a whole list over one bad entry); invalid platforms are dropped from their entry."""
    if not isinstance(document, dict) or not isinstance(document.get("versions"), list):
        raise UpstreamError("upstream versions list is malformed: no \"versions\" array")
    entries: dict[str, VersionEntry] = {}
    for item in document["versions"]:
        if not isinstance(item, dict) or not is_valid_version(item.get("version")):
            continue
        protocols = item.get("protocols")
        platforms: list[Platform] = []
        raw_platforms = item.get("platforms")
        if isinstance(raw_platforms, list):
            for raw in raw_platforms[:_MAX_PLATFORMS]:
                platform = _platform_or_none(raw)
                if platform is not None and platform not in platforms:
                    platforms.append(platform)
        entries[item["version"]] = VersionEntry(
            version=item["version"],
            protocols=tuple(p for p in protocols if isinstance(p, str))
            if isinstance(protocols, list) else (),
            platforms=tuple(platforms),
        )
    return list(entries.values())


def parse_download(document: object, final_url: str, platform: Platform) -> DownloadInfo:
    """Parse `GET :ns/:type/:version/download/:os/:arch`, checking what clients check."""
    if not isinstance(document, dict):
        raise UpstreamError("upstream download document is not a JSON object")
    if document.get("os") != platform.os or document.get("arch") != platform.arch:
        raise UpstreamError(
            f"upstream download document is for {document.get('os')!r}_{document.get('arch')!r}"
            f", not {platform.key}")
    filename = document.get("filename")
    if not isinstance(filename, str) or not _SAFE_FILENAME.fullmatch(filename):
        raise UpstreamError("upstream download document has an invalid filename")
    shasum = document.get("shasum")
    if not isinstance(shasum, str) or not _SHA256_HEX.fullmatch(shasum):
        raise UpstreamError("upstream download document has an invalid shasum")
    keys_block = document.get("signing_keys")
    keys: list[str] = []
    if isinstance(keys_block, dict) and isinstance(keys_block.get("gpg_public_keys"), list):
        for key in keys_block["gpg_public_keys"][:_MAX_KEYS]:
            if isinstance(key, dict) and isinstance(key.get("ascii_armor"), str):
                keys.append(key["ascii_armor"])
    return DownloadInfo(
        platform=platform,
        filename=filename,
        shasum=shasum,
        download_url=_https_url(document, "download_url", final_url),
        shasums_url=_https_url(document, "shasums_url", final_url),
        shasums_signature_url=_https_url(document, "shasums_signature_url", final_url),
        signing_keys=tuple(keys),
        document=document,
    )


def parse_sha256sums(data: bytes) -> dict[str, str]:
    """Map file name to lowercase sha256 hex from a SHA256SUMS file (`HEX  NAME` lines; a
    `*` before the name marks binary mode). Lines that do not parse are ignored."""
    sums: dict[str, str] = {}
    for raw_line in data.decode("utf-8", errors="replace").splitlines():
        digest, _, name = raw_line.strip().partition(" ")
        name = name.strip().removeprefix("*")
        if _SHA256_HEX.fullmatch(digest.lower()) and name:
            sums.setdefault(name, digest.lower())  # the first line wins, as in Terraform
    return sums


def _platform_or_none(raw: object) -> Platform | None:
    if not isinstance(raw, dict):
        return None
    os, arch = raw.get("os"), raw.get("arch")
    if not isinstance(os, str) or not isinstance(arch, str):
        return None
    try:
        return Platform.parse(os, arch)
    except BadRequest:
        return None


def _https_url(document: dict[str, object], key: str, final_url: str) -> str:
    value = document.get(key)
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise UpstreamError(f"upstream download document has no valid {key}")
    try:
        url = urljoin(final_url, value)
        parts = urlsplit(url)
        valid = parts.scheme == "https" and bool(parts.hostname)
    except ValueError:  # e.g. "//[x": an invalid IPv6 literal
        valid = False
    if not valid:
        raise UpstreamError(f"upstream {key} is not a valid https URL")
    return url
