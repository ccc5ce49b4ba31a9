"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from proxy.config import UpstreamConfig
from proxy.core.errors import (
    InsufficientStorage,
    IntegrityError,
    NotFound,
    Offline,
    ProxyError,
    UpstreamError,
)
from proxy.core.json_bodies import JsonBody, json_body
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress, version_sort_key
from proxy.core.spool import GrowingFile
from proxy.store.protocol import BlobInfo
from proxy.verification.hashes import zh_hash
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackage, VerifiedPackages
from proxy.verification.stored_packages import StoredPackages

log = logging.getLogger(__name__)
_PLATFORM_FETCH_CONCURRENCY = 8
_HELD_DOCUMENTS = 4096
# A document whose packages are all verified but some still lack their h1 is answered from
# memory this long; an h1 recorded by this process rebuilds it at once, one recorded by
# another process sharing the store shows within this bound.
INCOMPLETE_DOCUMENT_SECONDS = 5.0


@dataclass(frozen=True)
class _HeldDocument:
    document: dict[str, Any]
    body: JsonBody
    until: float | None  # monotonic; None: complete, nothing in it changes any more


class ProviderMirror:
    """Answers network mirror requests from verified packages: held ones from the store,
    others through a fill."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages, fills: PackageFills,
                 config: UpstreamConfig, metrics: Metrics) -> None:
        self._packages = packages
        self._stored = stored
        self._fills = fills
        self._filters = packages.filters
        # VERSION.json documents as sent, rebuilt when this process records facts about one
        # of their packages (saves counts those, so a build that raced one is not kept).
        self._documents: OrderedDict[tuple[str, str], _HeldDocument] = OrderedDict()
        self._saves = 0
        packages.on_save(self._forget_document)
        # index.json as sent, for the version list object it was built from (the same object
        # until the list is read or refreshed again).
        self._indexes: OrderedDict[str, tuple[object, JsonBody]] = OrderedDict()
        self._offline = config.offline
        self._metrics = metrics

    # --- protocol operations -------------------------------------------------------------

    async def list_versions(self, provider: ProviderAddress) -> dict[str, Any]:
        """The body of `index.json`: every valid version upstream lists (offline: held)."""
        self._packages.require_served(provider)
        entries = await self._stored.held_when_offline(
            provider, await self._packages.version_list(provider))
        ordered = sorted((e.version for e in entries), key=version_sort_key)
        return {"versions": {version: {} for version in ordered}}

    async def list_versions_body(self, provider: ProviderAddress) -> JsonBody:
        """`index.json` as sent: serialized once per version list read (online)."""
        if self._offline:  # follows what is stored, not only the list
            return json_body(await self.list_versions(provider))
        self._packages.require_served(provider)
        entries = await self._packages.version_list(provider)
        held = self._indexes.get(str(provider))
        if held is not None and held[0] is entries:
            self._indexes.move_to_end(str(provider))
            return held[1]
        ordered = sorted((e.version for e in entries), key=version_sort_key)
        body = json_body({"versions": {version: {} for version in ordered}})
        _keep(self._indexes, str(provider), (entries, body))
        return body

    async def version_document(self, provider: ProviderAddress, version: str) -> dict[str, Any]:
        """The body of `VERSION.json` (not to be modified): every platform whose package
        verifies, with its hashes."""
        return (await self._held_document(provider, version)).document

    async def version_document_body(self, provider: ProviderAddress, version: str) -> JsonBody:
        """`VERSION.json` as sent (see version_document)."""
        return (await self._held_document(provider, version)).body

    def _forget_document(self, provider: ProviderAddress, version: str) -> None:
        self._saves += 1
        self._documents.pop((str(provider), version), None)

    async def _held_document(self, provider: ProviderAddress, version: str) -> _HeldDocument:
        """The document from memory while it holds; else built, and kept unless it lacks a
        platform (retried on the next request) or the proxy is offline (it follows what is
        stored)."""
        self._packages.require_served(provider)
        key = (str(provider), version)
        held = self._documents.get(key)
        if held is not None and (held.until is None or time.monotonic() < held.until):
            self._documents.move_to_end(key)
            return held
        saves = self._saves
        document, complete, every_platform = await self._build_document(provider, version)
        held = _HeldDocument(document, json_body(document), None if complete else
                             time.monotonic() + INCOMPLETE_DOCUMENT_SECONDS)
        if every_platform and not self._offline and saves == self._saves:
            _keep(self._documents, key, held)
        return held

    async def _build_document(self, provider: ProviderAddress,
                              version: str) -> tuple[dict[str, Any], bool, bool]:
        """The VERSION.json document, whether it is complete (every platform with its h1) and
        whether every platform is in it.

        Platforms that upstream lists but cannot (yet) deliver or verify are left out and
        retried on the next request: nothing about them is cached. A bad signature condemns
        the whole release."""
        entry = await self._packages.version_entry(provider, version)
        if not entry.platforms:
            raise UpstreamError(f"upstream lists no platforms for {provider} {version}")
        platforms = [p for p in entry.platforms if self._filters.platform_allowed(p)]
        if not platforms:
            raise NotFound(f"{provider} {version} is not served for any platform (filters)")
        limit = asyncio.Semaphore(_PLATFORM_FETCH_CONCURRENCY)

        async def one(platform: Platform) -> VerifiedPackage:
            if self._offline and await self._stored.stored(provider, version, platform) is None:
                raise Offline(f"{provider} {version} {platform.key} is not in the cache, and "
                              "the proxy is offline")
            async with limit:
                package = await self._packages.package(provider, version, platform)
            return await self._stored.with_h1(provider, version, platform, package)

        results = await asyncio.gather(*(one(p) for p in platforms), return_exceptions=True)
        archives: dict[str, Any] = {}
        failures: list[ProxyError] = []
        for platform, result in zip(platforms, results, strict=True):
            if isinstance(result, IntegrityError) and result.kind == "signature":
                raise result
            if isinstance(result, BaseException):
                if not isinstance(result, ProxyError):
                    log.error("%s %s %s left out", provider, version, platform.key,
                              exc_info=result)
                failure = result if isinstance(result, ProxyError) else \
                    UpstreamError("internal error")
                # Offline, a platform the cache lacks is the normal case, not news.
                log.log(logging.DEBUG if isinstance(failure, Offline) else logging.WARNING,
                        "%s %s %s left out: %s", provider, version, platform.key,
                        failure.message)
                failures.append(failure)
                continue
            hashes = [zh_hash(result.shasum)]
            if result.h1:
                hashes.insert(0, result.h1)
            archives[platform.key] = {"url": provider.archive_filename(version, platform),
                                      "hashes": hashes}
        if not archives:
            if all(isinstance(f, NotFound) for f in failures):
                raise NotFound(f"no package of {provider} {version}: {failures[0].message}")
            if all(isinstance(f, InsufficientStorage) for f in failures):
                raise failures[0]
            raise UpstreamError(f"no package of {provider} {version} could be fetched: "
                                f"{failures[0].message}")
        every_platform = len(archives) == len(platforms)
        complete = every_platform and all(len(a["hashes"]) == 2 for a in archives.values())
        return {"archives": archives}, complete, every_platform

    async def archive(self, provider: ProviderAddress,
                      filename: str) -> BlobInfo | GrowingFile[BlobInfo]:
        """The verified package named `filename`: the stored blob, or on a miss the download
        under way (shared by every caller), which is published only once verified."""
        self._packages.require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        if not self._filters.platform_allowed(platform):
            raise NotFound(f"{platform.key} packages are not served by this proxy (filters)")
        stored = await self._stored.stored(provider, version, platform)
        if stored is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            return stored
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        return await self._fills.archive(provider, version, platform)


def _keep(held: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """Remember value as the most recently used, forgetting the least recently used beyond
    the bound."""
    held[key] = value
    held.move_to_end(key)
    while len(held) > _HELD_DOCUMENTS:
        held.popitem(last=False)
