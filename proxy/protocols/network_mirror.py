"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions_body (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from proxy.config import UpstreamConfig
from proxy.core.activity import Activity
from proxy.core.errors import (
    FilteredOut,
    Offline,
)
from proxy.core.json_bodies import JsonBody, json_body
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress, version_sort_key
from proxy.core.spool import GrowingFile
from proxy.core.waits import missed_the_cache
from proxy.protocols.held_documents import (
    Built,
    HeldAnswers,
    VersionListAnswers,
    current_for,
)
from proxy.protocols.platform_packages import for_each_platform, served_platforms
from proxy.protocols.version_policy import VersionPolicy, provider_target
from proxy.store.protocol import BlobInfo
from proxy.upstream.documents import VersionEntry
from proxy.verification.hashes import zh_hash
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackage, VerifiedPackages
from proxy.verification.stored_packages import StoredPackages

log = logging.getLogger(__name__)
_HELD_DOCUMENTS = 4096
# A document that may still change (some platforms lack their h1; offline, every document,
# since an import into the shared store may add to it) is taken as current this long: an h1
# recorded by this process rebuilds it at once, a change made by another process shows
# within this bound (the first request past it still gets the held one, and has it rebuilt
# in the background).
INCOMPLETE_DOCUMENT_SECONDS = 5.0


@dataclass(frozen=True)
class _HeldDocument:
    document: dict[str, Any]
    body: JsonBody


class ProviderMirror:
    """Answers network mirror requests from verified packages: held ones from the store,
    others through a fill."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages, fills: PackageFills,
                 config: UpstreamConfig, metrics: Metrics, activity: Activity,
                 policy: VersionPolicy) -> None:
        self._packages = packages
        self._policy = policy
        self._activity = activity
        self._stored = stored
        self._fills = fills
        self._filters = packages.filters
        # VERSION.json documents as sent, rebuilt when this process records facts about one
        # of their packages.
        self._documents: HeldAnswers[_HeldDocument] = HeldAnswers(_HELD_DOCUMENTS)
        packages.on_save(self._forget_document)
        self._indexes: VersionListAnswers[list[VersionEntry]] = VersionListAnswers(
            config.offline, _HELD_DOCUMENTS)
        self._offline = config.offline
        self._metrics = metrics

    async def close(self) -> None:
        """Stop document rebuilds under way (shutdown)."""
        await self._documents.close()
        await self._indexes.close()

    # --- protocol operations -------------------------------------------------------------

    async def list_versions_body(self, provider: ProviderAddress) -> JsonBody:
        """`index.json` as sent: serialized once per version list read (online), or per look
        at what the store holds (offline: it follows what is stored, not only the list)."""
        self._packages.require_served(provider)
        return await self._indexes.get(
            str(provider), lambda: self._packages.version_list(provider),
            lambda entries: self._index(provider, entries),
            lambda entries: self._policy.list_tag("provider", str(provider),
                                                  provider_target(provider),
                                                  [e.version for e in entries]))

    async def _index(self, provider: ProviderAddress,
                     entries: list[VersionEntry]) -> dict[str, Any]:
        """The body of `index.json`: every valid version upstream lists (offline: held)."""
        entries = await self._stored.held_when_offline(provider, entries)
        shown = await self._policy.visible("provider", str(provider), provider_target(provider),
                                           [e.version for e in entries])
        ordered = sorted(shown, key=version_sort_key)
        return {"versions": {version: {} for version in ordered}}

    async def version_document(self, provider: ProviderAddress, version: str) -> dict[str, Any]:
        """The body of `VERSION.json` (not to be modified; the same object while it is held):
        every platform whose package verifies, with its hashes."""
        return (await self._held_document(provider, version)).document

    async def version_document_body(self, provider: ProviderAddress, version: str) -> JsonBody:
        """`VERSION.json` as sent (see version_document)."""
        return (await self._held_document(provider, version)).body

    def holds_document(self, provider: ProviderAddress, version: str, body: JsonBody) -> bool:
        """Whether body is the VERSION.json held for the next requests (one lacking a
        platform that upstream failed to deliver is built again on the next request)."""
        held = self._documents.held((str(provider), version))
        return held is not None and held.body is body

    def _forget_document(self, provider: ProviderAddress, version: str) -> None:
        self._documents.forget((str(provider), version))

    async def _held_document(self, provider: ProviderAddress, version: str) -> _HeldDocument:
        """The document from memory while it holds; else built, and held unless it lacks a
        platform that upstream failed to deliver (retried on the next request)."""
        self._packages.require_served(provider)
        return await self._documents.get((str(provider), version),
                                         lambda: self._built_document(provider, version))

    async def _built_document(self, provider: ProviderAddress,
                              version: str) -> Built[_HeldDocument]:
        document, complete, every_platform = await self._build_document(provider, version)
        # Offline, a platform the store lacks is left out as a matter of course, and every
        # document follows what is stored.
        settled = complete and not self._offline
        return Built(_HeldDocument(document, json_body(document)),
                     keep=every_platform or self._offline,
                     until=None if settled else current_for(INCOMPLETE_DOCUMENT_SECONDS))

    async def _build_document(self, provider: ProviderAddress,
                              version: str) -> tuple[dict[str, Any], bool, bool]:
        """The VERSION.json document, whether it is complete (every platform with its h1) and
        whether every platform is in it.

        Platforms that upstream lists but cannot (yet) deliver or verify are left out and
        retried on the next request: nothing about them is cached. A bad signature condemns
        the whole release."""
        entry = await self._packages.version_entry(provider, version)
        platforms = served_platforms(provider, version, entry.platforms, self._filters)

        async def one(platform: Platform) -> VerifiedPackage:
            if self._offline and await self._stored.stored(provider, version, platform) is None:
                raise Offline(f"{provider} {version} {platform.key} is not in the cache, and "
                              "the proxy is offline")
            package = await self._packages.package(provider, version, platform)
            return await self._stored.with_h1(provider, version, platform, package)

        packages, every_platform = await for_each_platform(provider, version, platforms, one)
        archives: dict[str, Any] = {}
        for platform, package in packages:
            hashes = [zh_hash(package.shasum)]
            if package.h1:
                hashes.insert(0, package.h1)
            archives[platform.key] = {"url": provider.archive_filename(version, platform),
                                      "hashes": hashes}
        complete = every_platform and all(len(a["hashes"]) == 2 for a in archives.values())
        return {"archives": archives}, complete, every_platform

    async def archive(self, provider: ProviderAddress,
                      filename: str) -> BlobInfo | GrowingFile[BlobInfo]:
        """The verified package named `filename`: the stored blob, or on a miss the download
        under way (shared by every caller), which is published only once verified."""
        self._packages.require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        if not self._filters.platform_allowed(platform):
            raise FilteredOut(f"{platform.key} packages are not served by this proxy (filters)")
        stored = await self._stored.stored(provider, version, platform)
        if stored is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            await self._packages.note_served(provider, version, platform)
            return stored
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        missed_the_cache()
        filled = await self._fills.archive(provider, version, platform)
        await self._packages.note_served(provider, version, platform)
        return filled

