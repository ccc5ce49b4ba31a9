"""OpenTofu providers through the OCI distribution API, read-only, from the same verified
packages the network mirror serves (https://github.com/opencontainers/distribution-spec,
https://opentofu.org/docs/cli/oci_registries/provider-mirror/).
Operations: tags (tags/list), manifest (manifests/<tag|digest>), blob (blobs/<digest>).

A version's index needs every platform manifest, and a platform manifest the size of its
zip, which the provider registry protocol does not give: the first request for a tag fills
every platform the proxy serves of that version (single-flighted with every other fill).
Every document handed out is recorded by digest (oci_records), so a digest stays resolvable
everywhere; the layers are the stored packages themselves."""

from __future__ import annotations

import logging

from proxy.config import UpstreamConfig
from proxy.core.errors import BadRequest, Offline
from proxy.core.models import Platform, ProviderAddress, parse_version
from proxy.core.spool import GrowingFile
from proxy.protocols.held_documents import Built, HeldAnswers, current_for
from proxy.protocols.network_mirror import INCOMPLETE_DOCUMENT_SECONDS, ProviderMirror
from proxy.protocols.oci_manifests import (
    Document,
    PlatformPackage,
    platform_manifest,
    provider_index,
    tag_of,
    version_of,
)
from proxy.protocols.oci_records import (
    BlobUnknown,
    ManifestUnknown,
    OciRecords,
    digest_hex,
    is_digest,
)
from proxy.protocols.platform_packages import for_each_platform, served_platforms
from proxy.protocols.version_policy import VersionPolicy, provider_target
from proxy.store.protocol import BlobInfo
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackages
from proxy.verification.stored_packages import StoredPackages

log = logging.getLogger(__name__)
_HELD = 4096


def provider_repository(provider: ProviderAddress) -> str:
    """The OCI repository name of a provider: `providers/HOST/NAMESPACE/TYPE`."""
    return f"providers/{provider}"


class OciProviders:
    """Tags, manifests and blobs of provider repositories, built from verified packages."""

    def __init__(self, mirror: ProviderMirror, packages: VerifiedPackages,
                 stored: StoredPackages, fills: PackageFills, records: OciRecords,
                 config: UpstreamConfig, policy: VersionPolicy) -> None:
        self._mirror = mirror
        self._policy = policy
        self._packages = packages
        self._stored = stored
        self._fills = fills
        self._records = records
        self._offline = config.offline
        self._indexes: HeldAnswers[Document] = HeldAnswers(_HELD)

    async def close(self) -> None:
        """Stop index rebuilds under way (shutdown)."""
        await self._indexes.close()

    # --- protocol operations -------------------------------------------------------------

    async def tags(self, provider: ProviderAddress) -> list[str]:
        """`tags/list`: every version as a tag, in lexical order (the order `last`
        paginates by); offline, the versions the store holds."""
        self._packages.require_served(provider)
        entries = await self._stored.held_when_offline(
            provider, await self._packages.version_list(provider))
        shown = await self._policy.visible("provider", str(provider), provider_target(provider),
                                           [entry.version for entry in entries])
        return sorted(tag_of(version) for version in shown)

    async def manifest(self, provider: ProviderAddress, reference: str) -> Document:
        """`manifests/<reference>`: by tag, the version's index; by digest, any document
        handed out for this repository."""
        self._packages.require_served(provider)
        if is_digest(reference):
            return await self._records.document(provider_repository(provider),
                                                digest_hex(reference))
        try:
            version = parse_version(version_of(reference))
        except BadRequest:
            raise ManifestUnknown(f"{provider} has no tag {reference[:80]!r} (tags are "
                                  "versions, with _ for +)") from None
        return await self._indexes.get((str(provider), version),
                                       lambda: self._built_index(provider, version))

    def require_served(self, provider: ProviderAddress) -> None:
        """Raises unless the proxy serves this provider (host allowed, filters)."""
        self._packages.require_served(provider)

    async def blob(self, provider: ProviderAddress,
                   digest: str) -> BlobInfo | GrowingFile[BlobInfo]:
        """`blobs/<digest>`: a verified package zip (stored, or the fill under way: the
        same as the network mirror's archive)."""
        self._packages.require_served(provider)
        hexdigest = digest_hex(digest)
        layer = await self._layer(provider, hexdigest)
        if layer is None:
            raise BlobUnknown(f"{provider} has no blob {digest}: ask for its manifest first")
        version, platform = layer
        await self._policy.require("provider", str(provider), provider_target(provider),
                                   version, f"{provider} {version} {platform.key}")
        # The record names the package that had this digest; the one verified now may be
        # another (pruned since, and republished upstream with other bytes).
        if (await self._packages.package(provider, version, platform)).shasum != hexdigest:
            raise BlobUnknown(f"{provider} {version} {platform.key} no longer has blob "
                              f"{digest}: ask for its manifest again")
        return await self._mirror.archive(provider, provider.archive_filename(version,
                                                                                platform))

    # --- the index of a version ----------------------------------------------------------

    async def _built_index(self, provider: ProviderAddress, version: str) -> Built[Document]:
        """The index of every platform whose package verified (offline: is stored); one
        that lacks a platform is retried after a few seconds, as VERSION.json is."""
        entry = await self._packages.version_entry(provider, version)
        platforms = served_platforms(provider, version, entry.platforms,
                                     self._packages.filters)

        async def one(platform: Platform) -> Document:
            return platform_manifest(await self._package(provider, version, platform))

        manifests, every_platform = await for_each_platform(provider, version, platforms, one)
        index = provider_index(manifests)
        repository = provider_repository(provider)
        for _platform, document in manifests:
            await self._records.record_document(repository, document)
        await self._records.record_document(repository, index)
        settled = every_platform and not self._offline
        return Built(index, keep=True,
                     until=None if settled else current_for(INCOMPLETE_DOCUMENT_SECONDS))

    async def _package(self, provider: ProviderAddress, version: str,
                       platform: Platform) -> PlatformPackage:
        """The sha256 and size of a platform's verified zip: stored, or filled now."""
        package = await self._packages.package(provider, version, platform)
        stored = await self._stored.stored(provider, version, platform)
        if stored is None:
            if self._offline:
                raise Offline(f"{provider} {version} {platform.key} is not in the cache, and "
                              "the proxy is offline")
            filled = await self._fills.archive(provider, version, platform)
            stored = await filled.wait_done() if isinstance(filled, GrowingFile) else filled
        await self._records.record_layer(provider_repository(provider), package.shasum, {
            "version": version, "os": platform.os, "arch": platform.arch})
        return PlatformPackage(platform, package.shasum, stored.size)

    async def _layer(self, provider: ProviderAddress,
                     sha256: str) -> tuple[str, Platform] | None:
        """The version and platform whose package is the layer with this sha256."""
        record = await self._records.layer(provider_repository(provider), sha256)
        if record is None:
            return None
        try:
            return (parse_version(record["version"]),
                    Platform.parse(record["os"], record["arch"]))
        except (BadRequest, KeyError, TypeError):
            log.warning("ignoring a malformed OCI layer record for %s %s", provider, sha256)
            return None
