"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
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
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress, version_sort_key
from proxy.core.spool import GrowingFile
from proxy.verification.hashes import zh_hash
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackage, VerifiedPackages
from proxy.verification.stored_packages import StoredPackages

log = logging.getLogger(__name__)
_PLATFORM_FETCH_CONCURRENCY = 8
_COMPLETE_DOCUMENTS = 4096


class ProviderMirror:
    """Answers network mirror requests from verified packages: held ones from the store,
    others through a fill."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages, fills: PackageFills,
                 config: UpstreamConfig, metrics: Metrics) -> None:
        self._packages = packages
        self._stored = stored
        self._fills = fills
        self._filters = packages.filters
        # VERSION.json documents in which every platform upstream lists is present with its
        # h1: nothing in them changes any more, so they are answered from memory.
        self._complete_documents: dict[tuple[str, str], dict[str, Any]] = {}
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

    async def version_document(self, provider: ProviderAddress, version: str) -> dict[str, Any]:
        """The body of `VERSION.json`: every platform whose package verifies, with its hashes.

        Platforms that upstream lists but cannot (yet) deliver or verify are left out and
        retried on the next request: nothing about them is cached. A bad signature condemns
        the whole release."""
        self._packages.require_served(provider)
        complete = self._complete_documents.get((str(provider), version))
        if complete is not None:
            return complete
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
        if len(archives) == len(platforms) and not self._offline \
                and all(len(a["hashes"]) == 2 for a in archives.values()):
            if len(self._complete_documents) >= _COMPLETE_DOCUMENTS:
                self._complete_documents.pop(next(iter(self._complete_documents)))
            self._complete_documents[(str(provider), version)] = {"archives": archives}
        if not archives:
            if all(isinstance(f, NotFound) for f in failures):
                raise NotFound(f"no package of {provider} {version}: {failures[0].message}")
            if all(isinstance(f, InsufficientStorage) for f in failures):
                raise failures[0]
            raise UpstreamError(f"no package of {provider} {version} could be fetched: "
                                f"{failures[0].message}")
        return {"archives": archives}

    async def archive(self, provider: ProviderAddress, filename: str) -> Path | GrowingFile:
        """The verified package named `filename`: the stored file, or on a miss the download
        under way (shared by every caller), which is published only once verified."""
        self._packages.require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        if not self._filters.platform_allowed(platform):
            raise NotFound(f"{platform.key} packages are not served by this proxy (filters)")
        path = await self._stored.stored(provider, version, platform)
        if path is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            return path
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        return await self._fills.archive(provider, version, platform)
