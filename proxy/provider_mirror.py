"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiofiles.os

from proxy.archives import ArchiveStore, FillLock, GrowingFile, h1_of_stored
from proxy.cache import MetadataCache
from proxy.config import UpstreamConfig
from proxy.errors import IntegrityError, NotFound, Offline, ProxyError, UpstreamError
from proxy.filters import Filters
from proxy.freshness import RefreshingDocuments
from proxy.hashes import h1_of_zip, zh_hash
from proxy.metrics import Metrics
from proxy.models import Platform, ProviderAddress, version_sort_key
from proxy.registry_documents import DownloadInfo, VersionEntry, parse_sha256sums
from proxy.signatures import verify_detached
from proxy.singleflight import SingleFlight
from proxy.upstream.provider_registry import ProviderRegistryClient

log = logging.getLogger(__name__)

# registry.opentofu.org publishes some providers without signing keys; OpenTofu accepts that
# for this host alone, so the proxy does too (logged). Every other host must sign.
UNSIGNED_ALLOWED_HOSTS = frozenset({"registry.opentofu.org"})
_PLATFORM_FETCH_CONCURRENCY = 8
_COMPLETE_DOCUMENTS = 4096


@dataclass(frozen=True)
class VerifiedPackage:
    """Facts about one package that were checked against the signed SHA256SUMS; immutable.
    (Download URLs are not kept: registries may hand out short-lived ones.)"""

    filename: str
    shasum: str
    h1: str | None = None
    size: int | None = None  # of the zip as stored, once it was


