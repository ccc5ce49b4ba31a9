"""The module registry protocol, served from module archives the proxy fetched and repacked.

https://developer.hashicorp.com/terraform/internals/module-registry-protocol
Operations: list_versions_body, download (answered from the version list alone, at once: clients
give it 10 s), archive (fetch the source on a miss: https archive or git clone, apply the
subdirectory, repack as .tar.gz, store; the slow part, on a request clients do not time out).
Clients never see upstream's location. Each archive's sha256 is recorded when it is packed:
a hit on a blob written to since is checked against it first (see proxy.store.file_identity).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from typing import Any

from proxy.config import UpstreamConfig
from proxy.config.filters import Filters
from proxy.core.activity import Activity
from proxy.core.audit import NO_AUDIT, SERVED_FACTS, Artifact, AuditLog
from proxy.core.errors import IntegrityError, Offline, ProxyError, UnknownVersion
from proxy.core.executors import quick, slow
from proxy.core.json_bodies import JsonBody
from proxy.core.metrics import Metrics
from proxy.core.models import ModuleAddress
from proxy.core.redaction import mask_secrets
from proxy.core.singleflight import SingleFlight
from proxy.core.waits import missed_the_cache
from proxy.modules.packing import read_packed
from proxy.modules.sources import ModuleSource, parse_source
from proxy.protocols.held_documents import VersionListAnswers
from proxy.protocols.version_policy import VersionPolicy, module_target
from proxy.store import layout
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.file_identity import (
    FileIdentity,
    identity_from_record,
    identity_to_record,
)
from proxy.store.freshness import RefreshingDocuments
from proxy.store.leases import fill_unless_published
from proxy.store.protocol import BlobInfo, BlobStore, MetadataIndex
from proxy.upstream.module_registry import ModuleRegistryClient
from proxy.upstream.module_sources import ModuleSourceFetcher
from proxy.verification.stored_drops import drop_damaged, integrity_kind, what_went
from proxy.verification.stored_hashes import (
    CheckedFiles,
    Vouch,
    adopt_stored,
    fingerprint,
)

log = logging.getLogger(__name__)
_HELD_BODIES = 4096


class ModuleRegistry:
    """Answers module registry requests for every allowed upstream host."""

    def __init__(self, client: ModuleRegistryClient, sources: ModuleSourceFetcher,
                 cache: MetadataIndex, archives: BlobStore, config: UpstreamConfig,
                 metrics: Metrics, filters: Filters, activity: Activity,
                 policy: VersionPolicy, audit: AuditLog = NO_AUDIT) -> None:
        self._client = client
        self._policy = policy
        self._audit = audit
        self._sources = sources
        self._cache = cache
        self._archives = archives
        self._offline = config.offline
        self._metrics = metrics
        self._activity = activity
        self._filters = filters
        self._version_lists = RefreshingDocuments[list[str]](
            "module_versions", cache, metrics, config.versions_ttl,
            encode=list, decode=list, offline=config.offline, on_stale=activity.stale_answer)
        self._archive_fills: SingleFlight[BlobInfo] = SingleFlight(exclusive=self._fill_scope)
        self._fill_slots = asyncio.Semaphore(config.max_concurrent_fills)
        self._checked = CheckedFiles(archives)
        # `versions` as sent, for the version list object it was built from. Offline too: the
        # list is then what the store holds, the same object while its record is unchanged.
        self._version_bodies: VersionListAnswers[list[str]] = VersionListAnswers(
            offline=False, limit=_HELD_BODIES)

    async def close(self) -> None:
        """Stop fills under way (shutdown)."""
        await self._archive_fills.cancel_all()
        await self._checked.close()
        await self._version_lists.close()
        await self._version_bodies.close()

    def on_list_change(self, listener: Callable[[], None]) -> None:
        """Call listener() whenever a version list this process holds changes."""
        self._version_lists.on_change(listener)

    # --- protocol operations -------------------------------------------------------------

    async def list_versions_body(self, module: ModuleAddress) -> JsonBody:
        """`versions` as sent, `{"modules": [{"versions": [{"version": ...}]}]}`: serialized
        once per version list read."""
        self._filters.require_module(module)
        return await self._version_bodies.get(
            str(module), lambda: self._versions(module),
            lambda versions: self._shown_document(module, versions),
            lambda versions: self._policy.list_tag("module", str(module),
                                                   module_target(module), versions))

    async def _fetch_versions(self, module: ModuleAddress) -> list[str]:
        """Upstream's list, its versions noted as seen now (the version policy's dates)."""
        versions = await self._client.list_versions(module)
        await self._policy.times.listed("module", str(module), versions)
        return versions

    async def require_policy(self, module: ModuleAddress, version: str) -> None:
        """PolicyRefused unless the version policy serves this version now."""
        await self._policy.require("module", str(module), module_target(module), version,
                                   f"module {module} {version}")

    async def shown(self, module: ModuleAddress, versions: list[str]) -> list[str]:
        """The versions of module the version policy shows now."""
        return await self._policy.visible("module", str(module), module_target(module),
                                          versions)

    async def _shown_document(self, module: ModuleAddress,
                              versions: list[str]) -> dict[str, Any]:
        return await _versions_document(await self.shown(module, versions))

    async def download(self, module: ModuleAddress, version: str) -> None:
        """The `download` operation: raises unless the archive is held or the version list
        has the version (offline: held only). Starts fetching the source in the background,
        so that the archive request finds it under way, but never waits for it: Terraform
        gives this request 10 s and a clone may take minutes (the archive GET has no limit).
        """
        self._filters.require_module(module)
        if await self._archives.stat(layout.module_archive(module, version)) is not None:
            return
        if self._offline:
            raise Offline(f"module {module} {version} is not in the cache, and the proxy is "
                          "offline")
        if version not in await self._versions(module, wanted=version):
            raise UnknownVersion(f"module {module} has no version {version}")
        self._start_fill(module, version)

    async def archive(self, module: ModuleAddress, version: str) -> BlobInfo:
        """The repacked module archive, fetched from its source on a miss (waiting for a
        fetch already under way rather than starting another)."""
        self._filters.require_module(module)
        stored = await self._stored(module, version)
        if stored is not None:
            self._metrics.cache_lookups.labels("module", "hit").inc()
        else:
            self._metrics.cache_lookups.labels("module", "miss").inc()
            missed_the_cache()
            # Shielded: a client that hangs up does not cancel a fill others wait for.
            stored = await asyncio.shield(self._start_fill(module, version))
        await self._note_served(module, version)
        return stored

    def require_served(self, module: ModuleAddress) -> None:
        """Raises unless the filters let this module through."""
        self._filters.require_module(module)

    async def versions(self, module: ModuleAddress) -> list[str]:
        """The versions `versions` lists (offline: the list the store holds)."""
        self._filters.require_module(module)
        return await self._versions(module)

    async def archive_sha256(self, module: ModuleAddress, version: str) -> str | None:
        """The recorded sha256 of the stored archive (None: none recorded)."""
        return recorded_sha256(await self._cache.get(
            layout.module_archive_record(module, version)))

    async def _note_served(self, module: ModuleAddress, version: str) -> None:
        """Hand the archive's recorded sha256 to the audit line of the request serving it;
        nothing (no index read) while the audit log is off."""
        facts = SERVED_FACTS.get()
        if facts is not None:
            facts.sha256 = await self.archive_sha256(module, version)

    # --- versions ------------------------------------------------------------------------

    async def _versions(self, module: ModuleAddress, wanted: str | None = None) -> list[str]:
        return await self._version_lists.get(
            layout.module_version_list_record(module), lambda: self._fetch_versions(module),
            origin=module.hostname,
            knows=None if wanted is None else (lambda versions: wanted in versions))

    # --- archives ------------------------------------------------------------------------

    async def _stored(self, module: ModuleAddress, version: str,
                      check: bool = True) -> BlobInfo | None:
        """The stored archive while it is the file whose sha256 was recorded; one written to
        since is read again first (check; without it, under the fill lock, it is just not
        used), and dropped if it no longer matches. One stored before sha256s were recorded
        is adopted if it reads through as an intact .tar.gz."""
        key = layout.module_archive(module, version)
        return await self._checked.vouched(
            key, check=check,
            record=lambda _found: self._record_of(module, version),
            adopt=lambda: self._adopt(module, version, key),
            checked=lambda sha256, identity: self._record(module, version, sha256, identity),
            damaged=lambda damage: self._drop_damaged(module, version, key, damage))

    async def _record_of(self, module: ModuleAddress, version: str) -> Vouch:
        """What the index records about the stored archive (nothing, for one stored before
        sha256s were recorded)."""
        record = await self._cache.get(layout.module_archive_record(module, version)) or {}
        return Vouch(recorded_sha256(record), identity_from_record(record.get("stored_as")))

    async def _adopt(self, module: ModuleAddress, version: str,
                     key: str) -> tuple[str, FileIdentity] | None:
        """The sha256 and identity of an archive stored with none recorded, if it reads
        through as an intact .tar.gz; None when it is gone. Raises DamagedFile."""
        adopted = await adopt_stored(self._archives, key, read_packed)
        if adopted is not None:
            log.info("module %s %s: recorded the sha256 of an archive stored without one",
                     module, version)
        return adopted

    async def _record(self, module: ModuleAddress, version: str, sha256: str,
                      identity: FileIdentity) -> None:
        await self._cache.set(layout.module_archive_record(module, version), {
            "sha256": sha256, "size": identity.size,
            "stored_as": identity_to_record(identity)})

    async def _drop_damaged(self, module: ModuleAddress, version: str, key: str,
                            damage: DamagedFile) -> None:
        """Drop a damaged stored archive under the module's fill lock; offline, when that
        left nothing to serve, Offline."""
        async with self._archives.fill_lock(_fill_key(module, version), "module"):
            dropped = await self._drop_locked(module, version, key, damage)
        if self._offline and dropped is not Dropped.LOCAL_COPY:
            raise IntegrityError("stored", f"the stored archive of module {module} {version} "
                                 "was damaged and dropped; the proxy is offline, so it cannot "
                                 "be fetched again")

    async def _drop_locked(self, module: ModuleAddress, version: str, key: str,
                           damage: DamagedFile) -> Dropped:
        """Delete a damaged stored archive and its record, then count and log it: once, by
        whoever deletes it."""
        self._checked.forget(key)
        dropped = await drop_damaged(self._archives, key, damage, lambda: self._cache.delete(
            layout.module_archive_record(module, version)))
        if dropped is Dropped.NOTHING:
            # Gone, or replaced by a fill since it was read: the record is the fill's.
            log.info("module %s %s: the stored archive %s; already dropped or replaced",
                     module, version, damage.message)
            return dropped
        kind = integrity_kind(dropped, damage)
        where = "the local hot copy of the archive" if dropped is Dropped.LOCAL_COPY \
            else "the stored archive"
        self._metrics.integrity_failures.labels(kind).inc()
        self._activity.integrity_failure(f"module {module} {version}", kind,
                                         f"{where} {damage.message}; {what_went(dropped)}")
        log.error("integrity failure (%s): module %s %s: %s %s; %s", kind, module, version,
                  where, damage.message, what_went(dropped))
        return dropped

    def _start_fill(self, module: ModuleAddress, version: str) -> asyncio.Future[BlobInfo]:
        # One fill per module version, across the processes sharing the cache too.
        return self._archive_fills.start(_fill_key(module, version),
                                         lambda: self._fill(module, version))

    @asynccontextmanager
    async def _fill_scope(self, key: Hashable) -> AsyncIterator[None]:
        """Where a module fill's failure is logged: once per fill and out of space already
        told apart (a prefetch may have no client to report it to)."""
        try:
            yield
        except ProxyError as exc:
            log.log(logging.WARNING if exc.status >= 500 else logging.INFO,
                    "%s: fetching its source failed: %s", key, exc.message)
            raise
        except Exception:
            log.exception("%s: fetching its source failed", key)
            raise

    async def _fill(self, module: ModuleAddress, version: str) -> BlobInfo:
        # Under the module's fill lock, across processes and replicas. Published by another
        # fill meanwhile? (Not a file to check: it is replaced.)
        return await fill_unless_published(
            self._archives, _fill_key(module, version), "module",
            lambda: self._stored(module, version, check=False),
            lambda: self._fetch(module, version))

    async def _fetch(self, module: ModuleAddress, version: str) -> BlobInfo:
        if version not in await self._versions(module, wanted=version):
            raise UnknownVersion(f"module {module} has no version {version}")
        location = await self._client.download_location(module, version)
        source = parse_source(location)
        log.info("fetching module %s %s from %s", module, version, mask_secrets(source.url))
        async with self._fill_slots:
            built, sha256 = await self._build(module, version, source)
        self._audit.record("fetched", Artifact.module(module, version), cache="miss",
                           bytes=built.size, sha256=sha256,
                           upstream_url=mask_secrets(source.url))
        return built

    async def _build(self, module: ModuleAddress, version: str,
                     source: ModuleSource) -> tuple[BlobInfo, str]:
        """The archive packed from source, published, and its sha256."""
        work = await quick(self._archives.work_dir)
        self._metrics.fills_in_flight.inc()
        try:
            packed = self._archives.spool_path()
            try:
                await self._sources.fetch_packed(module, source, work, packed)
                # Recorded first: no moment when the archive is there and nothing vouches
                # for it. Publishing on disk renames it, which leaves its identity as it is;
                # elsewhere the blob gets an identity of its own, recorded once it is known.
                sha256, identity = await slow(fingerprint, packed)
                await self._record(module, version, sha256, identity)
                published = await self._archives.publish(
                    layout.module_archive(module, version), packed)
                if published.identity != identity:
                    await self._record(module, version, sha256, published.identity)
                self._checked.remember(published.key, published.identity)
                return published, sha256
            except BaseException:
                packed.unlink(missing_ok=True)
                raise
        finally:
            self._metrics.fills_in_flight.dec()
            await slow(shutil.rmtree, work, True)


def _fill_key(module: ModuleAddress, version: str) -> str:
    """The identity of one module version: the key of its fill, in this process and across
    the processes sharing the store."""
    return layout.module_fill(module, version)


def recorded_sha256(record: object) -> str | None:
    """The sha256 a module archive record holds; None if it is not such a record."""
    sha256 = record.get("sha256") if isinstance(record, dict) else None
    return sha256 if isinstance(sha256, str) else None


async def _versions_document(versions: list[str]) -> dict[str, Any]:
    """The body of `versions` for a version list."""
    return {"modules": [{"versions": [{"version": v} for v in versions]}]}
