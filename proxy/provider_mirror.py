"""The provider network mirror protocol, served from verified upstream artifacts.

https://developer.hashicorp.com/terraform/internals/provider-network-mirror-protocol
Operations: list_versions (index.json), version_document (VERSION.json), archive (the zip).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from proxy.archives import ArchiveStore
from proxy.cache import MetadataCache
from proxy.config import UpstreamConfig
from proxy.errors import IntegrityError, NotFound, ProxyError, UpstreamError
from proxy.hashes import zh_hash
from proxy.metrics import Metrics
from proxy.models import Platform, ProviderAddress, version_sort_key
from proxy.registry_documents import DownloadInfo, VersionEntry, parse_sha256sums
from proxy.signatures import verify_detached
from proxy.singleflight import SingleFlight
from proxy.upstream.provider_registry import ProviderRegistryClient

log = logging.getLogger(__name__)

# registry.opentofu.org publishes some providers without signing keys; OpenTofu accepts that
# for this host alone, so the proxy does too (logged and counted). Every other host must sign.
UNSIGNED_ALLOWED_HOSTS = frozenset({"registry.opentofu.org"})
# A client asking for a version we do not list forces a refresh, at most this often.
UNKNOWN_VERSION_REFRESH_SECONDS = 30.0
_PLATFORM_FETCH_CONCURRENCY = 8


class ProviderMirror:
    """Answers network mirror requests; fetches, verifies and stores on a miss."""

    def __init__(self, registry: ProviderRegistryClient, cache: MetadataCache,
                 archives: ArchiveStore, config: UpstreamConfig, metrics: Metrics) -> None:
        self._registry = registry
        self._cache = cache
        self._archives = archives
        self._config = config
        self._metrics = metrics
        self._version_fills: SingleFlight[list[VersionEntry]] = SingleFlight()
        self._package_fills: SingleFlight[dict[str, Any]] = SingleFlight()
        self._sums_fills: SingleFlight[bytes] = SingleFlight()
        self._archive_fills: SingleFlight[Path] = SingleFlight()

    async def close(self) -> None:
        """Stop fills under way (shutdown); their temp files are swept at the next start."""
        for flights in (self._archive_fills, self._sums_fills, self._package_fills,
                        self._version_fills):
            await flights.cancel_all()

    # --- protocol operations -------------------------------------------------------------

    def _require_served(self, provider: ProviderAddress) -> None:
        # Checked before the cache too: a host dropped from the config is not served from disk.
        if provider.hostname not in self._config.all_hosts:
            raise NotFound(f"host {provider.hostname} is not served by this proxy")

    async def list_versions(self, provider: ProviderAddress) -> dict[str, Any]:
        """The body of `index.json`: every valid version upstream lists."""
        self._require_served(provider)
        entries = await self._versions(provider)
        ordered = sorted((e.version for e in entries), key=version_sort_key)
        return {"versions": {version: {} for version in ordered}}

    async def version_document(self, provider: ProviderAddress, version: str) -> dict[str, Any]:
        """The body of `VERSION.json`: every platform whose package verifies, with its hashes.

        Platforms that upstream lists but cannot (yet) deliver are left out and retried on the
        next request: nothing about them is cached."""
        self._require_served(provider)
        entry = await self._version_entry(provider, version)
        if not entry.platforms:
            raise UpstreamError(f"upstream lists no platforms for {provider} {version}")
        limit = asyncio.Semaphore(_PLATFORM_FETCH_CONCURRENCY)

        async def one(platform: Platform) -> dict[str, Any]:
            async with limit:
                return await self._package(provider, version, platform)

        results = await asyncio.gather(*(one(p) for p in entry.platforms),
                                       return_exceptions=True)
        archives: dict[str, Any] = {}
        failures: list[ProxyError] = []
        for platform, result in zip(entry.platforms, results, strict=True):
            if isinstance(result, IntegrityError):
                raise result  # a bad signature or checksum condemns the release, loudly
            if isinstance(result, ProxyError):
                log.warning("%s %s %s left out: %s", provider, version, platform.key,
                            result.message)
                failures.append(result)
                continue
            if isinstance(result, BaseException):
                raise result
            hashes = [zh_hash(result["shasum"])]
            if result.get("h1"):
                hashes.insert(0, result["h1"])
            archives[platform.key] = {
                "url": provider.archive_filename(version, platform),
                "hashes": hashes,
            }
        if not archives:
            raise UpstreamError(f"no package of {provider} {version} could be fetched: "
                                f"{failures[0].message}")
        return {"archives": archives}

    async def archive(self, provider: ProviderAddress, filename: str) -> Path:
        """The verified package file named `filename`, fetched and stored on a miss."""
        self._require_served(provider)
        version, platform = provider.parse_archive_filename(filename)
        parts = self._archive_parts(provider, version, platform)
        path = await self._archives.lookup(parts)
        if path is not None:
            self._metrics.cache_lookups.labels("archive", "hit").inc()
            return path
        self._metrics.cache_lookups.labels("archive", "miss").inc()
        key = ("archive", str(provider), version, platform.key)
        return await self._archive_fills.run(
            key, lambda: self._fill_archive(provider, version, platform))

    # --- versions ------------------------------------------------------------------------

    async def _version_entry(self, provider: ProviderAddress, version: str) -> VersionEntry:
        for entry in await self._versions(provider, wanted=version):
            if entry.version == version:
                return entry
        raise NotFound(f"{provider} has no version {version}")

    async def _versions(self, provider: ProviderAddress,
                        wanted: str | None = None) -> list[VersionEntry]:
        key = f"versions/{provider}"
        record = await self._cache.get(key)
        now = time.time()
        if record is not None:
            entries = [_entry_from_record(e) for e in record["entries"]]
            age = now - record["fetched_at"]
            fresh = age < self._config.versions_ttl
            known = wanted is None or any(e.version == wanted for e in entries)
            if fresh and (known or age < UNKNOWN_VERSION_REFRESH_SECONDS):
                self._metrics.cache_lookups.labels("versions", "hit").inc()
                return entries
        try:
            entries = await self._version_fills.run(
                key, lambda: self._registry.list_versions(provider))
        except UpstreamError as exc:
            if record is None:
                raise
            self._metrics.cache_lookups.labels("versions", "stale").inc()
            log.warning("serving stale versions of %s: %s", provider, exc.message)
            return [_entry_from_record(e) for e in record["entries"]]
        self._metrics.cache_lookups.labels("versions", "miss").inc()
        await self._cache.set(key, {"fetched_at": now,
                                    "entries": [_entry_to_record(e) for e in entries]})
        return entries

    # --- verified package facts ----------------------------------------------------------

    async def _package(self, provider: ProviderAddress, version: str,
                       platform: Platform) -> dict[str, Any]:
        key = f"package/{provider}/{version}/{platform.key}"
        record = await self._cache.get(key)
        if record is not None:
            self._metrics.cache_lookups.labels("package", "hit").inc()
            return record
        self._metrics.cache_lookups.labels("package", "miss").inc()
        return await self._package_fills.run(
            key, lambda: self._fill_package(key, provider, version, platform))

    async def _fill_package(self, key: str, provider: ProviderAddress, version: str,
                            platform: Platform) -> dict[str, Any]:
        info = await self._registry.download_info(provider, version, platform)
        sums = parse_sha256sums(await self._signed_sums(provider, version, info))
        listed = sums.get(info.filename)
        if listed is None:
            raise self._integrity("sha256sums", f"SHA256SUMS of {provider} {version} has no "
                                  f"line for {info.filename}")
        if listed != info.shasum:
            raise self._integrity("sha256sums", f"SHA256SUMS lists {listed} for "
                                  f"{info.filename}, the download document {info.shasum}")
        record = {"filename": info.filename, "shasum": info.shasum,
                  "download_url": info.download_url}
        await self._cache.set(key, record)
        return record

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

    async def _fill_archive(self, provider: ProviderAddress, version: str,
                            platform: Platform) -> Path:
        parts = self._archive_parts(provider, version, platform)
        # A fill that finished after the caller's lookup has already published the file.
        published = await self._archives.lookup(parts)
        if published is not None:
            return published
        await self._version_entry(provider, version)  # 404 for versions upstream does not list
        package = await self._package(provider, version, platform)
        info_url = package["download_url"]
        self._metrics.fills_in_flight.inc()
        try:
            log.info("fetching %s %s %s from %s", provider, version, platform.key, info_url)
            stream = self._registry.open_package(provider, info_url,
                                                 self._config.max_archive_size)
            async with stream as chunks:
                try:
                    stored = await self._archives.store(parts, chunks, package["shasum"])
                except IntegrityError as exc:
                    raise self._integrity(exc.kind, f"{provider} {version} {platform.key}: "
                                          f"{exc.message}") from None
        finally:
            self._metrics.fills_in_flight.dec()
        key = f"package/{provider}/{version}/{platform.key}"
        await self._cache.set(key, {**package, "h1": stored.h1, "size": stored.size})
        return stored.path

    def _integrity(self, kind: str, message: str) -> IntegrityError:
        self._metrics.integrity_failures.labels(kind).inc()
        log.error("integrity failure (%s): %s", kind, message)
        return IntegrityError(kind, message)


def _entry_to_record(entry: VersionEntry) -> dict[str, Any]:
    record = asdict(entry)
    record["platforms"] = [p.key for p in entry.platforms]
    return record


def _entry_from_record(record: dict[str, Any]) -> VersionEntry:
    return VersionEntry(version=record["version"], protocols=tuple(record["protocols"]),
                        platforms=tuple(Platform.from_key(k) for k in record["platforms"]))
