"""The provider registry protocol (`providers.v1`) served by the proxy, for clients that reach
it through `host` blocks: upstream's documents with the signature material (`shasum`,
`signing_keys`, OpenTofu's `packages`, ...) passed through unchanged, SHA256SUMS and its
signature byte for byte, and the package from the same verified cache the mirror uses. The
client then checks the signature itself and records `zh:` hashes for every platform, as a
direct install does.

https://developer.hashicorp.com/terraform/internals/provider-registry-protocol
Operations: list_versions, download_document, signed_sums.
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import NotFound
from proxy.core.models import Platform, ProviderAddress
from proxy.verification.packages import VerifiedPackages, sums_id
from proxy.verification.stored_packages import StoredPackages


class ProviderRegistryService:
    """Answers `providers.v1` requests for every allowed upstream host."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages) -> None:
        self._packages = packages
        self._stored = stored
        self._filters = packages.filters

    async def list_versions(self, provider: ProviderAddress) -> dict[str, Any]:
        """`:namespace/:type/versions`, with protocols and (allowed) platforms."""
        self._packages.require_served(provider)
        entries = await self._stored.held_when_offline(
            provider, await self._packages.version_list(provider))
        listed = []
        for entry in entries:
            platforms = await self._stored.platforms_held_when_offline(
                provider, entry.version,
                [p for p in entry.platforms if self._filters.platform_allowed(p)])
            listed.append({"version": entry.version, "protocols": list(entry.protocols),
                           "platforms": [{"os": p.os, "arch": p.arch} for p in platforms]})
        return {"versions": listed}

    async def download_document(self, provider: ProviderAddress, version: str,
                                platform: Platform) -> tuple[dict[str, Any], str]:
        """Upstream's download document for the package (its URLs still upstream's; the
        caller points them at the proxy) and the name of the SHA256SUMS that vouches for it.
        Served only once the signature and checksum line verified."""
        self._packages.require_served(provider)
        if not self._filters.platform_allowed(platform):
            raise NotFound(f"{platform.key} packages are not served by this proxy (filters)")
        entry = await self._packages.version_entry(provider, version)
        if platform not in entry.platforms:
            raise NotFound(f"{provider} {version} is not published for {platform.key}")
        package = await self._packages.package(provider, version, platform)
        if package.document is None or package.sums_id is None:
            # Facts recorded by an older release of the proxy: fetch the document again.
            info, _current = await self._packages.current_download(provider, version, platform)
            await self._packages.signed_sums(provider, version, info)
            return dict(info.document), sums_id(info.shasums_url)
        return dict(package.document), package.sums_id

    async def signed_sums(self, provider: ProviderAddress, version: str,
                          name: str) -> tuple[bytes, bytes]:
        """The SHA256SUMS file and its signature, exactly as upstream published them."""
        self._packages.require_served(provider)
        found = await self._packages.stored_sums(provider, version, name)
        if found is None:
            raise NotFound(f"no verified SHA256SUMS {name[:40]!r} for {provider} {version}")
        return found
