"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
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
from proxy.core.executors import quick
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress, version_sort_key
from proxy.core.redaction import mask_secrets
from proxy.store import layout
from proxy.store.disk_space import is_out_of_space
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.spool import GrowingFile, StoredArchive, store_package
from proxy.verification.hashes import zh_hash
from proxy.verification.packages import VerifiedPackage, VerifiedPackages
from proxy.verification.stored_hashes import CheckedFiles, DamagedFile, h1_of_stored

log = logging.getLogger(__name__)
_PLATFORM_FETCH_CONCURRENCY = 8
_COMPLETE_DOCUMENTS = 4096


class ProviderMirror:
    """Answers network mirror requests; fetches, verifies and stores on a miss."""

    def __init__(self, packages: VerifiedPackages, archives: BlobStore,
                 config: UpstreamConfig, metrics: Metrics) -> None:
        self.packages = packages
        self._filters = packages.filters
        # VERSION.json documents in which every platform upstream lists is present with its
        # h1: nothing in them changes any more, so they are answered from memory.
        self._complete_documents: dict[tuple[str, str], dict[str, Any]] = {}
        self._archives = archives
        self._config = config
        self._metrics = metrics
        # Archive fills: one task per package, detached from clients; callers get the blob
        # (already there) or the GrowingFile as soon as the download has started.
        self._archive_ready: dict[tuple[str, ...], asyncio.Future[BlobInfo | GrowingFile]] = {}
        self._archive_tasks: set[asyncio.Task[None]] = set()
        self._fill_slots = asyncio.Semaphore(config.max_concurrent_fills)
        self._checked = CheckedFiles(archives)

    async def close(self) -> None:
        """Stop fills under way (shutdown); their temp files are swept at the next start."""
        tasks = list(self._archive_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._checked.close()
        await self.packages.close()

    # --- protocol operations -------------------------------------------------------------

    async def list_versions(self, provider: ProviderAddress) -> dict[str, Any]:
        """The body of `index.json`: every valid version upstream lists."""
        self.packages.require_served(provider)
        entries = await self.packages.version_list(provider)
        versions = [e.version for e in entries]
        if self._config.offline:
            # Offline, only what is held: a constraint then resolves to a version we have.
            held = layout.versions_held(
                provider, await self._archives.list(layout.provider_prefix(provider)))
            versions = [v for v in versions if v in held]
            if not versions:
                raise Offline(f"no version of {provider} is in the cache, and the proxy is "
                              "offline")
        ordered = sorted(versions, key=version_sort_key)
        return {"versions": {version: {} for version in ordered}}

    async def version_document(self, provider: ProviderAddress, version: str) -> dict[str, Any]:
        """The body of `VERSION.json`: every platform whose package verifies, with its hashes.

        Platforms that upstream lists but cannot (yet) deliver or verify are left out and
        retried on the next request: nothing about them is cached. A bad signature condemns
        the whole release."""
        self.packages.require_served(provider)
        complete = self._complete_documents.get((str(provider), version))
        if complete is not None:
            return complete
        entry = await self.packages.version_entry(provider, version)
        if not entry.platforms:
            raise UpstreamError(f"upstream lists no platforms for {provider} {version}")
        platforms = [p for p in entry.platforms if self._filters.platform_allowed(p)]
        if not platforms:
            raise NotFound(f"{provider} {version} is not served for any platform (filters)")
        limit = asyncio.Semaphore(_PLATFORM_FETCH_CONCURRENCY)

        async def one(platform: Platform) -> VerifiedPackage:
            if self._config.offline and await self._stored(provider, version, platform) is None:
                raise Offline(f"{provider} {version} {platform.key} is not in the cache, and "
                              "the proxy is offline")
            async with limit:
                package = await self.packages.package(provider, version, platform)
            return await self._with_h1(provider, version, platform, package)

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
        if len(archives) == len(platforms) and not self._config.offline \
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

    async def archive(self, provider: ProviderAddress, filename: str) -> BlobInfo | GrowingFile:
        """The verified package named `filename`: the stored blob, or on a miss the download
        under way (shared by every caller), which is published only once verified."""
        self.packages.require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        if not self._filters.platform_allowed(platform):
            raise NotFound(f"{platform.key} packages are not served by this proxy (filters)")
        stored = await self._stored(provider, version, platform)
        if stored is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            return stored
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        key = (str(provider), version, platform.key)
        ready = self._archive_ready.get(key)
        if ready is not None and _published(ready):
            # Its fill is still finishing (the h1 pass), yet the file was not found just now:
            # it left the cache since (evicted, dropped as damaged). Fill again.
            ready = None
        if ready is None:
            ready = asyncio.get_running_loop().create_future()
            ready.add_done_callback(_retrieve)
            self._archive_ready[key] = ready
            task = asyncio.ensure_future(self._fill_archive(provider, version, platform, ready))
            self._archive_tasks.add(task)
            task.add_done_callback(lambda done: self._archive_fill_ended(key, ready, done))
        return await asyncio.shield(ready)

    def _archive_fill_ended(self, key: tuple[str, ...],
                            ready: asyncio.Future[BlobInfo | GrowingFile],
                            task: asyncio.Task[None]) -> None:
        self._archive_tasks.discard(task)
        if self._archive_ready.get(key) is ready:
            del self._archive_ready[key]
        error = None if task.cancelled() else task.exception()
        if not ready.done():
            ready.set_exception(error or UpstreamError("the download was interrupted"))

    async def _stored(self, provider: ProviderAddress, version: str, platform: Platform,
                      check: bool = True) -> BlobInfo | None:
        """The stored zip, only if a verified record vouches for it (a file that is on disk
        without one, e.g. after the index was lost, is fetched and checked again), and only
        while it is the file whose bytes were checked: one that was written to since is read
        again first (check; without it, under the fill lock, it is just not used), and
        dropped if it is not the signed package."""
        key = layout.provider_archive(provider, version, platform)
        found = await self._archives.stat(key)
        if found is None:
            return None
        identity = found.identity
        if self._checked.seen(key, identity):  # the common hit: one stat, no index read
            return found
        package = await self.packages.stored_facts(provider, version, platform)
        if package is None or package.size != identity.size:
            log.warning("%s is stored without a matching verified record; fetching it again",
                        key)
            return None
        if package.stored_as == identity:
            self._checked.remember(key, identity)
            return found
        if not check:
            return None
        # Written to, replaced or restored since its bytes were checked (or checked before
        # identities were recorded): read it again before a client gets it.
        try:
            checked = await self._checked.verify(key, identity, package.shasum)
        except DamagedFile as damage:
            async with self._fill_lock(provider, version, platform):
                await self._drop_damaged(provider, version, platform, key, damage)
            if self._config.offline:
                raise Offline(f"the stored package {provider} {version} {platform.key} was "
                              "damaged, and the proxy is offline") from None
            return None
        if checked is not None:
            await self._record_identity(provider, version, platform, package, checked)
        return found if checked is not None else None

    async def _record_identity(self, provider: ProviderAddress, version: str,
                               platform: Platform, package: VerifiedPackage,
                               identity: FileIdentity) -> None:
        """Note which file now holds the checked bytes, so that other processes (and the
        next start) need not read it again."""
        current = await self.packages.stored_facts(provider, version, platform)
        if current is not None and (current.shasum, current.size) == (package.shasum,
                                                                       identity.size):
            await self.packages.save(provider, version, platform,
                                     replace(current, stored_as=identity))

    # --- archives ------------------------------------------------------------------------

    def _fill_lock(self, provider: ProviderAddress, version: str,
                   platform: Platform) -> AbstractAsyncContextManager[object]:
        # One fill (or drop) per package across the processes sharing the cache.
        return self._archives.fill_lock(layout.provider_fill(provider, version, platform))

    async def _with_h1(self, provider: ProviderAddress, version: str, platform: Platform,
                       package: VerifiedPackage) -> VerifiedPackage:
        """The facts with the h1 filled in from the stored zip if it is missing (lost when a
        crash hit between publishing the file and recording its hash). A stored zip that is
        not the signed package is dropped instead: no h1, fetched again when next asked for."""
        if package.h1 is not None:
            return package
        key = layout.provider_archive(provider, version, platform)
        if await self._archives.stat(key) is None:
            return package
        try:
            h1 = await h1_of_stored(self._archives, key, package.shasum)
        except DamagedFile as damage:
            async with self._fill_lock(provider, version, platform):
                await self._drop_damaged(provider, version, platform, key, damage)
            if self._config.offline:
                raise Offline(f"the stored package {provider} {version} {platform.key} was "
                              "damaged, and the proxy is offline") from None
            return replace(package, size=None)
        if h1 is None:
            return package
        # Re-read: a fill may have recorded the size meanwhile (the same bytes: same h1).
        current = await self.packages.stored_facts(provider, version, platform)
        if current is not None and current.shasum == package.shasum:
            package = current
        package = replace(package, h1=h1)
        await self.packages.save(provider, version, platform, package)
        return package

    async def _drop_damaged(self, provider: ProviderAddress, version: str, platform: Platform,
                            key: str, damage: DamagedFile) -> None:
        """Delete a damaged stored zip and the facts recorded about the file (size, h1; the
        signed facts stay), then count and log it: once, by whoever deletes it. Runs under the
        package's fill lock."""
        self._checked.forget(key)
        what = f"{provider} {version} {platform.key}: the stored file {damage.message}"
        if not await self._archives.delete(key, damage.identity):
            # Gone, or replaced since it was read (by whoever dropped it first, then a fill):
            # counted by whoever dropped it; the facts are not about this file.
            log.info("%s; already dropped or replaced", what)
            return
        self.packages.integrity(damage.kind, f"{what}; dropped, to be fetched again")
        record = await self.packages.stored_facts(provider, version, platform)
        if record is not None:
            await self.packages.save(provider, version, platform,
                                     replace(record, h1=None, size=None, stored_as=None))

    async def _vouch(self, provider: ProviderAddress, version: str, platform: Platform,
                     package: VerifiedPackage, stored: StoredArchive) -> None:
        """Record the size and identity of a zip just published (before its followers get
        its last byte)."""
        self._checked.remember(stored.key, stored.identity)
        await self.packages.save(provider, version, platform,
                                 replace(package, size=stored.size, stored_as=stored.identity))

    async def _fill_archive(self, provider: ProviderAddress, version: str, platform: Platform,
                            ready: asyncio.Future[BlobInfo | GrowingFile]) -> None:
        try:
            async with self._fill_lock(provider, version, platform):
                # Just published by another fill? (Not a file to check: it is replaced.)
                published = await self._stored(provider, version, platform, check=False)
                if published is not None:
                    ready.set_result(published)
                    return
                await self._download_archive(provider, version, platform, ready)
        except OSError as exc:  # the lock or temp file found no room (blocks or inodes)
            if not is_out_of_space(exc):
                raise
            raise self._archives.disk.ran_out("package") from exc

    async def _download_archive(self, provider: ProviderAddress, version: str,
                                platform: Platform,
                                ready: asyncio.Future[BlobInfo | GrowingFile]) -> None:
        entry = await self.packages.version_entry(provider, version)
        if platform not in entry.platforms:
            raise NotFound(f"{provider} {version} is not published for {platform.key}")
        # A fresh download document every time: its URL may be short-lived.
        info = await self.packages.registry.download_info(provider, version, platform)
        package = await self.packages.package(provider, version, platform, info)
        if (info.filename, info.shasum) != (package.filename, package.shasum):
            raise self.packages.integrity("changed", f"upstream now describes {provider} {version} "
                                  f"{platform.key} differently from what it signed before")
        async with self._fill_slots:
            self._metrics.fills_in_flight.inc()
            try:
                log.info("fetching %s %s %s from %s", provider, version, platform.key,
                         mask_secrets(info.download_url))  # may be a presigned URL
                stream = self.packages.registry.open_package(provider, info.download_url,
                                                     self._config.max_archive_size)
                async with stream as download:
                    if download.size is not None:  # cannot fit: a 507 before any headers
                        await quick(self._archives.disk.require_room, "package",
                                                download.size)
                    growing = GrowingFile(self._archives, self._archives.spool_path(),
                                          download.size)
                    await quick(growing.temp.touch)
                    ready.set_result(growing)
                    try:
                        stored = await store_package(
                            self._archives, layout.provider_archive(provider, version, platform),
                            download.chunks, package.shasum, growing,
                            lambda stored: self._vouch(provider, version, platform,
                                                       package, stored))
                    except IntegrityError as exc:
                        raise self.packages.integrity(exc.kind, f"{provider} {version} "
                                              f"{platform.key}: {exc.message}") from None
            finally:
                self._metrics.fills_in_flight.dec()
        # The record that vouches for the file was saved (_vouch); its h1 (a full read) now.
        package = replace(package, size=stored.size, stored_as=stored.identity)
        try:
            h1 = await h1_of_stored(self._archives, stored.key, package.shasum)
        except DamagedFile as damage:  # changed on disk since it was checked
            await self._drop_damaged(provider, version, platform, stored.key, damage)
            return
        if h1 is not None:
            await self.packages.save(provider, version, platform, replace(package, h1=h1))


def _published(ready: asyncio.Future[BlobInfo | GrowingFile]) -> bool:
    """Whether the fill behind ready already published its file."""
    if not ready.done() or ready.cancelled() or ready.exception() is not None:
        return False
    source = ready.result()
    return not isinstance(source, GrowingFile) or source.final is not None


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Callers that left must not leave an "exception was never retrieved" warning behind.
    if not future.cancelled():
        future.exception()
