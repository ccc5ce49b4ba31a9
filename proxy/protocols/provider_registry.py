"""The provider registry protocol (`providers.v1`) served by the proxy, for clients that reach
it through `host` blocks: upstream's documents with the signature material (`shasum`,
`signing_keys`, OpenTofu's `packages`, ...) passed through unchanged, SHA256SUMS and its
signature byte for byte, and the package from the same verified cache the mirror uses. The
client then checks the signature itself and records `zh:` hashes for every platform, as a
direct install does.

https://developer.hashicorp.com/terraform/internals/provider-registry-protocol
Operations: list_versions_body, download_document, signed_sums.
"""

from __future__ import annotations

from collections import OrderedDict
from types import MappingProxyType
from typing import Any

from proxy.config import UpstreamConfig
from proxy.core.errors import FilteredOut, NotFound
from proxy.core.held import keep_recent
from proxy.core.json_bodies import JsonBody
from proxy.core.models import Platform, ProviderAddress
from proxy.protocols.held_documents import VersionListAnswers
from proxy.protocols.version_policy import VersionPolicy, provider_target
from proxy.upstream.documents import VersionEntry
from proxy.verification.packages import VerifiedPackages, sums_id
from proxy.verification.stored_packages import StoredPackages

_HELD = 4096
# Upstream's download document and the id of the SHA256SUMS that vouches for it: verified
# facts, the same for good.
DownloadFacts = tuple[MappingProxyType[str, Any], str]


class ProviderRegistryService:
    """Answers `providers.v1` requests for every allowed upstream host."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages,
                 config: UpstreamConfig, policy: VersionPolicy) -> None:
        self._packages = packages
        self._policy = policy
        self._stored = stored
        self._filters = packages.filters
        self._versions: VersionListAnswers[list[VersionEntry]] = VersionListAnswers(
            config.offline, _HELD)
        self._downloads: OrderedDict[tuple[str, str, str], DownloadFacts] = OrderedDict()

    async def close(self) -> None:
        """Stop document rebuilds under way (shutdown)."""
        await self._versions.close()

    async def _versions_document(self, provider: ProviderAddress,
                                 entries: list[VersionEntry]) -> dict[str, Any]:
        """`:namespace/:type/versions`, with protocols and (allowed) platforms, from upstream's
        list (offline: what of it is held)."""
        entries = await self._stored.held_when_offline(provider, entries)
        target = provider_target(provider)
        shown = set(await self._policy.visible("provider", str(provider), target,
                                               [e.version for e in entries]))
        listed = []
        for entry in (e for e in entries if e.version in shown):
            platforms = await self._stored.platforms_held_when_offline(
                provider, entry.version,
                [p for p in entry.platforms if self._filters.platform_allowed(p)])
            listed.append({"version": entry.version, "protocols": list(entry.protocols),
                           "platforms": [{"os": p.os, "arch": p.arch} for p in platforms]})
        # Why versions are missing (the version policy), as Terraform prints them.
        warnings = self._policy.warnings("provider", str(provider), target)
        return {"versions": listed, **({"warnings": warnings} if warnings else {})}

    async def list_versions_body(self, provider: ProviderAddress) -> JsonBody:
        """`versions` as sent: serialized once per version list read (online), or per look
        at what the store holds (offline)."""
        self._packages.require_served(provider)
        return await self._versions.get(
            str(provider), lambda: self._packages.version_list(provider),
            lambda entries: self._versions_document(provider, entries),
            lambda entries: self._policy.list_tag("provider", str(provider),
                                                  provider_target(provider),
                                                  [e.version for e in entries]))

    async def download_document(self, provider: ProviderAddress, version: str,
                                platform: Platform) -> DownloadFacts:
        """Upstream's download document for the package (read-only; its URLs still
        upstream's: the caller points them at the proxy) and the name of the SHA256SUMS that
        vouches for it. Served only once the signature and checksum line verified; held in
        memory from then on."""
        self._packages.require_served(provider)
        if not self._filters.platform_allowed(platform):
            raise FilteredOut(f"{platform.key} packages are not served by this proxy (filters)")
        key = (str(provider), version, platform.key)
        held = self._downloads.get(key)
        if held is not None:
            self._downloads.move_to_end(key)
            return held
        entry = await self._packages.version_entry(provider, version)
        if platform not in entry.platforms:
            raise NotFound(f"{provider} {version} is not published for {platform.key}")
        package = await self._packages.package(provider, version, platform)
        if package.document is None or package.sums_id is None:
            # Facts recorded by an older release of the proxy: fetch the document again.
            info, _current = await self._packages.current_download(provider, version, platform)
            await self._packages.signed_sums(provider, version, info)
            return MappingProxyType(dict(info.document)), sums_id(info.shasums_url)
        facts = (MappingProxyType(dict(package.document)), package.sums_id)
        return keep_recent(self._downloads, key, facts, _HELD)

    async def signed_sums(self, provider: ProviderAddress, version: str,
                          name: str) -> tuple[bytes, bytes]:
        """The SHA256SUMS file and its signature, exactly as upstream published them."""
        self._packages.require_served(provider)
        found = await self._packages.stored_sums(provider, version, name)
        if found is None:
            raise NotFound(f"no verified SHA256SUMS {name[:40]!r} for {provider} {version}")
        return found

