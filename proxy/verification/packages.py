"""Verified package facts, shared by the network mirror and the registry protocol: version
lists (refreshed), and per package the facts checked against the signed SHA256SUMS, with the
SHA256SUMS bytes and signature themselves."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from typing import Any

from proxy.config import UpstreamConfig
from proxy.config.filters import Filters
from proxy.core.activity import Activity
from proxy.core.audit import SERVED_FACTS, Artifact, key_id
from proxy.core.errors import IntegrityError, IntegrityKind, UnknownVersion
from proxy.core.executors import quick
from proxy.core.held import keep_recent
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress
from proxy.core.redaction import mask_secrets
from proxy.core.singleflight import SingleFlight, retrieved
from proxy.store import layout
from proxy.store.file_identity import FileIdentity, identity_from_record, identity_to_record
from proxy.store.freshness import RefreshingDocuments
from proxy.store.protocol import MetadataIndex
from proxy.upstream.documents import (
    DownloadInfo,
    VersionEntry,
    parse_sha256sums,
    without_upstream_urls,
)
from proxy.upstream.http import Download, origin_of
from proxy.upstream.provider_registry import ProviderRegistryClient
from proxy.verification.integrity import reported
from proxy.verification.noted_downloads import note_download, noted_download, reusable_url
from proxy.verification.release_times import ReleaseTimes
from proxy.verification.signatures import signature_time, verify_detached

log = logging.getLogger(__name__)

# registry.opentofu.org publishes some providers without signing keys; OpenTofu accepts that
# for this host alone, so the proxy does too (logged). Every other host must sign.
UNSIGNED_ALLOWED_HOSTS = frozenset({"registry.opentofu.org"})
# Verified facts held in memory once they carry an h1 (nothing a document shows changes after
# that), the most recently used ones.
HELD_FACTS = 16384
# How long a failed SHA256SUMS check counts as the same failure when met again.
SUMS_FAILURE_SECONDS = 10.0
# A download document fetched for a package's facts (VERSION.json) whose URL has no query (no
# signature that may be short-lived or single-use) is taken by the package's fill this long
# after (once), with the facts verified with it: the zip of a VERSION.json just answered
# costs no second request for it and no read of its facts. Other processes on the same index
# take it from the facts' record (proxy.verification.noted_downloads) as long. Later fills,
# and URLs with a query, ask upstream again.
RECENT_DOWNLOAD_SECONDS = 10.0
HELD_RECENT = 1024


@dataclass(frozen=True)
class VerifiedPackage:
    """Facts about one package that were checked against the signed SHA256SUMS; immutable.
    (Download URLs are not kept: registries may hand out short-lived ones.)"""

    filename: str
    shasum: str
    h1: str | None = None
    size: int | None = None  # of the zip as stored, once it was
    sums_id: str | None = None  # which signed SHA256SUMS vouches for it
    document: dict[str, Any] | None = None  # upstream's download document, as published
    # The stored zip as it was when its bytes last matched shasum: a hit on a file that no
    # longer looks like this reads it again before serving it.
    stored_as: FileIdentity | None = None


# A download document asked for, and the package's verified facts (None: none recorded).
AskedDownload = tuple[DownloadInfo, VerifiedPackage | None]


class VerifiedPackages:
    """Version lists and verified package facts, fetched on a miss and cached."""

    def __init__(self, registry: ProviderRegistryClient, cache: MetadataIndex,
                 config: UpstreamConfig, metrics: Metrics, filters: Filters,
                 activity: Activity, release_times: ReleaseTimes | None = None,
                 expect_download: Callable[[str], None] = lambda _origin: None) -> None:
        self._registry = registry
        # Told the origin of a zip a client is about to ask for (see _fill_package).
        self._expect_download = expect_download
        self._times = release_times
        self.filters = filters
        self._cache = cache
        self._config = config
        self._metrics = metrics
        self._activity = activity
        self._versions = RefreshingDocuments[list[VersionEntry]](
            "versions", cache, metrics, config.versions_ttl,
            encode=lambda entries: [_entry_to_record(e) for e in entries],
            decode=lambda records: [_entry_from_record(r) for r in records],
            offline=config.offline, on_stale=activity.stale_answer)
        self._package_fills: SingleFlight[VerifiedPackage] = SingleFlight()
        self._sums_fills: SingleFlight[bytes] = SingleFlight()
        # SHA256SUMS that just failed their check, by record key: the same bytes met again
        # moments later (the other platforms of one VERSION.json, looked up apart) are
        # checked again but are not another failure to count, log and list.
        self._failed_sums: OrderedDict[str, float] = OrderedDict()
        self._held: OrderedDict[str, VerifiedPackage] = OrderedDict()
        self._on_save: list[Callable[[ProviderAddress, str], None]] = []
        # When this instance last noted a download document in a facts record or took one
        # noted there, by package key: a note is taken once, as a document held in memory is
        # (the noting instance's one use is its copy in memory).
        self._used_notes: OrderedDict[str, float] = OrderedDict()
        # Download documents just fetched and verified for facts, by package key: (when, the
        # document, the facts).
        self._recent_downloads: OrderedDict[
            str, tuple[float, DownloadInfo, VerifiedPackage]] = OrderedDict()

    def on_save(self, listener: Callable[[ProviderAddress, str], None]) -> None:
        """Call listener(provider, version) whenever this process records facts that may
        change what a document of that version shows (an h1, a stored zip), so it is rebuilt."""
        self._on_save.append(listener)

    def on_list_change(self, listener: Callable[[], None]) -> None:
        """Call listener() whenever a version list this process holds changes."""
        self._versions.on_change(listener)

    def require_served(self, provider: ProviderAddress) -> None:
        """NotFound unless the proxy serves this provider (see Filters.require_provider)."""
        self.filters.require_provider(provider)

    async def close(self) -> None:
        """Stop fills under way (shutdown)."""
        for flights in (self._sums_fills, self._package_fills):
            await flights.cancel_all()
        await self._versions.close()

    async def version_list(self, provider: ProviderAddress,
                           wanted: str | None = None) -> list[VersionEntry]:
        """Upstream's version list (refreshed early when `wanted` is not in it)."""
        return await self._versions.get(
            layout.version_list_record(provider), lambda: self._fetch_versions(provider),
            origin=provider.hostname, knows=None if wanted is None else
            (lambda entries: any(e.version == wanted for e in entries)))

    async def _fetch_versions(self, provider: ProviderAddress) -> list[VersionEntry]:
        """Upstream's list, its versions noted as seen now (the version policy's dates)."""
        entries = await self._registry.list_versions(provider)
        if self._times is not None:
            await self._times.listed("provider", str(provider), [e.version for e in entries])
        return entries

    async def signed_at(self, provider: ProviderAddress, version: str) -> float | None:
        """When the signature over the version's SHA256SUMS was made (verifying it first,
        from one of its platforms' download documents, if it is not yet)."""
        entry = await self.version_entry(provider, version)
        platforms = [p for p in entry.platforms if self.filters.platform_allowed(p)]
        if not platforms:
            return None
        package = await self.package(provider, version, platforms[0])
        sums = None if package.sums_id is None else \
            await self.stored_sums(provider, version, package.sums_id)
        return None if sums is None else signature_time(sums[1])

    async def version_entry(self, provider: ProviderAddress, version: str) -> VersionEntry:
        """One version's entry; NotFound when upstream does not list it."""
        for entry in await self.version_list(provider, wanted=version):
            if entry.version == version:
                return entry
        raise UnknownVersion(f"{provider} has no version {version}")

    def ask_download(self, provider: ProviderAddress, version: str,
                     platform: Platform) -> asyncio.Future[AskedDownload]:
        """The package's verified facts and a download document, under way (see
        current_download): the facts read first (their record may note a document another
        process just verified), then the document asked for. A document this process
        verified at most RECENT_DOWNLOAD_SECONDS ago is taken instead (once), with the facts
        verified with it: nothing to ask upstream, nothing to read."""
        recent = self._recent_downloads.pop(self.package_key(provider, version, platform), None)
        if recent is not None and time.monotonic() - recent[0] <= RECENT_DOWNLOAD_SECONDS:
            taken: asyncio.Future[AskedDownload] = asyncio.get_running_loop().create_future()
            taken.set_result((recent[1], recent[2]))
            return taken
        asking = asyncio.ensure_future(self._download_and_facts(provider, version, platform))
        asking.add_done_callback(retrieved)  # a caller that failed first leaves no warning
        return asking

    async def _download_and_facts(self, provider: ProviderAddress, version: str,
                                  platform: Platform) -> AskedDownload:
        """The facts recorded, with the download document another process noted in their
        record moments ago (noted_downloads; taken once); else upstream's, asked for then."""
        known, record = await self._recorded_with_record(provider, version, platform)
        noted = None if record is None else self._take_note(
            self.package_key(provider, version, platform), record, platform)
        if noted is not None:
            return noted, known
        return await self._registry.download_info(provider, version, platform), known

    def _take_note(self, key: str, record: dict[str, Any],
                   platform: Platform) -> DownloadInfo | None:
        """The download document noted in record, unless this instance used that note."""
        used = self._used_notes.get(key)
        if used is not None and time.monotonic() - used <= RECENT_DOWNLOAD_SECONDS:
            return None
        noted = noted_download(record, platform, RECENT_DOWNLOAD_SECONDS)
        if noted is not None:
            keep_recent(self._used_notes, key, time.monotonic(), HELD_RECENT)
        return noted

    async def current_download(self, provider: ProviderAddress, version: str,
                               platform: Platform,
                               asked: asyncio.Future[AskedDownload] | None = None
                               ) -> tuple[DownloadInfo, VerifiedPackage]:
        """A fresh download document (its URL may be short-lived) and the verified facts,
        which it must still agree with: both from ask_download (asked now unless the caller
        asked already); facts not recorded yet are fetched with the document."""
        if asked is None:
            asked = self.ask_download(provider, version, platform)
        try:
            info, known = await asked
        finally:
            asked.cancel()  # a no-op once it is done
        package = known if known is not None else \
            await self.package(provider, version, platform, info)
        if (info.filename, info.shasum) != (package.filename, package.shasum):
            raise self.integrity("changed", f"upstream now describes {provider} {version} "
                                 f"{platform.key} differently from what it signed before",
                                 f"{provider} {version} {platform.key}")
        return info, package

    def open_package(self, provider: ProviderAddress, info: DownloadInfo,
                     max_bytes: int) -> AbstractAsyncContextManager[Download]:
        """Stream the package zip from the URL of a current download document."""
        return self._registry.open_package(provider, info.download_url, max_bytes)

    @staticmethod
    def package_key(provider: ProviderAddress, version: str, platform: Platform) -> str:
        """The metadata cache key of a package's verified facts."""
        return layout.package_record(provider, version, platform)

    async def save(self, provider: ProviderAddress, version: str, platform: Platform,
                   package: VerifiedPackage) -> None:
        """Record (updated) facts about a package."""
        record = asdict(package)
        record["stored_as"] = identity_to_record(package.stored_as)
        key = self.package_key(provider, version, platform)
        await self._cache.set(key, record)
        held = self._held.get(key)
        self._hold(key, package)
        # Documents show the h1, or compute it once the zip is stored: only facts that repeat
        # the h1 already held leave them as they are.
        if package.h1 is None or held is None or held.h1 != package.h1:
            for listener in self._on_save:
                listener(provider, version)

    def _hold(self, key: str, package: VerifiedPackage) -> None:
        """Keep facts that carry an h1 in memory; facts without one are read from the store
        each time, so an h1 that another process records shows on the next request."""
        if package.h1 is None:
            self._held.pop(key, None)
            return
        self._held[key] = package
        self._held.move_to_end(key)
        while len(self._held) > HELD_FACTS:
            self._held.popitem(last=False)

    async def stored_facts(self, provider: ProviderAddress, version: str,
                           platform: Platform) -> VerifiedPackage | None:
        """The recorded facts, without fetching anything."""
        record = await self._cache.get(self.package_key(provider, version, platform))
        return _package_from_record(record) if record is not None else None

    async def package(self, provider: ProviderAddress, version: str, platform: Platform,
                      info: DownloadInfo | None = None) -> VerifiedPackage:
        """The verified facts of a package: cached, or fetched and checked now."""
        known = await self._recorded(provider, version, platform)
        if known is not None:
            return known
        key = self.package_key(provider, version, platform)
        self._metrics.cache_lookups.labels("package", "miss").inc()
        return await self._package_fills.run(
            key, lambda: self._fill_package(key, provider, version, platform, info))

    async def _recorded(self, provider: ProviderAddress, version: str,
                        platform: Platform) -> VerifiedPackage | None:
        """The verified facts held in memory or recorded in the index (a hit), if any."""
        return (await self._recorded_with_record(provider, version, platform))[0]

    async def _recorded_with_record(self, provider: ProviderAddress, version: str,
                                    platform: Platform
                                    ) -> tuple[VerifiedPackage | None, dict[str, Any] | None]:
        """_recorded's facts, and the record they were read from (None: held in memory)."""
        key = self.package_key(provider, version, platform)
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
            self._metrics.cache_lookups.labels("package", "hit").inc()
            return held, None
        record = await self._cache.get(key)
        if record is None:
            return None, None
        self._metrics.cache_lookups.labels("package", "hit").inc()
        package = _package_from_record(record)
        self._hold(key, package)
        return package, record

    async def _fill_package(self, key: str, provider: ProviderAddress, version: str,
                            platform: Platform, info: DownloadInfo | None) -> VerifiedPackage:
        record = await self._cache.get(key)  # a fill that finished since the caller looked
        if record is not None:
            return _package_from_record(record)
        fetched = info is None  # for VERSION.json, not for a fill
        if info is None:
            info = await self._registry.download_info(provider, version, platform)
        sums = parse_sha256sums(await self.signed_sums(provider, version, info))
        listed = sums.get(info.filename)
        if listed is None:
            raise self.integrity("sha256sums", f"SHA256SUMS of {provider} {version} has no "
                                  f"line for {info.filename}", f"{provider} {version} "
                                  f"{platform.key}")
        if listed != info.shasum:
            raise self.integrity("sha256sums", f"SHA256SUMS lists {listed} for "
                                  f"{info.filename}, the download document {info.shasum}",
                                  f"{provider} {version} {platform.key}")
        package = VerifiedPackage(filename=info.filename, shasum=info.shasum,
                                  sums_id=sums_id(info.shasums_url),
                                  document=without_upstream_urls(info.document))
        record = asdict(package)
        # The zip is usually asked for next (Terraform: right after VERSION.json, on a new
        # connection that another process may accept): the document is held for this
        # process's fill, and noted in the record for another's. A URL with a query may carry
        # a signature (S3, GCS, Azure, a token): asked for anew. Whichever process takes the
        # zip finds a connection to its host ready (proxy.upstream.warm_connections).
        if fetched and (origin := origin_of(info.download_url)) is not None:
            self._expect_download(origin)
        if fetched and note_download(record, info):
            keep_recent(self._used_notes, key, time.monotonic(), HELD_RECENT)
        await self._cache.set(key, record)
        if fetched and reusable_url(info.download_url):
            keep_recent(self._recent_downloads, key, (time.monotonic(), info, package),
                        HELD_RECENT)
        return package

    async def stored_sums(self, provider: ProviderAddress, version: str,
                          name: str) -> tuple[bytes, bytes] | None:
        """The verified SHA256SUMS and its signature, byte for byte, if held."""
        record = await self._cache.get(layout.sums_record(provider, version, name))
        if record is None:
            return None
        return bytes(record["sums"]), bytes(record["signature"])

    async def signer(self, provider: ProviderAddress, version: str,
                     name: str | None) -> str | None:
        """The fingerprint of the key whose signature over the SHA256SUMS `name` verified
        (None: not known, or accepted unsigned)."""
        if name is None:
            return None
        record = await self._cache.get(layout.sums_record(provider, version, name))
        signed_by = record.get("signed_by") if isinstance(record, dict) else None
        return signed_by if isinstance(signed_by, str) and signed_by else None

    async def note_served(self, provider: ProviderAddress, version: str,
                          platform: Platform) -> None:
        """Hand the package's sha256 and the key that signed its SHA256SUMS to the audit line
        of the request serving it; nothing (no read) while the audit log is off."""
        facts = SERVED_FACTS.get()
        if facts is None:
            return
        package = self._held.get(self.package_key(provider, version, platform)) or \
            await self.stored_facts(provider, version, platform)
        if package is None:
            return
        facts.sha256 = package.shasum
        facts.artifact = Artifact.provider(provider, version, platform)
        facts.key_id = key_id(await self.signer(provider, version, package.sums_id))

    async def signed_sums(self, provider: ProviderAddress, version: str,
                          info: DownloadInfo) -> bytes:
        """SHA256SUMS bytes whose signature verified (cached: immutable once verified)."""
        key = layout.sums_record(provider, version, sums_id(info.shasums_url))
        record = await self._cache.get(key)
        if record is not None:
            self._metrics.cache_lookups.labels("sums", "hit").inc()
            return bytes(record["sums"])
        self._metrics.cache_lookups.labels("sums", "miss").inc()
        return await self._sums_fills.run(
            key, lambda: self._fill_sums(key, provider, version, info))

    async def _fill_sums(self, key: str, provider: ProviderAddress, version: str,
                         info: DownloadInfo) -> bytes:
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
                signed_by = await quick(
                    verify_detached, sums, signature, info.signing_keys)
            except IntegrityError as exc:
                message = f"{provider}: {exc.message}"
                if self._failed_recently(key):
                    raise IntegrityError(exc.kind, message, signed_by=exc.signed_by,
                                         keys_tried=exc.keys_tried) from None
                raise self.integrity(exc.kind, message, f"{provider} {version} SHA256SUMS",
                                     exc) from None
        await self._cache.set(key, {"sums": sums, "signature": signature,
                                    "signed_by": signed_by, "url": mask_secrets(info.shasums_url)})
        return sums

    def _failed_recently(self, key: str) -> bool:
        """Whether the SHA256SUMS at key failed its check in the last few seconds; notes
        this failure either way."""
        now = time.monotonic()
        while self._failed_sums and next(iter(self._failed_sums.values())) < now - \
                SUMS_FAILURE_SECONDS:
            self._failed_sums.popitem(last=False)
        recent = key in self._failed_sums
        self._failed_sums.pop(key, None)
        self._failed_sums[key] = now
        return recent

    def integrity(self, kind: IntegrityKind, message: str, artifact: str,
                  cause: IntegrityError | None = None) -> IntegrityError:
        """Count, log, record (the status page) and return an integrity failure of artifact
        (provider, version and platform, or the SHA256SUMS file), with the key IDs cause
        names."""
        return reported(self._metrics, self._activity, kind, message, artifact, cause)


def _entry_to_record(entry: VersionEntry) -> dict[str, Any]:
    return {"version": entry.version, "protocols": list(entry.protocols),
            "platforms": [p.key for p in entry.platforms]}


def _entry_from_record(record: dict[str, Any]) -> VersionEntry:
    return VersionEntry(version=record["version"], protocols=tuple(record["protocols"]),
                        platforms=tuple(Platform.from_key(k) for k in record["platforms"]))


def _package_from_record(record: dict[str, Any]) -> VerifiedPackage:
    return VerifiedPackage(record["filename"], record["shasum"], record.get("h1"),
                           record.get("size"), record.get("sums_id"), record.get("document"),
                           identity_from_record(record.get("stored_as")))


# What sums_id returns; what a path or a bundle may name a SHA256SUMS file by.
SUMS_ID = re.compile(r"[0-9a-f]{32}")


def sums_id(shasums_url: str) -> str:
    """A short, stable name for one upstream SHA256SUMS file (matches SUMS_ID)."""
    return hashlib.sha256(shasums_url.encode()).hexdigest()[:32]