class ProviderMirror:
    """Answers network mirror requests; fetches, verifies and stores on a miss."""

    def __init__(self, registry: ProviderRegistryClient, cache: MetadataCache,
                 archives: ArchiveStore, config: UpstreamConfig, metrics: Metrics,
                 filters: Filters | None = None) -> None:
        self._registry = registry
        self._filters = filters or Filters()
        # VERSION.json documents in which every platform upstream lists is present with its
        # h1: nothing in them changes any more, so they are answered from memory.
        self._complete_documents: dict[tuple[str, str], dict[str, Any]] = {}
        self._cache = cache
        self._archives = archives
        self._config = config
        self._metrics = metrics
        self._versions = RefreshingDocuments[list[VersionEntry]](
            "versions", cache, metrics, config.versions_ttl,
            encode=lambda entries: [_entry_to_record(e) for e in entries],
            decode=lambda records: [_entry_from_record(r) for r in records],
            offline=config.offline)
        self._package_fills: SingleFlight[VerifiedPackage] = SingleFlight()
        self._sums_fills: SingleFlight[bytes] = SingleFlight()
        # Archive fills: one task per package, detached from clients; callers get the file
        # (already there) or the GrowingFile as soon as the download has started.
        self._archive_ready: dict[tuple[str, ...], asyncio.Future[Path | GrowingFile]] = {}
        self._archive_tasks: set[asyncio.Task[None]] = set()
        self._fill_slots = asyncio.Semaphore(config.max_concurrent_fills)
        self._verified_sizes: dict[Path, int] = {}

    async def close(self) -> None:
        """Stop fills under way (shutdown); their temp files are swept at the next start."""
        tasks = list(self._archive_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for flights in (self._sums_fills, self._package_fills):
            await flights.cancel_all()
        await self._versions.close()

    def _require_served(self, provider: ProviderAddress) -> None:
        # Checked before the cache too: a host dropped from the config is not served from disk.
        if not self._config.serves(provider.hostname):
            raise NotFound(f"host {provider.hostname} is not served by this proxy")
        if not self._filters.provider_allowed(provider):
            raise NotFound(f"{provider} is not served by this proxy (filters)")

    # --- protocol operations -------------------------------------------------------------

    async def list_versions(self, provider: ProviderAddress) -> dict[str, Any]:
        """The body of `index.json`: every valid version upstream lists."""
        self._require_served(provider)
        entries = await self._version_list(provider)
        versions = [e.version for e in entries]
        if self._config.offline:
            # Offline, only what is held: a constraint then resolves to a version we have.
            held = await asyncio.to_thread(
                self._archives.versions_held, ["archives", provider.hostname,
                                               provider.namespace, provider.type])
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
        self._require_served(provider)
        complete = self._complete_documents.get((str(provider), version))
        if complete is not None:
            return complete
        entry = await self._version_entry(provider, version)
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
                return await self._package(provider, version, platform)

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
                log.warning("%s %s %s left out: %s", provider, version, platform.key,
                            failure.message)
                failures.append(failure)
                continue
            package = await self._with_h1(provider, version, platform, result)
            hashes = [zh_hash(package.shasum)]
            if package.h1:
                hashes.insert(0, package.h1)
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
            raise UpstreamError(f"no package of {provider} {version} could be fetched: "
                                f"{failures[0].message}")
        return {"archives": archives}

    async def archive(self, provider: ProviderAddress, filename: str) -> Path | GrowingFile:
        """The verified package named `filename`: the stored file, or on a miss the download
        under way (shared by every caller), which is published only once verified."""
        self._require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        if not self._filters.platform_allowed(platform):
            raise NotFound(f"{platform.key} packages are not served by this proxy (filters)")
        path = await self._stored(provider, version, platform)
        if path is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            return path
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        key = (str(provider), version, platform.key)
        ready = self._archive_ready.get(key)
        if ready is None:
            ready = asyncio.get_running_loop().create_future()
            ready.add_done_callback(_retrieve)
            self._archive_ready[key] = ready
            task = asyncio.ensure_future(self._fill_archive(provider, version, platform, ready))
            self._archive_tasks.add(task)
            task.add_done_callback(lambda done: self._archive_fill_ended(key, ready, done))
        return await asyncio.shield(ready)

    def _archive_fill_ended(self, key: tuple[str, ...],
                            ready: asyncio.Future[Path | GrowingFile],
                            task: asyncio.Task[None]) -> None:
        self._archive_tasks.discard(task)
        if self._archive_ready.get(key) is ready:
            del self._archive_ready[key]
        error = None if task.cancelled() else task.exception()
        if not ready.done():
            ready.set_exception(error or UpstreamError("the download was interrupted"))

    async def _stored(self, provider: ProviderAddress, version: str,
                      platform: Platform) -> Path | None:
        """The stored zip, only if a verified record vouches for it (a file that is on disk
        without one, e.g. after the index was lost, is fetched and checked again)."""
        found = await self._archives.lookup(self._archive_parts(provider, version, platform))
        if found is None:
            return None
        size = (await aiofiles.os.stat(found)).st_size
        if self._verified_sizes.get(found) == size:
            return found
        record = await self._cache.get(self._package_key(provider, version, platform))
        if record is not None and record.get("size") == size:
            self._verified_sizes[found] = size
            return found
        log.warning("%s is on disk without a matching verified record; fetching it again",
                    found)
        return None

    # --- versions ------------------------------------------------------------------------

    async def _version_list(self, provider: ProviderAddress,
                            wanted: str | None = None) -> list[VersionEntry]:
        return await self._versions.get(
            f"versions/{provider}", lambda: self._registry.list_versions(provider),
            knows=None if wanted is None else
            (lambda entries: any(e.version == wanted for e in entries)))

    async def _version_entry(self, provider: ProviderAddress, version: str) -> VersionEntry:
        for entry in await self._version_list(provider, wanted=version):
            if entry.version == version:
                return entry
        raise NotFound(f"{provider} has no version {version}")

    # --- verified package facts ----------------------------------------------------------

    @staticmethod
    def _package_key(provider: ProviderAddress, version: str, platform: Platform) -> str:
        return f"package/{provider}/{version}/{platform.key}"

    async def _package(self, provider: ProviderAddress, version: str, platform: Platform,
                       info: DownloadInfo | None = None) -> VerifiedPackage:
        key = self._package_key(provider, version, platform)
        record = await self._cache.get(key)
        if record is not None:
            self._metrics.cache_lookups.labels("package", "hit").inc()
            return _package_from_record(record)
        self._metrics.cache_lookups.labels("package", "miss").inc()
        return await self._package_fills.run(
            key, lambda: self._fill_package(key, provider, version, platform, info))

    async def _fill_package(self, key: str, provider: ProviderAddress, version: str,
                            platform: Platform, info: DownloadInfo | None) -> VerifiedPackage:
        record = await self._cache.get(key)  # a fill that finished since the caller looked
        if record is not None:
            return _package_from_record(record)
        if info is None:
            info = await self._registry.download_info(provider, version, platform)
        sums = parse_sha256sums(await self._signed_sums(provider, version, info))
        listed = sums.get(info.filename)
        if listed is None:
            raise self._integrity("sha256sums", f"SHA256SUMS of {provider} {version} has no "
                                  f"line for {info.filename}")
        if listed != info.shasum:
            raise self._integrity("sha256sums", f"SHA256SUMS lists {listed} for "
                                  f"{info.filename}, the download document {info.shasum}")
        package = VerifiedPackage(filename=info.filename, shasum=info.shasum)
        await self._cache.set(key, asdict(package))
        return package

    async def _with_h1(self, provider: ProviderAddress, version: str, platform: Platform,
                       package: VerifiedPackage) -> VerifiedPackage:
        """Fill in a missing h1 from the stored zip (lost if a crash hit between publishing
        the file and recording its hash)."""
        if package.h1 is not None:
            return package
        path = await self._archives.lookup(self._archive_parts(provider, version, platform))
        if path is None:
            return package
        package = replace(package, h1=await asyncio.to_thread(h1_of_zip, path))
        await self._cache.set(self._package_key(provider, version, platform), asdict(package))
        return package

    async def _signed_sums(self, provider: ProviderAddress, version: str,
                           info: DownloadInfo) -> bytes:
        """SHA256SUMS bytes whose signature verified (cached: immutable once verified)."""
        url_id = hashlib.sha256(info.shasums_url.encode()).hexdigest()[:32]
        key = f"sums/{provider}/{version}/{url_id}"
        record = await self._cache.get(key)
        if record is not None:
            self._metrics.cache_lookups.labels("sums", "hit").inc()
            return bytes(record["sums"])
        self._metrics.cache_lookups.labels("sums", "miss").inc()
        return await self._sums_fills.run(key, lambda: self._fill_sums(key, provider, info))

    async def _fill_sums(self, key: str, provider: ProviderAddress, info: DownloadInfo) -> bytes:
        record = await self._cache.get(key)  # a fill that finished since the caller looked
        if record is not None:
            return bytes(record["sums"])
        sums, signature = await self._registry.shasums(provider, info)
        if not info.signing_keys and provider.hostname in UNSIGNED_ALLOWED_HOSTS:
            log.warning("%s publishes %s without signing keys; accepted for this host only",
                        provider.hostname, provider)
            signed_by = ""
        else:
            try:
                signed_by = await asyncio.to_thread(
                    verify_detached, sums, signature, info.signing_keys)
            except IntegrityError as exc:
                raise self._integrity(exc.kind, f"{provider}: {exc.message}") from None
        await self._cache.set(key, {"sums": sums, "signature": signature,
                                    "signed_by": signed_by, "url": info.shasums_url})
        return sums

    # --- archives ------------------------------------------------------------------------

    @staticmethod
    def _archive_parts(provider: ProviderAddress, version: str,
                       platform: Platform) -> list[str]:
        return ["archives", provider.hostname, provider.namespace, provider.type, version,
                provider.archive_filename(version, platform)]

    async def _fill_archive(self, provider: ProviderAddress, version: str, platform: Platform,
                            ready: asyncio.Future[Path | GrowingFile]) -> None:
        lock = FillLock(self._archives.lock_path(f"{provider}/{version}/{platform.key}"))
        async with lock:  # one fill per package across the processes sharing the cache
            published = await self._stored(provider, version, platform)  # one just finished
            if published is not None:
                ready.set_result(published)
                return
            await self._download_archive(provider, version, platform, ready)

    async def _download_archive(self, provider: ProviderAddress, version: str,
                                platform: Platform,
                                ready: asyncio.Future[Path | GrowingFile]) -> None:
        entry = await self._version_entry(provider, version)
        if platform not in entry.platforms:
            raise NotFound(f"{provider} {version} is not published for {platform.key}")
        # A fresh download document every time: its URL may be short-lived.
        info = await self._registry.download_info(provider, version, platform)
        package = await self._package(provider, version, platform, info)
        if (info.filename, info.shasum) != (package.filename, package.shasum):
            raise self._integrity("changed", f"upstream now describes {provider} {version} "
                                  f"{platform.key} differently from what it signed before")
        async with self._fill_slots:
            self._metrics.fills_in_flight.inc()
            try:
                log.info("fetching %s %s %s from %s", provider, version, platform.key,
                         info.download_url)
                stream = self._registry.open_package(provider, info.download_url,
                                                     self._config.max_archive_size)
                async with stream as download:
                    growing = GrowingFile(self._archives.temp_file(), download.size)
                    await asyncio.to_thread(growing.temp.touch)
                    ready.set_result(growing)
                    try:
                        stored = await self._archives.store(
                            self._archive_parts(provider, version, platform),
                            download.chunks, package.shasum, growing)
                    except IntegrityError as exc:
                        raise self._integrity(exc.kind, f"{provider} {version} "
                                              f"{platform.key}: {exc.message}") from None
            finally:
                self._metrics.fills_in_flight.dec()
        # The record that vouches for the file first; its h1 (a full read) after.
        self._verified_sizes[stored.path] = stored.size
        key = self._package_key(provider, version, platform)
        package = replace(package, size=stored.size)
        await self._cache.set(key, asdict(package))
        h1 = await h1_of_stored(stored.path)
        if h1 is not None:
            await self._cache.set(key, asdict(replace(package, h1=h1)))


    def _integrity(self, kind: str, message: str) -> IntegrityError:
        self._metrics.integrity_failures.labels(kind).inc()
        log.error("integrity failure (%s): %s", kind, message)
        return IntegrityError(kind, message)


def _entry_to_record(entry: VersionEntry) -> dict[str, Any]:
    return {"version": entry.version, "protocols": list(entry.protocols),
            "platforms": [p.key for p in entry.platforms]}


def _entry_from_record(record: dict[str, Any]) -> VersionEntry:
    return VersionEntry(version=record["version"], protocols=tuple(record["protocols"]),
                        platforms=tuple(Platform.from_key(k) for k in record["platforms"]))


def _package_from_record(record: dict[str, Any]) -> VerifiedPackage:
    return VerifiedPackage(record["filename"], record["shasum"], record.get("h1"),
                           record.get("size"))


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Callers that left must not leave an "exception was never retrieved" warning behind.
    if not future.cancelled():
        future.exception()
