"""Provider package fills: on a miss, one download per package (across processes: under its
fill lock), detached from the clients that asked, streamed to them while it is written,
checked against the signed SHA256SUMS, then published, with the record that vouches for it
saved before the last byte reaches anyone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import replace

from proxy.config import UpstreamConfig
from proxy.core.audit import NO_AUDIT, Artifact, AuditLog, key_id
from proxy.core.errors import IntegrityError, NotFound
from proxy.core.metrics import Metrics
from proxy.core.models import Platform, ProviderAddress
from proxy.core.redaction import mask_secrets
from proxy.core.singleflight import Offer, SingleFlight, retrieved
from proxy.core.spool import GrowingFile
from proxy.store import layout
from proxy.store.fill_notices import OtherFill, PostedNotice
from proxy.store.leases import fill_unless_published
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.spool import SpoolStart, store_package
from proxy.upstream.documents import VersionEntry
from proxy.upstream.http import DOWNLOAD_STALL_SECONDS
from proxy.verification.packages import AskedDownload, VerifiedPackages
from proxy.verification.stored_packages import StoredPackages, fill_key

log = logging.getLogger(__name__)
# What a fill asks for as soon as it holds its lock: the version's entry, and the package's
# download document and verified facts under way (None: offline, or a platform the entry does
# not name).
_Ahead = tuple[VersionEntry, asyncio.Future[AskedDownload] | None]


class PackageFills:
    """Fetches, verifies and stores provider packages that are not held yet."""

    def __init__(self, packages: VerifiedPackages, stored: StoredPackages,
                 archives: BlobStore, config: UpstreamConfig, metrics: Metrics,
                 audit: AuditLog = NO_AUDIT) -> None:
        self._packages = packages
        self._audit = audit
        self._stored = stored
        self._archives = archives
        self._max_size = config.max_archive_size
        self._offline = config.offline
        self._metrics = metrics
        self._flights: SingleFlight[BlobInfo | GrowingFile[BlobInfo]] = SingleFlight()
        self._fill_slots = asyncio.Semaphore(config.max_concurrent_fills)

    async def close(self) -> None:
        """Stop fills under way (shutdown); their temp files are swept at the next start. A
        fill that published its file finishes: its h1 pass (one read of the zip) is all that
        is left, and a package stored without its h1 would be read whole again later."""
        await self._flights.cancel_all(finish=_published)

    async def archive(self, provider: ProviderAddress, version: str,
                      platform: Platform) -> BlobInfo | GrowingFile[BlobInfo]:
        """The package as soon as it can be read: the blob a fill just published, or the
        download under way (shared by every caller), which is published only once verified.
        A fill still finishing (its h1 pass) whose file the caller just did not find has
        lost it since (evicted, dropped as damaged): a new fill starts."""
        return await self._flights.run_streaming(
            fill_key(provider, version, platform),
            lambda offer: self._fill(provider, version, platform, offer), stale=_published)

    async def _fill(self, provider: ProviderAddress, version: str, platform: Platform,
                    offer: Offer[BlobInfo | GrowingFile[BlobInfo]]
                    ) -> BlobInfo | GrowingFile[BlobInfo]:
        ahead: asyncio.Task[_Ahead] | None = None
        key = fill_key(provider, version, platform)
        other: OtherFill | None = None

        def locked() -> None:
            # What the download needs first is asked for at once, while the store is looked
            # at again: a cold package's first byte waits for less. Not before the lock: a
            # fill waiting for another process's lease asks upstream nothing.
            nonlocal ahead
            ahead = asyncio.ensure_future(self._entry_and_document(provider, version, platform))
            ahead.add_done_callback(retrieved)  # a fill that failed first: no warning

        def published() -> Awaitable[BlobInfo | None]:
            return self._stored.stored(provider, version, platform, check=False)

        async def followed() -> GrowingFile[BlobInfo] | None:
            # Another process of this host is downloading it: its spool, followed.
            nonlocal other
            other = await OtherFill.find(self._archives, key)
            return None if other is None else other.spool

        try:
            # Under the package's fill lock, across processes and replicas. Published by
            # another fill meanwhile? (Not a file to check: it is replaced.)
            found = await fill_unless_published(
                self._archives, key, "package", published,
                lambda: self._download(provider, version, platform, key, offer, ahead), locked,
                followed)
            if other is not None and found is other.spool:
                offer(other.spool)
                return await other.follow(published, 2 * DOWNLOAD_STALL_SECONDS)
            return found
        finally:
            if ahead is not None:
                _stop(ahead)
            if other is not None:
                other.close()

    async def _entry_and_document(self, provider: ProviderAddress, version: str,
                                  platform: Platform) -> _Ahead:
        """The version's entry, and its download document asked for with the verified facts
        (online, for a platform the entry names)."""
        entry = await self._packages.version_entry(provider, version)
        if self._offline or platform not in entry.platforms:
            return entry, None
        return entry, self._packages.ask_download(provider, version, platform)

    async def _download(self, provider: ProviderAddress, version: str, platform: Platform,
                        key: str, offer: Offer[BlobInfo | GrowingFile[BlobInfo]],
                        ahead: asyncio.Task[_Ahead] | None
                        ) -> BlobInfo | GrowingFile[BlobInfo]:
        assert ahead is not None  # asked for by locked(), which runs before the fill
        entry, document = await ahead
        if platform not in entry.platforms:
            raise NotFound(f"{provider} {version} is not published for {platform.key}")
        info, package = await self._packages.current_download(provider, version, platform,
                                                              document)
        async with self._fill_slots:
            self._metrics.fills_in_flight.inc()
            try:
                log.info("fetching %s %s %s from %s", provider, version, platform.key,
                         mask_secrets(info.download_url))  # may be a presigned URL
                async with SpoolStart(self._archives) as start, \
                        self._packages.open_package(provider, info, self._max_size) as download:
                    spool = await start.spool(download.size)
                    offer(spool)
                    # For this host's other processes to follow (proxy.store.fill_notices).
                    notice = PostedNotice.of(self._archives, key)
                    if notice is not None:
                        notice.begin(spool)
                    try:
                        stored = await store_package(
                            self._archives, layout.provider_archive(provider, version, platform),
                            download.chunks, package.shasum, spool,
                            lambda stored: self._stored.vouch(provider, version, platform,
                                                              package, stored))
                        if notice is not None:
                            await notice.posted()
                    except IntegrityError as exc:
                        artifact = f"{provider} {version} {platform.key}"
                        raise self._packages.integrity(exc.kind, f"{artifact}: {exc.message}",
                                                       artifact) from None
                    finally:
                        if notice is not None:
                            notice.end()  # under the lock
            finally:
                self._metrics.fills_in_flight.dec()
        self._audit.record(
            "fetched", Artifact.provider(provider, version, platform), cache="miss",
            bytes=stored.info.size, sha256=package.shasum,
            upstream_url=mask_secrets(info.download_url),
            key_id=key_id(await self._packages.signer(provider, version, package.sums_id)))
        # The record that vouches for the file was saved (vouch); its h1 (a full read, at the
        # lowest priority: clients may still be downloading it) now.
        await self._stored.record_h1(
            provider, version, platform,
            replace(package, size=stored.info.size, stored_as=stored.info.identity),
            stored.info.key,
            holding_lock=True, written=stored.info.identity)
        return stored.info


def _published(source: BlobInfo | GrowingFile[BlobInfo]) -> bool:
    """Whether the fill that handed out source already published its file."""
    return not isinstance(source, GrowingFile) or source.final is not None


def _stop(ahead: asyncio.Task[_Ahead]) -> None:
    """Stop what the fill asked for ahead and did not use (another fill published it)."""
    if not ahead.done():
        ahead.cancel()
    elif not ahead.cancelled() and ahead.exception() is None:
        document = ahead.result()[1]
        if document is not None:
            document.cancel()  # a no-op once it was answered
